"""What a run tells: metrics lines, trackers, MFU, profiles. Nothing here may stop a run.

metrics.py    the Meter and Reporter: metrics.jsonl, step timing, loss lines
progress.py   rank 0's progress line: step of the total, time per step, time left
trackers.py   TensorBoard, W&B, MLflow (--tracker)
flops.py      MFU: a sample's FLOPs and the GPU's peak
profiling.py  --profile_steps
"""
