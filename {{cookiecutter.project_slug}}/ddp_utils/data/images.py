"""A folder of images, one subfolder per class, as training and validation datasets: its
layout and split, decoding, and the check of every file before the first step. Either layout:

    data_dir/<class>/*                          a share of each class is held out (--val_fraction)
    data_dir/train/<class>/*, data_dir/val/<class>/*    a split made by hand (val/ optional)

The class folders' sorted names are the labels 0, 1, ...; images in their subfolders count too.
Images are any format Pillow opens (.png, .jpg, .webp, .bmp, .gif, .tif, ...), 8 or 16 bits a
channel; other files are left out with a warning, hidden ones (.DS_Store) silently.

Every image is decoded once before the first step (ImageFolder.check_samples): a corrupt file
stops the run at once, naming it, rather than hours in. Files that decoded fine are remembered
by size and modification time in data_dir/.checked_images.json, so the next run skips them.

Shards (a URL such as s3://bucket/prefix, or a folder with index.json; the vision task's
make_shards.py writes them): Parquet files of each image's encoded bytes, its label and its path
under data_dir, streamed by ddp_utils/data/shards.py (checked against their sha256, not decoded
ahead); ImageShards decodes and transforms them as ImageFolder does its files.

What the model sees of an image (its transforms) is the task's dataset.py's, handed to
ImageFolder (or ImageShards). Pillow is imported where an image is listed or read: the vision task's
dependency, not every project's.
"""

import functools
import io
import json
import os
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from ..core.logs import warn_main
from ..errors import ConfigError
from .loaders import mix_seed
from .shards import ShardedDataset, check_cache

# --- the folder ----------------------------------------------------------------------------


@functools.cache
def image_suffixes():
    """Every suffix of a format Pillow can open (not those it can only save, such as .pdf)."""
    from PIL import Image

    return frozenset(suffix for suffix, name in Image.registered_extensions().items() if name in Image.OPEN)


def no_images(data_dir, problem, fix=""):
    """The error for a data_dir without usable images, with what makes some (`fix`) where the
    caller knows it: only the demo's folder is prepare_data.py's to write."""
    return ConfigError("data_dir", f"{data_dir} {problem}" + (f": {fix}" if fix else ""))


def split_folders(data_dir):
    """(folder of the training classes, folder of the validation classes or None)."""
    root = Path(data_dir)
    if (root / "train").is_dir():
        return root / "train", (root / "val" if (root / "val").is_dir() else None)
    if (root / "val").is_dir():  # val/ would otherwise be taken for a class
        raise ConfigError("data_dir", f"{data_dir} has val/ but no train/: put the training images in train/<class>/")
    return root, None


def subfolders(folder):
    return sorted(p.name for p in folder.iterdir() if p.is_dir() and not p.name.startswith("."))


def class_folders(data_dir, fix=""):
    """The class folders (of data_dir/train, or else of data_dir), sorted: their positions are the labels."""
    if not Path(data_dir).is_dir():
        raise no_images(data_dir, "does not exist", fix)
    folder, _ = split_folders(data_dir)
    names = subfolders(folder)
    if not names:
        raise no_images(data_dir, "has no class folders (<class>/ or train/<class>/)", fix)
    return names


def image_samples(data_dir, classes, val_fraction, seed, fix=""):
    """(train, val) lists of (path, label) from data_dir: its val/ folder, else `val_fraction`
    of each class held out (hold_out); val uses train's class folders (`classes`) as its labels.
    Files of no image format are left out with one warning that counts them."""
    train_folder, val_folder = split_folders(data_dir)
    train, others = list_images(train_folder, classes)
    if val_folder is None:
        train, val = hold_out(train, val_fraction, seed, data_dir)
    else:
        extra = sorted(set(subfolders(val_folder)) - set(classes))
        if extra:
            raise ConfigError("data_dir", f"{data_dir}/val has class folder {extra[0]!r} that train/ lacks")
        val, val_others = list_images(val_folder, classes)
        others += val_others
    if not train:
        raise no_images(
            data_dir, "has no training images" + (f", only {describe_others(others)}" if others else ""), fix
        )
    if not val:
        no_val = "has no validation images" if val_folder else "has no class of 2 or more images: none to hold out"
        raise no_images(data_dir, no_val, fix)
    if others:
        warn_main(f"--data_dir {data_dir}: left out {describe_others(others)}")
    return train, val


