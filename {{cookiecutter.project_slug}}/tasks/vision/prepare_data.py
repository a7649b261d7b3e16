"""Yours to run: write the demo dataset: real images that need no download.

    python prepare_data.py [--output_dir data/images] [--val_fraction 0.2] [--seed 0]

scikit-learn ships 1797 handwritten digits (8x8 grayscale, 10 classes) inside the package. They
are written as 32x32 PNG files in one of the layouts dataset.py reads, train/<digit>/ and
val/<digit>/, plus classes.json (the class names in label order, for predict.py). Your own
images need no such step: point --data_dir at a folder of <class>/ folders (dataset.py).
"""

import argparse
import json
import sys
from pathlib import Path

import numpy as np
from PIL import Image

OUTPUT_DIR = "data/images"  # dataset.py's --data_dir default (DEMO_DATA_DIR): train.py finds it with no flags


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output_dir", default=OUTPUT_DIR, help="folder to write train/, val/ and classes.json")
    parser.add_argument("--val_fraction", type=float, default=0.2, help="share of each class held out for validation")
    parser.add_argument("--seed", type=int, default=0, help="seed of the train/val split")
    args = parser.parse_args(argv)
    if not 0 < args.val_fraction < 1:
        parser.error("--val_fraction must be between 0 and 1")
    try:
        from sklearn.datasets import load_digits  # only here: training never needs scikit-learn
    except ImportError:
        print("prepare_data.py needs scikit-learn for the demo digits: pip install scikit-learn", file=sys.stderr)
        return 2

    digits = load_digits()
    classes = [str(c) for c in range(10)]  # sorted folder names = labels: "0".."9" sort as digits do
    output = Path(args.output_dir)
    rng = np.random.default_rng(args.seed)
    counts = {"train": 0, "val": 0}
    for label, name in enumerate(classes):
        # Split each class on its own: every class gets its share of the validation set.
        indices = rng.permutation(np.flatnonzero(digits.target == label))
        num_val = round(len(indices) * args.val_fraction)
        for split, chosen in (("val", indices[:num_val]), ("train", indices[num_val:])):
            folder = output / split / name
            folder.mkdir(parents=True, exist_ok=True)
            for old in folder.glob("*.png"):  # a previous split's files would leak val images into train
                old.unlink()
            for index in chosen:
                pixels = (digits.images[index] * (255 / 16)).round().astype(np.uint8)  # values 0..16
                Image.fromarray(pixels).resize((32, 32), Image.BICUBIC).save(folder / f"{index:04d}.png")
            counts[split] += len(chosen)
    (output / "classes.json").write_text(json.dumps(classes) + "\n")
    print(
        f"wrote {counts['train']} training and {counts['val']} validation images of {len(classes)} classes to {output}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
