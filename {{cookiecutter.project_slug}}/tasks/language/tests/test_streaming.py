"""Data streamed in shards from object storage keeps every guarantee local data has: 1 vs 2
processes, every sample once an epoch, exact resume after SIGTERM and SIGKILL and on another
world size, and a store that fails says so in one line and loses nothing (docs/streaming.md).

The store is a real S3 API (moto's server, tests/object_store.py) reached by the real client over
HTTP. The shards are the test data's first 1024 training windows, in 8 shards: 16 steps an epoch
at a global batch of 64, as the reference runs of test_resilience.py."""

import dataclasses
import functools
import json
import signal
import subprocess
import sys
from collections import Counter
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from conftest import (
    ARGS,
    ONE,
    PROJECT,
    TINY,
    TINY_CONFIG,
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
from object_store import SECRET, ObjectStore, without_credentials

from dataset import TokenShards
from ddp_utils.data.loaders import build_loaders
from ddp_utils.data.shards import ShardStore

WINDOWS, SHARDS = 1024, 8
BUCKET = "data"


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    """The store, with the shards under s3://data/text and the same shards in a local folder."""
    tokens = tmp_path_factory.mktemp("tokens")
    source = Path(TINY_CONFIG.data_dir)
    block = TINY_CONFIG.block_size
    (tokens / "meta.json").write_bytes((source / "meta.json").read_bytes())
    for name, windows in (("train.bin", WINDOWS), ("val.bin", 64)):
        data = (source / name).read_bytes()
        itemsize = 2 if b"uint32" not in (source / "meta.json").read_bytes() else 4
        (tokens / name).write_bytes(data[: (windows * block + 1) * itemsize])
    shard_mb = (WINDOWS // SHARDS * block) * 2 / 2**20  # 128 windows a shard (uint16 tokens)
    with ObjectStore() as object_store:
        object_store.client().create_bucket(Bucket=BUCKET)
        for destination in (f"s3://{BUCKET}/text", str(tokens / "shards")):
            subprocess.run(
                [sys.executable, "make_shards.py", "--data_dir", str(tokens),
                 "--output_dir", destination, "--shard_mb", str(shard_mb)],
                cwd=PROJECT, env=training_env(object_store.env), check=True, capture_output=True, text=True,
            )  # fmt: skip
        object_store.local = tokens / "shards"
        yield object_store


def streamed(cache, data_dir=f"s3://{BUCKET}/text", workers=2):
    return ["--data_dir", data_dir, "--stream_cache_dir", str(cache), "--stream_shuffle_shards", "2",
            "--num_workers", str(workers)]  # fmt: skip


class Runs:
    """Uninterrupted float64 runs, made when a test first asks: `two` streamed from the store
    (2 processes x 32, DataLoader workers), `one` from the local shards (1 process x 64)."""

    def __init__(self, store, tmp_path_factory):
        self.store, self.tmp = store, tmp_path_factory

    @functools.cached_property
    def two(self):
        output_dir, before = self.tmp.mktemp("streamed_two"), Counter(self.store.downloads)
        run_training(output_dir, *ARGS, *TWO, *streamed(self.tmp.mktemp("cache")), nproc=2, probe="float64",
                     env=self.store.env)  # fmt: skip
        self.two_downloads = Counter(self.store.downloads) - before
        return output_dir

    @functools.cached_property
    def one(self):
        output_dir = self.tmp.mktemp("local_one")
        run_training(output_dir, *ARGS, *ONE, *streamed(self.tmp.mktemp("cache"), self.store.local), probe="float64")
        return output_dir


@pytest.fixture(scope="module")
def runs(store, tmp_path_factory):
    return Runs(store, tmp_path_factory)


def assert_close_parameters(output_dir, reference_dir):
    ours, theirs = load_final_model(output_dir), load_final_model(reference_dir)
    for key in theirs:  # in float64: summation order aside
        assert relative_difference(ours[key], theirs[key]) < run_tolerance(), key


def training_samplers(cfg, data, world, global_batch):
    """Each rank's training sampler for `world` processes, as train.py builds it (build_loaders)."""
    cfg = dataclasses.replace(cfg, batch_size=global_batch // world, grad_accum_steps=1, num_workers=0)
    contexts = [SimpleNamespace(rank=rank, world_size=world, device=torch.device("cpu")) for rank in range(world)]
    return [build_loaders(cfg, ctx, data, data)[0].sampler for ctx in contexts]


def test_every_sample_once_an_epoch_in_one_order_for_any_world_size(store):
    """The shards' order: each window once an epoch, the same global batches for 1, 2 and 4
    processes, a new order each epoch, a few shards at a time; a resume's order is the rest."""
    shards = ShardStore(str(store.local), store.local / "cache", 1)
    cfg = dataclasses.replace(TINY_CONFIG, data_dir=str(store.local), stream_shuffle_shards=2)
    data = TokenShards(shards, "train", cfg)
    assert len(data) == WINDOWS
    global_batch = 64
    orders, raw = {}, None
    for world in (1, 2, 4):
        samplers = training_samplers(cfg, data, world, global_batch)
        for sampler in samplers:
            sampler.set_epoch(1)
        ranks = [list(sampler) for sampler in samplers]
        raw = raw or ranks[0]
        batches = [sorted(i for r in ranks for i in r[k * (global_batch // world) : (k + 1) * (global_batch // world)])
                   for k in range(WINDOWS // global_batch)]  # fmt: skip
        orders[world] = batches
        seen = sorted(i for r in ranks for i in r)
        assert seen == list(range(WINDOWS)), f"{world} processes: a window twice or none"
    assert orders[1] == orders[2] == orders[4]
    # 2 shards of 128 windows at a time: each stretch of 256 windows comes from 2 shards.
    flat = [i for batch in orders[1] for i in batch]
    assert all(len({i // 128 for i in flat[s : s + 256]}) == 2 for s in range(0, WINDOWS, 256))
    assert data.epoch_order(0, 1).tolist() != data.epoch_order(0, 2).tolist()
    (resumed,) = training_samplers(cfg, data, 1, global_batch)
    resumed.set_epoch(1, start=320)
    assert list(resumed) == raw[320:]


def test_two_streaming_processes_train_as_one_reading_local_shards(runs, store):
    """2 processes with DataLoader workers, shards from the store, = 1 process from a folder."""
    assert_close_parameters(runs.two, runs.one)
    # The node's cache served both ranks and all their workers: each shard downloaded once (a
    # download the client retried on a loaded machine may count twice; a cache of each process's
    # own would download each shard in every process that reads it).
    train = {key: count for key, count in runs.two_downloads.items() if key.startswith("text/train-")}
    assert len(train) == SHARDS and sum(train.values()) <= SHARDS + 2, train


def test_no_credential_is_printed_or_saved(runs):
    for path in runs.two.rglob("*"):
        if path.is_file() and "cache" not in path.parts:
            assert SECRET.encode() not in path.read_bytes(), path


def test_sigterm_then_sigkill_mid_epoch_resume_exactly(runs, store, tmp_path):
    """SIGTERM mid-epoch, resume; SIGKILL later in the same epoch, resume: equal to the run
    never stopped, bit for bit (float64), shards from the store."""
    output_dir = tmp_path / "run"
    args = [*ARGS, *TWO, *streamed(tmp_path / "cache")]

    def start(probe):
        command = training_command(output_dir, *args, nproc=2, probe=probe)
        return subprocess.Popen(command, cwd=PROJECT, env=training_env(store.env), stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)  # fmt: skip

    process = start("float64,slow_until_stopped")
    wait_for(checkpoint(output_dir, 20), process)
    process.send_signal(signal.SIGTERM)
    assert process.wait(timeout=60) != 0
    step, epoch, _ = saved_step(output_dir)
    assert epoch == 1 and 20 <= step < 32, step  # mid-way through the second epoch
    process = start("float64,slow_until_stopped")
    wait_for(checkpoint(output_dir, 24), process)
    kill_tree(process.pid)
    process.wait()
    step, epoch, _ = saved_step(output_dir)
    assert epoch == 1 and 24 <= step < 32, step
    run_training(output_dir, *args, nproc=2, probe="float64", env=store.env)
    assert_same_parameters(output_dir, runs.two)


@pytest.mark.parametrize("step", [20, 32], ids=["mid_epoch", "epoch_end"])
def test_resume_on_another_world_size_is_exact(runs, store, tmp_path, step):
    """The 2-process run's checkpoint, resumed by 1 process (the same global batch), streams on
    to the result of the 1-process run: the order is the seed's and the epoch's, not the world's."""
    run_training(tmp_path, *ARGS, *ONE, *streamed(tmp_path / "cache"), "--resume", checkpoint(runs.two, step),
                 probe="float64", env=store.env)  # fmt: skip
    assert_close_parameters(tmp_path, runs.one)


def broken_copy(store, name):
    """The shards under s3://data/<name>: a copy of text/ the test may spoil."""
    client = store.client()
    for item in client.list_objects_v2(Bucket=BUCKET, Prefix="text/")["Contents"]:
        key = item["Key"].replace("text/", f"{name}/", 1)
        client.copy_object(Bucket=BUCKET, Key=key, CopySource={"Bucket": BUCKET, "Key": item["Key"]})
    return client, f"s3://{BUCKET}/{name}"


def one_line(result, text):
    errors = [line for line in (result.stdout + result.stderr).splitlines() if text in line]
    assert errors, result.stdout[-3000:] + result.stderr[-3000:]
    return errors[0]


def test_a_download_cut_half_way_is_fetched_again_and_never_read(runs, store, tmp_path):
    """The 1-process run's last two epochs, streamed into an empty cache, one download cut: the
    same run, bit for bit (the first epoch, streamed or not, is the other tests' to check)."""
    client, url = broken_copy(store, "cut")
    store.cut_next("cut/train-00001.bin")
    run_training(tmp_path / "run", *ARGS, *ONE, *streamed(tmp_path / "cache", url), "--resume",
                 checkpoint(runs.one, 16), probe="float64", env=store.env)  # fmt: skip
    assert store.downloads["cut/train-00001.bin"] == 2  # the cut one, and the whole one, then read from the cache
    # Each other shard once: a DataLoader worker that closed the S3 client it inherited from the
    # training process would have dropped that process's connections from its event loop, and its
    # own next download (the first batch's check) would time out and be fetched again.
    others = {key: n for key, n in store.downloads.items() if key.startswith("cut/train-") and "00001" not in key}
    assert len(others) == SHARDS - 1 and set(others.values()) == {1}, others
    assert not [p for p in (tmp_path / "cache").rglob("*") if ".part" in p.name]
    assert_same_parameters(tmp_path / "run", runs.one)  # the same data: the same run


@pytest.mark.parametrize("fault", ["missing", "corrupt"])
def test_a_missing_or_corrupt_shard_stops_with_one_line_naming_it(store, tmp_path, fault):
    client, url = broken_copy(store, fault)
    key = f"{fault}/train-00003.bin"
    if fault == "missing":
        client.delete_object(Bucket=BUCKET, Key=key)
    else:
        size = client.head_object(Bucket=BUCKET, Key=key)["ContentLength"]
        client.put_object(Bucket=BUCKET, Key=key, Body=b"\xff" * size)
    result = run_training(tmp_path, *ARGS, *ONE, *streamed(tmp_path / "cache", url), "--epochs", "1",
                          env=store.env, check=False)  # fmt: skip
    assert result.returncode != 0
    line = one_line(result, f"s3://{BUCKET}/{key}")
    assert ("is missing" if fault == "missing" else "corrupt") in line
    assert "Traceback" not in result.stderr.split(line)[0][-200:]


def test_no_credentials_is_one_line_before_anything_is_written(store, tmp_path):
    result = run_training(tmp_path / "run", *ARGS, *ONE, *streamed(tmp_path / "cache"),
                          env=without_credentials(store.env), check=False)  # fmt: skip
    assert result.returncode == 2
    assert one_line(result, "error: --data_dir").count("no credentials") == 1
    assert not (tmp_path / "run").exists()
    # A password in the URL would be saved with the run's config: refused, masked.
    url = f"s3://testing:{SECRET}@{BUCKET}/text"
    result = run_training(tmp_path / "run", *ARGS, *ONE, *streamed(tmp_path / "cache", url), env=store.env, check=False)
    assert result.returncode == 2 and "carries a password" in result.stderr
    assert SECRET not in result.stdout + result.stderr and not (tmp_path / "run").exists()


def test_a_store_gone_mid_epoch_stops_with_a_line_and_the_same_command_resumes_exactly(runs, store, tmp_path):
    """The store unreachable mid-epoch: the download is retried, then the run stops with one line;
    its last checkpoint is intact and the same command, the store back, resumes bit for bit."""
    output_dir = tmp_path / "run"
    args = [*ARGS, *TWO, *streamed(tmp_path / "cache"), "--stream_cache_gb", "0.00002"]  # shards evicted: read again
    command = training_command(output_dir, *args, nproc=2, probe="float64,slow_until_stopped")
    process = subprocess.Popen(command, cwd=PROJECT, env=training_env(store.env), stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True, start_new_session=True)  # fmt: skip
    try:
        wait_for(checkpoint(output_dir, 12), process)
        store.down = True
        output, _ = process.communicate(timeout=240)
    finally:
        store.down = False
        kill_tree(process.pid)
    assert process.returncode != 0
    line = one_line(subprocess.CompletedProcess([], 1, output, ""), "the last checkpoint is intact")
    assert f"s3://{BUCKET}/text/train-" in line
    # Said once, by the first rank that met it, before anything else: torchrun's summary follows.
    assert output.count("the last checkpoint is intact") == 1 and "Traceback" not in output.split(line)[0], output
    step, _, _ = saved_step(output_dir)
    assert step >= 12
    run_training(output_dir, *args, nproc=2, probe="float64", env=store.env)
    assert_same_parameters(output_dir, runs.two)


def test_the_doctor_passes_on_streamed_data(store, tmp_path):
    """The doctor's checks (1 vs 2 processes, exact resume, the data position and the data per
    rank among them) pass with the data streamed from the store, DataLoader workers reading."""
    flags = [*streamed(tmp_path / "cache", workers=1), "--output_dir", str(tmp_path)]
    done = subprocess.run([sys.executable, "doctor.py", *TINY, *flags], cwd=PROJECT, capture_output=True, text=True,
                          env=training_env(store.env), timeout=900)  # fmt: skip
    printed = done.stdout + done.stderr
    assert done.returncode == 0, printed[-5000:]
    statuses = {row["check"]: row["status"] for row in json.loads((tmp_path / "doctor.json").read_text())["checks"]}
    assert "fail" not in statuses.values(), printed
    assert [statuses[name] for name in ("data position", "data per rank", "exact resume")] == ["pass"] * 3, statuses


def test_the_preflight_times_a_shard_from_the_store(store, tmp_path):
    """Each node's first process fetches a shard and says how long an epoch's shards take."""
    command = [sys.executable, "preflight.py", *TINY, *streamed(tmp_path / "cache"), "--output_dir", str(tmp_path)]
    done = subprocess.run(
        command, cwd=PROJECT, capture_output=True, text=True, env=training_env(store.env), timeout=600
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (line,) = [line for line in done.stdout.splitlines() if "data: a " in line]
    assert f"shard of s3://{BUCKET}/text fetched and checked in" in line and "an epoch's" in line, line
    assert SECRET not in done.stdout + done.stderr
