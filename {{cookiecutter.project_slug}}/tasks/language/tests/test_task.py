"""The language task: a GPT that learns real text, samples from a checkpoint, and the knobs
that change how it trains but not what it learns."""

import json
import math
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import DATA, PROJECT, load_final_model, read_metrics, run_training, training_env

from config import Config
from dataset import TokenWindows
from ddp_utils import metrics
from ddp_utils.contract import load_task
from model import build_model

pytestmark = pytest.mark.fixed_amp

# Big enough to learn in a CI-sized budget: 200 steps of 2 x 16 windows of 64 bytes.
LEARN = ["--amp", "none", "--block_size", "64", "--n_layer", "2", "--n_head", "4", "--n_embd", "64"]
LEARN += ["--batch_size", "16", "--lr", "0.003", "--max_steps", "200", "--eval_every_steps", "100"]


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("learn")
    run_training(output_dir, *LEARN, nproc=2, timeout=600)
    return output_dir


def test_the_gpt_learns_real_text(trained):
    """The standard library's source, byte by byte: validation loss falls far below a uniform
    guess over 256 bytes (ln 256 = 5.55); each evaluation is a line with its epoch, step and
    tokens/s."""
    metrics_lines = read_metrics(trained)
    assert [m["step"] for m in metrics_lines] == [100, 200]
    assert metrics_lines[-1]["val_loss"] < 3.0 < math.log(256)
    assert all(m["tokens_per_s"] == pytest.approx(m["samples_per_s"] * 64) for m in metrics_lines)


def test_sample_prints_text_from_a_checkpoint(trained):
    command = [sys.executable, "sample.py", "--checkpoint", str(trained / "checkpoints" / "last.pt")]
    command += ["--prompt", "def ", "--max_new_tokens", "80", "--seed", "1", "--device", "cpu"]
    first = subprocess.run(command, cwd=PROJECT, env=training_env(), capture_output=True, text=True, timeout=120)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith("def ") and len(first.stdout) > len("def ") + 40
    again = subprocess.run(command, cwd=PROJECT, env=training_env(), capture_output=True, text=True, timeout=120)
    assert again.stdout == first.stdout  # the same seed, the same text


def test_activation_checkpointing_gives_the_same_parameters(tmp_path):
    """Recomputing each block in backward saves memory and changes nothing else, dropout included
    (checkpoint restores the random state for the recompute)."""
    for value in ("false", "true"):
        run_training(tmp_path / value, "--amp", "none", "--epochs", "1", "--dropout", "0.1",
                     "--activation_checkpointing", value)  # fmt: skip
    plain, recomputed = load_final_model(tmp_path / "false"), load_final_model(tmp_path / "true")
    assert all(torch.equal(plain[key], recomputed[key]) for key in plain)


def test_input_and_output_embeddings_are_one_matrix():
    model = build_model(Config(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32))
    assert model.lm_head.weight is model.tok_emb.weight
    assert sum(p.numel() for p in model.parameters()) < sum(t.numel() for t in model.state_dict().values())


