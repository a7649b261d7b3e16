"""The task contract: the one place the machinery reads the files a user edits.

model.py and dataset.py state the contract in their docstrings. `load_task()` reads it when
training starts: what the task defines, else the default below. Batches may be tensors,
tuples/lists or dicts of tensors (nested too); the loop moves any of them to the device
(`to_device`), counts samples by their first dimension (`batch_size`), and hands the model
`model_inputs(batch)`: the first element of a tuple or list, a dict's "inputs", or the batch
itself.
"""

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Task:
    build_model: object  # cfg -> nn.Module
    build_datasets: object  # cfg -> (train Dataset, validation Dataset)
    loss_fn: object  # (output, batch) -> the mean training loss, a scalar tensor
    evaluation_sums: object  # (output, batch) -> {name: sum over the batch}, added over batches and ranks
    evaluation_metrics: object  # {name: total} -> {metric: value}, with "val_loss"
    shape_fields: tuple  # config fields a checkpoint to resume must match
    tokens_per_sample: object  # cfg -> predictions per sample (tokens/s is reported when above 1)


def load_task():
    """The task as model.py and dataset.py define it, with defaults for what they leave out:
    without a loss, classification (cross-entropy, accuracy); with a loss but no evaluation,
    the validation loss alone."""
    import dataset
    import model

    loss_fn = getattr(model, "loss_fn", None)
    sums, metrics = (loss_sums(loss_fn), loss_metrics) if loss_fn else (classification_sums, classification_metrics)
    return Task(
        build_model=model.build_model,
        build_datasets=dataset.build_datasets,
        loss_fn=loss_fn or cross_entropy,
        evaluation_sums=getattr(model, "evaluation_sums", sums),
        evaluation_metrics=getattr(model, "evaluation_metrics", metrics),
        shape_fields=tuple(getattr(model, "SHAPE_FIELDS", ())),
        tokens_per_sample=getattr(model, "tokens_per_sample", lambda cfg: 1),
    )


# --- batches of any structure ----------------------------------------------------------------


def to_device(batch, device):
    """The batch with every tensor on `device` (pinned memory copies asynchronously)."""
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    if isinstance(batch, dict):
        return {key: to_device(value, device) for key, value in batch.items()}
    if isinstance(batch, (tuple, list)):
        return type(batch)(to_device(value, device) for value in batch)
    return batch


def model_inputs(batch):
    """What the model's forward gets: a tuple's or list's first element, a dict's "inputs"."""
    if isinstance(batch, (tuple, list)):
        return batch[0]
    if isinstance(batch, dict):
        return batch["inputs"]
    return batch


def batch_size(batch):
    """Samples in a batch: the first dimension of its first tensor."""
    leaves = torch.utils._pytree.tree_leaves(batch)
    return next(len(leaf) for leaf in leaves if isinstance(leaf, torch.Tensor))


# --- the defaults: classification ---------------------------------------------------------


def targets(batch):
    """The targets of a (inputs, targets) batch or a dict's "targets"."""
    return batch["targets"] if isinstance(batch, dict) else batch[1]


def cross_entropy(output, batch):
    """Mean cross-entropy of logits [..., classes] against class indices [...]: one per sample
    (a class) or per token (language)."""
    return F.cross_entropy(output.flatten(0, -2), targets(batch).flatten())


def classification_sums(output, batch):
    """Summed cross-entropy and correct predictions, over every prediction of the batch."""
    labels = targets(batch).flatten()
    logits = at_least_float32(output.flatten(0, -2))
    return {
        "loss": F.cross_entropy(logits, labels, reduction="sum"),
        "correct": (logits.argmax(dim=-1) == labels).sum(),
        "predictions": labels.numel(),
    }


def at_least_float32(tensor):
    """bf16 and fp16 outputs (autocast) summed in float32; float64 (the tests' exact runs) kept."""
    return tensor.float() if tensor.dtype in (torch.float16, torch.bfloat16) else tensor


def classification_metrics(sums):
    return {"val_loss": sums["loss"] / sums["predictions"], "val_accuracy": sums["correct"] / sums["predictions"]}


def loss_sums(loss_fn):
    """Evaluation sums of a task that defines only its loss: the mean loss weighted by samples."""

    def sums(output, batch):
        samples = batch_size(batch)
        return {"loss": loss_fn(output, batch).double() * samples, "samples": samples}

    return sums


def loss_metrics(sums):
    return {"val_loss": sums["loss"] / sums["samples"]}
