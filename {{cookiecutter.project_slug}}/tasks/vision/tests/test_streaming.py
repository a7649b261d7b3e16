"""An image folder streamed in Parquet shards from object storage keeps the guarantees of the
folder: 1 vs 2 processes with the same augmentation, exact resume after SIGTERM, the class names in
every checkpoint, and a corrupt shard stops the run in one line (docs/streaming.md).

The store is a real S3 API (moto's server, tests/object_store.py) reached by the real client over
HTTP. The shards are the TINY run's images (1024 training, 256 validation), a dozen shards: 16
steps an epoch at a global batch of 64, as the reference runs of test_resilience.py."""

import functools
import signal
import subprocess
import sys

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
from task_settings import AUGMENT

from config import Config
from dataset import build_datasets
from ddp_utils.configuration import parse_config

BUCKET = "data"
EPOCHS = ["--epochs", "2"]


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The store, with the shards under s3://data/images and the same shards in a local folder."""
    local = tmp_path_factory.mktemp("images") / "shards"
    shard_mb = 0.06  # about 80 of the digits' small PNG files
    with ObjectStore() as object_store:
        object_store.client().create_bucket(Bucket=BUCKET)
        for destination in (f"s3://{BUCKET}/images", str(local)):
            subprocess.run([sys.executable, "make_shards.py", *TINY, "--output_dir", destination, "--shard_mb",
                            str(shard_mb)], cwd=PROJECT, env=training_env(object_store.env), check=True,
                           capture_output=True, text=True)  # fmt: skip
        object_store.local = local
        yield object_store


def streamed(cache, data_dir=f"s3://{BUCKET}/images", workers=2):
    return ["--data_dir", data_dir, "--stream_cache_dir", str(cache), "--stream_shuffle_shards", "2",
            "--num_workers", str(workers), *AUGMENT]  # fmt: skip


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
    the checkpoint keeps the class names, for predict.py."""
    ours, theirs = load_final_model(runs.two), load_final_model(runs.one)
    for key in theirs:  # in float64: summation order aside
        assert relative_difference(ours[key], theirs[key]) < run_tolerance(), key
    saved = torch.load(runs.two / "checkpoints" / "last.pt", map_location="cpu", weights_only=False)["data"]
    folder, _ = build_datasets(parse_config(Config, TINY))
    assert saved == folder.data_state()
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
    for item in client.list_objects_v2(Bucket=BUCKET, Prefix="images/")["Contents"]:
        key = item["Key"].replace("images/", "corrupt/", 1)
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
