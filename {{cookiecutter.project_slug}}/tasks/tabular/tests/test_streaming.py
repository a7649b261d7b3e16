"""A table streamed in Parquet shards from object storage keeps the guarantees of the table read
whole: 1 vs 2 processes, exact resume after SIGTERM, the statistics and label names in every
checkpoint, and a corrupt shard stops the run in one line (docs/streaming.md). make_shards.py writes,
a chunk at a time, exactly the rows that training on the table reads whole.

The store is a real S3 API (moto's server, tests/object_store.py) reached by the real client over
HTTP. The shards are the TINY run's rows (1024 training, 256 validation), 8 training shards of 128:
16 steps an epoch at a global batch of 64, as the reference runs of test_resilience.py."""

import functools
import os
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import (
    ARGS,
    ONE,
    PROJECT,
    TINY,
    TWO,
    assert_same_parameters,
    checkpoint,
    kill_tree,
    load_final_model,
    relative_difference,
    run_tolerance,
    run_training,
    saved_step,
    training_command,
    training_env,
    wait_for,
)
from object_store import SECRET, ObjectStore

from config import Config
from dataset import build_datasets
from ddp_utils.configuration import parse_config
from ddp_utils.data.tables import chunk_rows

BUCKET, SHARDS = "data", 8
EPOCHS = ["--epochs", "2"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The store, with the shards under s3://data/table and the same shards in a local folder."""
    local = tmp_path_factory.mktemp("table") / "shards"
    shard_mb = 1024 // SHARDS * (4 * 4 + 8) / 2**20  # 128 rows of 4 float32 features and a target
    with ObjectStore() as object_store:
        object_store.client().create_bucket(Bucket=BUCKET)
        for destination in (f"s3://{BUCKET}/table", str(local)):
            subprocess.run([sys.executable, "make_shards.py", *TINY, "--output_dir", destination, "--shard_mb",
                            str(shard_mb)], cwd=PROJECT, env=training_env(object_store.env), check=True,
                           capture_output=True, text=True)  # fmt: skip
        object_store.local = local
        yield object_store


def streamed(cache, data_file=f"s3://{BUCKET}/table", workers=2):
    return ["--data_file", data_file, "--stream_cache_dir", str(cache), "--stream_shuffle_shards", "2",
            "--num_workers", str(workers), "--input_noise_std", "0.3"]  # fmt: skip


class Runs:
    """Uninterrupted float64 runs, made when a test first asks: `two` streamed from the store
    (2 processes x 32, DataLoader workers), `one` from the local shards (1 process x 64)."""

    def __init__(self, store, tmp_path_factory):
        self.store, self.tmp = store, tmp_path_factory

    @functools.cached_property
    def two(self):
        output_dir = self.tmp.mktemp("streamed_two")
        run_training(output_dir, *ARGS, *TWO, *EPOCHS, *streamed(self.tmp.mktemp("cache")), nproc=2, probe="float64",
                     env=self.store.env)  # fmt: skip
        return output_dir

    @functools.cached_property
    def one(self):
        output_dir = self.tmp.mktemp("local_one")
        run_training(output_dir, *ARGS, *ONE, *EPOCHS, *streamed(self.tmp.mktemp("cache"), str(self.store.local)),
                     probe="float64")  # fmt: skip
        return output_dir


@pytest.fixture(scope="module")
def runs(store, tmp_path_factory):
    return Runs(store, tmp_path_factory)


def test_two_streaming_processes_train_as_one_reading_local_shards(runs, store):
    """2 processes with DataLoader workers, shards from the store, = 1 process from a folder;
    the checkpoint keeps the table's statistics and label names, for predict.py."""
    ours, theirs = load_final_model(runs.two), load_final_model(runs.one)
    for key in theirs:  # in float64: summation order aside
        assert relative_difference(ours[key], theirs[key]) < run_tolerance(), key
    saved = torch.load(runs.two / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)["data"]
    table, _ = build_datasets(parse_config(Config, TINY))
    assert saved == table.data_state()
    for path in runs.two.rglob("*"):
        if path.is_file():
            assert SECRET.encode() not in path.read_bytes(), path


def test_sigterm_mid_epoch_then_the_same_command_resumes_exactly(runs, store, tmp_path):
    output_dir = tmp_path / "run"
    args = [*ARGS, *TWO, *EPOCHS, *streamed(tmp_path / "cache")]
    command = training_command(output_dir, *args, nproc=2, probe="float64,slow_until_stopped")
    process = subprocess.Popen(command, cwd=PROJECT, env=training_env(store.env), stdout=subprocess.DEVNULL,
                               stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip
    try:
        wait_for(checkpoint(output_dir, 20), process)
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=60) != 0
    finally:
        kill_tree(process.pid)
    step, epoch, _ = saved_step(output_dir)
    assert epoch == 1 and 20 <= step < 32, step  # mid-way through the second epoch
    run_training(output_dir, *args, nproc=2, probe="float64", env=store.env)
    assert_same_parameters(output_dir, runs.two)


def test_a_corrupt_shard_stops_with_one_line_naming_it(store, tmp_path):
    client = store.client()
    for item in client.list_objects_v2(Bucket=BUCKET, Prefix="table/")["Contents"]:
        key = item["Key"].replace("table/", "corrupt/", 1)
        client.copy_object(Bucket=BUCKET, Key=key, CopySource={"Bucket": BUCKET, "Key": item["Key"]})
    key = "corrupt/train-00003.parquet"
    size = client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
    client.put_object(Bucket=BUCKET, Key=key, Body=b"\xff" * size)
    result = run_training(tmp_path, *ARGS, *ONE, *streamed(tmp_path / "cache", f"s3://{BUCKET}/corrupt", workers=0),
                          "--epochs", "1", env=store.env, check=False)  # fmt: skip
    assert result.returncode != 0
    lines = [line for line in (result.stdout + result.stderr).splitlines() if f"s3://{BUCKET}/{key}" in line]
    assert lines and "corrupt" in lines[0], result.stdout[-3000:] + result.stderr[-3000:]
    assert "Traceback" not in result.stderr.split(lines[0])[0][-200:]


def write_wide_table(path, rows, seed=0):
    """A CSV of `rows` rows: 20 numeric features on a large scale, a label from the first one."""
    inputs = np.random.default_rng(seed).normal(size=(rows, 20)) * 1000 + 50
    with open(path, "w") as f:
        f.write(",".join([*(f"f{i}" for i in range(20)), "label"]) + "\n")
        for values in inputs.tolist():
            f.write(",".join(map(repr, values)) + ("," + ("up" if values[0] > 50 else "down")) + "\n")
    return path


def shard_rows(folder, index, split):
    """(inputs, targets) of one split's shards, read back with pyarrow."""
    import pyarrow.parquet  # noqa: PLC0415

    inputs, targets = [], []
    for shard in index["splits"][split]:
        table = pyarrow.parquet.read_table(folder / shard["name"])
        x = table.column("x").combine_chunks()
        inputs.append(x.flatten().to_numpy().reshape(len(x), x.type.list_size))
        targets.append(table.column("y").to_numpy())
    return torch.from_numpy(np.concatenate(inputs)), torch.from_numpy(np.concatenate(targets))


def make_shards(*args):
    """make_shards.py's run, in its own process: its peak memory in MiB. VmHWM, the high-water mark
    of the process's own memory since its start (ru_maxrss would count the parent's, which a child
    inherits at its exec). pyarrow allocates from the C library's heap, not its own pool: the pool
    keeps tens of MiB of slack after a Parquet write, whatever the table's size."""
    peak = "[line.split()[1] for line in open('/proc/self/status') if line.startswith('VmHWM')][0]"
    run = (
        "import atexit, runpy, sys\n"
        f"atexit.register(lambda: print('peak', {peak}, file=sys.stderr))\n"
        "sys.argv = sys.argv[1:]\n"
        "runpy.run_path(sys.argv[0], run_name='__main__')\n"
    )
    env = training_env({"ARROW_DEFAULT_MEMORY_POOL": "system"})
    result = subprocess.run([sys.executable, "-c", run, "make_shards.py", *args], cwd=PROJECT, env=env,
                            capture_output=True, text=True)  # fmt: skip
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-2000:]
    return int(result.stderr.split("peak ")[-1]) / 1024  # KiB


