"""This project's task, for the shared tests: a tiny model, its data, and what differs."""

import math

# A tiny model (conftest.py adds the sizes every task shares).
TINY = ["--hidden_dim", "32", "--lr", "0.01"]
# Randomness inside the data pipeline, for the seeding tests: training inputs get noise.
AUGMENT = ["--input_noise_std", "0.3"]
# Whether gradient accumulation trains other parameters than one big batch.
ACCUMULATION_CHANGES_RESULTS = False
# The validation loss of a uniform guess: training must end below it.
CHANCE_LOSS = math.log(4)  # 4 classes
# A change of model shape that a checkpoint must refuse, and the line that says so.
SHAPE_CHANGE = (["--hidden_dim", "48"], "--hidden_dim is 48, the checkpoint's is 32")
# Fields that scripts and sweeps of this task rely on (besides the shared ones).
CONTRACT_FIELDS = ("train_samples", "val_samples", "input_dim", "hidden_dim", "num_classes", "dataset")

# Options every --strategy fsdp run of the shared tests adds: none for this model.
FSDP_ARGS = []

# The network tests' model (test_network.py): 0.43M parameters, 1.7 MB of fp32 gradients a
# step, which a 20 Mbit/s link needs ~0.7 s to all-reduce; a batch large enough for the
# compute (not the loop's own overhead) to set the step time at full link speed.
NETWORK_ARGS = ["--hidden_dim", "640", "--batch_size", "1024", "--train_samples", "32768"]

# Extra arguments of the world-size equivalence runs (test_correctness.py): none.
EQUIVALENCE_ARGS = []


def prepare_data(folder):
    """The data is made in memory from the seed: nothing to prepare, no arguments to add."""
    return []
