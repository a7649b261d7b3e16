"""The language task: a GPT that learns real text, samples from a checkpoint, and the knobs
that change how it trains but not what it learns."""

import json
import math
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest
import torch
from conftest import (
    DATA,
    PROJECT,
    TINY_CONFIG,
    checkpoint,
    kill_tree,
    load_final_model,
    read_metrics,
    run_training,
    training_command,
    training_env,
    wait_for,
)

from config import Config
from dataset import TokenWindows
from ddp_utils.configuration import parse_config
from ddp_utils.errors import ConfigError
from ddp_utils.observe import flops
from model import build_model
from task import TASK

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


def test_input_and_output_embeddings_are_one_matrix():
    model = build_model(Config(vocab_size=256, block_size=16, n_layer=1, n_head=2, n_embd=32))
    assert model.lm_head.weight is model.tok_emb.weight
    assert sum(p.numel() for p in model.parameters()) < sum(t.numel() for t in model.state_dict().values())


def test_flop_count_includes_attention():
    """Counted as the model runs, forward and backward, against nanoGPT's estimate per token:
    6 N (N: parameters but the position embedding) + 12 L H Q T for attention."""
    cfg = Config(vocab_size=256, block_size=128, n_layer=4, n_head=4, n_embd=128)
    batch = (torch.zeros(1, 128, dtype=torch.int64), torch.zeros(1, 128, dtype=torch.int64))
    counted = flops.flops_per_sample(cfg, TASK, batch)
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
    output = result.stdout + result.stderr
    assert 'train.py", line' not in output and 'trainer.py", line' not in output
    assert not run.exists()


# --- tokenizers ---------------------------------------------------------------------------


def prepare(folder, *flags):
    """prepare_data.py on the tests' text (DATA/text, tests/task_settings.py) into `folder`."""
    command = [sys.executable, "prepare_data.py", "--input", str(DATA / "text"), "--output_dir", str(folder), *flags]
    result = subprocess.run(command, cwd=PROJECT, env=training_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    return json.loads((folder / "meta.json").read_text())


def test_a_trained_bpe_tokenizer_round_trips_and_the_gpt_learns_its_tokens(tmp_path):
    """--train_tokenizer 512: a byte-level BPE learned offline, saved beside the token files,
    that decodes every text back exactly; the GPT learns its tokens (below a uniform guess over
    512), the checkpoint carries it, and sample.py decodes with it."""
    pytest.importorskip("tokenizers")
    from language.tokenizer import from_text

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
    sample = result.stdout.removesuffix("\n")  # print's own newline is not a decoded character
    assert len(sample) > len("def ") + 20, sample  # 20 tokens of several bytes each, decoded


def test_a_vocabulary_over_65535_writes_uint32_token_files_that_train(tmp_path):
    """A tokenizer.json of 66,300 ids (a small BPE with unused ids added to its vocabulary)."""
    pytest.importorskip("tokenizers")
    from language.tokenizer import train_bpe

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


# --- Hugging Face GPT-2 in and out -------------------------------------------------------
# A GPT-2 of the tests' tiny shape (experiments/tiny.toml), random weights, saved by
# transformers itself; 300 ids: more than the bytes of the tests' data use.

GPT2_VOCAB = 300
# A fine-tune that checkpoints every 4 steps, with dropout: its random draws show any disturbance.
FINE_TUNE = ["--amp", "none", "--checkpoint_every_steps", "4", "--dropout", "0.1"]


def save_tiny_gpt2(folder, seed=0):
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(seed)
    shape = {name: getattr(TINY_CONFIG, name) for name in ("n_layer", "n_head", "n_embd")}
    config = transformers.GPT2Config(vocab_size=GPT2_VOCAB, n_positions=2 * TINY_CONFIG.block_size, **shape)
    model = transformers.GPT2LMHeadModel(config).eval()
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="module")
def gpt2(tmp_path_factory):
    """(folder, the transformers model saved in it)."""
    folder = tmp_path_factory.mktemp("gpt2")
    return folder, save_tiny_gpt2(folder)