def test_flop_count_includes_attention():
    """Counted as the model runs, forward and backward, against nanoGPT's estimate per token:
    6 N (N: parameters but the position embedding) + 12 L H Q T for attention."""
    cfg = Config(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
    batch = (torch.zeros(1, 128, dtype=torch.int64), torch.zeros(1, 128, dtype=torch.int64))
    counted = metrics.flops_per_sample(cfg, load_task(), batch)
    model = build_model(cfg)
    n = sum(p.numel() for p in model.parameters()) - model.pos_emb.weight.numel()
    estimate = 128 * (6 * n + 12 * 4 * 4 * (128 // 4) * 128)
    assert counted == pytest.approx(estimate, rel=0.02)
    without_attention = 128 * 6 * n
    assert counted > 1.1 * without_attention


def test_windows_are_read_from_a_memory_map_opened_by_each_process():
    cfg = Config(data_dir=str(DATA / "data"), block_size=32)
    windows = TokenWindows(DATA / "data" / "train.bin", 32, 8, seed=0)
    x, y = windows[3]
    assert torch.equal(x[1:], y[:-1]) and x.dtype == torch.int64 and cfg.block_size == len(x)
    assert windows.tokens is not None and windows.__getstate__()["tokens"] is None  # workers open their own


def test_training_windows_are_fresh_every_epoch_and_the_same_on_resume():
    """Window i of epoch e starts where (seed, e, i) says: other windows next epoch (the model
    sees more of the corpus), the same ones again for the same epoch (a resume, another rank)."""
    windows = TokenWindows(DATA / "data" / "train.bin", block_size=16, num_samples=64, seed=0)
    starts = []
    for epoch in (0, 1, 0):
        windows.set_epoch(epoch)
        starts.append([windows.offset(i) for i in range(64)])
    assert starts[0] == starts[2]
    assert sum(a != b for a, b in zip(starts[0], starts[1])) > 60


def test_prepare_data_without_input_uses_the_standard_library(tmp_path):
    command = [sys.executable, "prepare_data.py", "--output_dir", str(tmp_path), "--max_bytes", "20000"]
    result = subprocess.run(command, cwd=PROJECT, capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "no --input: using the Python standard library's source" in result.stdout
    meta = json.loads((tmp_path / "meta.json").read_text())
    assert meta == {"vocab_size": 256, "tokenizer": "bytes", "dtype": "uint16"}
    assert (tmp_path / "train.bin").stat().st_size + (tmp_path / "val.bin").stat().st_size == 2 * 20000


def test_missing_data_is_one_line_naming_the_flag(tmp_path):
    """The format of every bad setting: `error: ...` once, exit status 2 (torchrun: 1), and
    nothing written."""
    run = tmp_path / "run"
    result = run_training(run, "--data_dir", tmp_path / "nowhere", "--vocab_size", "256", nproc=2, check=False)
    assert result.returncode != 0
    assert result.stderr.count(f"error: --data_dir {tmp_path / 'nowhere'} has no train.bin") == 1, result.stderr
    assert 'train.py", line' not in result.stdout + result.stderr
    assert not run.exists()


# --- tokenizers ---------------------------------------------------------------------------


def prepare(folder, *flags):
    """prepare_data.py on the tests' text (DATA/text, tests/task.py) into `folder`."""
    command = [sys.executable, "prepare_data.py", "--input", str(DATA / "text"), "--output_dir", str(folder), *flags]
    result = subprocess.run(command, cwd=PROJECT, env=training_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads((folder / "meta.json").read_text())


def test_a_trained_bpe_tokenizer_round_trips_and_the_gpt_learns_its_tokens(tmp_path):
    """--train_tokenizer 512: a byte-level BPE learned offline, saved beside the token files,
    that decodes every text back exactly; the GPT learns its tokens (below a uniform guess over
    512), the checkpoint carries it, and sample.py decodes with it."""
    pytest.importorskip("tokenizers")
    from tokenizer import from_text

    data = tmp_path / "bpe"
    assert prepare(data, "--train_tokenizer", "512") == {"vocab_size": 512, "tokenizer": "tokenizer.json",
                                                         "dtype": "uint16"}  # fmt: skip
    tokenizer = from_text((data / "tokenizer.json").read_text())
    text = (DATA / "text" / "argparse.py").read_text() + "ünïcödé ✓ \t\r\n"
    assert tokenizer.decode(tokenizer.encode(text)) == text
    assert len(tokenizer.encode(text)) < len(text.encode()) / 2  # merges: fewer tokens than bytes
    run = tmp_path / "run"
    run_training(run, "--data_dir", data, "--max_steps", "40", "--eval_every_steps", "40", "--lr", "0.01", nproc=2)
    assert read_metrics(run)[-1]["val_loss"] < math.log(512)
    state = torch.load(run / "checkpoints" / "last.pt", weights_only=True)
    assert state["config"]["vocab_size"] == 512 and state["data"]["tokenizer"] == tokenizer.to_text()
    command = [sys.executable, "sample.py", "--checkpoint", str(run / "checkpoints" / "last.pt"), "--prompt", "def ",
               "--max_new_tokens", "20", "--device", "cpu"]  # fmt: skip
    result = subprocess.run(command, cwd=PROJECT, env=training_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0 and result.stdout.startswith("def "), result.stderr
    assert len(result.stdout) > len("def ") + 20  # 20 tokens of several bytes each, decoded


def test_a_vocabulary_over_65535_writes_uint32_token_files_that_train(tmp_path):
    """A tokenizer.json of 66,300 ids (a small BPE with unused ids added to its vocabulary)."""
    pytest.importorskip("tokenizers")
    from tokenizer import train_bpe

    document = json.loads(train_bpe([(DATA / "text" / "argparse.py").read_text()], 300).to_text())
    document["model"]["vocab"].update({f"<unused_{i}>": 300 + i for i in range(66000)})
    (tmp_path / "large.json").write_text(json.dumps(document))
    meta = prepare(tmp_path / "data", "--tokenizer", tmp_path / "large.json")
    assert meta["dtype"] == "uint32" and meta["vocab_size"] == 66300
    tokens = np.fromfile(tmp_path / "data" / "train.bin", dtype=np.uint32)
    first = TokenWindows(tmp_path / "data" / "train.bin", 16, 4, dtype="uint32")[0]  # fixed windows: the first at 0
    assert first[0].tolist() == tokens[:16].tolist() and first[1].tolist() == tokens[1:17].tolist()
    run_training(tmp_path / "run", "--data_dir", tmp_path / "data", "--max_steps", "2", "--eval_every_steps", "2",
                 "--val_samples", "16")  # 66,300 logits a token: a small evaluation  # fmt: skip
    assert math.isfinite(read_metrics(tmp_path / "run")[-1]["val_loss"])
