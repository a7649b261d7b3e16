"""The experiment workflow: config files (--config), trackers (--tracker) and --profile_steps.

The trackers run for real and offline: W&B in offline mode (its run folder read back record
by record), MLflow on a local SQLite store queried through MLflow's own client, TensorBoard's
event files read by TensorBoard's own reader.
"""

import json
import logging
import struct
from types import SimpleNamespace

import pytest
from conftest import (
    LR,
    PROJECT,
    assert_same_metrics,
    assert_same_parameters,
    read_metrics,
    run_training,
)

from config import Config
from ddp_utils.configuration import parse_config
from ddp_utils.observe.metrics import Reporter
from task import TASK

pytestmark = pytest.mark.fixed_amp

# --- config files ---------------------------------------------------------------------------


def write(path, text):
    path.write_text(text)
    return str(path)


def test_file_over_defaults_and_flags_over_file(tmp_path):
    path = write(
        tmp_path / "exp.toml",
        'lr = 0.01\noutput_dir = "runs/exp"\n\n[optimisation]\nbatch_size = 32\nwarmup_steps = 3\nweight_decay = 0\n',
    )
    cfg = parse_config(Config, ["--config", path, "--warmup_steps", "5"], resolve=False)
    assert (cfg.lr, cfg.output_dir, cfg.batch_size, cfg.warmup_steps) == (0.01, "runs/exp", 32, 5)
    assert cfg.weight_decay == 0.0 and isinstance(cfg.weight_decay, float)  # an integer where a float goes
    assert cfg.epochs == Config().epochs  # not in the file: the default
    assert (
        parse_config(Config, ["--lr", "0.5", "--config", path], resolve=False).lr == 0.5
    )  # flags win wherever they are


@pytest.mark.parametrize(
    "text, message",
    [
        ("lre = 0.1\n", "unknown key lre (did you mean lr?)"),
        ("[optimisation]\nbatch_sizes = 4\n", "unknown key optimisation.batch_sizes (did you mean batch_size?)"),
        ('lr = "1e-3"\n', "key lr must be a number, not '1e-3' (str)"),
        ("epochs = 2.5\n", "key epochs must be an integer, not 2.5 (float)"),
        ('compile = "yes"\n', "key compile must be true or false, not 'yes' (str)"),
        ("epochs = true\n", "key epochs must be an integer, not True (bool)"),
        ("lr = \n", "not valid TOML: Invalid value (at line 1, column 6)"),
        ("lr = 0.1\n[a]\nlr = 0.2\n", "key a.lr is set twice (also as lr)"),
        ("lr = -1\n", "key lr must be greater than 0"),
        ('amp = "fp8"\n', "key amp must be one of bf16, fp16, none"),
        ("max_grad_norm = nan\n", "key max_grad_norm must be a finite number"),
        ("[logging]\ntensorboard = true\n", "key logging.tensorboard was replaced by --tracker tensorboard"),
        (  # every bad key at once, in the file's order: one edit fixes them all
            'lre = 0.1\nepochs = 2.5\n[speed]\ncompile = "yes"\n',
            "unknown key lre (did you mean lr?); key epochs must be an integer, not 2.5 (float); "
            "key speed.compile must be true or false, not 'yes' (str)",
        ),
    ],
)
def test_bad_file_is_one_line_naming_the_file_and_key(tmp_path, capsys, text, message):
    path = write(tmp_path / "bad.toml", text)
    with pytest.raises(SystemExit) as exit_info:
        parse_config(Config, ["--config", path], resolve=False)
    assert exit_info.value.code == 2
    (line,) = capsys.readouterr().err.strip().splitlines()
    assert line == f"error: --config {path}: {message}"


