"""The optimizer and the learning rate.

optimizer.py    the optimizer --optimizer names (AdamW, fused, in two groups; or Muon beside AdamW), gradient clipping
muon.py         Muon for the hidden weight matrices: Newton-Schulz batched by shape, each rank its share
lr_schedule.py  the learning rate as a pure function of samples trained
"""
