"""Issue 64's comparison of streaming data libraries against the guarantees of the project's own
training order (ShardedSampler, ddp_utils/data/loaders.py), and their speed. One library a run,
with a Python that has it installed (each in a venv of its own: torch as the project pins it
first, then the library; datasets also needs torchdata):

    python bench/stream_libraries.py ours          # the project's sampler (.venv suffices)
    python bench/stream_libraries.py streaming     # mosaicml-streaming: MDS shards, StreamingDataset
    python bench/stream_libraries.py litdata       # litdata: optimize()'s chunks, StreamingDataset
    python bench/stream_libraries.py datasets      # Hugging Face datasets: Parquet shards, streaming=True,
                                                   #   shuffle + split_dataset_by_node, StatefulDataLoader
    python bench/stream_libraries.py torchdata     # torchdata's StatefulDataLoader, map-style, DistributedSampler

Writes --samples samples (each an int64 row whose first value is its id) in the library's own
shard format (for ours and torchdata, which have none: one .npy file read as a map-style
dataset) to a temporary folder, then runs real ranks: each rank a process of its own (RANK,
WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE set, a gloo process group), a DataLoader with
--workers workers (2), a global batch of --global_batch samples (12: 12 a rank with one process,
6 with two), a shuffled order from the seed, two epochs; every rank records the ids of each of
its batches. The uneven end: 1001 samples are 83 global batches of 12 and 5 more, an odd number
that 2 processes cannot share evenly. Checked:

- same batches 1 vs 2: every global batch (the union of the ranks' batches of a step) of a
  2-process run holds the same samples as that step's batch of a 1-process run;
- each sample once: in each epoch of the 2-process run no id twice, none missing (the few of a
  partial last global batch, left out the same way by every rank, are named), and every rank
  gets the same number of batches (fewer on one rank: DDP's collectives of the others hang);
- resume, same size: 2 processes stopped after 20 steps, each rank's state (the library's own
  state_dict and the epoch) saved; a fresh run loads it and stops 15 steps later; a third loads
  that and stops at the last step of the epoch; a fourth loads that and finishes. Their batches,
  one after the other, must be the uninterrupted 2-process run's;
- resume, other size: the state of 2 processes after 20 steps loaded by 1 process (rank 0's
  state), and that of 1 process by 2 (both load it), each finishing the run: the rest must be
  the uninterrupted run's (either size's, where the two agree);
- the resume state: its size pickled (the largest rank's), and the samples read again: those
  the third run above (from a mid-epoch state to the epoch's end) reads that the two before it
  trained on, less the repeats its batches hold themselves. A library that replays what was
  seen to get back to its place reads them again. Counted where the library hands a sample over
  (its __getitem__, or a map() for datasets): a re-read below that (a shard decoded again up to
  its offset) is not seen.

Speed: samples/s of one process iterating --speed_samples samples of --payload bytes each
(besides the id) in batches of 64 with the same workers, the median of 3 epochs, each timed
from the loader's iter() to its last batch (workers' start and the epoch's shuffle included), or
stopped after --speed_seconds (a slow reader: its rate so far). The machine's load moves it:
compare libraries run on the same machine at the same time.

Prints one Markdown table row per run (the header first). A benchmark, not a test: it asserts
nothing; a guarantee reads "no: ..." with the first thing seen to break it.
"""

import argparse
import collections
import datetime
import importlib.metadata
import json
import os
import pickle
import platform
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
# bench/ comes first on sys.path: a script named like a library (streaming.py) must never shadow it
sys.path[:] = [path for path in sys.path if Path(path or ".").resolve() != BENCH]
PROJECT = BENCH.parent / "{{cookiecutter.project_slug}}"
SEED, EPOCHS = 0, 2
STOPS = (20, 15)  # the first resume after 20 steps, the second 15 steps later
SPEED_BATCH = 64
READS = "STREAM_BENCH_READS"  # a folder: each process appends the ids it reads to a file of its own


def note_read(sample_id):
    """Called where a library hands over one sample: counts the reads of a resumed run."""
    folder = os.environ.get(READS)
    if folder:
        with open(os.path.join(folder, str(os.getpid())), "a") as file:
            file.write(f"{sample_id}\n")