def list_images(folder, classes):
    """([(path, label) of every image under folder/<class>/], [paths of the other files]), in a
    fixed (sorted) order; subfolders are walked, hidden files and folders skipped."""
    images, others, suffixes = [], [], image_suffixes()
    for label, name in enumerate(classes):
        for directory, dirs, files in os.walk(folder / name, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # os.walk recurses in this order
            for file in sorted(f for f in files if not f.startswith(".")):
                path = os.path.join(directory, file)
                if os.path.splitext(file)[1].lower() in suffixes:
                    images.append((path, label))
                else:
                    others.append(path)
    return images, others


def hold_out(samples, fraction, seed, root):
    """(train, val): of each class, round(fraction x its images) held out for validation, at
    least one of a class with two or more and never all. The images held out are those first in
    an order hashed from (seed, path under root): the same split on every rank and on resume,
    and adding or removing a file moves at most one other to the other side."""
    by_class = {}
    for sample in samples:
        by_class.setdefault(sample[1], []).append(sample)
    train, val = [], []
    for mine in by_class.values():
        hashed = sorted(mine, key=lambda sample: mix_seed(seed, "val_fraction", os.path.relpath(sample[0], root)))
        held = set(hashed[: min(len(mine) - 1, max(1, round(len(mine) * fraction)))])
        train += [sample for sample in mine if sample not in held]  # in the listing's order
        val += [sample for sample in mine if sample in held]
    return train, val


def first_of_shuffled(samples, count, flag):
    """The first `count` samples of one fixed shuffled order (all classes mixed); 0 = all of them.
    Fixed, not from --seed: runs with different seeds train and evaluate on the same images."""
    if count == 0:
        return samples
    if count > len(samples):
        raise ConfigError(flag, f"is {count} but there are only {len(samples)} images")
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(mix_seed(flag)))
    return [samples[i] for i in order[:count].tolist()]


def describe_others(others):
    """'3 files of no image format Pillow opens (2 .txt, 1 .csv), such as cat/notes.txt'."""
    suffixes = Counter(os.path.splitext(path)[1].lower() or "without suffix" for path in others)
    kinds = ", ".join(f"{count} {suffix}" for suffix, count in suffixes.most_common(3))
    files = "1 file" if len(others) == 1 else f"{len(others)} files"
    return f"{files} of no image format Pillow opens ({kinds}), such as {others[0]}"


# --- decoding ------------------------------------------------------------------------------


def read_pixels(path):
    """The pixels of an image file as float32 [H, W, 3] in [0, 1]; raises Pillow's error.

    8-bit modes go through Pillow's conversion to RGB. 16-bit grayscale (PNG, TIFF) and 32-bit
    integer images are scaled by 65535 and float images clipped to [0, 1]: convert("RGB") would
    clip them to 255, all but black turning white.
    """
    from PIL import Image

    with Image.open(path) as image:
        if image.mode.startswith("I;16") or image.mode == "I":
            gray = np.asarray(image, dtype=np.float32) / 65535
        elif image.mode == "F":
            gray = np.asarray(image, dtype=np.float32)
        else:
            return np.asarray(image.convert("RGB"), dtype=np.float32) / 255
    return np.repeat(np.clip(gray, 0, 1)[:, :, None], 3, axis=2)


def problem_text(error):
    """Pillow's reason an image does not decode, without the path it sometimes repeats."""
    from PIL import UnidentifiedImageError

    if isinstance(error, UnidentifiedImageError):
        return "cannot identify image file (not an image, or a format Pillow cannot read)"
    return str(error) if isinstance(error, OSError) else f"{type(error).__name__}: {error}"


def load_image(path):
    """An image file as a float tensor [3, H, W] in [0, 1]; OSError naming the file if unreadable."""
    try:
        pixels = read_pixels(path)
    except Exception as error:  # noqa: BLE001 - Pillow's plugins raise many kinds (OSError, SyntaxError, ...)
        raise OSError(f"cannot read image {path}: {problem_text(error)}") from None
    return torch.from_numpy(pixels).permute(2, 0, 1)


CHECKED_FILE = ".checked_images.json"  # in data_dir
CHECK_THREADS = min(16, os.cpu_count() or 1)  # threads: Pillow's decoders and file reads release the GIL
CHECK_CHUNK = 4096


class CheckedFiles:
    """The images under `root` that decoded fine, as {path under root: [size, mtime_ns]}, kept
    in root/.checked_images.json between runs. Best effort: without write access there is no
    cache, and processes writing at once may lose each other's entries; either way unchanged
    files are only checked again."""

    def __init__(self, root):
        self.root, self.file = root, Path(root) / CHECKED_FILE
        self.known, self.new = self.read(), {}

    def read(self):
        try:
            entries = json.loads(self.file.read_text())
        except (OSError, ValueError):  # none yet, unreadable, or cut short
            return {}
        return entries if isinstance(entries, dict) else {}

    def key(self, path):
        return os.path.relpath(path, self.root)

    def unchanged(self, path, stat):
        return self.known.get(self.key(path)) == [stat.st_size, stat.st_mtime_ns]

    def add(self, path, stat):  # from several threads at once: one dict assignment is atomic
        self.new[self.key(path)] = [stat.st_size, stat.st_mtime_ns]

    def save(self):
        if not self.new:
            return
        entries = {**self.read(), **self.new}  # with what other processes wrote since we read it
        try:
            handle, temporary = tempfile.mkstemp(dir=self.file.parent, prefix=f"{CHECKED_FILE}.", suffix=".tmp")
        except OSError:  # a read-only folder
            return
        try:
            with os.fdopen(handle, "w") as out:
                json.dump(entries, out)
            os.chmod(temporary, 0o644)  # mkstemp's 0600 would hide the cache from other users
            os.replace(temporary, self.file)  # atomic: a reader sees the old file or the new one
        except OSError:
            Path(temporary).unlink(missing_ok=True)