def check_shards(folder, args):
    """The shards at `folder` hold the rows, statistics and label names training reads from the table."""
    import json  # noqa: PLC0415

    index = json.loads((folder / "index.json").read_text())
    train, val = build_datasets(parse_config(Config, args))
    for split, table in (("train", train), ("val", val)):
        inputs, targets = shard_rows(folder, index, split)
        assert torch.equal(inputs, table.inputs) and torch.equal(targets, table.targets), split
    assert index["data_state"] == train.data_state()
    return index


def test_make_shards_writes_the_rows_training_reads_without_holding_the_table(tmp_path):
    """A table of many chunks: the shards hold, to the bit, the rows that training on the table
    reads (split, order, statistics), and the writer's memory grows with the table by well under
    the file's own bytes, where reading it whole takes several times them."""
    small, large = write_wide_table(tmp_path / "small.csv", 50_000), write_wide_table(tmp_path / "large.csv", 150_000)
    assert 150_000 > 8 * chunk_rows(21)  # the writer reads the large table in many chunks
    peaks = {}
    for table in (small, large):
        args = ["--data_file", str(table), "--target", "label", "--seed", "3"]
        peaks[table] = make_shards(*args, "--output_dir", str(tmp_path / table.stem), "--shard_mb", "1")
    index = check_shards(tmp_path / "large", args)
    assert len(index["splits"]["train"]) > 8
    grown = (peaks[large] - peaks[small]) * 2**20  # bytes, for 100,000 rows more
    assert grown < large.stat().st_size - small.stat().st_size, peaks


