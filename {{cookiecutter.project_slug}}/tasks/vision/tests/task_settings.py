"""This project's data, for the shared tests (the model's tiny sizes: experiments/tiny.toml; the
rest the tests read from model.py and dataset.py). With your own data, set these for it."""

import math

import prepare_data as prepare

# Randomness inside the data pipeline: random-resized crops and flips from (seed, epoch, index).
AUGMENT = ["--hflip", "true"]
# The validation loss of a uniform guess: training must end below it.
CHANCE_LOSS = math.log(10)  # 10 digits

# The network tests' model (tests/cluster/test_network.py): a ResNet of 0.7M parameters, 2.8 MB of fp32
# gradients a step, which a 20 Mbit/s link needs over 1 s to all-reduce. Without sync batch
# norm: its statistics' all-reduces run in forward, so the preflight counts them as compute,
# and on one host (a group of one) they do not happen at all.
NETWORK_ARGS = ["--width", "32", "--depth", "2", "--batch_size", "16", "--sync_batchnorm", "false"]


def prepare_data(folder):
    """scikit-learn's handwritten digits as PNG files, as prepare_data.py writes them."""
    prepare.main(["--output_dir", str(folder / "digits")])
    return ["--data_dir", str(folder / "digits")]