@pytest.fixture(scope="module")
def fine_tuned(gpt2, tmp_path_factory):
    """An uninterrupted 2-process fine-tune of the GPT-2 folder (ddp)."""
    output_dir = tmp_path_factory.mktemp("fine_tuned")
    run_training(output_dir, "--init_from", gpt2[0], *FINE_TUNE, nproc=2)
    return output_dir


def logits_of(model, tokens):
    with torch.no_grad():
        output = model(tokens)
    return getattr(output, "logits", output)


def test_init_from_a_gpt2_folder_gives_transformers_logits(gpt2):
    """--init_from: the shape from config.json, the weights mapped (Conv1D transposed, the
    output tied, positions cut to --block_size): our logits are transformers' within 1e-4."""
    from config import Config
    from ddp_utils.configuration import parse_config
    from model import pretrained_weights

    folder, reference = gpt2
    cfg = parse_config(Config, ["--init_from", str(folder), "--data_dir", str(DATA / "data"),
                        "--block_size", str(TINY_CONFIG.block_size)])  # fmt: skip
    assert (cfg.vocab_size, cfg.gelu, cfg.n_layer) == (GPT2_VOCAB, "tanh", TINY_CONFIG.n_layer)
    model = build_model(cfg).eval()
    model.load_state_dict(pretrained_weights(cfg))
    tokens = torch.randint(0, GPT2_VOCAB, (2, TINY_CONFIG.block_size))
    assert torch.allclose(logits_of(model, tokens), logits_of(reference, tokens), atol=1e-4, rtol=0)


def test_a_gpt2_folder_that_does_not_fit_is_one_line(gpt2, tmp_path, capsys):
    """A flag that contradicts the folder's config.json, a longer context than it has
    positions for, or another architecture: one line naming the flag (before train.py creates
    anything: the config is resolved first)."""
    from config import Config
    from ddp_utils.configuration import parse_config

    other = tmp_path / "bert"
    other.mkdir()
    (other / "config.json").write_text(json.dumps({"model_type": "bert"}))
    cases = {
        ("--n_layer", str(TINY_CONFIG.n_layer + 1)): f"--n_layer is {TINY_CONFIG.n_layer + 1}, but --init_from",
        ("--block_size", str(4 * TINY_CONFIG.block_size)): f"--block_size is {4 * TINY_CONFIG.block_size}, but",
        ("--init_from", str(other)): "--init_from " + str(other / "config.json") + " has model_type 'bert'",
    }
    for flags, message in cases.items():
        with pytest.raises(SystemExit) as stopped:
            parse_config(Config, ["--init_from", str(gpt2[0]), *flags, "--data_dir", str(DATA / "data")])
        stderr = capsys.readouterr().err
        assert stopped.value.code == 2 and stderr.startswith(f"error: {message}"), stderr
        assert len(stderr.strip().splitlines()) == 1


def test_a_gpt2_folder_with_another_tokenizer_than_the_data_is_one_line(gpt2, tmp_path):
    """A folder with its own tokenizer.json and data prepared with another (bytes here): the
    ids would mean other tokens to the pretrained model. Refused, naming the fix."""
    from config import Config
    from dataset import build_datasets
    from ddp_utils.configuration import parse_config
    from language.tokenizer import train_bpe

    folder = tmp_path / "gpt2"
    shutil.copytree(gpt2[0], folder)
    (folder / "tokenizer.json").write_text(train_bpe(["some text to learn from"], GPT2_VOCAB).to_text())
    cfg = parse_config(Config, ["--init_from", str(folder), "--data_dir", str(DATA / "data"),
                        "--block_size", str(TINY_CONFIG.block_size)])  # fmt: skip
    with pytest.raises(ConfigError, match=r"has its own tokenizer.json, but .* holds tokens of bytes \(256 ids\): "
                                          r"prepare the data with python prepare_data.py --tokenizer"):  # fmt: skip
        build_datasets(cfg)


