"""This project's data, for the shared tests (the model's tiny sizes: experiments/tiny.toml; the
rest the tests read from model.py and dataset.py). With your own data, set these for it."""

import math
import sysconfig
from pathlib import Path

import prepare_data as prepare

# Randomness inside the data pipeline: the training windows' offsets come from (seed, epoch,
# index) already.
AUGMENT = []
# The validation loss of a uniform guess: training must end below it.
CHANCE_LOSS = math.log(256)  # 256 byte values

# The network tests' model (tests/cluster/test_network.py): 0.44M parameters, 1.7 MB of fp32 gradients a
# step, which a 20 Mbit/s link needs ~0.7 s to all-reduce, against ~0.1 s of compute.
NETWORK_ARGS = ["--block_size", "64", "--n_layer", "2", "--n_head", "4", "--n_embd", "128", "--batch_size", "16"]


def prepare_data(folder):
    """A few modules of the Python standard library, as prepare_data.py writes them."""
    stdlib = Path(sysconfig.get_paths()["stdlib"])
    text = folder / "text"
    text.mkdir()
    for name in ("argparse.py", "dataclasses.py", "functools.py", "pathlib.py"):
        (text / name).write_bytes((stdlib / name).read_bytes())
    prepare.main(["--input", str(text), "--output_dir", str(folder / "data")])
    return ["--data_dir", str(folder / "data")]
