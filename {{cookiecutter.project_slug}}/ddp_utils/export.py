"""Export: a checkpoint's model as one file, the whole state dict and the config, for inference
and sharing; or, with --format hf, as a Hugging Face folder (a task with `write_hf`: the
language task's GPT-2).

    python export.py runs/default/checkpoints/last model.pt
    python export.py runs/default/checkpoints/last model_hf --format hf

CHECKPOINT is what train.py wrote: a sharded folder (--strategy fsdp, e.g. checkpoints/last
or checkpoints/step_000000400) or a file (--strategy ddp, last.pt). OUT loads with
`torch.load(OUT, weights_only=True)`: {"model": state dict, "config": the run's Config fields,
"data": the training set's `data_state()` (label names, normalisation statistics) or None}.
With --format hf, OUT is a folder `transformers.AutoModelForCausalLM.from_pretrained(OUT)`
loads. Under torchrun every process may run it; rank 0 alone writes OUT.
"""

import warnings
from pathlib import Path

import torch

from .checkpoint.loading import load_checkpoint
from .checkpoint.sharded import load_sharded_checkpoint
from .configuration import RENAMED
from .contract import build_on_meta
from .core.files import write_atomically
from .core.logs import exit_with_error, rank_zero_only
from .errors import CheckpointError, ConfigError
from .knobs import OneLineParser


def consolidated(task, path):
    """{"model": the whole state dict, "config": the run's Config fields, "data": what the
    training data left for predictions} of a checkpoint."""
    state = load_checkpoint(path)  # a folder gives the trainer's state: config, steps
    if "model" in state:
        return {"model": state["model"], "config": state["config"], "data": state.get("data")}
    try:
        # Fields since removed (RENAMED) are left out: an older run's checkpoint still exports.
        cfg = task.config(**{name: value for name, value in state["config"].items() if name not in RENAMED})
    except (TypeError, ConfigError) as error:
        raise CheckpointError(f"checkpoint {path} holds a config this project does not accept: {error}") from None
    module = build_on_meta(task.build_model, cfg)  # only for the names and shapes: no memory, no initialisation
    if module is None:  # its construction needs real tensors: built for real, then overwritten
        module = task.build_model(cfg)
    else:
        module.to_empty(device="cpu")
    weights = {"model": module.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        # No process group: this process alone reads every shard, whatever world size wrote them.
        load_sharded_checkpoint(path, weights, group=None)
    return {"model": weights["model"], "config": state["config"], "data": state.get("data")}


@rank_zero_only
def export(task, checkpoint, out, format="pt"):
    try:
        state = consolidated(task, Path(checkpoint))
    except CheckpointError as error:
        exit_with_error(str(error))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if format == "hf":
        task.write_hf(state, out)  # a folder, renamed into place when complete
    else:
        # OUT is complete or absent, never half-written.
        write_atomically(out, lambda f: torch.save(state, f))
    parameters = sum(t.numel() for t in state["model"].values())
    print(f"wrote {out}: {parameters:,} values from {checkpoint}")


def main(task, argv=None):
    """Export a checkpoint of `task` (contract.Task); returns the exit code."""
    parser = OneLineParser(prog="export.py", description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (fsdp) or file (ddp) that train.py wrote")
    parser.add_argument("out", help="the single file to write, e.g. model.pt (a folder with --format hf)")
    parser.add_argument(
        "--format", choices=("pt", "hf"), default="pt", help="pt: one torch file; hf: a Hugging Face folder"
    )
    args = parser.parse_args(argv)
    if not Path(args.checkpoint).exists():
        exit_with_error(f"checkpoint {args.checkpoint} does not exist")
    if args.format == "hf" and task.write_hf is None:
        exit_with_error("--format hf: this task has no write_hf (task.py; the language task's GPT has one)")
    export(task, args.checkpoint, args.out, args.format)
    return 0
