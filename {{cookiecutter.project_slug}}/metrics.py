"""What a run reports, on global rank 0 only: metrics.jsonl, TensorBoard, a progress bar, MFU.

Nothing here calls a collective: the Trainer reduces the numbers first, then hands them over.
"""

import json
import resource
import sys

import torch

from ddp_utils import rank_zero_only

# Dense peak TFLOPS per GPU for bf16/fp16 tensor cores and for fp32 (TF32 where it applies),
# from the vendors' data sheets. Matched by substring of torch.cuda.get_device_name().
# Set --peak_tflops for anything missing here.
PEAK_TFLOPS = {
    "H200": {"bf16": 989.0, "fp16": 989.0, "none": 494.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "none": 494.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "none": 156.0},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "none": 183.0},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "none": 35.0},
    "L4": {"bf16": 121.0, "fp16": 121.0, "none": 60.0},
    "V100": {"bf16": 0.0, "fp16": 125.0, "none": 15.7},
    "T4": {"bf16": 0.0, "fp16": 65.0, "none": 8.1},
}


def peak_tflops(device_name, amp, override=0.0):
    """Peak TFLOPS of one device for this precision; 0.0 when unknown (MFU is then not reported)."""
    if override > 0:
        return override
    for name, peaks in PEAK_TFLOPS.items():
        if name in device_name:
            return peaks[amp]
    return 0.0


def flops_per_sample(model):
    """Training FLOPs per sample of a model made of dense layers: 2 per weight forward, 4 backward."""
    return 6 * sum(p.numel() for p in model.parameters() if p.dim() > 1)


def mfu(flops_per_sample, samples_per_s, world_size, peak_tflops):
    """Model FLOPs utilisation: achieved model FLOPs per device over the device's peak."""
    if peak_tflops <= 0:
        return None
    return flops_per_sample * samples_per_s / world_size / (peak_tflops * 1e12)


def peak_memory_mb(device):
    """Peak memory of this process: allocated on the GPU, or resident (RSS) on the CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def format_metrics(metrics):
    parts = [f"{key} {value:.5g}" if isinstance(value, float) else f"{key} {value}" for key, value in metrics.items()]
    return " ".join(parts)


class Reporter:
    """Writes metrics.jsonl (always), TensorBoard events (optional) and a progress bar (on a TTY).

    Every method is a no-op on ranks other than 0.
    """

    def __init__(self, ctx, cfg, output_dir):
        self.is_main = ctx.is_main
        self.metrics_path = output_dir / "metrics.jsonl"
        self.tensorboard = None
        self.bar = None
        # A bar only for a person watching: not in CI logs, files or other ranks' output.
        self.progress = cfg.progress_bar and ctx.is_main and sys.stdout.isatty()
        if cfg.tensorboard:
            # Imported on every rank, so a missing package stops all of them alike.
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package

            if ctx.is_main:
                self.tensorboard = SummaryWriter(output_dir / "tensorboard")

    @rank_zero_only
    def epoch_metrics(self, metrics):
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.tensorboard:
            for key, value in metrics.items():
                if isinstance(value, (int, float)) and key not in ("epoch", "step"):
                    self.tensorboard.add_scalar(key, value, metrics["step"])
            self.tensorboard.flush()

    @rank_zero_only
    def train_loss(self, step, loss):
        if self.tensorboard:
            self.tensorboard.add_scalar("train_loss_step", loss, step)

    @rank_zero_only
    def truncate(self, step):
        """On resume, drop lines logged after the checkpoint: they are about to be redone."""
        if self.metrics_path.exists():
            kept = []
            for line in self.metrics_path.read_text().splitlines(keepends=True):
                try:
                    if json.loads(line)["step"] <= step:
                        kept.append(line)
                except (ValueError, KeyError):  # a line cut short by a crash: drop it
                    pass
            self.metrics_path.write_text("".join(kept))

    @rank_zero_only
    def start_epoch(self, epoch, epochs, steps, done):
        if self.progress:
            from tqdm import tqdm

            self.bar = tqdm(total=steps, initial=done, desc=f"epoch {epoch}/{epochs}", unit="step")

    @rank_zero_only
    def step(self, loss=None, samples_per_s=None):
        if self.bar is not None:
            self.bar.update(1)
            if loss is not None:
                self.bar.set_postfix(loss=f"{loss:.4f}", samples_per_s=f"{samples_per_s:.0f}", refresh=False)

    @rank_zero_only
    def end_epoch(self):
        if self.bar is not None:
            self.bar.close()
            self.bar = None

    @rank_zero_only
    def close(self):
        self.end_epoch()
        if self.tensorboard:
            self.tensorboard.close()