def test_unreadable_file_and_removed_flag_are_one_line(tmp_path, capsys):
    for args, message in [
        (["--config", str(tmp_path / "missing.toml")], f"--config {tmp_path / 'missing.toml'}: cannot read it"),
        (["--tensorboard", "true"], "--tensorboard was replaced by --tracker tensorboard"),
        (["--tracker", "wandb,comet"], "--tracker must be none, or one or more of tensorboard, wandb, mlflow"),
        (["--profile_steps", "5:2"], "--profile_steps must be A:B with 1 <= A <= B"),
        (["--profile_steps", "\u00b2:3"], "--profile_steps must be A:B with 1 <= A <= B"),
        (["--max_grad_norm", "nan"], "--max_grad_norm must be a finite number"),
        (["--config", "a.toml", "--config=b.toml"], "--config is given twice"),
        (["--config="], "--config needs the path of a TOML file"),
    ]:
        with pytest.raises(SystemExit):
            parse_config(Config, args, resolve=False)
        (line,) = capsys.readouterr().err.strip().splitlines()
        assert line.startswith(f"error: {message}"), line


def test_resolved_config_file_reads_back_to_the_same_config(tmp_path):
    hostile = 'runs/ünï "quoted" back\\slash \t tab \x7f del \U0001f600'
    cfg = Config(output_dir=hostile, lr=1e-5, max_grad_norm=0.25, tracker="tensorboard,mlflow", compile=True)
    path = write(tmp_path / "config.toml", cfg.to_toml())
    assert parse_config(Config, ["--config", path], resolve=False) == cfg


@pytest.mark.quick
@pytest.mark.parametrize("name", ["quick_cpu.toml", "multinode_gpu.toml"])
def test_example_experiments_are_valid_configs(name):
    path = PROJECT / "experiments" / name
    cfg = parse_config(Config, ["--config", str(path)], resolve=False)
    assert cfg.output_dir.startswith("runs/")
    assert (cfg.amp == "none") == (name == "quick_cpu.toml")  # CPUs run float32; the GPU example, mixed precision


def test_resolved_config_alone_reproduces_the_run(one_node_run, tmp_path):
    """The file rank 0 wrote at the start of a run, and nothing else (no TINY flags), trains the
    same parameters and metrics again."""
    saved = one_node_run / "config.toml"
    run_training(tmp_path, "--config", saved, nproc=2, tiny=False)
    assert_same_parameters(tmp_path, one_node_run)
    assert_same_metrics(tmp_path, one_node_run)
    assert len(read_metrics(tmp_path)) == len(read_metrics(one_node_run))
    assert (tmp_path / "config.toml").read_text() == saved.read_text().replace(str(one_node_run), str(tmp_path))


# --- trackers, step diagnostics and the profiler: one tracked 2-process job, resumed once ----------

TRACKED = ["--tracker", "tensorboard,wandb,mlflow", "--log_every_steps", "2", "--amp", "fp16"]
TRACKED += ["--eval_every_steps", "4", "--profile_steps", "5:7"]
# Text samples, where model.py can make them (sample_text): at steps 4 and 8.
SAMPLES = bool(TASK.sample_text)
TRACKED += ["--sample_every_steps", "4"] if SAMPLES else []


@pytest.fixture(scope="module")
def tracked(tmp_path_factory):
    """A 2-process fp16 job with all three trackers that stops at step 6 (a checkpoint), then
    its resume to step 10."""
    root = tmp_path_factory.mktemp("tracked")
    output_dir = root / "run"
    env = {"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": f"sqlite:///{root / 'mlflow.db'}"}
    # Its experiment made beforehand with its artifacts here: by default MLflow writes them to
    # ./mlruns of the working directory, the project's, which other tests read.
    import mlflow

    experiment = Config().tracker_project
    mlflow.MlflowClient(env["MLFLOW_TRACKING_URI"]).create_experiment(experiment, (root / "artifacts").as_uri())
    first = run_training(output_dir, *TRACKED, "--max_steps", "6", nproc=2, env=env, probe="count_scale_reads")
    ids = json.loads((output_dir / "trackers.json").read_text())
    second = run_training(output_dir, *TRACKED, "--max_steps", "10", nproc=2, env=env, probe="count_scale_reads")
    assert "resumed from" in second.stdout
    return output_dir, env["MLFLOW_TRACKING_URI"], ids, first.stdout + second.stdout


def test_trackers_keep_their_run_ids_beside_the_checkpoints(tracked):
    output_dir, _, ids, _ = tracked
    assert json.loads((output_dir / "trackers.json").read_text()) == ids  # the resume continued them
    assert set(ids) == {"tensorboard", "wandb", "mlflow"}


