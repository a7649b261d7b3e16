"""What a run tells: metrics lines, trackers, MFU, profiles. Nothing here may stop a run.

metrics.py    the Meter and Reporter: metrics.jsonl, progress, step timing, loss lines
trackers.py   TensorBoard, W&B, MLflow (--tracker)
flops.py      MFU: a sample's FLOPs and the GPU's peak
profiling.py  --profile_steps
"""
