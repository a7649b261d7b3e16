"""The task contract: the one object the machinery is handed, and how it reads a batch.

The project's `task.py` builds `TASK = Task(...)` from the user's config.py, model.py and
dataset.py, and every entry point (train.py, doctor.py, preflight.py, export.py, and the
launchers that call them) hands it over: the machinery never imports a user file. This
docstring is the one list of what the machinery reads; nothing else is looked up by name.

Required, as keywords:
- `config`: the Config dataclass (config.py) with every knob of a run. Its bases ModelConfig
  and DataConfig may define `check_model()`/`check_data()` (raise `errors.ConfigError` naming
  the flag) and `resolve_model()`/`resolve_data()` (a dict of fields filled in from the data,
  e.g. a vocabulary size of 0); all four are optional.
- `build_model(cfg) -> nn.Module`: built as written, with torch seeded by --seed, under ddp
  and fsdp alike (its own initialisation is kept).
- `build_datasets(cfg) -> (train, val)`: map-style datasets. An item may be a tensor, a tuple
  or list, or a dict of tensors (nested too): the loop moves any of them to the device
  (`to_device`), counts samples by their first dimension (`count_samples`), and hands the model
  `model_inputs(batch)`: a tuple's or list's first element, a dict's "inputs", or the batch.
  A bad setting or missing data: raise `errors.ConfigError` (naming the flag) or `InputError`.

Optional, as keywords (the default after the colon):
- `loss_fn(output, batch)`: the mean training loss: cross-entropy against the targets (a
  tuple's second element, a dict's "targets").
- `evaluation_sums(output, batch) -> {name: sum}`, summed over every validation batch and rank,
  then `evaluation_metrics(sums) -> {metric: value}`, which includes "val_loss": a classifier's
  loss and accuracy; with only a `loss_fn`, the loss alone.
- `shape_fields`: config fields a checkpoint to resume must match: none.
- `tokens_per_sample(cfg)`: predictions per sample, for a tokens/s figure: 1.
- `pretrained_weights(cfg)`: a whole state dict to start from (e.g. --init_from's), copied into
  the model on a fresh start (never on resume), under ddp and fsdp alike: None.
- `sample_text(model, cfg, data) -> str`: a short sample of the model's output (text from a
  fixed prompt and seed), logged every --sample_every_steps; `data` is the training set's
  `data_state()`: none, that flag is refused.
- `write_hf(exported, out_dir)`: export.py --format hf, a Hugging Face folder of an exported
  checkpoint ({"model", "config", "data"}): none, that format is refused.

Optional on the model object (looked up on the module build_model returns):
- `shard_units()`: the blocks --strategy fsdp shards one by one: the children of its largest
  nn.ModuleList/nn.Sequential.
- `init_weights(name, module)`: an initialisation module by module, which lets a model too big
  for one process start on the meta device (strategy.build_module).
- `same_buffers_on_every_rank = True` on a submodule whose buffers are kept equal across ranks
  by the module itself (as torch's SyncBatchNorm does): DDP need not resend them.
- `muon_parameters()`: the parameters --optimizer muon gives Muon (the rest go to AdamW): the
  hidden Linear and convolution weights (ddp_utils/optim/muon.py hidden_layers).

Optional on the datasets:
- `data_state()` (training set): what a prediction needs from the training data (label names,
  normalisation statistics, the tokenizer) as plain data, saved in every checkpoint.
- `check_samples(indices) -> {index: problem}` and `without(indices) -> Dataset`: bad samples
  found before training (data.find_bad_samples).
- `set_epoch(epoch)`: called before each epoch, for randomness drawn from (seed, epoch, index).
- `__getitems__(indices)` (torch's own hook: DataLoader asks for a whole batch) returning a
  `data.Batch(inputs, targets)` of tensors gathered at once: the loaders take it as it is,
  with no collation sample by sample (data.collate). Any other item is default-collated.

A misspelled keyword is an error naming the near miss; a method on the model, the datasets or
the config classes whose name is a near miss of a hook above is reported once at start.
"""

import dataclasses
import difflib
import inspect
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F

from .errors import ConfigError

CONFIG_HOOKS = ("check_model", "resolve_model", "check_data", "resolve_data")
MODEL_HOOKS = ("shard_units", "init_weights", "same_buffers_on_every_rank", "muon_parameters")
DATASET_HOOKS = ("data_state", "check_samples", "without", "set_epoch")


