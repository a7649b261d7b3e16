"""MFU: the FLOPs of one training sample (counted on the meta device) and the peak of the GPU it
runs on (from its data sheet), for the metrics lines' model FLOPs utilisation; with
--activation_checkpointing, HFU beside it: the hardware's FLOPs, the recompute's included."""

from dataclasses import dataclass

import torch
from torch.utils.flop_counter import FlopCounterMode

from ..contract import build_on_meta, model_inputs
from ..core.logs import warn_main
from ..errors import NotCounted

# Dense peak TFLOPS of one GPU (tensor cores without sparsity: half the sheets' sparse figures),
# by the exact name torch.cuda.get_device_name() gives: bf16/fp16 tensor cores, TF32 tensor
# cores, and plain FP32 (amp none with --tf32 false). Each from NVIDIA's data sheet for that
# part. A name that is not here (a GPU without a data sheet, such as AWS's A10G, or a new one)
# gets no MFU: set --peak_tflops.
_H100_SXM = {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0}  # H100 data sheet, SXM
_H100_NVL = {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0}  # H100 data sheet, NVL
_A100 = {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5}  # A100 data sheet, SXM and PCIe alike
_V100_SXM2 = {"bf16": 0.0, "fp16": 125.0, "tf32": 0.0, "fp32": 15.7}  # V100 data sheet: no bf16, no TF32
_V100_PCIE = {"bf16": 0.0, "fp16": 112.0, "tf32": 0.0, "fp32": 14.0}
PEAK_TFLOPS = {
    "NVIDIA B200": {"bf16": 2250.0, "fp16": 2250.0, "tf32": 1100.0, "fp32": 75.0},  # HGX B200 data sheet, per GPU
    "NVIDIA H200": _H100_SXM,  # H200 data sheet, SXM: the H100 SXM's tensor cores
    "NVIDIA H200 NVL": _H100_NVL,  # H200 data sheet, NVL
    "NVIDIA H100 80GB HBM3": _H100_SXM,
    "NVIDIA H100 NVL": _H100_NVL,
    "NVIDIA H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},  # H100 data sheet, PCIe
    "NVIDIA A100-SXM4-40GB": _A100,
    "NVIDIA A100-SXM4-80GB": _A100,
    "NVIDIA A100-PCIE-40GB": _A100,
    "NVIDIA A100 80GB PCIe": _A100,
    "NVIDIA L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},  # L40S data sheet
    "NVIDIA L40": {"bf16": 181.0, "fp16": 181.0, "tf32": 90.5, "fp32": 90.5},  # L40 data sheet
    "NVIDIA L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},  # L4 data sheet
    "NVIDIA A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},  # A10 data sheet
    "Tesla V100-SXM2-16GB": _V100_SXM2,
    "Tesla V100-SXM2-32GB": _V100_SXM2,
    "Tesla V100-PCIE-16GB": _V100_PCIE,
    "Tesla V100-PCIE-32GB": _V100_PCIE,
    "Tesla T4": {"bf16": 0.0, "fp16": 65.0, "tf32": 0.0, "fp32": 8.1},  # T4 data sheet
}


def peak_tflops(device_name, amp, tf32, override=0.0):
    """Peak TFLOPS of one device for this precision; 0.0 when unknown (MFU is then not reported).

    amp none runs matmuls in TF32 when --tf32 is on and the GPU has it, else in plain FP32.
    """
    if override > 0:
        return override
    peaks = PEAK_TFLOPS.get(device_name.strip())
    if peaks is None:
        return 0.0
    if amp != "none":
        return peaks[amp]
    return peaks["tf32"] if tf32 and peaks["tf32"] else peaks["fp32"]


