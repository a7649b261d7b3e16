"""This project's data, for the shared tests (the model's tiny sizes: experiments/tiny.toml; the
rest the tests read from model.py and dataset.py). With your own data, set these for it."""

import math

# Randomness inside the data pipeline, for the seeding tests: training inputs get noise.
AUGMENT = ["--input_noise_std", "0.3"]
# The validation loss of a uniform guess: training must end below it.
CHANCE_LOSS = math.log(4)  # 4 classes

# The network tests' model (tests/cluster/test_network.py): 0.43M parameters, 1.7 MB of fp32 gradients a
# step, which a 20 Mbit/s link needs ~0.7 s to all-reduce; a batch large enough for the
# compute (not the loop's own overhead) to set the step time at full link speed.
NETWORK_ARGS = ["--hidden_dim", "640", "--batch_size", "1024", "--train_samples", "32768"]


def prepare_data(folder):
    """The data is made in memory from the seed: nothing to prepare, no arguments to add."""
    return []
