"""A trained model for inference (sample.py and predict.py, through ddp_utils/inference.py): a
checkpoint loads into the task's model, and every way one can be wrong is one line naming it."""

import pytest
import torch
from conftest import TINY_CONFIG

from ddp_utils.inference import load_trained
from task import TASK


def tiny_model():
    cfg = TINY_CONFIG.resolved()  # the tests' sizes, with what the data resolves
    return TASK.build_model(cfg), cfg


def test_a_checkpoint_loads_into_its_model_in_evaluation_mode(tmp_path):
    model, cfg = tiny_model()
    torch.save({"model": model.state_dict(), "config": cfg.to_dict(), "data": None}, tmp_path / "model.pt")
    loaded, loaded_cfg, state = load_trained(tmp_path / "model.pt", TASK.build_model, torch.device("cpu"))
    assert not loaded.training and loaded_cfg.batch_size == cfg.batch_size and state["data"] is None
    assert all(torch.equal(ours, theirs) for ours, theirs in zip(loaded.state_dict().values(),
                                                                 model.state_dict().values(), strict=True))  # fmt: skip


PROBLEMS = {
    "a sharded folder": "is sharded (--strategy fsdp): python export.py",
    "a missing file": "does not exist",
    "junk bytes": "cannot be read as a PyTorch checkpoint (",
    "another file saved by torch": "has no model and config: not a checkpoint train.py wrote",
    "another model's weights": "does not fit this project's model (",
}


@pytest.mark.parametrize("case", PROBLEMS)
def test_a_bad_checkpoint_is_one_line_naming_it(tmp_path, capsys, case):
    model, cfg = tiny_model()
    path = tmp_path / "model.pt"
    if case == "a sharded folder":
        path.mkdir()
    elif case == "junk bytes":
        path.write_bytes(b"not a checkpoint")
    elif case == "another file saved by torch":
        torch.save({"weights": torch.zeros(1)}, path)
    elif case == "another model's weights":  # every name, no shape right
        torch.save({"model": dict.fromkeys(model.state_dict(), torch.zeros(1)), "config": cfg.to_dict()}, path)
    with pytest.raises(SystemExit) as stopped:
        load_trained(path, TASK.build_model, torch.device("cpu"))
    stderr = capsys.readouterr().err
    assert stopped.value.code == 2 and stderr.startswith(f"error: --checkpoint {path} {PROBLEMS[case]}"), stderr
    assert len(stderr.strip().splitlines()) == 1