def export(checkpoint, out, *flags):
    command = [sys.executable, "export.py", str(checkpoint), str(out), *flags]
    result = subprocess.run(command, cwd=PROJECT, env=training_env(), capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
def test_a_fine_tuned_gpt2_exports_a_folder_transformers_loads(gpt2, fine_tuned, tmp_path, strategy):
    """Fine-tuned from a GPT-2 folder on 2 processes, then export.py --format hf: transformers
    loads the folder, and its logits equal ours within 1e-4. The weights started from the
    folder's (they moved by at most a few learning-rate steps). Under fsdp a text sample is
    logged at step 2 (--sample_every_steps: every rank runs the sharded model)."""
    transformers = pytest.importorskip("transformers")
    run = fine_tuned
    if strategy == "fsdp":
        run = tmp_path / "run"
        run_training(run, "--init_from", gpt2[0], "--strategy", "fsdp", *FINE_TUNE, "--max_steps", "3",
                     "--eval_every_steps", "3", "--sample_every_steps", "2", nproc=2)  # fmt: skip
        log = (run / "train.log").read_text()
        assert log.count("sample at step") == 1 and len(log.split("sample at step 2:\n", 1)[1]) > 20  # decoded
    last = run / "checkpoints" / ("last" if strategy == "fsdp" else "last.pt")
    export(last, tmp_path / "model.pt")
    export(last, tmp_path / "hf", "--format", "hf")
    exported = torch.load(tmp_path / "model.pt", weights_only=True)
    ours = build_model(Config(**exported["config"])).eval()
    ours.load_state_dict(exported["model"])
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf").eval()
    tokens = torch.randint(0, GPT2_VOCAB, (2, TINY_CONFIG.block_size))
    assert torch.allclose(logits_of(ours, tokens), logits_of(theirs, tokens), atol=1e-4, rtol=0)
    steps = read_metrics(run)[-1]["step"]
    moved = (theirs.transformer.wte.weight - gpt2[1].transformer.wte.weight).abs().max().item()
    assert 0 < moved < 2 * steps * TINY_CONFIG.lr  # Adam moves a weight about lr a step: the folder's, trained


def test_fine_tuning_resumes_exactly_after_sigterm_without_loading_the_folder_again(gpt2, fine_tuned, tmp_path):
    """SIGTERM mid-run, then the same command: the run continues from its own checkpoint, bit
    for bit the uninterrupted run, even though the folder now holds other weights (--init_from
    applies at step 0 only). This run also logs a text sample every 3 steps, which changes
    nothing: dropout draws the same masks, the model trains in training mode."""
    folder = tmp_path / "gpt2"
    shutil.copytree(gpt2[0], folder)
    flags = ["--init_from", folder, *FINE_TUNE, "--sample_every_steps", "3"]
    output_dir = tmp_path / "run"
    command = training_command(output_dir, *flags, nproc=2, probe="slow_until_stopped")  # time to signal
    with open(tmp_path / "run.log", "w") as log:
        process = subprocess.Popen(command, cwd=PROJECT, env=training_env(), stdout=log, stderr=subprocess.STDOUT,
                                   start_new_session=True)  # fmt: skip
        try:
            wait_for(checkpoint(output_dir, 8), process)
            process.send_signal(signal.SIGTERM)
            assert process.wait(timeout=60) != 0
        finally:
            kill_tree(process.pid)
            process.wait()
    assert "stopped by SIGTERM" in (tmp_path / "run.log").read_text()
    save_tiny_gpt2(folder, seed=1)  # other weights: applying them again would show
    run_training(output_dir, *flags, nproc=2)
    assert "sample at step 3:" in (output_dir / "train.log").read_text()  # rank 0 alone, under ddp
    ours, reference = load_final_model(output_dir), load_final_model(fine_tuned)
    assert all(torch.equal(ours[name], reference[name]) for name in reference)


# --- the README's Hugging Face example, pasted as shown -------------------------------------


def readme_snippet(page, after):
    """The first Python block of `page` (README.md or a docs/ page) after the text `after`."""
    text = (PROJECT / page).read_text().split(after, 1)[1]
    return text.split("```python\n", 1)[1].split("```", 1)[0]


def with_snippet(folder, snippet):
    """A copy of this project's code (its Python files, packages and experiments; no data, runs
    or environments) with `snippet` pasted at the end of model.py, as the README says."""
    for path in PROJECT.iterdir():
        if path.suffix == ".py":
            shutil.copy(path, folder / path.name)
        elif path.is_dir() and ((path / "__init__.py").exists() or path.name == "experiments"):
            shutil.copytree(path, folder / path.name, ignore=shutil.ignore_patterns("__pycache__"))
    with open(folder / "model.py", "a") as model:
        model.write("\n\n" + snippet)
    return folder


def quick_start_model(snippet):
    """The model build_model makes at experiments/quick_cpu.toml's sizes, `snippet` pasted after model.py."""
    namespace = {"__name__": "model"}
    exec(compile((PROJECT / "model.py").read_text() + "\n\n" + snippet, "model.py", "exec"), namespace)
    torch.manual_seed(0)
    return namespace["build_model"](quick_start_config())


def quick_start_config():
    return parse_config(Config, ["--config", str(PROJECT / "experiments" / "quick_cpu.toml"), *DATA_FLAGS])


DATA_FLAGS = ["--data_dir", str(DATA / "data")]  # the tests' data (tests/task_settings.py)
HF_EXAMPLE = "A model from the Hugging Face zoo"  # the README's text before its snippet
# A quick-start run cut short: 40 steps, the second half's speed compared (steady state: no start-up).
QUICK_START = ["--config", "experiments/quick_cpu.toml", *DATA_FLAGS, "--max_steps", "40", "--eval_every_steps", "20"]


def test_the_readmes_hugging_face_example_is_the_configs_size_and_trains_about_as_fast_as_the_gpt(tmp_path):
    """The README's Llama, pasted at the end of model.py, takes every size from the config: at
    the quick start's, its parameters are those of docs/your-model.md's Llama, and within 2x the
    GPT's (a SwiGLU MLP is 3 matrices of 4 x n_embd to the GPT's 2: 1.33x per block; with
    transformers' defaults, an MLP 11,008 wide, it was 20x). A 2-process quick-start run of it
    takes at most 3x the GPT's time a step: its arithmetic is 1.33x the GPT's, and eager
    attention, rotary embeddings and transformers' Python add some; the defaults made it 12x."""
    pytest.importorskip("transformers")
    snippet = readme_snippet("README.md", HF_EXAMPLE)
    llama, gpt = quick_start_model(snippet), build_model(quick_start_config())
    parameters = sum(p.numel() for p in llama.parameters())
    documented = quick_start_model(readme_snippet("docs/your-model.md", "## A model from the Hugging Face zoo"))
    assert parameters == sum(p.numel() for p in documented.parameters())
    assert parameters <= 2 * sum(p.numel() for p in gpt.parameters()), parameters

    speeds = {}
    for name, project in [("gpt", PROJECT), ("llama", with_snippet(tmp_path, snippet))]:
        output_dir = tmp_path / "runs" / name
        command = training_command(output_dir, *QUICK_START, nproc=2, tiny=False)
        done = subprocess.run(command, cwd=project, env=training_env(), capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        speeds[name] = read_metrics(output_dir)[-1]["samples_per_s"]
    print(f"quick start, 2 processes, steps 21-40: {speeds} samples/s")  # pytest -s shows it
    assert speeds["llama"] >= speeds["gpt"] / 3, speeds