def test_mlflow_holds_one_run_with_params_and_every_metric(tracked):
    import mlflow

    output_dir, uri, ids, _ = tracked
    client = mlflow.MlflowClient(uri)
    (experiment,) = [e for e in client.search_experiments() if e.name == Config().tracker_project]
    (run,) = client.search_runs([experiment.experiment_id])  # one run for 2 processes and a resume
    assert run.info.run_id == ids["mlflow"] and run.info.status == "FINISHED"
    assert run.data.params["lr"] == str(LR) and run.data.params["tracker"] == "tensorboard,wandb,mlflow"
    steps = {key: [m.step for m in client.get_metric_history(run.info.run_id, key)] for key in run.data.metrics}
    assert steps["train_loss_step"] == steps["grad_norm"] == steps["loss_scale"] == [2, 4, 6, 8, 10]
    assert steps["val_loss"] == steps["train_loss"] == [4, 6, 8, 10]  # every metrics line, the run's end too
    val_loss = [m.value for m in client.get_metric_history(run.info.run_id, "val_loss")]
    assert val_loss == [line["val_loss"] for line in read_metrics(output_dir)]
    samples = [artifact.path for artifact in client.list_artifacts(run.info.run_id, "sample")]
    assert samples == (["sample/step_000000004.txt", "sample/step_000000008.txt"] if SAMPLES else [])


def wandb_records(path):
    """The records of a W&B run file: a LevelDB-style log (32 KiB blocks of CRC, length, type
    and data) of wandb_internal_pb2.Record messages behind a 7-byte header."""
    from wandb.proto import wandb_internal_pb2

    data, position, pieces, block = path.read_bytes(), 7, [], 32768
    assert data.startswith(b":W&B")
    while position + 7 <= len(data):
        left = block - position % block
        _, length, kind = struct.unpack("<IHB", data[position : position + 7])
        if left < 7 or (kind == 0 and length == 0):  # the rest of a block is padding
            position += left
            continue
        pieces.append(data[position + 7 : position + 7 + length])
        position += 7 + length
        if kind in (1, 4):  # a whole record, or the last piece of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(b"".join(pieces))
            pieces = []
            yield record


def test_wandb_offline_run_is_one_run_continued_on_resume(tracked):
    output_dir, _, ids, _ = tracked
    folders = sorted((output_dir / "wandb").glob("offline-run-*"))
    assert [folder.name.rsplit("-", 1)[1] for folder in folders] == [ids["wandb"]] * 2  # one per start, one id
    history, config = [], {}
    for folder in folders:
        for record in wandb_records(next(folder.glob("run-*.wandb"))):
            kind = record.WhichOneof("record_type")
            if kind == "history":
                items = record.history.item
                history.append({item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in items})
            elif kind in ("run", "config"):
                updates = record.run.config.update if kind == "run" else record.config.update
                config.update({item.key: json.loads(item.value_json) for item in updates})
    assert config["lr"] == LR and config["amp"] == "fp16"
    assert [h["step"] for h in history if "train_loss_step" in h] == [2, 4, 6, 8, 10]
    assert all("grad_norm" in h and "loss_scale" in h for h in history if "train_loss_step" in h)
    assert [h["val_loss"] for h in history if "val_loss" in h] == [
        line["val_loss"] for line in read_metrics(output_dir)
    ]
    assert [h["step"] for h in history if h.get("sample")] == ([4, 8] if SAMPLES else [])


