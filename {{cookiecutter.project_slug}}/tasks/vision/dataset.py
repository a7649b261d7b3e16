"""Yours: the data, a folder of images, one subfolder per class, with augmentation that is the same on any
number of processes and workers. Either layout:

    data_dir/<class>/*                          a share of each class is held out (--val_fraction)
    data_dir/train/<class>/*, data_dir/val/<class>/*    a split made by hand (val/ optional)

`python prepare_data.py` writes a small real dataset in the second layout (handwritten digits).
A `--data_dir` that is a URL (s3://bucket/prefix) or a folder with index.json is read in shards
(make_shards.py writes them from an image folder; docs/streaming.md): the same images, decoded and
transformed here the same way, the class names from the shards' index.
Listing, splitting, decoding and checking the folder (a corrupt image stops the run before the
first step, naming it) are ddp_utils/data/images.py's, the same for any image folder; what the
model sees of an image is decided here (`augment`, `preprocess`).

Images are augmented with plain tensor ops, not torchvision: torchvision must be built for the
exact torch release, and there is none for this torch (2.13, CPU wheel) on the machine the
template is tested on (PyPI's torchvision fails to import beside it). The transforms below are
torchvision's RandomResizedCrop, RandomHorizontalFlip and Resize in a few lines of tensor ops.
"""

import math
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from ddp_utils.data.images import ImageFolder, ImageShards, class_folders, first_of_shuffled, image_samples
from ddp_utils.data.shards import first_of_shards, is_sharded, open_store, read_index, shown
from ddp_utils.errors import ConfigError
from ddp_utils.knobs import knob

DEMO_DATA_DIR = "data/images"  # where prepare_data.py writes the digits (its --output_dir default)


@dataclass(frozen=True)
class DataConfig:
    """The data's knobs: fields of Config, each a --flag."""

    data_dir: str = knob(
        DEMO_DATA_DIR,
        "image folder: <class>/ folders, or train/<class>/ and val/<class>/ (python prepare_data.py); "
        "or its shards: a URL or folder (make_shards.py)",
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


def build_datasets(cfg):
    """(train, val) Datasets from cfg.data_dir: its val/ folder, else --val_fraction of each
    class held out; val uses train's class folders as its labels. Training images are
    augmented (`augment`), validation images only resized (`preprocess`)."""
    classes = class_names(cfg.data_dir)
    if 0 < getattr(cfg, "num_classes", 0) < len(classes):  # labels past the model's head: a cryptic CUDA assert
        problem = f"is {cfg.num_classes} but --data_dir {cfg.data_dir} has {len(classes)} classes"
        raise ConfigError("num_classes", problem)
    augmentation = partial(augment, image_size=cfg.image_size, min_crop_scale=cfg.min_crop_scale, hflip=cfg.hflip)
    if is_sharded(cfg.data_dir):
        store = open_store(cfg)
        where = shown(cfg.data_dir)
        train = first_of_shards(store.split("train"), cfg.train_samples, "train_samples", where)
        val = first_of_shards(store.split("val"), cfg.val_samples, "val_samples", where)
        return (
            ImageShards(store, *train, cfg, classes, augmentation, seed=cfg.seed),
            ImageShards(store, *val, cfg, classes, partial(preprocess, image_size=cfg.image_size)),
        )
    train, val = image_samples(cfg.data_dir, classes, cfg.val_fraction, cfg.seed, fix=missing_images_fix(cfg.data_dir))
    train = first_of_shuffled(train, cfg.train_samples, "train_samples")
    val = first_of_shuffled(val, cfg.val_samples, "val_samples")
    return (
        ImageFolder(train, classes, cfg.data_dir, augmentation, seed=cfg.seed),
        ImageFolder(val, classes, cfg.data_dir, partial(preprocess, image_size=cfg.image_size)),
    )


def class_names(data_dir):
    """The class folders, sorted: their positions are the labels (model.py counts them); of shards,
    their index's."""
    if is_sharded(data_dir):
        index = read_index(data_dir)
        if index.get("kind") != "images":
            raise ConfigError("data_dir", f"{shown(data_dir)} holds {index.get('kind')} shards, not images")
        return index["classes"]
    return class_folders(data_dir, fix=missing_images_fix(data_dir))


def missing_images_fix(data_dir):
    """What makes images where there are none: only the demo's folder is prepare_data.py's to write."""
    return "run python prepare_data.py first" if Path(data_dir) == Path(DEMO_DATA_DIR) else ""


# --- transforms ----------------------------------------------------------------------------


def resize(image, size):
    """[3, h, w] -> [3, size, size], antialiased like Pillow's (and torchvision's) resize."""
    return F.interpolate(image[None], size=(size, size), mode="bilinear", antialias=True, align_corners=False)[0]


def normalize(image):
    return (image - 0.5) / 0.5  # [0, 1] -> [-1, 1] per channel; no dataset statistics to compute


def preprocess(image, image_size):
    """Evaluation (and predict.py): the whole image, resized; nothing random."""
    return normalize(resize(image, image_size))


def augment(image, generator, image_size, min_crop_scale, hflip):
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
