"""The task contract (ddp_utils/contract.py): the Task the entry points hand over takes only the
hooks it knows, needs only the config, the model and the data, and a near miss of a hook's name
anywhere (the Task, the config classes, the model, the datasets) is reported, never silently
ignored."""

import dataclasses

import pytest
from conftest import TINY_CONFIG
from torch import nn

from ddp_utils.contract import DATASET_HOOKS, Task, model_near_misses, near_misses
from task import TASK


def test_a_misspelled_task_hook_is_an_error_naming_the_hook():
    with pytest.raises(TypeError, match="evaluation_metric is not a hook .*did you mean evaluation_metrics"):
        TASK.replace(evaluation_metric=TASK.evaluation_metrics)
    with pytest.raises(TypeError, match="build_model is required"):
        Task(config=TASK.config, build_datasets=TASK.build_datasets)


def test_only_the_config_the_model_and_the_data_are_required():
    task = Task(config=TASK.config, build_model=TASK.build_model, build_datasets=TASK.build_datasets)
    assert task.shape_fields == () and task.sample_text is None and task.write_hf is None
    assert task.tokens_per_sample(TINY_CONFIG) == 1 and task.pretrained_weights(TINY_CONFIG) is None
    classified = task.evaluation_metrics({"loss": 6.0, "correct": 1, "predictions": 3})
    assert classified == {"val_loss": 2.0, "val_accuracy": 1 / 3}
    with_loss = Task(config=TASK.config, build_model=TASK.build_model, build_datasets=TASK.build_datasets,
                     loss_fn=lambda output, batch: output.mean())  # fmt: skip
    # Its own loss and no evaluation: the validation loss alone, weighted by samples.
    assert with_loss.evaluation_metrics({"loss": 6.0, "samples": 3}) == {"val_loss": 2.0}
    assert task.replace(shape_fields=["seed"]).shape_fields == ("seed",)


def test_a_near_miss_of_a_hook_on_the_model_the_datasets_or_the_config_is_reported():
    class Block(nn.Module):
        def shard_unit(self):
            return [self]

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.block = Block()

        def init_weight(self, name, module):
            pass

        def _init_weights(self, module):  # private: a class's own business, not a hook
            pass

    class FromALibrary(nn.Module):
        def initialize_weights(self):  # a library's own name (Hugging Face's), not a hook
            pass

    FromALibrary.__module__ = "numpy"  # as if installed: numpy is, in site-packages

    class Mine(FromALibrary):
        def shard_unit(self):
            return [self]

    assert model_near_misses(FromALibrary()) == []
    assert len(model_near_misses(Mine())) == 1  # the user's subclass is still read

    problems = model_near_misses(Net())
    assert len(problems) == 2, problems
    assert any("Net.init_weight " in p and "did you mean init_weights?" in p for p in problems)
    assert any("Block.shard_unit " in p and "did you mean shard_units?" in p for p in problems)

    class Data:
        def data_states(self):
            return {}

    (problem,) = near_misses(Data(), DATASET_HOOKS, "the training set")
    assert "Data.data_states" in problem and "did you mean data_state?" in problem

    @dataclasses.dataclass(frozen=True)
    class Misspelled(TASK.config):
        def check_modle(self):
            raise AssertionError("never called")

    with pytest.raises(TypeError, match="check_modle is not a hook .*did you mean check_model"):
        TASK.replace(config=Misspelled)


@pytest.mark.quick
def test_the_shipped_task_has_no_near_miss():
    """The project's own model and datasets: nothing reported (a false alarm at every start would
    teach users to ignore the warning)."""
    cfg = TINY_CONFIG.resolved()
    assert model_near_misses(TASK.build_model(cfg)) == []
    train, val = TASK.build_datasets(cfg)
    assert near_misses(train, DATASET_HOOKS, "the training set") == []
    assert near_misses(val, DATASET_HOOKS, "the validation set") == []