def test_tensorboard_has_every_metric_and_the_config(tracked):
    from tensorboard.backend.event_processing.event_file_loader import EventFileLoader
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams.plugin_data_pb2 import HParamsPluginData

    output_dir, _, _, _ = tracked
    events = EventMultiplexer({"run": str(output_dir / "tensorboard")})
    events.Reload()
    scalars = set(events.Runs()["run"]["scalars"])
    assert {"train_loss", "val_loss", "samples_per_s", "train_loss_step", "grad_norm", "loss_scale"} <= scalars
    assert [event.step for event in events.Scalars("run", "train_loss_step")] == [2, 4, 6, 8, 10]
    hparams, texts = {}, []  # the config, for the HPARAMS tab; the text samples' steps
    for path in sorted((output_dir / "tensorboard").glob("events.out.tfevents.*")):
        for event in EventFileLoader(str(path)).Load():
            for value in event.summary.value:
                if value.metadata.plugin_data.plugin_name == "hparams":
                    data = HParamsPluginData.FromString(value.metadata.plugin_data.content)
                    hparams.update(data.session_start_info.hparams)
                if value.metadata.plugin_data.plugin_name == "text" and value.tag.startswith("sample"):
                    texts.append(event.step)
    assert hparams["lr"].number_value == LR and hparams["tracker"].string_value == "tensorboard,wandb,mlflow"
    assert texts == ([4, 8] if SAMPLES else [])


def test_log_steps_show_gradient_norm_and_fp16_loss_scale(tracked):
    output_dir, _, _, stdout = tracked
    logged = [line.split(" INFO ", 1)[1] for line in stdout.splitlines() if " loss_scale " in line]
    assert [line.split()[1] for line in logged] == ["2", "4", "6", "8", "10"]
    for line in logged:
        words = line.split()
        norm, scale = float(words[words.index("grad_norm") + 1]), float(words[words.index("loss_scale") + 1])
        assert 0 < norm < 100 and scale == 65536.0  # fp16's first scale, no overflow in 10 steps
    # Logged without the host reading the scale in a step: on a GPU each read waits for it.
    assert stdout.count('PROBE {"scale_reads_in_steps": 0}') == 2, stdout


def test_profile_traces_the_asked_steps_from_rank_zero_across_a_resume(tracked):
    """Steps 5:7 of a run stopped at step 6: steps 5-6 before the stop, step 7 after the resume."""
    output_dir, _, _, _ = tracked
    traces = sorted(path.name for path in (output_dir / "profile").iterdir())  # rank 0's only
    assert traces == ["trace_steps_5-6.json", "trace_steps_7-7.json"]
    for name, steps in [("trace_steps_5-6.json", {5, 6}), ("trace_steps_7-7.json", {7})]:
        events = json.loads((output_dir / "profile" / name).read_text())["traceEvents"]
        names = {event.get("name", "") for event in events}
        recorded = {int(n.split("#")[1]) for n in names if n.startswith("optimizer_step#")}
        assert recorded == steps
        assert any(n in ("aten::addmm", "aten::mm") for n in names)  # the model's work is in it


def test_a_tracker_that_fails_mid_run_is_dropped_and_metrics_jsonl_keeps_everything(tmp_path, caplog, monkeypatch):
    """Rank 0 alone talks to trackers: an exception there must never reach the loop (the other
    ranks would wait in the next all-reduce)."""

    class Broken:
        def log(self, metrics, step):
            raise ConnectionError("tracking server unreachable")

    monkeypatch.setattr(logging.getLogger("train"), "propagate", True)  # setup_logging turns it off
    reporter = Reporter(SimpleNamespace(is_main=True), Config(), tmp_path)
    reporter.trackers = {"mlflow": Broken()}
    with caplog.at_level(logging.WARNING, logger="train"):
        reporter.epoch_metrics({"epoch": 1, "step": 4, "val_loss": 1.5})
        reporter.epoch_metrics({"epoch": 1, "step": 8, "val_loss": 1.25})
    assert reporter.trackers == {}
    assert [line["step"] for line in read_metrics(tmp_path)] == [4, 8]
    (warning,) = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert "--tracker mlflow failed and is turned off" in warning and "unreachable" in warning


def test_missing_tracker_package_is_one_clear_error(tmp_path):
    shadow = tmp_path / "shadow" / "wandb"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('no wandb here')\n")
    env = {"PYTHONPATH": str(shadow.parent)}
    result = run_training(tmp_path / "run", "--tracker", "tensorboard,wandb", nproc=2, env=env, check=False)
    assert result.returncode != 0  # each rank exits 2, torchrun 1
    assert result.stderr.count('error: --tracker wandb needs the wandb package: pip install ".[wandb]"') == 1
    assert not (tmp_path / "run").exists()  # stopped before anything was written