def check_file(path, checked):
    """None if the image at `path` decodes (or decoded before and is unchanged), else the problem."""
    try:
        stat = os.stat(path)  # before decoding: a file changed meanwhile is checked again next time
        if checked.unchanged(path, stat):
            return None
        read_pixels(path)
    except Exception as error:  # noqa: BLE001 - any failure is the file's problem, reported with its path
        return problem_text(error)
    checked.add(path, stat)
    return None


# --- the dataset ---------------------------------------------------------------------------


class Augmented:
    """What ImageFolder and ImageShards share: the labels' `classes`, the epoch, and each image's
    `transform`. Training images (a `seed` given) go through `transform(image, generator)`, the
    generator seeded with (seed, epoch, index): the same whichever rank or DataLoader worker
    loads the image, so any world size, any number of workers and a resumed run see exactly the
    same images. Validation images (no seed) go through `transform(image)`: nothing random.
    Workers get `transform` pickled: a function of a module, or a functools.partial of one."""

    def augmented(self, classes, transform, seed):
        self.classes, self.transform, self.seed = classes, transform, seed
        # Shared memory: persistent DataLoader workers keep their copy of the dataset across
        # epochs, and still see the epoch the main process sets.
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def data_state(self):
        """Saved in every checkpoint: predict.py names the classes without the data."""
        return {"classes": list(self.classes)}

    def transformed(self, image, label, index):
        if self.seed is not None:
            generator = torch.Generator().manual_seed(mix_seed(self.seed, int(self.epoch), index))
            image = self.transform(image, generator)
        else:
            image = self.transform(image)
        return image, torch.tensor(label)


class ImageFolder(Augmented, Dataset):
    """(image, label) pairs from a list of (path, label) under `root` (data_dir), labels
    indexing `classes`; each image decoded (load_image), then transformed (Augmented)."""

    def __init__(self, samples, classes, root, transform, seed=None):
        self.samples, self.root = samples, root
        self.augmented(classes, transform, seed)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, label = self.samples[index]
        return self.transformed(load_image(path), label, index)

    def check_samples(self, indices):
        """{index: "path: problem"} of the images at `indices` that do not decode, each decoded
        whole, several at once; those that decoded before and are unchanged are not decoded again."""
        checked = CheckedFiles(self.root)
        paths, problems = [self.samples[index][0] for index in indices], []
        with ThreadPoolExecutor(CHECK_THREADS) as pool:
            for start in range(0, len(paths), CHECK_CHUNK):  # map queues a chunk's futures at once: bounded memory
                problems += pool.map(lambda path: check_file(path, checked), paths[start : start + CHECK_CHUNK])
        checked.save()
        return {index: f"{path}: {problem}" for index, path, problem in zip(indices, paths, problems) if problem}

    def without(self, indices):
        """This dataset without the samples at `indices` (--skip_bad_files)."""
        drop = set(indices)
        samples = [sample for index, sample in enumerate(self.samples) if index not in drop]
        return ImageFolder(samples, self.classes, self.root, self.transform, self.seed)


# --- shards --------------------------------------------------------------------------------


def decode_image(data, name):
    """Encoded image bytes as a float tensor [3, H, W] in [0, 1]; OSError naming `name` if unreadable."""
    try:
        pixels = read_pixels(io.BytesIO(data))
    except Exception as error:  # noqa: BLE001 - Pillow's plugins raise many kinds
        raise OSError(f"cannot read image {name}: {problem_text(error)}") from None
    return torch.from_numpy(pixels).permute(2, 0, 1)


class ImageShards(Augmented, ShardedDataset):
    """(image, label) pairs from Parquet shards of (path, image bytes, label): `shards` and their
    `sizes` of one split (the first of a split's samples: sizes may be cut), labels indexing
    `classes`; each image decoded, then transformed as ImageFolder's (Augmented)."""

    def __init__(self, store, shards, sizes, cfg, classes, transform, seed=None):
        check_cache(cfg, shards)
        ShardedDataset.__init__(self, store, shards, sizes, cfg.stream_shuffle_shards)
        self.augmented(classes, transform, seed)

    def open_shard(self, path):
        import pyarrow.parquet  # noqa: PLC0415 - only for shards

        table = pyarrow.parquet.read_table(path)
        return path.name, table.column("path").to_pylist(), table.column("image"), table.column("label").to_numpy()

    def read(self, opened, j):
        shard, paths, images, labels = opened
        return decode_image(images[j].as_py(), f"{paths[j]} (in shard {shard})"), int(labels[j])

    def __getitem__(self, index):
        return self.transformed(*ShardedDataset.__getitem__(self, index), index)
