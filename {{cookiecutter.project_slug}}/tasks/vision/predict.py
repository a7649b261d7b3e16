"""Yours to run: classify images with a trained checkpoint, in one process.

    python predict.py --checkpoint runs/default/checkpoints/last.pt cat.png dog.jpg

Prints `PATH: CLASS (probability)` per image. Images are preprocessed exactly as validation
images are (dataset.preprocess). Class names come from the checkpoint (the training set's
classes, saved with it), else <data_dir>/classes.json, else the data's class folders, else the
label index.
"""

import argparse
import json
import sys
from pathlib import Path

import torch

from dataset import class_names, preprocess
from ddp_utils.data.images import load_image
from ddp_utils.errors import ConfigError
from ddp_utils.inference import load_trained, pick_device
from model import build_model


def label_names(state, cfg):
    """The class name of each label."""
    saved = (state.get("data") or {}).get("classes")  # checkpoints from before data_state() lack it
    if saved:
        names = saved
    elif (Path(cfg.data_dir) / "classes.json").is_file():
        names = json.loads((Path(cfg.data_dir) / "classes.json").read_text())
    else:
        try:
            names = class_names(cfg.data_dir)
        except ConfigError:  # the data is elsewhere now
            names = []
    return names if len(names) == cfg.num_classes else [str(i) for i in range(cfg.num_classes)]


def main(argv=None):
    parser = argparse.ArgumentParser(description="Classify images with a trained checkpoint.")
    parser.add_argument("--checkpoint", required=True, help="a checkpoint written by train.py")
    parser.add_argument("images", nargs="+", metavar="IMAGE", help="image files (png, jpg, ...)")
    parser.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"), help="auto: cuda if available")
    args = parser.parse_args(argv)
    device = pick_device(args.device)
    model, cfg, state = load_trained(args.checkpoint, build_model, device)
    names = label_names(state, cfg)

    failed = False
    for path in args.images:
        try:
            image = preprocess(load_image(path), cfg.image_size)
        except OSError as error:  # names the file; the other images are still classified
            print(f"error: {error}", file=sys.stderr)
            failed = True
            continue
        with torch.no_grad():
            probabilities = model(image[None].to(device)).float().softmax(dim=-1)[0]
        probability, label = (t.item() for t in probabilities.max(dim=0))
        print(f"{path}: {names[label]} ({probability:.3f})")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
