"""Yours: the data, windows of text from the token files that prepare_data.py writes.

`<data_dir>/train.bin` and `val.bin` are nanoGPT's format: token ids one after another, uint16
(or uint32 for a vocabulary over 65,536: `dtype` in meta.json), so nanoGPT's prepare scripts
can fill a data folder too. Each item is `block_size` tokens and the same tokens shifted by
one: the model predicts every next token at once. The tokenizer that made the files (meta.json,
tokenizer.json) goes into every checkpoint, for sample.py.

A `--data_dir` that is a URL (s3://bucket/prefix) or a folder with index.json is read in shards
(make_shards.py writes them from the token files; ddp_utils/data/shards.py streams them): each
sample is one of the shards' consecutive windows, every window once an epoch.
"""

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ddp_utils.data import mix_seed
from ddp_utils.data.shards import ShardedDataset, check_cache, is_sharded, open_store
from ddp_utils.errors import ConfigError
from ddp_utils.knobs import knob
from language.tokenizer import describe

DEFAULT_DATA_DIR = "data/text"


@dataclass(frozen=True)
class DataConfig:
    """The data's knobs: fields of Config, each a --flag."""

    data_dir: str = knob(
        DEFAULT_DATA_DIR,
        "folder with train.bin, val.bin and meta.json (prepare_data.py), or shards: a URL or folder (make_shards.py)",
    )
    train_samples: int = knob(16384, "training windows per epoch, each at a fresh random offset every epoch")
    val_samples: int = knob(512, "validation windows, fixed and evenly spread over val.bin (each evaluated once)")

    def check_data(self):
        if not self.data_dir:
            raise ConfigError("data_dir", "must not be empty")
        for name in ("train_samples", "val_samples"):
            if getattr(self, name) < 1:
                raise ConfigError(name, "must be at least 1")

    def resolve_data(self):
        return {}


