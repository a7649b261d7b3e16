"""The vision task: a ResNet that learns real images, predicts from a checkpoint, keeps batch
statistics global across processes, and augments the same way on any number of processes; an
image folder of your own splits itself, and its bad files stop a run before the first step."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DATA, PROJECT, load_final_model, read_metrics, run_training, training_env
from PIL import Image

import prepare_data
from config import Config
from dataset import build_datasets
from ddp_utils.data import images
from ddp_utils.data.images import load_image
from ddp_utils.errors import ConfigError
from ddp_utils.parallel.strategy import buffers_may_differ
from model import SyncBatchNorm2d, build_model

pytestmark = pytest.mark.fixed_amp

# Enough to learn the digits in a CI-sized budget: 8 epochs of 1438 images at their native
# 8 x 8 (97.2% here; crops of at least 60% of the area keep each digit readable).
LEARN = ["--amp", "none", "--train_samples", "0", "--val_samples", "0", "--width", "16", "--depth", "1"]
LEARN += ["--image_size", "8", "--min_crop_scale", "0.6", "--hflip", "false", "--lr", "0.01", "--epochs", "8"]
LEARN += ["--keep_checkpoints", "1"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("learn")
    run_training(output_dir, *LEARN, nproc=2, timeout=600)
    return output_dir


def test_the_resnet_learns_the_digits(trained):
    """scikit-learn's handwritten digits, written as PNG files by prepare_data.py: at least 95%
    of the validation images right."""
    last = read_metrics(trained)[-1]
    assert last["val_samples"] > 300
    assert last["val_accuracy"] >= 0.95, last


@pytest.mark.parametrize("config", ["as saved", "saved before --device existed"])
def test_predict_names_the_class_of_each_image(trained, tmp_path, config):
    checkpoint = trained / "checkpoints" / "last.pt"
    if config != "as saved":
        state = torch.load(checkpoint, weights_only=True)
        del state["config"]["device"]
        torch.save(state, checkpoint := tmp_path / "old.pt")
    images = sorted((DATA / "digits" / "val" / "7").glob("*.png"))[:3]
    command = [sys.executable, "predict.py", "--checkpoint", str(checkpoint), "--device", "cpu"]
    result = subprocess.run([*command, *map(str, images)], cwd=PROJECT, env=training_env(), capture_output=True,
                            text=True, timeout=120)  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 3 and all(line.startswith(str(image)) for line, image in zip(lines, images))
    assert sum(": 7 (" in line for line in lines) >= 2, lines


def test_batch_statistics_are_global_only_with_sync_batchnorm(tmp_path):
    """Without sync_batchnorm each process normalises by its own half of the batch: 2 x 32 then
    trains other parameters than 1 x 64. (With it, test_correctness.py's world-size test
    passes for this model.)"""
    off = ["--amp", "none", "--epochs", "1", "--sync_batchnorm", "false"]
    run_training(tmp_path / "one", *off, "--batch_size", "64")
    run_training(tmp_path / "two", *off, "--batch_size", "32", nproc=2)
    one, two = load_final_model(tmp_path / "one"), load_final_model(tmp_path / "two")
    difference = max(((one[k] - two[k]).norm() / one[k].norm().clamp_min(1e-12)).item() for k in one if one[k].dim())
    assert difference > 1e-3


def test_sync_batchnorm_is_torchs_on_gpus_and_ddp_resends_buffers_only_without_it(monkeypatch):
    """With sync_batchnorm, where the model trains on GPUs every BatchNorm is torch.nn.SyncBatchNorm
    (fused kernels); on the CPU, where torch's refuses, the hand-written SyncBatchNorm2d. Either
    way the running statistics come from the global batch, equal on every rank: DDP need not
    broadcast rank 0's before each forward. Without sync_batchnorm each rank's differ, and DDP
    keeps broadcasting them."""
    digits = str(DATA / "digits")
    for gpus, device, expected in ((False, "auto", SyncBatchNorm2d), (True, "auto", torch.nn.SyncBatchNorm),
                                   (True, "cpu", SyncBatchNorm2d)):  # fmt: skip
        monkeypatch.setattr(torch.cuda, "is_available", lambda gpus=gpus: gpus)
        model = build_model(Config(data_dir=digits, device=device).resolved())
        norms = [m for m in model.modules() if isinstance(m, torch.nn.modules.batchnorm._BatchNorm)]
        assert norms and all(type(m) is expected for m in norms), (gpus, device)
        assert not buffers_may_differ(model)
    model = build_model(Config(data_dir=digits, sync_batchnorm=False).resolved())
    assert buffers_may_differ(model)


def test_augmentation_depends_on_seed_epoch_and_index_only():
    cfg = Config(data_dir=str(DATA / "digits"), image_size=16, hflip=True)
    train, _ = build_datasets(cfg)
    again, _ = build_datasets(cfg)
    assert torch.equal(train[5][0], again[5][0])  # another object (process, worker): the same crop
    train.set_epoch(1)
    assert not torch.equal(train[5][0], again[5][0])  # another epoch: another crop
    again.set_epoch(1)
    assert torch.equal(train[5][0], again[5][0])
    assert train[5][0].shape == (3, 16, 16) and train[5][1] == again[5][1]


# --- your own image folder ------------------------------------------------------------------

CLASSES = ["cat", "dog", "fox"]
# The whole folder, a batch of 4 per process; a quarter of each class (3 of 12) held out.
OWN = ["--train_samples", "0", "--val_samples", "0", "--batch_size", "4", "--epochs", "1", "--val_fraction", "0.25"]


def write_image_folder(folder, per_class=12):
    """Class folders directly in `folder` (no train/, no val/): 16 x 16 images, each class its
    colour plus noise, every other one WebP; and a file that is no image."""
    rng = np.random.default_rng(0)
    for label, name in enumerate(CLASSES):
        (folder / name).mkdir(parents=True)
        for i in range(per_class):
            pixels = rng.integers(0, 60, (16, 16, 3)).astype(np.uint8)
            pixels[..., label] += 180
            Image.fromarray(pixels).save(folder / name / f"{i:02d}.{'webp' if i % 2 else 'png'}")
    (folder / "cat" / "notes.txt").write_text("not an image")
    return folder


@pytest.fixture(scope="module")
def own_images(tmp_path_factory):
    return write_image_folder(tmp_path_factory.mktemp("own") / "images")


def test_an_image_folder_without_val_splits_itself_from_the_seed(own_images):
    """Without val/, --val_fraction of each class is held out, chosen by a hash of (seed, path):
    no rank, world size or Python hash seed goes in, so every process (and a resumed run) holds
    out the same images; another --seed holds out others."""
    cfg = Config(data_dir=str(own_images), val_fraction=0.25, seed=3)
    train, val = build_datasets(cfg)
    split = {"train": [list(s) for s in train.samples], "val": [list(s) for s in val.samples]}
    assert [sum(label == c for _, label in val.samples) for c in range(3)] == [3, 3, 3]  # each class its share
    assert sorted(path for path, _ in train.samples + val.samples) == sorted(
        str(p) for p in own_images.glob("*/*.*") if p.suffix != ".txt"
    )  # .png and .webp, each image once
    assert {os.path.splitext(path)[1] for path, _ in val.samples} == {".png", ".webp"}
    other_seed = build_datasets(Config(data_dir=str(own_images), val_fraction=0.25, seed=4))[1]
    assert other_seed.samples != val.samples
    again = build_datasets(Config(data_dir=str(own_images), val_fraction=0.25, seed=3))
    assert [list(s) for s in again[0].samples] == split["train"] and [list(s) for s in again[1].samples] == split["val"]


def test_training_on_an_image_folder_of_png_and_webp(own_images, tmp_path):
    """2 processes train on the folder as it is; the file that is no image is counted, once;
    the checkpoint names the classes, and predict.py reads them from it (the data gone)."""
    result = run_training(tmp_path / "run", "--data_dir", own_images, *OWN, nproc=2)
    assert read_metrics(tmp_path / "run")[-1]["val_samples"] == 9
    assert result.stderr.count("left out 1 file of no image format Pillow opens (1 .txt)") == 1, result.stderr
    state = torch.load(tmp_path / "run" / "checkpoints" / "last.pt", weights_only=True)
    assert state["data"] == {"classes": CLASSES}
    state["config"]["data_dir"] = str(tmp_path / "gone")
    torch.save(state, checkpoint := tmp_path / "moved.pt")
    image = own_images / "dog" / "01.webp"
    command = [sys.executable, "predict.py", "--checkpoint", str(checkpoint), "--device", "cpu", str(image)]
    result = subprocess.run(command, cwd=PROJECT, env=training_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert re.fullmatch(rf"{re.escape(str(image))}: (cat|dog|fox) \(0\.\d+\)", result.stdout.strip()), result.stdout


def test_a_corrupt_image_stops_the_run_before_the_first_step(own_images, tmp_path):
    """A truncated PNG and a text file named .png: one error line naming them and Pillow's
    reason, before anything is written; --skip_bad_files true trains without them."""
    data = shutil.copytree(own_images, tmp_path / "data")
    whole = (data / "cat" / "00.png").read_bytes()
    bad = {str(data / "cat" / "cut.png"): "image file is truncated", str(data / "dog" / "text.png"): "cannot identify"}
    (data / "cat" / "cut.png").write_bytes(whole[: len(whole) // 2])
    (data / "dog" / "text.png").write_text("not a PNG")

    result = run_training(tmp_path / "stopped", "--data_dir", data, *OWN, nproc=2, check=False)
    errors = [line for line in result.stderr.splitlines() if line.startswith("error:")]
    assert result.returncode != 0 and len(errors) == 1, result.stderr
    assert not (tmp_path / "stopped").exists()
    train, val = build_datasets(Config(data_dir=str(data), val_fraction=0.25))
    in_train, in_val = ([path for path, _ in d.samples if path in bad] for d in (train, val))
    assert len(in_train + in_val) == 2 and all(f"{p}: {bad[p]}" in errors[0] for p in bad), errors  # both at once

    run_training(tmp_path / "skipped", "--data_dir", data, *OWN, "--skip_bad_files", "true")
    assert read_metrics(tmp_path / "skipped")[-1]["val_samples"] == len(val) - len(in_val)
    assert "training without" in (tmp_path / "skipped" / "train.log").read_text()


def test_16_bit_images_keep_their_values(tmp_path):
    """16-bit grayscale (PNG: Pillow's I;16) scaled by 65535, float images (TIFF: F) clipped to
    [0, 1], 8-bit ones by 255; all as 3 equal channels, not clipped to white by convert("RGB")."""
    values16 = np.array([[0, 1000], [32768, 65535]], np.uint16)
    Image.fromarray(values16).save(tmp_path / "16.png")
    Image.fromarray(np.array([[-0.5, 0.25], [0.5, 2.0]], np.float32)).save(tmp_path / "float.tif")
    Image.fromarray(np.array([[0, 51], [128, 255]], np.uint8)).save(tmp_path / "8.png")
    expected = {"16.png": values16 / 65535, "float.tif": [[0, 0.25], [0.5, 1]], "8.png": [[0, 0.2], [128 / 255, 1]]}
    for name, values in expected.items():
        image = load_image(tmp_path / name)
        assert image.shape == (3, 2, 2) and image.dtype == torch.float32
        assert torch.allclose(image, torch.tensor(values, dtype=torch.float32).expand(3, 2, 2), atol=1e-6), name


def test_the_check_decodes_only_new_or_changed_images(tmp_path, monkeypatch):
    """Images that decoded fine are remembered by size and modification time: a second check
    decodes none of them, a changed file is decoded again, a bad one each time."""
    data = write_image_folder(tmp_path / "images", per_class=2)
    train, _ = build_datasets(Config(data_dir=str(data), val_fraction=0.5))
    decoded, read_pixels = [], images.read_pixels

    def counting(path):
        decoded.append(path)
        return read_pixels(path)

    monkeypatch.setattr(images, "read_pixels", counting)
    everything = range(len(train))
    assert train.check_samples(everything) == {} and len(decoded) == len(train) == 3
    decoded.clear()
    assert train.check_samples(everything) == {} and decoded == []

    touched, cut = train.samples[0][0], train.samples[1][0]
    os.utime(touched, ns=(os.stat(touched).st_atime_ns, os.stat(touched).st_mtime_ns + 10**9))
    Path(cut).write_bytes(Path(cut).read_bytes()[:40])
    decoded.clear()
    problems = train.check_samples(everything)
    assert sorted(decoded) == sorted([touched, cut]) and list(problems) == [1] and problems[1].startswith(f"{cut}: ")
    decoded.clear()
    assert train.check_samples(everything) == problems and decoded == [cut]  # a bad file: each time
    assert [path for path, _ in train.without([1]).samples] == [touched, train.samples[2][0]]
    assert train.data_state() == {"classes": CLASSES}


def test_a_folder_without_images_says_what_it_holds(tmp_path, monkeypatch):
    """No images: the error counts the other files; only the demo's folder points at prepare_data.py."""
    (tmp_path / "own" / "cat").mkdir(parents=True)
    (tmp_path / "own" / "cat" / "scan.raw").write_bytes(b"")
    with pytest.raises(ConfigError) as error:
        build_datasets(Config(data_dir=str(tmp_path / "own")))
    assert "has no training images, only 1 file of no image format Pillow opens (1 .raw)" in str(error.value)
    assert "prepare_data" not in str(error.value)
    monkeypatch.chdir(tmp_path)
    assert Config().data_dir == prepare_data.OUTPUT_DIR  # train.py finds prepare_data.py's images by default
    with pytest.raises(ConfigError, match="run python prepare_data.py first"):
        build_datasets(Config())
