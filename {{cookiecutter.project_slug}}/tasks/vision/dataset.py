"""Yours: the data, a folder of images, one subfolder per class, with augmentation that is the same on any
number of processes and workers. Either layout:

    data_dir/<class>/*                          a share of each class is held out (--val_fraction)
    data_dir/train/<class>/*, data_dir/val/<class>/*    a split made by hand (val/ optional)

The class folders' sorted names are the labels 0, 1, ...; images in their subfolders count too.
`python prepare_data.py` writes a small real dataset in the second layout (handwritten digits).
Images are any format Pillow opens (.png, .jpg, .webp, .bmp, .gif, .tif, ...), 8 or 16 bits a
channel; other files are left out with a warning, hidden ones (.DS_Store) silently.

Every image is decoded once before the first step (ImageFolder.check_samples): a corrupt file
stops the run at once, naming it, rather than hours in. Files that decoded fine are remembered
by size and modification time in data_dir/.checked_images.json, so the next run skips them.

Images are decoded with Pillow and augmented with plain tensor ops, not torchvision: torchvision
must be built for the exact torch release, and there is none for this torch (2.13, CPU wheel) on
the machine the template is tested on (PyPI's torchvision fails to import beside it). The
transforms below are torchvision's RandomResizedCrop, RandomHorizontalFlip and Resize in a few
lines of tensor ops.
"""

import json
import math
import os
import tempfile
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image, UnidentifiedImageError
from torch.utils.data import Dataset

from ddp_utils.core.logs import warn_main
from ddp_utils.data import mix_seed
from ddp_utils.errors import ConfigError
from ddp_utils.knobs import knob

DEMO_DATA_DIR = "data/images"  # where prepare_data.py writes the digits (its --output_dir default)
# Every suffix of a format Pillow can open (not those it can only save, such as .pdf).
IMAGE_SUFFIXES = frozenset(suffix for suffix, name in Image.registered_extensions().items() if name in Image.OPEN)


@dataclass(frozen=True)
class DataConfig:
    """The data's knobs: fields of Config, each a --flag."""

    data_dir: str = knob(
        DEMO_DATA_DIR, "image folder: <class>/ folders, or train/<class>/ and val/<class>/ (python prepare_data.py)"
    )
    val_fraction: float = knob(
        0.1, "share of each class held out for validation where data_dir has no val/ folder (from --seed)"
    )
    image_size: int = knob(32, "side in pixels of the square images the model sees")
    train_samples: int = knob(0, "training images, 0 = all; else the first N of a fixed shuffled order")
    val_samples: int = knob(0, "validation images, 0 = all; else the first N of a fixed shuffled order")
    min_crop_scale: float = knob(0.35, "random-resized-crop: smallest crop, as a fraction of the image's area")
    hflip: bool = knob(False, "flip training images left-right at random (on for natural images; off for digits, text)")

    def check_data(self):
        if not 0 < self.val_fraction < 1:
            raise ConfigError("val_fraction", "must be greater than 0 and less than 1")
        if self.image_size < 1:
            raise ConfigError("image_size", "must be at least 1")
        for name in ("train_samples", "val_samples"):
            if getattr(self, name) < 0:
                raise ConfigError(name, "must not be negative")
        if not 0 < self.min_crop_scale <= 1:
            raise ConfigError("min_crop_scale", "must be greater than 0 and at most 1")

    def resolve_data(self):
        return {}


# --- the folder ----------------------------------------------------------------------------


def no_data(data_dir, problem):
    """The error for a data_dir without usable images; only the demo's folder is prepare_data.py's to write."""
    if Path(data_dir) == Path(DEMO_DATA_DIR):
        problem += ": run python prepare_data.py first"
    return ConfigError("data_dir", f"{data_dir} {problem}")


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


def class_names(data_dir):
    """The class folders (of data_dir/train, or else of data_dir), sorted: their positions are the labels."""
    if not Path(data_dir).is_dir():
        raise no_data(data_dir, "does not exist")
    folder, _ = split_folders(data_dir)
    names = subfolders(folder)
    if not names:
        raise no_data(data_dir, "has no class folders (<class>/ or train/<class>/)")
    return names


def list_images(folder, classes):
    """([(path, label) of every image under folder/<class>/], [paths of the other files]), in a
    fixed (sorted) order; subfolders are walked, hidden files and folders skipped."""
    images, others = [], []
    for label, name in enumerate(classes):
        for directory, dirs, files in os.walk(folder / name, followlinks=True):
            dirs[:] = sorted(d for d in dirs if not d.startswith("."))  # os.walk recurses in this order
            for file in sorted(f for f in files if not f.startswith(".")):
                path = os.path.join(directory, file)
                if os.path.splitext(file)[1].lower() in IMAGE_SUFFIXES:
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


# --- transforms ----------------------------------------------------------------------------


