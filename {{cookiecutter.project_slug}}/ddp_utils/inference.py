"""A trained model for inference in one process (the task's scripts that use one): the device,
and the checkpoint read with one line for each way it can be wrong."""

from pathlib import Path
from types import SimpleNamespace

import torch

from .core.logs import exit_with_error


def pick_device(name):
    """--device auto (cuda where PyTorch sees a GPU), cpu or cuda, as a torch.device."""
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        exit_with_error("--device cuda, but PyTorch sees no CUDA GPU: use --device cpu")
    return torch.device(name)


def load_trained(path, build_model, device):
    """(model, cfg, state) of a checkpoint file that train.py or export.py wrote: `build_model`'s
    model with its weights, on `device`, in evaluation mode; `cfg` the run's config fields as
    attributes; `state` the rest ("data": the training set's data_state(), such as label names,
    statistics or the tokenizer). Anything else exits with one line naming the checkpoint."""
    path = Path(path)
    if path.is_dir():
        exit_with_error(
            f"--checkpoint {path} is sharded (--strategy fsdp): "
            f"python export.py {path} model.pt, then pass --checkpoint model.pt"
        )
    if not path.is_file():
        exit_with_error(f"--checkpoint {path} does not exist")
    try:
        # weights_only: tensors and plain values only, so a checkpoint cannot run code on load.
        state = torch.load(path, map_location=device, weights_only=True)
    except Exception as error:  # noqa: BLE001 - junk or truncated bytes; torch's messages run many lines
        exit_with_error(f"--checkpoint {path} cannot be read as a PyTorch checkpoint ({type(error).__name__})")
    if not isinstance(state, dict) or not {"model", "config"} <= state.keys():
        exit_with_error(f"--checkpoint {path} has no model and config: not a checkpoint train.py wrote")
    cfg = SimpleNamespace(**state["config"])  # every Config field, with what the data resolved
    try:
        model = build_model(cfg)
        model.load_state_dict(state["model"])
    except Exception as error:  # noqa: BLE001 - another model's weights, or a config it no longer takes
        problem = " ".join(str(error).split())[:300]  # load_state_dict's message spans lines
        exit_with_error(f"--checkpoint {path} does not fit this project's model ({type(error).__name__}: {problem})")
    return model.to(device).eval(), cfg, state
