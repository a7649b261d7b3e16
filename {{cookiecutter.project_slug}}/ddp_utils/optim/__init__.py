"""The optimizer and the learning rate.

optimizer.py   the optimizer (AdamW, fused, Muon) and gradient clipping
lr_schedule.py the learning rate as a pure function of samples trained
"""
