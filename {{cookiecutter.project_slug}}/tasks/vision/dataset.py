"""Data: a folder of images, one subfolder per class, with augmentation that is the same on any
number of processes and workers.

    data_dir/train/<class>/*.png|jpg|jpeg
    data_dir/val/<class>/*.png|jpg|jpeg

`python prepare_data.py` writes a small real dataset in this layout (handwritten digits); put
your own images there the same way (the class folders' sorted names are the labels 0, 1, ...).

Images are decoded with Pillow and augmented with plain tensor ops, not torchvision: torchvision
must be built for the exact torch release, and there is none for this torch (2.13, CPU wheel) on
the machine the template is tested on (PyPI's torchvision fails to import beside it). The
transforms below are torchvision's RandomResizedCrop, RandomHorizontalFlip and Resize in a few
lines of tensor ops.
"""

import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data import Dataset

from ddp_utils.data import mix_seed
from ddp_utils.knobs import ConfigError, knob

IMAGE_SUFFIXES = (".png", ".jpg", ".jpeg")


@dataclass(frozen=True)
class DataConfig:
    """The data's knobs: fields of Config, each a --flag."""

    data_dir: str = knob("data/images", "folder with train/<class>/ and val/<class>/ images (python prepare_data.py)")
    image_size: int = knob(32, "side in pixels of the square images the model sees")
    train_samples: int = knob(0, "training images, 0 = all; else the first N of a fixed shuffled order")
    val_samples: int = knob(0, "validation images, 0 = all; else the first N of a fixed shuffled order")
    min_crop_scale: float = knob(0.35, "random-resized-crop: smallest crop, as a fraction of the image's area")
    hflip: bool = knob(False, "flip training images left-right at random (on for natural images; off for digits, text)")

    def check_data(self):
        if self.image_size < 1:
            raise ConfigError("image_size", "must be at least 1")
        for name in ("train_samples", "val_samples"):
            if getattr(self, name) < 0:
                raise ConfigError(name, "must not be negative")
        if not 0 < self.min_crop_scale <= 1:
            raise ConfigError("min_crop_scale", "must be greater than 0 and at most 1")

    def resolve_data(self):
        return {}


def class_names(data_dir):
    """The class folders of data_dir/train, sorted: their positions are the labels."""
    train = Path(data_dir) / "train"
    names = sorted(p.name for p in train.iterdir() if p.is_dir()) if train.is_dir() else []
    if not names:
        raise ConfigError("data_dir", f"{data_dir} has no class folders in train/: run python prepare_data.py first")
    return names


def list_images(data_dir, split, classes):
    """(path, label) of every image in data_dir/split/<class>/, in a fixed (sorted) order."""
    folder = Path(data_dir) / split
    if not folder.is_dir():
        raise ConfigError("data_dir", f"{data_dir} has no {split}/ folder: run python prepare_data.py first")
    extra = sorted({p.name for p in folder.iterdir() if p.is_dir()} - set(classes))
    if extra:
        raise ConfigError("data_dir", f"{data_dir}/{split} has class folder {extra[0]!r} that train/ lacks")
    samples = []
    for label, name in enumerate(classes):
        files = sorted((folder / name).glob("*")) if (folder / name).is_dir() else []
        samples += [(str(p), label) for p in files if p.suffix.lower() in IMAGE_SUFFIXES]
    if not samples:
        raise ConfigError("data_dir", f"{data_dir}/{split} has no .png/.jpg images: run python prepare_data.py first")
    return samples


def first_of_shuffled(samples, count, flag):
    """The first `count` samples of one fixed shuffled order (all classes mixed); 0 = all of them.
    Fixed, not from --seed: runs with different seeds train and evaluate on the same images."""
    if count == 0:
        return samples
    if count > len(samples):
        raise ConfigError(flag, f"is {count} but there are only {len(samples)} images")
    order = torch.randperm(len(samples), generator=torch.Generator().manual_seed(mix_seed(flag)))
    return [samples[i] for i in order[:count].tolist()]


def load_image(path):
    """An image file as a float tensor [3, H, W] in [0, 1]; OSError naming the file if unreadable."""
    try:
        with Image.open(path) as image:
            pixels = np.array(image.convert("RGB"))  # a copy: torch wants a writable array
    except (OSError, ValueError) as error:  # missing, truncated, not an image
        raise OSError(f"cannot read image {path}: {error}") from None
    return torch.from_numpy(pixels).permute(2, 0, 1).float().div_(255)


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
    """(image [3, image_size, image_size], label) pairs from a list of (path, label).

    Training images get a fresh random crop and flip each epoch, drawn from a generator seeded
    with (seed, epoch, index): the same whichever rank or DataLoader worker loads the image, so
    any world size, any number of workers and a resumed run see exactly the same images.
    """

    def __init__(self, samples, image_size, train, seed=0, min_crop_scale=1.0, hflip=False):
        self.samples, self.image_size, self.train = samples, image_size, train
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


def build_datasets(cfg):
    """(train, val) Datasets from cfg.data_dir; val uses train's class folders as its labels."""
    classes = class_names(cfg.data_dir)
    if 0 < getattr(cfg, "num_classes", 0) < len(classes):  # labels past the model's head: a cryptic CUDA assert
        raise ConfigError("num_classes", f"is {cfg.num_classes} but {cfg.data_dir}/train has {len(classes)} classes")
    train = first_of_shuffled(list_images(cfg.data_dir, "train", classes), cfg.train_samples, "train_samples")
    val = first_of_shuffled(list_images(cfg.data_dir, "val", classes), cfg.val_samples, "val_samples")
    augmentation = dict(seed=cfg.seed, min_crop_scale=cfg.min_crop_scale, hflip=cfg.hflip)
    return ImageFolder(train, cfg.image_size, train=True, **augmentation), ImageFolder(val, cfg.image_size, train=False)
