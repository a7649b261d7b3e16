"""The task contract: the one place the machinery reads the files a user edits, and what it
reads (`load_task()`, when training starts; only `build_model` is required).

dataset.py
- `build_datasets(cfg) -> (train, val)`: map-style datasets. An item may be a tensor, a tuple
  or list, or a dict of tensors (nested too): the loop moves any of them to the device
  (`to_device`), counts samples by their first dimension (`batch_size`), and hands the model
  `model_inputs(batch)`: a tuple's or list's first element, a dict's "inputs", or the batch.
  A bad setting or missing data: raise `knobs.ConfigError` (naming the flag) or `InputError`.
- On the datasets, optionally: `data_state()` (training set), what a prediction needs from the
  training data (label names, normalisation statistics) as plain data, saved in every
  checkpoint as state["data"]; `check_samples(indices) -> {index: problem}` and
  `without(indices) -> Dataset`, bad samples found before training (data.find_bad_samples).
model.py
- `build_model(cfg) -> nn.Module`: built as written, with torch seeded by --seed, under ddp
  and fsdp alike (its own initialisation is kept).
- `loss_fn(output, batch)`: the mean training loss. Default: cross-entropy against the
  targets (a tuple's second element, a dict's "targets").
- `evaluation_sums(output, batch) -> {name: sum}`: summed over every validation batch and
  rank, then `evaluation_metrics(sums) -> {metric: value}`, which includes "val_loss".
  Default: a classifier's loss and accuracy; with only a `loss_fn`, the loss alone.
- `SHAPE_FIELDS`: config fields a checkpoint to resume must match. Default: none.
- `tokens_per_sample(cfg)`: predictions per sample, for a tokens/s figure. Default: 1.
- `pretrained_weights(cfg)`: a whole state dict to start from (e.g. --init_from's), copied into
  the model on a fresh start (never on resume), under ddp and fsdp alike. Default: None.
- `sample_text(model, cfg) -> str`: a short sample of the model's output (text from a fixed
  prompt and seed), logged every --sample_every_steps. Default: none, that flag is refused.
- `write_hf(exported, out_dir)`: export.py --format hf, a Hugging Face folder of an exported
  checkpoint ({"model", "config", "data"}). Default: none, that format is refused.
- On the model, optionally: `shard_units()`, the blocks --strategy fsdp shards one by one
  (default: the children of its largest nn.ModuleList/nn.Sequential); `init_weights(name,
  module)`, an initialisation module by module, which lets a model too big for one process
  start on the meta device (strategy.build_module).
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
    pretrained_weights: object  # cfg -> a whole state dict to start from, or None
    sample_text: object  # (model, cfg) -> a sample of its output as text, or None: the task has none


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
        pretrained_weights=getattr(model, "pretrained_weights", lambda cfg: None),
        sample_text=getattr(model, "sample_text", None),
    )


def data_state(train_set):
    """What the training set keeps in every checkpoint (its `data_state()`), or None."""
    return train_set.data_state() if hasattr(train_set, "data_state") else None


def build_on_meta(build_model, cfg):
    """`build_model(cfg)` on the meta device (no memory, no arithmetic, no random draws), or
    None when its construction needs real tensors (a table computed in __init__, a file read)."""
    try:
        with torch.device("meta"), torch.random.fork_rng(devices=[]):
            return build_model(cfg)
    except Exception:  # noqa: BLE001 - any failure means: it cannot be built there
        return None


# --- batches of any structure ----------------------------------------------------------------


def to_device(batch, device):
    """The batch with every tensor on `device` (pinned memory copies asynchronously)."""
    if type(batch) in (tuple, list) and all(isinstance(item, torch.Tensor) for item in batch):
        return type(batch)(item.to(device, non_blocking=True) for item in batch)  # the common case, no pytree walk
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.to(device, non_blocking=True), batch)


def model_inputs(batch):
    """What the model's forward gets: a tuple's or list's first element, a dict's "inputs"."""
    if isinstance(batch, (tuple, list)):
        return batch[0]
    if isinstance(batch, dict):
        return batch["inputs"]
    return batch


def batch_size(batch):
    """Samples in a batch: the first dimension of its first tensor."""
    if type(batch) in (tuple, list) and isinstance(batch[0], torch.Tensor):
        return len(batch[0])
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