@dataclass(frozen=True, init=False)
class Task:
    """What the machinery reads of a task (this module's docstring): built with keywords only."""

    config: type
    build_model: object
    build_datasets: object
    loss_fn: object
    evaluation_sums: object
    evaluation_metrics: object
    shape_fields: tuple
    tokens_per_sample: object
    pretrained_weights: object
    sample_text: object  # or None: the task has none
    write_hf: object  # or None

    def __init__(self, **hooks):
        names = [f.name for f in dataclasses.fields(self)]
        for name in hooks:
            if name not in names:
                close = difflib.get_close_matches(name, names, n=1)
                hint = f": did you mean {close[0]}?" if close else f" (the hooks: {', '.join(names)})"
                raise TypeError(f"Task(): {name} is not a hook the machinery reads{hint}")
        for name in ("config", "build_model", "build_datasets"):
            if hooks.get(name) is None:
                raise TypeError(f"Task(): {name} is required")
        loss_fn = hooks.get("loss_fn")
        sums, metrics = (loss_sums(loss_fn), loss_metrics) if loss_fn else (classification_sums, classification_metrics)
        defaults = {
            "loss_fn": cross_entropy,
            "evaluation_sums": sums,
            "evaluation_metrics": metrics,
            "shape_fields": (),
            "tokens_per_sample": one_per_sample,
            "pretrained_weights": no_weights,
            "sample_text": None,
            "write_hf": None,
        }
        for name in names:
            value = hooks.get(name)
            object.__setattr__(self, name, defaults[name] if value is None else value)
        object.__setattr__(self, "shape_fields", tuple(self.shape_fields))
        for problem in near_misses(self.config, CONFIG_HOOKS, "config"):
            raise TypeError(f"Task(): {problem}")

    def replace(self, **hooks):
        """This task with `hooks` replaced, every other one kept as it is (no defaults recomputed)."""
        return Task(**{**{f.name: getattr(self, f.name) for f in dataclasses.fields(self)}, **hooks})


def one_per_sample(cfg):
    return 1


def no_weights(cfg):
    return None


def near_misses(obj, hooks, what):
    """A line for each name that the user's classes of `obj` (an instance or a class; torch's
    and the standard library's own are left out) define and that is close to, but not, one of
    `hooks`: a misspelled hook the machinery would silently not call."""
    cls = obj if isinstance(obj, type) else type(obj)
    names = set()
    for base in inspect.getmro(cls):
        if not installed(base):
            # Private names (a leading underscore) are the class's own business, never hooks.
            names.update(n for n in vars(base) if not n.startswith("_"))
    problems = []
    for name in sorted(names - set(hooks)):
        close = difflib.get_close_matches(name, hooks, n=1, cutoff=0.8)
        if close:
            problems.append(f"{what} {cls.__name__}.{name} is not a hook the machinery reads: did you mean {close[0]}?")
    return problems


def installed(cls):
    """Whether `cls` comes from the standard library or an installed package (torch,
    transformers, ddp_utils itself): its names are the library's, never the user's hooks (a
    Hugging Face model's public `initialize_weights` is not a misspelled `init_weights`)."""
    top = cls.__module__.split(".")[0]
    if top in ("builtins", "ddp_utils") or top in sys.stdlib_module_names:
        return True
    path = getattr(sys.modules.get(top), "__file__", None) or ""
    return any(part in ("site-packages", "dist-packages") for part in Path(path).parts)


def model_near_misses(model):
    """near_misses of MODEL_HOOKS on each class of module in `model`."""
    classes = {type(module): None for module in model.modules()}
    return [problem for cls in classes for problem in near_misses(cls, MODEL_HOOKS, "the model's")]


def resolved(cfg):
    """The config with what comes from the data filled in (`resolve_data()`, `resolve_model()`,
    each optional); a field they name that the config does not have is a ConfigError."""
    filled = {}
    for hook in ("resolve_data", "resolve_model"):
        if hasattr(cfg, hook):
            filled.update(getattr(cfg, hook)() or {})
    unknown = sorted(set(filled) - {f.name for f in dataclasses.fields(cfg)})
    if unknown:
        raise ConfigError(unknown[0], "is filled in by resolve_data/resolve_model but is not a config field")
    return dataclasses.replace(cfg, **filled) if filled else cfg


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


def count_samples(batch):
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
        samples = count_samples(batch)
        return {"loss": loss_fn(output, batch).double() * samples, "samples": samples}

    return sums


def loss_metrics(sums):
    return {"val_loss": sums["loss"] / sums["samples"]}
