"""This project's task, for the shared tests: a tiny model, its data, and what differs."""

import math
import sysconfig
from pathlib import Path

import prepare_data as prepare

# A tiny GPT (conftest.py adds the sizes every task shares).
# lr 0.001: at 0.01 this model's training is chaotic enough that float rounding (1e-7 after a
# step) grows past 1e-2 in 32 steps, and 1 x 64 against 2 x 32 would compare rounding, not
# DDP; at 0.001 the two stay within 2e-5.
TINY = ["--block_size", "16", "--n_layer", "1", "--n_head", "2", "--n_embd", "32", "--lr", "0.001"]
# Randomness inside the data pipeline: the training windows' offsets come from (seed, epoch,
# index) already.
AUGMENT = []
# Whether gradient accumulation trains other parameters than one big batch.
ACCUMULATION_CHANGES_RESULTS = False
# The validation loss of a uniform guess: training must end below it.
CHANCE_LOSS = math.log(256)  # 256 byte values
SHAPE_CHANGE = (["--n_embd", "48"], "--n_embd is 48, the checkpoint's is 32")
CONTRACT_FIELDS = ("data_dir", "train_samples", "val_samples", "vocab_size", "block_size", "n_layer", "n_head")
CONTRACT_FIELDS += ("n_embd", "dropout", "activation_checkpointing")

# --strategy fsdp runs with activation checkpointing too: it must combine with sharding.
FSDP_ARGS = ["--activation_checkpointing", "true"]

# The network tests' model (test_network.py): 0.44M parameters, 1.7 MB of fp32 gradients a
# step, which a 20 Mbit/s link needs ~0.7 s to all-reduce, against ~0.1 s of compute.
NETWORK_ARGS = ["--block_size", "64", "--n_layer", "2", "--n_head", "4", "--n_embd", "128", "--batch_size", "16"]

# Extra arguments of the world-size equivalence runs (test_correctness.py): none.
EQUIVALENCE_ARGS = []


def prepare_data(folder):
    """A few modules of the Python standard library, as prepare_data.py writes them."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = folder / "text"
    text.mkdir()
    for name in ("argparse.py", "dataclasses.py", "functools.py", "pathlib.py"):
        (text / name).write_bytes((stdlib / name).read_bytes())
    prepare.main(["--input", str(text), "--output_dir", str(folder / "data")])
    return ["--data_dir", str(folder / "data")]