def test_make_shards_of_a_parquet_table_with_a_validation_file_and_a_number_to_predict(tmp_path):
    """--val_file (its first --val_samples rows), a Parquet --data_file read in chunks across its
    row groups, a regression target: the rows training reads, to the bit."""
    import pyarrow.csv  # noqa: PLC0415
    import pyarrow.parquet  # noqa: PLC0415

    data = tmp_path / "rows.parquet"
    pyarrow.parquet.write_table(pyarrow.csv.read_csv(write_wide_table(tmp_path / "rows.csv", 40_000)), data,
                                row_group_size=7_777)  # fmt: skip
    val = write_wide_table(tmp_path / "val.csv", 15_000, seed=1)  # 2 chunks: the first --val_samples span both
    args = ["--data_file", str(data), "--target", "f1", "--ignore_columns", "label", "--val_file", str(val)]
    args += ["--val_samples", "14000", "--train_samples", "30000"]
    make_shards(*args, "--output_dir", str(tmp_path / "shards"), "--shard_mb", "0.5")
    index = check_shards(tmp_path / "shards", args)
    assert index["data_state"]["target_kind"] == "regression" and len(index["splits"]["val"]) > 1


def test_a_temp_dir_without_room_is_one_line_before_anything_is_written(tmp_path):
    """--temp_dir on a disk too small for the sorted rows: one line naming it, at once; no shard,
    no folder at --output_dir, nothing left in --temp_dir."""
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root")
    temp = tmp_path / "temp"
    temp.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", str(temp)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        table = write_wide_table(tmp_path / "table.csv", 5_000)
        command = [sys.executable, "make_shards.py", "--data_file", str(table), "--target", "label", "--output_dir",
                   str(tmp_path / "shards"), "--temp_dir", str(temp)]  # fmt: skip
        result = subprocess.run(command, cwd=PROJECT, env=training_env(), capture_output=True, text=True)
        assert list(temp.iterdir()) == []
    finally:
        subprocess.run(["umount", "-l", str(temp)], capture_output=True)
    assert result.returncode == 2, result.stdout[-2000:] + result.stderr[-2000:]
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and f"--temp_dir {temp}" in lines[0] and "free" in lines[0], result.stderr
    assert not (tmp_path / "shards").exists()