def flops_per_sample(cfg, task, batch, as_trained=None):
    """Training FLOPs (forward and backward) per sample, counted by PyTorch's FlopCounterMode;
    with `as_trained(model)` (activation checkpointing applied) the recompute's forwards too.

    The model is built on the meta device: no memory, no arithmetic, no random draws and no
    state touched, yet every matmul, convolution and attention call is counted as it runs
    (6 x parameters misses attention and convolutions, and counts embedding lookups).
    `batch` is a batch of one training sample; `task` the contract.Task. Raises NotCounted
    when the model cannot be built there, or its forward, loss or backward cannot run there
    (a Hugging Face model's mask code calls .item(), which a meta tensor has no value for):
    a count from anywhere else would be a guess.
    """
    batch = torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: torch.empty_like(t, device="meta"), batch)
    model = build_on_meta(task.build_model, cfg)
    if model is None:
        raise NotCounted("the model cannot be built on the meta device")
    # The model's FLOPs (MFU's) as built; the hardware's as trained, the backward running each
    # checkpointed block's forward again. Evaluation mode: no dropout drawn.
    if as_trained is not None:
        as_trained(model)
    model.eval()
    try:
        with FlopCounterMode(display=False) as counter:
            task.loss_fn(model(model_inputs(batch)), batch).backward()
    except Exception as error:  # noqa: BLE001 - whatever the model's code raises there
        first = (str(error).strip().splitlines() or [""])[0][:200]
        why = f"the model's forward cannot run on the meta device: {type(error).__name__}: {first}"
        raise NotCounted(why) from None
    return counter.get_total_flops()


def counted_flops(cfg, task, batch, as_trained=None, metric="MFU"):
    """flops_per_sample, or 0 with one warning naming why and the `metric` not reported: a
    metric never stops a run."""
    try:
        return flops_per_sample(cfg, task, batch, as_trained)
    except Exception as error:  # noqa: BLE001 - NotCounted, or anything the counter itself raises
        why = str(error) if isinstance(error, NotCounted) else f"counting FLOPs raised {type(error).__name__}: {error}"
        warn_main(f"{metric} not reported: {why}")
        return 0


def mfu(flops_per_sample, samples_per_s, world_size, peak_tflops):
    """Model FLOPs utilisation: achieved model FLOPs per device over the device's peak."""
    if peak_tflops <= 0 or flops_per_sample <= 0:
        return None
    return flops_per_sample * samples_per_s / world_size / (peak_tflops * 1e12)


@dataclass(frozen=True)
class Throughput:
    """What turns samples/s into tokens/s and MFU for this model, precision and device."""

    flops_per_sample: float  # training FLOPs (flops_per_sample); 0 when not counted
    tokens_per_sample: int  # predictions per sample (model.py's tokens_per_sample)
    peak_tflops: float  # of one device; 0 when unknown
    world_size: int
    hardware_flops_per_sample: float = 0.0  # with activation checkpointing's recompute; 0: as the model's

    def metrics(self, samples_per_s):
        """tokens_per_s for sequences, mfu where the device's peak is known, and hfu (hardware
        FLOPs utilisation: the recompute counted) where checkpointing recomputes any."""
        metrics = {}
        if self.tokens_per_sample > 1:  # sequences: each sample holds many predictions
            metrics["tokens_per_s"] = samples_per_s * self.tokens_per_sample
        utilisation = mfu(self.flops_per_sample, samples_per_s, self.world_size, self.peak_tflops)
        if utilisation is not None:
            metrics["mfu"] = utilisation
            if self.hardware_flops_per_sample > self.flops_per_sample:
                metrics["hfu"] = utilisation * self.hardware_flops_per_sample / self.flops_per_sample
        return metrics


def build_throughput(cfg, ctx, task, one_sample, checkpoint_blocks):
    """The run's Throughput: the GPU's peak from its name (or --peak_tflops) and, where it is
    known, the FLOPs counted on a batch of `one_sample` (meta device): the model's, and with
    --activation_checkpointing the hardware's (`checkpoint_blocks(model)` applies it)."""
    device_name = torch.cuda.get_device_name(ctx.device) if ctx.device.type == "cuda" else ""
    peak = peak_tflops(device_name, cfg.amp, cfg.tf32, cfg.peak_tflops)
    model = counted_flops(cfg, task, one_sample) if peak > 0 else 0  # counted for MFU only
    recomputes = model > 0 and cfg.activation_checkpointing != "none"
    return Throughput(
        flops_per_sample=model,
        tokens_per_sample=task.tokens_per_sample(cfg),
        peak_tflops=peak,
        world_size=ctx.world_size,
        # A Hugging Face model checkpointed (its cache off) may not run on the meta device: MFU stays.
        hardware_flops_per_sample=counted_flops(cfg, task, one_sample, checkpoint_blocks, "HFU") if recomputes else 0,
    )