def rows(samples, payload):
    """Sample i: an int64 row, i then payload // 8 filler values."""
    import numpy as np

    data = np.zeros((samples, 1 + payload // 8), dtype=np.int64)
    data[:, 0] = np.arange(samples)
    data[:, 1:] = np.random.default_rng(0).integers(0, 2**31, size=data[:, 1:].shape)
    return data


def ids_of(batch):
    """The ids of a collated batch: rows (a tensor: their first column), or a dict of them."""
    if isinstance(batch, dict):
        batch = batch["row"]
    return [int(row) for row in (batch[:, 0] if batch.dim() == 2 else batch)]


class MapRows:
    """A map-style dataset over an .npy file (ours and torchdata: neither has a shard format)."""

    def __init__(self, path):
        import numpy as np

        self.path, self.rows, self.length = path, None, len(np.load(path, mmap_mode="r"))

    def __len__(self):
        return self.length

    def __getitem__(self, index):
        import numpy as np
        import torch

        if self.rows is None:  # opened in each worker
            self.rows = np.load(self.path, mmap_mode="r")
        row = torch.from_numpy(np.array(self.rows[index]))
        note_read(int(row[0]))
        return row


def write_npy(folder, samples, payload):
    import numpy as np

    folder.mkdir(parents=True)
    np.save(folder / "rows.npy", rows(samples, payload))
    return str(folder / "rows.npy")


class Ours:
    """The project's ShardedSampler over a map-style dataset, a plain DataLoader; the state: the
    epoch and the samples done (the sampler's start), nothing else."""

    name, package = "ours", None

    @staticmethod
    def version():
        return "ShardedSampler (this template)"

    write = staticmethod(write_npy)

    def __init__(self, path, rank, world, batch, workers):
        sys.path.insert(0, str(PROJECT))
        from ddp_utils.data.loaders import ShardedSampler
        from torch.utils.data import DataLoader

        dataset = MapRows(path)
        self.global_batch = batch * world
        self.sampler = ShardedSampler(len(dataset), self.global_batch, rank, world, SEED)
        self.loader = DataLoader(dataset, batch_size=batch, sampler=self.sampler, num_workers=workers)
        self.done = 0

    def batches(self, epoch):
        self.sampler.set_epoch(epoch, self.done)
        for batch in self.loader:
            self.done += self.global_batch
            yield batch
        self.done = 0

    def state(self):
        return {"samples_done": self.done}

    def load(self, state):
        self.done = state["samples_done"]


class TorchData:
    """torchdata's StatefulDataLoader over a map-style dataset with torch's DistributedSampler."""

    name, package = "torchdata", "torchdata"
    write = staticmethod(write_npy)

    def __init__(self, path, rank, world, batch, workers):
        from torch.utils.data import DistributedSampler
        from torchdata.stateful_dataloader import StatefulDataLoader

        dataset = MapRows(path)
        self.sampler = DistributedSampler(dataset, num_replicas=world, rank=rank, shuffle=True, seed=SEED)
        self.loader = StatefulDataLoader(dataset, batch_size=batch, sampler=self.sampler, num_workers=workers)

    def batches(self, epoch):
        self.sampler.set_epoch(epoch)
        yield from self.loader

    def state(self):
        return self.loader.state_dict()

    def load(self, state):
        self.loader.load_state_dict(state)


class Streaming:
    """mosaicml-streaming: MDS shards (about 10), StreamingDataset (it reads RANK, WORLD_SIZE,
    LOCAL_WORLD_SIZE itself) and its StreamingDataLoader, whose state_dict is the dataset's."""

    name, package = "streaming", "mosaicml-streaming"

    @staticmethod
    def write(folder, samples, payload):
        from streaming import MDSWriter

        data = rows(samples, payload)
        with MDSWriter(
            out=str(folder), columns={"row": "ndarray:int64"}, size_limit=max(data.nbytes // 10, 1024)
        ) as out:
            for row in data:
                out.write({"row": row})
        return str(folder)

    def __init__(self, path, rank, world, batch, workers):
        from streaming import StreamingDataLoader, StreamingDataset

        class Counted(StreamingDataset):
            def __getitem__(self, index):
                sample = super().__getitem__(index)
                note_read(int(sample["row"][0]))
                return sample["row"]

        self.dataset = Counted(local=path, shuffle=True, shuffle_seed=SEED, batch_size=batch)
        self.loader = StreamingDataLoader(self.dataset, batch_size=batch, num_workers=workers)

    def batches(self, epoch):  # the dataset counts its epochs itself
        yield from self.loader

    def state(self):
        return self.loader.state_dict()

    def load(self, state):
        self.loader.load_state_dict(state)


class LitData:
    """litdata: optimize()'s chunks (about 10), StreamingDataset and StreamingDataLoader (their
    rank and world size from the process group)."""

    name, package = "litdata", "litdata"

    @staticmethod
    def write(folder, samples, payload):
        import litdata

        litdata.optimize(fn=_row, inputs=list(rows(samples, payload)), output_dir=str(folder),
                         chunk_size=max(samples // 10, 1), num_workers=1, mode="overwrite")  # fmt: skip
        return str(folder)

    def __init__(self, path, rank, world, batch, workers):
        import litdata

        class Counted(litdata.StreamingDataset):
            def __getitem__(self, index):
                sample = super().__getitem__(index)
                note_read(int(sample["row"][0]))
                return sample["row"]

        # drop_last: litdata's default is True under a process group, False without, and a state
        # saved under one does not load under the other
        self.dataset = Counted(path, shuffle=True, seed=SEED, drop_last=True)
        self.loader = litdata.StreamingDataLoader(self.dataset, batch_size=batch, num_workers=workers)

    def batches(self, epoch):  # the loader counts its epochs itself
        yield from self.loader

    def state(self):
        return self.loader.state_dict()

    def load(self, state):
        self.loader.load_state_dict(state)


def _row(row):  # litdata.optimize's fn: a module-level function, for its worker processes
    return {"row": row}


class HFDatasets:
    """Hugging Face datasets: Parquet shards (10), load_dataset(streaming=True), shuffle (a
    buffer of 100), split_dataset_by_node, a map() that counts reads, torchdata's
    StatefulDataLoader (what datasets' docs name for a resumable loader with workers)."""

    name, package = "datasets", "datasets"

    @staticmethod
    def write(folder, samples, payload):
        import pyarrow as pa
        import pyarrow.parquet as pq

        data = rows(samples, payload)
        folder.mkdir(parents=True)
        for shard, start in enumerate(range(0, samples, -(-samples // 10))):
            part = data[start : start + -(-samples // 10)]
            pq.write_table(pa.table({"row": list(part)}), folder / f"shard-{shard:02d}.parquet")
        return str(folder)

    def __init__(self, path, rank, world, batch, workers):
        from datasets import load_dataset
        from datasets.distributed import split_dataset_by_node
        from torchdata.stateful_dataloader import StatefulDataLoader

        files = sorted(str(file) for file in Path(path).glob("*.parquet"))
        stream = load_dataset("parquet", data_files=files, split="train", streaming=True)
        stream = split_dataset_by_node(stream.shuffle(seed=SEED, buffer_size=100), rank=rank, world_size=world)
        self.stream = stream.map(_count_row).with_format("torch")
        self.loader = StatefulDataLoader(self.stream, batch_size=batch, num_workers=workers)

    def batches(self, epoch):
        self.stream.set_epoch(epoch)
        yield from self.loader

    def state(self):
        return self.loader.state_dict()

    def load(self, state):
        self.loader.load_state_dict(state)


def _count_row(sample):
    note_read(int(sample["row"][0]))
    return sample


LIBRARIES = {library.name: library for library in (Ours, Streaming, LitData, HFDatasets, TorchData)}


def version(library):
    if library.package is None:
        return library.version()
    return f"{library.package} {importlib.metadata.version(library.package)}"


def rank_job(spec):
    """One rank of a run: its batches' ids, until `stop` steps (or the end of the last epoch),
    from a saved state or the start; then its state saved. Writes rank-R.json and state-R.pkl."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    rank, world, out = spec["rank"], spec["world"], Path(spec["out"])
    dist.init_process_group("gloo", rank=rank, world_size=world)
    library = LIBRARIES[spec["library"]]
    reader = library(spec["data"], rank, world, spec["global_batch"] // world, spec["workers"])
    epoch, records = 0, []
    if spec["resume"]:
        saved = Path(spec["resume"]) / f"state-{rank}.pkl"
        saved = saved if saved.exists() else Path(spec["resume"]) / "state-0.pkl"  # another world size
        state = pickle.loads(saved.read_bytes())
        epoch = state["epoch"]
        reader.load(state["loader"])
    while epoch < EPOCHS and len(records) != spec["stop"]:
        for batch in reader.batches(epoch):
            records.append([epoch, ids_of(batch)])
            if len(records) == spec["stop"]:  # stopped after this step: the epoch goes on
                break
        else:
            epoch += 1
    (out / f"state-{rank}.pkl").write_bytes(pickle.dumps({"epoch": epoch, "loader": reader.state()}))
    (out / f"rank-{rank}.json").write_text(json.dumps(records))
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)  # the libraries' worker and cleanup threads: the run is recorded


def free_port():
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Runs:
    """Launches runs of one library's ranks in `work`, each in a folder of its own."""

    def __init__(self, args, data, work):
        self.args, self.data, self.work, self.count = args, data, work, 0

    def __call__(self, world, stop=None, resume=None):
        self.count += 1
        out = self.work / f"run-{self.count}"
        (out / "reads").mkdir(parents=True)
        port = free_port()
        processes = []
        for rank in range(world):
            spec = {"library": self.args.library, "data": self.data, "rank": rank, "world": world, "stop": stop,
                    "resume": str(resume.out) if resume else None, "out": str(out), "workers": self.args.workers,
                    "global_batch": self.args.global_batch}  # fmt: skip
            env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                   "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
                   "OMP_NUM_THREADS": "1", READS: str(out / "reads")}  # fmt: skip
            command = [sys.executable, __file__, self.args.library, "--rank_job", json.dumps(spec)]
            log = open(out / f"log-{rank}.txt", "w")  # noqa: SIM115 - the process writes it
            processes.append(subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT))
        deadline = time.monotonic() + self.args.timeout
        for process in processes:
            try:
                process.wait(timeout=max(deadline - time.monotonic(), 1))
            except subprocess.TimeoutExpired:
                for other in processes:
                    other.kill()
                raise RunFailed(f"hung for {self.args.timeout:.0f} s: {error_line(out)}") from None
        if any(process.returncode for process in processes):
            raise RunFailed(error_line(out))
        return Run(out, world)

    def tried(self, world, stop=None, resume=None):
        """The run, or its RunFailed (also when the run it resumes from failed)."""
        if isinstance(resume, RunFailed):
            return resume
        try:
            return self(world, stop, resume)
        except RunFailed as error:
            return error


class RunFailed(Exception):
    """A run whose ranks failed: the message is the error's line (the log's last line that names one)."""


def error_line(out):
    lines = [line for log in sorted(out.glob("log-*.txt")) for line in log.read_text().splitlines()]
    errors = [line for line in lines if "Error" in line and not line.startswith(" ")]
    return (errors or lines or ["no output"])[-1].removeprefix("[rank0]: ").removeprefix("[rank1]: ")[:200]


class Run:
    """A finished run: each rank's records [[epoch, ids], ...], the global batches, reads."""

    def __init__(self, out, world):
        self.out, self.world = out, world
        self.ranks = [json.loads((out / f"rank-{rank}.json").read_text()) for rank in range(world)]
        steps = max(len(records) for records in self.ranks)
        self.batches = [
            (min(r[step][0] for r in self.ranks if step < len(r)), sorted(i for r in self.ranks if step < len(r) for i in r[step][1]))
            for step in range(steps)
        ]  # fmt: skip
        self.reads = [int(i) for file in (out / "reads").iterdir() for i in file.read_text().split()]
        self.state_bytes = max(len((out / f"state-{rank}.pkl").read_bytes()) for rank in range(world))

    def unequal(self):
        """Ranks' batches per epoch where they differ: {epoch: [count of rank 0, ...]}."""
        counts = [collections.Counter(epoch for epoch, _ in records) for records in self.ranks]
        return {e: [c[e] for c in counts] for e in range(EPOCHS) if len({c[e] for c in counts}) > 1}


def differ(got, expected):
    """Why the global batches `got` are not `expected` (None when they are)."""
    got, expected = [ids for _, ids in got], [ids for _, ids in expected]
    if got == expected:
        return None
    if len(got) > len(expected) and got[: len(expected)] == expected:
        return f"the same batches, then {len(got) - len(expected)} more"
    if len(got) != len(expected):
        return f"{len(got)} batches where {len(expected)}"
    wrong = [step for step, (a, b) in enumerate(zip(got, expected)) if a != b]
    return f"{len(wrong)} of {len(got)} batches differ, the first at step {wrong[0]}"


def once(runs, samples, global_batch):
    """Each sample once per epoch over `runs` (one after the other)? None, or why not. By each
    rank's own epoch: a rank whose epoch ends early goes on to the next while the others do not."""
    problems = []
    for epoch in range(EPOCHS):
        counts = collections.Counter(i for run in runs for records in run.ranks for e, ids in records if e == epoch
                                     for i in ids)  # fmt: skip
        twice = sum(count - 1 for count in counts.values() if count > 1)
        missing = samples - len(counts)
        if twice:
            problems.append(f"epoch {epoch}: {twice} read twice, {missing} missing")
        elif missing and missing != samples % global_batch:
            problems.append(f"epoch {epoch}: {missing} missing")
    return "; ".join(problems) or None


def check(args, runs):
    """{guarantee: "yes" / "no: why"} and the resume state's figures."""
    verdict = {}
    one, two = runs(1), runs(2)
    problem = differ(two.batches, one.batches)
    if problem and sorted(i for _, ids in two.batches for i in ids) == sorted(i for _, ids in one.batches for i in ids):
        problem += " (the same samples per epoch)"
    verdict["same batches 1 vs 2"] = problem

    missing = args.samples - len({i for records in two.ranks for e, ids in records if e == 0 for i in ids})
    problems = [once([two], args.samples, args.global_batch)]
    if two.unequal():
        problems.append(f"the ranks' batches per epoch differ, {two.unequal()}: DDP's collectives hang")
    problem = "; ".join(filter(None, problems))
    verdict["each sample once"] = problem or (
        f"yes ({missing} of the partial last global batch left out)" if missing else "yes"
    )

    steps = sum(1 for e, _ in two.batches if e == 0)
    first = runs(2, stop=STOPS[0])
    second = runs.tried(2, stop=STOPS[1], resume=first)
    third = runs.tried(2, stop=steps - sum(STOPS), resume=second)
    fourth = runs.tried(2, resume=third)
    chain, problem = [], None
    for stage, run in zip(
        ("stop", "mid-epoch resume", "second resume", "resume at the epoch's end"), (first, second, third, fourth)
    ):
        if isinstance(run, RunFailed):
            problem = f"{stage}: fails: {run}"
            break
        chain += run.batches
        why = differ(chain, two.batches[: len(chain)] if run is not fourth else two.batches)
        if why:
            problem = f"{stage}: {why}"
            break
    verdict["resume, same size"] = problem

    problems = []
    for before, after in ((2, 1), (1, 2)):
        try:
            stopped = first if before == 2 else runs(1, stop=STOPS[0])
            resumed = runs(after, resume=stopped)
        except RunFailed as error:
            problems.append(f"{before}->{after}: fails: {error}")
            continue
        got = stopped.batches + resumed.batches
        if differ(got, two.batches) and differ(got, one.batches):
            why = once([stopped, resumed], args.samples, args.global_batch)
            problems.append(f"{before}->{after}: " + (why or "other batches, each sample still once"))
    verdict["resume, other size"] = "; ".join(problems) or None

    state = f"{first.state_bytes} B pickled"
    if isinstance(third, RunFailed):
        verdict["resume state"] = f"{state}; resumed runs fail"
    else:
        seen = {i for run in (first, second) for _, ids in run.batches for i in ids}  # epoch 0's, before it
        # less those its own order holds again (a sample repeated to even out the ranks' shares)
        replayed = sum(i in seen for i in third.reads) - sum(i in seen for _, ids in third.batches for i in ids)
        verdict["resume state"] = (f"no: {state}, {replayed} sample{'s' * (replayed > 1)} read again" if replayed > 0 else
                                   f"yes: {state}, nothing read again")  # fmt: skip
    return verdict


def speed(args, library, work):
    """Samples/s of one process over --speed_samples samples, the median of 3 epochs: measured in
    a process of its own (litdata's optimize() leaves this one spawning its workers)."""
    data = library.write(work / "speed", args.speed_samples, args.payload)
    one = {"RANK": "0", "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "OMP_NUM_THREADS": "1"}
    env = {name: value for name, value in {**os.environ, **one}.items() if name != READS}
    command = [sys.executable, __file__, args.library, "--speed_job", data, "--workers", str(args.workers),
               "--speed_seconds", str(args.speed_seconds)]  # fmt: skip
    result = subprocess.run(command, check=False, env=env, capture_output=True, text=True, timeout=args.timeout)
    if result.returncode:
        raise RuntimeError(f"the speed run failed: {result.stderr[-2000:]}")
    return float(result.stdout.split()[-1])


def speed_job(args):
    import torch

    torch.set_num_threads(1)
    reader = LIBRARIES[args.library](args.speed_job, 0, 1, SPEED_BATCH, args.workers)
    rates = []
    for epoch in range(3):
        started, count = time.perf_counter(), 0
        for batch in reader.batches(epoch):
            count += len(ids_of(batch))
            if time.perf_counter() - started > args.speed_seconds:
                break  # a slow reader: its rate so far
        rates.append(count / (time.perf_counter() - started))
    print(statistics.median(rates))
    os._exit(0)


COLUMNS = ["same batches 1 vs 2", "each sample once", "resume, same size", "resume, other size", "resume state"]


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("library", choices=sorted(LIBRARIES))
    parser.add_argument("--samples", type=int, default=1001)
    parser.add_argument("--global_batch", type=int, default=12)
    parser.add_argument("--workers", type=int, default=2, help="DataLoader workers of each rank")
    parser.add_argument("--speed_samples", type=int, default=20000)
    parser.add_argument("--speed_seconds", type=float, default=30, help="an epoch of the speed run stops after this")
    parser.add_argument("--payload", type=int, default=1024, help="bytes of each speed sample besides its id")
    parser.add_argument("--timeout", type=float, default=300, help="seconds one run may take")
    parser.add_argument("--keep", action="store_true", help="keep the temporary folder (each run's logs)")
    parser.add_argument("--rank_job", help=argparse.SUPPRESS)
    parser.add_argument("--speed_job", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.rank_job:
        return rank_job(json.loads(args.rank_job))
    if args.speed_job:
        return speed_job(args)
    library = LIBRARIES[args.library]
    work = Path(tempfile.mkdtemp(prefix=f"stream-{args.library}-"))
    started = time.perf_counter()
    try:
        data = library.write(work / "data", args.samples, 0)
        verdict = check(args, Runs(args, data, work))
        rate = speed(args, library, work)
    finally:
        if args.keep:
            print(f"kept {work}", file=sys.stderr)
        else:
            shutil.rmtree(work, ignore_errors=True)
    import torch

    print(f"# {datetime.datetime.now(datetime.UTC):%Y-%m-%d %H:%M} UTC, {platform.machine()}, "
          f"{os.cpu_count()} CPUs, Python {platform.python_version()}, torch {torch.__version__}; "
          f"{args.samples} samples, global batch {args.global_batch}, {args.workers} workers a rank; "
          f"checks took {time.perf_counter() - started:.0f} s")  # fmt: skip
    print("| library | " + " | ".join(COLUMNS) + " | samples/s |")
    print("|" + " --- |" * (len(COLUMNS) + 2))
    cells = [verdict[column] or "yes" for column in COLUMNS]
    cells = [cell if cell.startswith(("yes", "no")) else f"no: {cell}" for cell in cells]
    print(f"| {version(library)} | " + " | ".join(cells) + f" | {rate:,.0f} |")


if __name__ == "__main__":
    main()
