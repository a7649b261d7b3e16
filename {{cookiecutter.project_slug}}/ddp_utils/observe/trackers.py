"""Experiment trackers: TensorBoard, Weights & Biases and MLflow, chosen by --tracker.

Each gets the resolved config as hyperparameters, every metrics line, the step-wise
training loss, and text samples (--sample_every_steps). Only global rank 0 imports a tracker's
package or talks to it (the Reporter in metrics.py calls in here), so a 2-process job is one
tracker run, not two. A resumed run continues the same tracker runs: their ids are kept beside
the checkpoints, in output_dir/trackers.json.

Where the runs go is each tool's own setting: WANDB_MODE, WANDB_DIR and `wandb login` for
W&B; MLFLOW_TRACKING_URI for MLflow (a server; by default sqlite:///mlflow.db, in the working
folder).
"""

import importlib
import json
import time
from pathlib import Path

from ..core.files import write_atomically
from ..core.logs import log


def missing_package(names):
    """A one-line error for the first tracker in `names` whose package is not installed, or None.
    Each tracker's module and pyproject extra have its name."""
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError:
            return f'--tracker {name} needs the {name} package: pip install ".[{name}]"'
    return None


def open_trackers(cfg, output_dir, resumed_step):
    """The trackers --tracker asks for, each with its run started (a new one), or continued
    when the run resumes from a checkpoint at `resumed_step` (None: a fresh start)."""
    ids_path = Path(output_dir) / "trackers.json"
    ids = {}
    if resumed_step is not None and ids_path.exists():
        try:
            ids = json.loads(ids_path.read_text())
        except ValueError:
            log.warning("%s is not valid JSON: the trackers start new runs", ids_path)
    config = cfg.to_dict()
    run_name = Path(cfg.output_dir).resolve().name
    trackers = {}
    try:
        for name in cfg.trackers:
            tracker = TRACKERS[name](cfg.tracker_project, run_name, Path(output_dir), ids.get(name), resumed_step)
            trackers[name] = tracker
            tracker.log_config(config)
    except BaseException:
        for tracker in trackers.values():  # the ones already started: closed, not left running
            tracker.close("failed")
        raise
    ids = {name: tracker.run_id for name, tracker in trackers.items()}
    write_atomically(ids_path, lambda f: f.write((json.dumps(ids, indent=2) + "\n").encode()))
    return trackers


class TensorBoard:
    """Event files in output_dir/tensorboard (`tensorboard --logdir runs`)."""

    def __init__(self, project, run_name, output_dir, run_id, resumed_step):
        from torch.utils.tensorboard import SummaryWriter

        # A resumed run redoes the steps after its checkpoint: purge_step drops their old events.
        purge_step = None if resumed_step is None else resumed_step + 1
        self.writer = SummaryWriter(output_dir / "tensorboard", purge_step=purge_step)
        self.run_id = "tensorboard"  # the folder is the run

    def log_config(self, config):
        from torch.utils.tensorboard.summary import hparams

        for summary in hparams(config, {}):  # the HPARAMS tab, in this run's own event file
            self.writer.file_writer.add_summary(summary)

    def log(self, metrics, step):
        for key, value in metrics.items():
            self.writer.add_scalar(key, value, step)
        self.writer.flush()

    def log_text(self, name, text, step):
        self.writer.add_text(name, text, step)
        self.writer.flush()

    def close(self, status):
        self.writer.close()


class WandB:
    """A W&B run; its local files in output_dir/wandb (offline runs too, for `wandb sync`)."""

    def __init__(self, project, run_name, output_dir, run_id, resumed_step):
        import wandb

        self.run = wandb.init(
            project=project,
            name=run_name,
            id=run_id,
            resume="allow" if run_id else None,
            dir=output_dir,
            settings=wandb.Settings(console="off"),  # train.log has the console already
        )
        # Our step is the x-axis, not W&B's own counter, which only grows: a resumed run logs
        # the steps after its checkpoint again.
        self.run.define_metric("step")
        self.run.define_metric("*", step_metric="step")
        self.run_id = self.run.id

    def log_config(self, config):
        self.run.config.update(config, allow_val_change=True)  # a resume may change some

    def log(self, metrics, step):
        self.run.log({**metrics, "step": step})

    def log_text(self, name, text, step):
        self.run.log({name: text, "step": step})

    def close(self, status):
        self.run.finish(exit_code=0 if status == "finished" else 1)


class MLflow:
    """An MLflow run in the experiment named by --tracker_project, at MLFLOW_TRACKING_URI."""

    def __init__(self, project, run_name, output_dir, run_id, resumed_step):
        import mlflow

        self.mlflow, self.entities = mlflow, mlflow.entities
        self.client = mlflow.MlflowClient()
        self.resumed = False
        if run_id is not None:
            try:
                self.client.update_run(run_id, status="RUNNING")
                self.resumed = True
            except mlflow.exceptions.MlflowException as error:  # deleted, or another tracking store
                log.warning("MLflow run %s cannot be continued (%s): starting a new run", run_id, error)
        if not self.resumed:
            experiment = self.client.get_experiment_by_name(project)
            experiment_id = experiment.experiment_id if experiment else self.client.create_experiment(project)
            run_id = self.client.create_run(experiment_id, run_name=run_name).info.run_id
        self.run_id = run_id

    def log_config(self, config):
        if self.resumed:  # MLflow's params are write-once: the first start's stay
            return
        params = [self.entities.Param(key, str(value)) for key, value in config.items()]
        for start in range(0, len(params), 100):  # at most 100 params a call
            self.client.log_batch(self.run_id, params=params[start : start + 100])

    def log(self, metrics, step):
        now = int(time.time() * 1000)
        metrics = [self.entities.Metric(key, float(value), now, step) for key, value in metrics.items()]
        # In MLflow's background thread: a slow tracking server must not hold up rank 0 (the
        # other ranks would wait for it in the next all-reduce).
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=False)

    def log_text(self, name, text, step):
        self.client.log_text(self.run_id, text, f"{name}/step_{step:09d}.txt")  # an artifact

    def close(self, status):
        self.mlflow.flush_async_logging()  # the metrics still queued
        # A preempted run shows as KILLED until its resume sets it RUNNING again.
        self.client.set_terminated(self.run_id, {"finished": "FINISHED", "preempted": "KILLED"}.get(status, "FAILED"))


TRACKERS = {"tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}