class TokenWindows(Dataset):
    """`num_samples` windows of `block_size + 1` consecutive tokens: (tokens, next tokens).

    The file is memory-mapped, never read whole: the OS pages in the windows we touch, so a
    corpus larger than RAM works. With `seed`, window i of epoch e starts at an offset drawn
    from (seed, e, i): fresh windows every epoch, yet the same for any world size, worker count
    or resume. Without it (validation) the windows are fixed and evenly spread over the file.
    """

    def __init__(self, path, block_size, num_samples, seed=None, dtype="uint16", tokenizer="bytes"):
        self.path, self.block_size, self.num_samples, self.seed = path, block_size, num_samples, seed
        self.dtype, self.tokenizer = np.dtype(dtype), tokenizer
        self.num_tokens = path.stat().st_size // self.dtype.itemsize
        if self.num_tokens < block_size + 1:
            raise ConfigError(
                "data_dir",
                f"{path.parent} has {self.num_tokens} tokens in {path.name}, fewer than --block_size + 1 "
                f"({block_size + 1}): prepare more text, or lower --block_size",
            )
        self.tokens = None  # the memory map, opened by the process that reads (see __getstate__)
        # Shared memory: persistent DataLoader workers keep their copy of the dataset across
        # epochs, and still see the epoch the main process sets.
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def data_state(self):
        """Saved in every checkpoint: sample.py encodes and decodes with the same tokenizer."""
        return {"tokenizer": self.tokenizer}

    def __getstate__(self):
        # A DataLoader worker started by spawn gets a pickled copy: it opens its own map.
        return {**self.__dict__, "tokens": None}

    def __len__(self):
        return self.num_samples

    def offset(self, index):
        starts = self.num_tokens - self.block_size  # offsets that leave room for the shifted targets
        if self.seed is None:
            return index * (starts - 1) // max(1, self.num_samples - 1)
        return mix_seed(self.seed, int(self.epoch), index) % starts

    def __getitem__(self, index):
        if self.tokens is None:
            self.tokens = np.memmap(self.path, dtype=self.dtype, mode="r")
        start = self.offset(index)
        window = torch.from_numpy(self.tokens[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


def build_datasets(cfg):
    if is_sharded(cfg.data_dir):
        return shard_datasets(cfg)
    folder = Path(cfg.data_dir)
    fix = "run python prepare_data.py" + ("" if cfg.data_dir == DEFAULT_DATA_DIR else f" --output_dir {folder}")
    for name in ("train.bin", "val.bin"):
        if not (folder / name).is_file():
            raise ConfigError("data_dir", f"{folder} has no {name}: {fix} first")
    files = token_file_meta(folder)
    used = files.pop("vocab_size")
    own = Path(cfg.init_from) / "tokenizer.json" if cfg.init_from else None
    if own is not None and own.is_file() and own.read_text(encoding="utf-8") != files["tokenizer"]:
        raise ConfigError(
            "init_from",
            f"{cfg.init_from} has its own tokenizer.json, but {folder} holds tokens of {describe(files['tokenizer'])}: "
            f"prepare the data with python prepare_data.py --tokenizer {own}",
        )
    if used > cfg.vocab_size:  # an id the embedding has no row for
        raise ConfigError(
            "vocab_size",
            f"is {cfg.vocab_size}, but {folder / 'meta.json'} says the token files use {used} "
            "ids: prepare the data with the model's tokenizer",
        )
    train = TokenWindows(folder / "train.bin", cfg.block_size, cfg.train_samples, seed=cfg.seed, **files)
    val = TokenWindows(folder / "val.bin", cfg.block_size, cfg.val_samples, **files)
    return train, val


def token_file_meta(folder):
    """{"dtype", "tokenizer", "vocab_size"} of a data folder, from its meta.json: the ids' type
    (uint16 when it does not say: nanoGPT's files), "bytes" or the text of its tokenizer.json,
    and the ids it uses (0 when it does not say)."""
    meta_file = folder / "meta.json"
    try:
        meta = json.loads(meta_file.read_text()) if meta_file.is_file() else {}
    except (OSError, ValueError) as error:
        raise ConfigError("data_dir", f"{meta_file} is not readable JSON ({error})") from None
    dtype = meta.get("dtype", "uint16")
    if dtype not in ("uint16", "uint32"):
        raise ConfigError("data_dir", f"{meta_file} says dtype {dtype!r}: token files are uint16 or uint32")
    tokenizer = meta.get("tokenizer", "bytes")
    if tokenizer != "bytes":
        try:
            tokenizer = (folder / tokenizer).read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError) as error:
            raise ConfigError("data_dir", f"{meta_file} names tokenizer {tokenizer!r}, unreadable: {error}") from None
    vocab_size = meta.get("vocab_size", 0)
    if not isinstance(vocab_size, int):
        raise ConfigError("data_dir", f"{meta_file} says vocab_size {vocab_size!r}: a whole number")
    return {"dtype": dtype, "tokenizer": tokenizer, "vocab_size": vocab_size}


class TokenShards(ShardedDataset):
    """The windows of token shards: shard s of T tokens holds (T - 1) // block_size windows of
    `block_size + 1` tokens, one after another; an epoch reads each once, in the loaders' order.
    `picks` (validation) keeps --val_samples windows evenly spread over all of them."""

    def __init__(self, store, split, cfg, picks=None):
        shards = store.split(split)
        check_cache(cfg, shards)
        self.block_size, self.dtype = cfg.block_size, np.dtype(store.index["dtype"])
        self.tokenizer = store.index["tokenizer"]
        sizes = [(shard["samples"] - 1) // cfg.block_size for shard in shards]
        if not any(sizes):
            raise ConfigError(
                "block_size",
                f"is {cfg.block_size}: no {split} shard of {cfg.data_dir} holds a window of that many tokens + 1",
            )
        super().__init__(store, shards, sizes, cfg.stream_shuffle_shards)
        total = self.starts[-1]
        self.picks = None if picks is None else [i * (total - 1) // max(1, picks - 1) for i in range(min(picks, total))]

    def data_state(self):
        return {"tokenizer": self.tokenizer}

    def __len__(self):
        return super().__len__() if self.picks is None else len(self.picks)

    def __getitem__(self, index):
        return super().__getitem__(index if self.picks is None else self.picks[index])

    def open_shard(self, path):
        return np.memmap(path, dtype=self.dtype, mode="r")

    def read(self, tokens, j):
        start = j * self.block_size
        window = torch.from_numpy(tokens[start : start + self.block_size + 1].astype(np.int64))
        return window[:-1], window[1:]


def shard_datasets(cfg):
    store = open_store(cfg)
    used = store.index.get("vocab_size", 0)
    if used > cfg.vocab_size:
        raise ConfigError("vocab_size", f"is {cfg.vocab_size}, but the shards' index says their tokens use {used} ids")
    return TokenShards(store, "train", cfg), TokenShards(store, "val", cfg, picks=cfg.val_samples)