def resize(image, size):
    """[3, h, w] -> [3, size, size], antialiased like Pillow's (and torchvision's) resize."""
    return F.interpolate(image[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]


def normalize(image):
    return (image - 0.5) / 0.5  # [0, 1] -> [-1, 1] per channel; no dataset statistics to compute


def preprocess(image, image_size):
    """Evaluation (and predict.py): the whole image, resized; nothing random."""
    return normalize(resize(image, image_size))


def augment(image, image_size, min_crop_scale, hflip, generator):
    """RandomResizedCrop (area fraction in [min_crop_scale, 1], aspect ratio in [3/4, 4/3]) and
    a random horizontal flip, drawn from `generator` alone."""
    _, height, width = image.shape
    area_u, ratio_u, top_u, left_u, flip_u = torch.rand(5, generator=generator).tolist()
    area = height * width * (min_crop_scale + (1 - min_crop_scale) * area_u)
    ratio = math.exp(math.log(3 / 4) + math.log(16 / 9) * ratio_u)  # 3/4..4/3, uniform in log space
    # torchvision redraws a crop that does not fit; clamping to the image is simpler and close.
    crop_h = min(height, max(1, round((area / ratio) ** 0.5)))
    crop_w = min(width, max(1, round((area * ratio) ** 0.5)))
    top, left = int(top_u * (height - crop_h + 1)), int(left_u * (width - crop_w + 1))
    image = resize(image[:, top : top + crop_h, left : left + crop_w], image_size)
    if hflip and flip_u < 0.5:
        image = torch.flip(image, dims=(2,))
    return normalize(image)


class ImageFolder(Dataset):
    """(image [3, image_size, image_size], label) pairs from a list of (path, label) under
    `root` (data_dir), labels indexing `classes`.

    Training images get a fresh random crop and flip each epoch, drawn from a generator seeded
    with (seed, epoch, index): the same whichever rank or DataLoader worker loads the image, so
    any world size, any number of workers and a resumed run see exactly the same images.
    """

    def __init__(self, samples, classes, root, image_size, train, seed=0, min_crop_scale=1.0, hflip=False):
        self.samples, self.classes, self.root = samples, classes, root
        self.image_size, self.train = image_size, train
        self.seed, self.min_crop_scale, self.hflip = seed, min_crop_scale, hflip
        # Shared memory: persistent DataLoader workers keep their copy of the dataset across
        # epochs, and still see the epoch the main process sets.
        self.epoch = torch.zeros((), dtype=torch.int64).share_memory_()

    def set_epoch(self, epoch):
        self.epoch.fill_(epoch)

    def __len__(self):
        return len(self.samples)

    def __getitem__(self, index):
        path, label = self.samples[index]
        image = load_image(path)
        if self.train:
            generator = torch.Generator().manual_seed(mix_seed(self.seed, int(self.epoch), index))
            image = augment(image, self.image_size, self.min_crop_scale, self.hflip, generator)
        else:
            image = preprocess(image, self.image_size)
        return image, torch.tensor(label)

    def data_state(self):
        """Saved in every checkpoint: predict.py names the classes without the data folder."""
        return {"classes": list(self.classes)}

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
        settings = dict(seed=self.seed, min_crop_scale=self.min_crop_scale, hflip=self.hflip)
        return ImageFolder(samples, self.classes, self.root, self.image_size, self.train, **settings)


def build_datasets(cfg):
    """(train, val) Datasets from cfg.data_dir: its val/ folder, else --val_fraction of each
    class held out; val uses train's class folders as its labels."""
    classes = class_names(cfg.data_dir)
    if 0 < getattr(cfg, "num_classes", 0) < len(classes):  # labels past the model's head: a cryptic CUDA assert
        problem = f"is {cfg.num_classes} but --data_dir {cfg.data_dir} has {len(classes)} classes"
        raise ConfigError("num_classes", problem)
    train_folder, val_folder = split_folders(cfg.data_dir)
    train, others = list_images(train_folder, classes)
    if val_folder is None:
        train, val = hold_out(train, cfg.val_fraction, cfg.seed, cfg.data_dir)
    else:
        extra = sorted(set(subfolders(val_folder)) - set(classes))
        if extra:
            raise ConfigError("data_dir", f"{cfg.data_dir}/val has class folder {extra[0]!r} that train/ lacks")
        val, val_others = list_images(val_folder, classes)
        others += val_others
    if not train:
        raise no_data(cfg.data_dir, "has no training images" + (f", only {describe_others(others)}" if others else ""))
    if not val:
        no_val = "has no validation images" if val_folder else "has no class of 2 or more images: none to hold out"
        raise no_data(cfg.data_dir, no_val)
    if others:
        warn_main(f"--data_dir {cfg.data_dir}: left out {describe_others(others)}")
    train = first_of_shuffled(train, cfg.train_samples, "train_samples")
    val = first_of_shuffled(val, cfg.val_samples, "val_samples")
    augmentation = dict(seed=cfg.seed, min_crop_scale=cfg.min_crop_scale, hflip=cfg.hflip)
    return (
        ImageFolder(train, classes, cfg.data_dir, cfg.image_size, train=True, **augmentation),
        ImageFolder(val, classes, cfg.data_dir, cfg.image_size, train=False),
    )
