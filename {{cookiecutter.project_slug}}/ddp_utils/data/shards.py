"""Data in shards, read from a local folder, a shared file system or object storage (any URL
fsspec reaches: s3://, gs://, az://, ...): the index, each node's cache, and the global order.

    <data_dir>/index.json          what the shards hold: per split, each shard's name, samples,
                                   bytes and sha256; the task's own facts (dtype, tokenizer, ...)
    <data_dir>/train-00000.bin     the shards, written once (ShardWriter), never changed

A shard is fetched whole into the node's cache (--stream_cache_dir, at most --stream_cache_gb,
least recently used shards evicted), shared by the node's ranks and workers: the first to need it
downloads it under a lock, to a temporary name, checks its size and sha256 against the index, and
only then renames it into place, so a half-downloaded or corrupt shard is never read. The store's
own client (fsspec's s3fs, gcsfs, adlfs) takes the credentials as it always does (environment,
profile, instance role); nothing here prints or saves them.

The order stays the loaders' (loaders.ShardedSampler): a pure function of (seed, epoch), the same
for any world size, resumed from (epoch, samples done). Only its shape changes: `shard_order` keeps
each stretch of the epoch within a few shards (--stream_shuffle_shards at a time, their samples
shuffled together), so a node holds a handful of shards at once instead of the whole dataset.
"""

import bisect
import contextlib
import fcntl
import hashlib
import itertools
import json
import logging
import os
import sys
import tempfile
import time
from collections import OrderedDict
from pathlib import Path

import torch
from torch.utils.data import Dataset

from ..errors import ConfigError, DataUnavailable, InputError
from .loaders import mix_seed

INDEX = "index.json"
FORMAT = "ddp-shards/1"
ATTEMPTS = 4  # a shard's download: tries before the run stops (waits 1, 2, 4 s between)


def is_sharded(data_dir):
    """Whether `data_dir` names shards: a URL (s3://...), or a folder with an index.json."""
    return "://" in data_dir or (Path(data_dir) / INDEX).is_file()


def shown(url):
    """`url` with any password in it masked (s3://key:secret@bucket -> s3://key:***@bucket)."""
    scheme, sep, rest = url.partition("://")
    if not sep or "@" not in rest.split("/", 1)[0]:
        return url
    user, _, host = rest.partition("@")
    return f"{scheme}://{user.split(':', 1)[0]}:***@{host}"


# S3's client retries a lost connection 25 times, for minutes, with no word: here each request is
# tried twice, with timeouts, and _retried's tries (each said in the stop line) do the rest.
S3_OPTIONS = {
    "config_kwargs": {"connect_timeout": 10, "read_timeout": 60, "retries": {"max_attempts": 2, "mode": "standard"}}
}


_INHERITED = []  # a forked process's copies of its parent's S3 clients: kept, never closed


def _keep_the_parents_clients():
    """A forked process (a DataLoader worker) keeps the S3 clients it inherited, unused: collected,
    they would close their connections, which are the parent's sockets in the parent's event loop
    (an epoll the fork shares), and the parent's next request on one would wait out its timeout."""
    s3fs = sys.modules.get("s3fs")
    if s3fs is not None:
        _INHERITED.extend(s3fs.S3FileSystem._cache.values())  # noqa: SLF001 - fsspec drops them in a new process


os.register_at_fork(after_in_child=_keep_the_parents_clients)


