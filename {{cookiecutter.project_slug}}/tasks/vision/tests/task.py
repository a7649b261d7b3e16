"""This project's task, for the shared tests: a tiny model, its data, and what differs."""

import math

import prepare_data as prepare

# A tiny ResNet on 16x16 digits (conftest.py adds the sizes every task shares).
# lr 0.001: at 0.01 this ResNet's training is chaotic enough that float rounding (1e-7 after
# one step) grows to 1e-2 in 16 steps, and 1 x 64 against 2 x 32 would compare rounding, not
# DDP. At 0.001 the two stay within 1e-5.
TINY = ["--image_size", "16", "--width", "8", "--depth", "1", "--lr", "0.001"]
# Randomness inside the data pipeline: random-resized crops and flips from (seed, epoch, index).
AUGMENT = ["--hflip", "true"]
# Whether gradient accumulation trains other parameters than one big batch.
ACCUMULATION_CHANGES_RESULTS = True  # BatchNorm normalises each micro-batch: accumulating changes the statistics
# The validation loss of a uniform guess: training must end below it.
CHANCE_LOSS = math.log(10)  # 10 digits
SHAPE_CHANGE = (["--width", "12"], "--width is 12, the checkpoint's is 8")
CONTRACT_FIELDS = ("data_dir", "train_samples", "val_samples", "image_size", "num_classes", "width", "depth")
CONTRACT_FIELDS += ("sync_batchnorm", "channels_last")

# Options every --strategy fsdp run of the shared tests adds: none for this model.
FSDP_ARGS = []

# The network tests' model (test_network.py): a ResNet of 0.7M parameters, 2.8 MB of fp32
# gradients a step, which a 20 Mbit/s link needs over 1 s to all-reduce. Without sync batch
# norm: its statistics' all-reduces run in forward, so the preflight counts them as compute,
# and on one host (a group of one) they do not happen at all.
NETWORK_ARGS = ["--width", "32", "--depth", "2", "--batch_size", "16", "--sync_batchnorm", "false"]

# The world-size equivalence runs (test_correctness.py) stop after 4 steps: later this ResNet's
# training amplifies float rounding (AdamW turns noise in near-zero BatchNorm bias gradients
# into whole steps). Measured, 1 x 64 against 2 x 32: within 4e-6 after 4 steps for seeds 0-2,
# but 7e-4, 1e-3 and 2e-2 after 32 steps depending on the seed's initial weights.
EQUIVALENCE_ARGS = ["--max_steps", "4"]


def prepare_data(folder):
    """scikit-learn's handwritten digits as PNG files, as prepare_data.py writes them."""
    prepare.main(["--output_dir", str(folder / "digits")])
    return ["--data_dir", str(folder / "digits")]
