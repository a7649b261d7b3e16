"""Write a checkpoint's model as one file: the whole state dict and the config, for inference
and sharing; or, with --format hf, as a Hugging Face folder (the tasks whose model.py has
`write_hf`: the language task's GPT-2).

    python export.py runs/default/checkpoints/last model.pt
    python export.py runs/default/checkpoints/last model_hf --format hf

CHECKPOINT is what train.py wrote: a sharded folder (--strategy fsdp, e.g. checkpoints/last
or checkpoints/step_000000400) or a file (--strategy ddp, last.pt). OUT loads with
`torch.load(OUT, weights_only=True)`: {"model": state dict, "config": the run's Config fields,
"data": the training set's `data_state()` (label names, normalisation statistics) or None}.
With --format hf, OUT is a folder `transformers.AutoModelForCausalLM.from_pretrained(OUT)`
loads. Under torchrun every process may run it; rank 0 alone writes OUT.
"""

import argparse
import sys
import warnings
from pathlib import Path

import torch

import model
from config import RENAMED, Config
from ddp_utils.checkpoint_files import load_checkpoint, load_sharded_checkpoint
from ddp_utils.contract import build_on_meta
from ddp_utils.faults import CheckpointError
from ddp_utils.knobs import ConfigError, exit_with_error
from ddp_utils.logs import rank_zero_only


def consolidated(path):
    """{"model": the whole state dict, "config": the run's Config fields, "data": what the
    training data left for predictions} of a checkpoint."""
    state = load_checkpoint(path)  # a folder gives the trainer's state: config, steps
    if "model" in state:
        return {"model": state["model"], "config": state["config"], "data": state.get("data")}
    try:
        # Fields since removed (RENAMED) are left out: an older run's checkpoint still exports.
        cfg = Config(**{name: value for name, value in state["config"].items() if name not in RENAMED})
    except (TypeError, ConfigError) as error:
        raise CheckpointError(f"checkpoint {path} holds a config this project does not accept: {error}") from None
    module = build_on_meta(model.build_model, cfg)  # only for the names and shapes: no memory, no initialisation
    if module is None:  # its construction needs real tensors: built for real, then overwritten
        module = model.build_model(cfg)
    else:
        module.to_empty(device="cpu")
    weights = {"model": module.state_dict()}
    with warnings.catch_warnings():  # "assuming the intent is to load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        # No process group: this process alone reads every shard, whatever world size wrote them.
        load_sharded_checkpoint(path, weights, group=None)
    return {"model": weights["model"], "config": state["config"], "data": state.get("data")}


@rank_zero_only
def export(checkpoint, out, format="pt"):
    try:
        state = consolidated(Path(checkpoint))
    except CheckpointError as error:
        exit_with_error(str(error))
    out = Path(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    if format == "hf":
        model.write_hf(state, out)  # a folder, renamed into place when complete
    else:
        tmp = out.with_name(f".{out.name}.tmp")
        torch.save(state, tmp)
        tmp.replace(out)  # OUT is complete or absent, never half-written
    parameters = sum(t.numel() for t in state["model"].values())
    print(f"wrote {out}: {parameters:,} values from {checkpoint}")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", help="a checkpoint folder (fsdp) or file (ddp) that train.py wrote")
    parser.add_argument("out", help="the single file to write, e.g. model.pt (a folder with --format hf)")
    parser.add_argument(
        "--format", choices=("pt", "hf"), default="pt", help="pt: one torch file; hf: a Hugging Face folder"
    )
    args = parser.parse_args(argv)
    if not Path(args.checkpoint).exists():
        exit_with_error(f"checkpoint {args.checkpoint} does not exist")
    if args.format == "hf" and not hasattr(model, "write_hf"):
        exit_with_error("--format hf: this task's model.py has no write_hf (the language task's GPT has)")
    export(args.checkpoint, args.out, args.format)
    return 0


if __name__ == "__main__":
    sys.exit(main())