def _filesystem(url):
    import fsspec  # noqa: PLC0415 - local data needs no streaming extra

    if not url.startswith(("s3://", "s3a://")):
        return fsspec.core.url_to_fs(url)
    fs, root = fsspec.core.url_to_fs(url, **S3_OPTIONS)
    fs.retries = 1  # s3fs's own loop around the client's
    # A process that stops with the store gone closes the client's session at exit on a loop that
    # is closing: asyncio would log the session's own connection error as a traceback after the
    # line that named the problem.
    logging.getLogger("asyncio").setLevel(logging.CRITICAL)
    return fs, root


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as file:
        for block in iter(lambda: file.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _retried(what, action):
    """`action()`, tried ATTEMPTS times: a store that stays unreachable stops the run with a line."""
    for attempt in range(ATTEMPTS):
        try:
            return action()
        except FileNotFoundError:
            raise
        except Exception as error:  # noqa: BLE001 - each store's client has its own errors for a lost connection
            if _no_credentials(error) or isinstance(error, PermissionError):
                raise DataUnavailable(f"{what}: {_problem(error)}") from None
            if attempt == ATTEMPTS - 1:
                raise DataUnavailable(
                    f"{what}: {type(error).__name__}: {error} ({ATTEMPTS} tries); "
                    "the last checkpoint is intact: run the same command to resume"
                ) from None
            time.sleep(2**attempt)
    return None


def _no_credentials(error):
    return "credentials" in str(error).lower() or "NoCredentialsError" in type(error).__name__


def _problem(error):
    if _no_credentials(error):
        return (
            "no credentials for the store: set them as its own client reads them (AWS_ACCESS_KEY_ID and "
            "AWS_SECRET_ACCESS_KEY, AWS_PROFILE, an instance role)"
        )
    if isinstance(error, PermissionError):
        return f"access denied ({error})"
    return f"{type(error).__name__}: {error}"


def read_index(url, flag="data_dir"):
    """The index.json of the shards at `url`, checked; a ConfigError naming --flag (the task's data
    path) if it cannot be read."""
    where = f"{shown(url)}/{INDEX}"
    if shown(url) != url:  # it would be saved with the run's config.toml and its checkpoints
        raise ConfigError(
            flag, f"{shown(url)} carries a password: give the store's client its credentials in the environment"
        )
    try:
        fs, root = _filesystem(url.rstrip("/"))
        index = json.loads(_retried(f"reading {where}", lambda: fs.cat_file(f"{root}/{INDEX}")))
    except FileNotFoundError:
        raise ConfigError(flag, f"{shown(url)} has no {INDEX}: write shards there with python make_shards.py") from None
    except ImportError as error:
        raise ConfigError(
            flag, f"is a URL, which needs the streaming extra: pip install -e '.[streaming]' ({error})"
        ) from None
    except DataUnavailable as error:
        raise ConfigError(flag, f"cannot be read: {error}") from None
    except ValueError as error:
        raise ConfigError(flag, f"{where} is not readable JSON ({error})") from None
    if not isinstance(index, dict) or index.get("format") != FORMAT:
        raise ConfigError(flag, f"{where} is not a {FORMAT} index")
    return index


class ShardWriter:
    """Writes one dataset as shards and, last, its index: `add(split, data, samples)` per shard
    (bytes of one shard, never the whole dataset), then `close(facts)`. Local folders get each file
    under a temporary name and renamed; object stores make a put visible whole. The index, written
    last, is what makes the shards a dataset: a write that stops half-way leaves none."""

    def __init__(self, destination):
        self.destination = destination.rstrip("/")
        self.fs, self.root = _filesystem(self.destination)
        self.splits, self.made = {}, False
        if self.fs.exists(f"{self.root}/{INDEX}"):
            raise InputError(f"{shown(destination)} already holds shards ({INDEX}): choose an empty --output_dir")

    def add(self, split, data, samples, suffix=".bin"):
        shards = self.splits.setdefault(split, [])
        name = f"{split}-{len(shards):05d}{suffix}"
        self._put(name, data)
        shards.append(
            {"name": name, "samples": samples, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        )

    def close(self, facts):
        index = {"format": FORMAT, **facts, "splits": self.splits}
        self._put(INDEX, json.dumps(index, indent=1).encode())
        return index

    def _put(self, name, data):
        if not self.made:  # made with the first shard: input found bad before then leaves nothing behind
            self.fs.makedirs(self.root, exist_ok=True)
            self.made = True
        path = f"{self.root}/{name}"
        if "file" in self.fs.protocol:
            temporary = f"{path}.tmp{os.getpid()}"
            self.fs.pipe_file(temporary, data)
            os.replace(temporary, path)
        else:
            self.fs.pipe_file(path, data)


def write_or_exit(destination, write):
    """make_shards.py's last step: `write()` (its ShardWriter's index), then a line of what was
    written; a failure is one line naming the destination (the store's client names the cause:
    credentials, a bucket, the network), exit status 2."""
    from ..knobs import exit_with_error  # noqa: PLC0415 - a command's exit, not the loaders'

    try:
        index = write()
    except InputError as error:
        exit_with_error(str(error))
    except Exception as error:  # noqa: BLE001 - any store's client error, named in the line
        exit_with_error(f"writing to {shown(destination)}: {type(error).__name__}: {error}")
    counts = {split: len(shards) for split, shards in index["splits"].items()}
    print(f"wrote {counts['train']} train and {counts['val']} val shards to {shown(destination)}")


class ShardStore:
    """The shards at `url`: its index, and each shard as a verified local file.

    Local folders are read in place (each shard checked once per process); a URL's shards go
    through the node's cache. Picklable before use: a DataLoader worker opens its own client.
    """

    def __init__(self, url, cache_dir, cache_gb, flag="data_dir"):
        self.url, self.flag = url.rstrip("/"), flag
        self.local = "://" not in url or url.startswith("file://")
        self.cache = Path(cache_dir) / hashlib.sha256(self.url.encode()).hexdigest()[:16]
        self.cache_bytes = int(cache_gb * 2**30)
        self.index = read_index(self.url, flag)
        self.shards = {shard["name"]: shard for shards in self.index["splits"].values() for shard in shards}
        self.checked = set()
        self._fs = None

    def __getstate__(self):
        return {**self.__dict__, "_fs": None}

    def fs(self):
        """(filesystem, root): a client of this process's own; one from before a fork is not safe to use."""
        if self._fs is None or self._fs[0] != os.getpid():
            self._fs = (os.getpid(), _filesystem(self.url))
        return self._fs[1]

    def split(self, name):
        """[{"name", "samples", "bytes", "sha256"}, ...] of one split."""
        shards = self.index["splits"].get(name)
        if not shards:
            raise ConfigError(self.flag, f"{shown(self.url)}/{INDEX} has no {name} shards")
        return shards

    def path(self, name):
        """A local file with shard `name`'s verified bytes."""
        shard = self.shards[name]
        if self.local:
            path = Path(self.url.removeprefix("file://")) / name
            if name not in self.checked:
                if not path.is_file():
                    raise DataUnavailable(f"shard {path} is missing (named in {INDEX})")
                self._verify(path, shard, str(path))
                self.checked.add(name)
            return path
        final = self.cache / name
        if final.is_file():
            os.utime(final)  # recently used: evicted last
            return final
        self.cache.mkdir(parents=True, exist_ok=True)
        with _locked(self.cache / f"{name}.lock"):  # the node's other ranks wait for this download
            if not final.is_file():
                self._download(name, shard, final)
        return final

    def _download(self, name, shard, final):
        fs, root = self.fs()
        where = f"{shown(self.url)}/{name}"
        self._make_room(shard["bytes"])
        partial = final.with_name(f"{name}.part{os.getpid()}")

        def fetch():
            try:
                fs.get_file(f"{root}/{name}", str(partial))
                self._verify(partial, shard, where)
            except BaseException:
                partial.unlink(missing_ok=True)
                raise

        try:
            _retried(f"downloading {where}", fetch)
        except FileNotFoundError:
            raise DataUnavailable(f"shard {where} is missing from the store (named in {INDEX})") from None
        os.replace(partial, final)

    def _verify(self, path, shard, where):
        size = os.path.getsize(path)
        if size != shard["bytes"]:
            raise ShardCorrupt(f"shard {where} has {size} bytes, its index says {shard['bytes']}")
        digest = _sha256(path)
        if digest != shard["sha256"]:
            raise ShardCorrupt(
                f"shard {where} is corrupt: sha256 {digest[:12]}..., its index says {shard['sha256'][:12]}..."
            )

    def _make_room(self, needed):
        """Evict the least recently used shards until `needed` more bytes fit in the cache."""
        files = sorted(
            (p for p in self.cache.iterdir() if p.suffix != ".lock" and ".part" not in p.name),
            key=lambda p: p.stat().st_mtime,
        )
        used = sum(p.stat().st_size for p in files)
        for path in files:
            if used + needed <= self.cache_bytes:
                break
            used -= path.stat().st_size
            path.unlink(missing_ok=True)  # a reader that has it open keeps its pages


class ShardCorrupt(DataUnavailable, OSError):
    """A shard whose bytes are not the index's: downloaded again (an OSError to _retried), then fatal."""


LOCK_WAIT = 900  # seconds a process waits for another's download of a shard (each try is bounded)


@contextlib.contextmanager
def _locked(path):
    """The node's lock on one shard's download. Polled, not blocking: a DataLoader worker whose
    training process is gone stops waiting (torch's worker checks its parent only between batches)."""
    parent, deadline = os.getppid(), time.monotonic() + LOCK_WAIT
    with open(path, "a") as file:
        while True:
            try:
                fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if os.getppid() != parent:
                    os._exit(1)  # orphaned: nobody reads what we would load
                if time.monotonic() > deadline:
                    raise DataUnavailable(
                        f"waited {LOCK_WAIT} s for another process's download of {path.stem}"
                    ) from None
                time.sleep(0.05)
        try:
            yield
        finally:
            fcntl.flock(file, fcntl.LOCK_UN)


def shard_order(sizes, seed, epoch, window):
    """One epoch's order of the samples of shards of `sizes` (sample ids numbered shard by shard):
    the shards shuffled, then `window` shards at a time with their samples shuffled together.
    A pure function of (seed, epoch): the same for any world size, worker count or resume."""
    starts = torch.tensor([0, *sizes]).cumsum(0)
    generator = torch.Generator().manual_seed(mix_seed(seed, epoch, "shards"))
    shards = torch.randperm(len(sizes), generator=generator).tolist()
    order = []
    for first in range(0, len(shards), window):
        ids = torch.cat([torch.arange(starts[s], starts[s + 1]) for s in shards[first : first + window]])
        order.append(ids[torch.randperm(len(ids), generator=generator)])
    return torch.cat(order)


class ShardedDataset(Dataset):
    """The samples of one split's shards, numbered shard by shard: `sizes[s]` samples in shard s.
    A subclass says how a shard's local file opens (`open_shard(path)`) and how sample j of it reads
    (`read(opened, j)`). The last few opened shards stay open in each process."""

    def __init__(self, store, shards, sizes, window):
        self.store, self.shards, self.sizes, self.window = store, shards, sizes, window
        self.starts = list(itertools.accumulate(sizes, initial=0))
        self.opened = OrderedDict()

    def __getstate__(self):
        return {**self.__dict__, "opened": OrderedDict()}  # a worker opens its own

    def __len__(self):
        return self.starts[-1]

    def epoch_order(self, seed, epoch):
        """The loaders' order of an epoch (loaders.ShardedSampler): a few shards at a time."""
        return shard_order(self.sizes, seed, epoch, self.window)

    def __getitem__(self, index):
        shard = bisect.bisect_right(self.starts, index) - 1
        return self.read(self._opened(shard), index - self.starts[shard])

    def _opened(self, shard):
        if shard not in self.opened:
            self.opened[shard] = self._open(self.shards[shard]["name"])
            if len(self.opened) > self.window + 1:
                self.opened.popitem(last=False)
        self.opened.move_to_end(shard)
        return self.opened[shard]

    def _open(self, name):
        for attempt in range(3):
            try:
                return self.open_shard(self.store.path(name))
            except FileNotFoundError:  # evicted by another rank between its check and our open: fetch again
                if attempt == 2:
                    raise
        return None


def first_of_shards(shards, count, flag, where):
    """(shards, samples of each) holding the first `count` samples of a split (0 = all)."""
    sizes = [shard["samples"] for shard in shards]
    if count > sum(sizes):
        raise ConfigError(flag, f"is {count} but the shards of {where} hold {sum(sizes)}")
    if not count:
        return shards, sizes
    starts = itertools.accumulate(sizes, initial=0)
    kept = [min(size, count - start) for size, start in zip(sizes, starts) if start < count]
    return shards[: len(kept)], kept


def check_cache(cfg, shards):
    """The cache must hold the shards an epoch reads at once (--stream_shuffle_shards), and one more."""
    if cfg.stream_shuffle_shards < 1:
        raise ConfigError("stream_shuffle_shards", "must be at least 1")
    largest = max(shard["bytes"] for shard in shards)
    needed = (cfg.stream_shuffle_shards + 1) * largest
    if cfg.stream_cache_gb * 2**30 < needed:
        raise ConfigError(
            "stream_cache_gb",
            f"is {cfg.stream_cache_gb:g}, but {cfg.stream_shuffle_shards} + 1 shards of up to "
            f"{largest / 2**30:.3g} GiB are read at once: at least {needed / 2**30:.3g}, "
            "or a lower --stream_shuffle_shards",
        )


def open_store(cfg, flag="data_dir"):
    """The ShardStore at --flag (the task's data path), its cache in --stream_cache_dir (default:
    the system's temporary folder)."""
    cache = cfg.stream_cache_dir or Path(tempfile.gettempdir()) / "ddp-shards"
    return ShardStore(getattr(cfg, flag), cache, cfg.stream_cache_gb, flag)


def time_download(url):
    """(seconds to fetch and check the first training shard of `url`, its bytes, an epoch's bytes):
    the preflight's measure of the store from one node. Fetched to a temporary folder, not the cache."""
    store = ShardStore(url, tempfile.mkdtemp(prefix="ddp-preflight-"), 1e9)
    shards = store.split("train")
    try:
        started = time.perf_counter()
        store.path(shards[0]["name"])
        seconds = time.perf_counter() - started
    finally:
        import shutil  # noqa: PLC0415

        shutil.rmtree(store.cache.parent, ignore_errors=True)
    return seconds, shards[0]["bytes"], sum(shard["bytes"] for shard in shards)
