"""A sweep file (sweep.py SWEEP.toml): the knobs to search, the metric, the trials and the run's
other flags, read and checked whole before any trial starts. Every problem is one line naming
the key to fix (all of a file's problems at once).

    [sweep]
    trials = 8                   # trials in all, over every worker
    steps = 300                  # --max_steps of each trial
    metric = "val_loss"          # a metric the task reports in metrics.jsonl
    direction = "minimize"       # or "maximize"
    config = "experiments/quick_cpu.toml"  # the trials' --config (optional)
    processes = 1                # processes per trial (scripts/launch.sh's NPROC_PER_NODE)

    [knobs]                      # Config fields (train.py --help), each one range:
    lr = { log_uniform = [1e-4, 3e-2] }
    warmup_steps = { int = [0, 100] }
    dropout = { uniform = [0.0, 0.2] }
    optimizer = { choices = ["adamw", "muon"] }
    # or every knob a grid: batch_size = { grid = [16, 32, 64] }

    [flags]                      # the trials' other flags (Config fields), over --config
    eval_every_steps = 50
"""

import dataclasses
import difflib
import math
from dataclasses import dataclass, field
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..configuration import RENAMED, read_config_file, type_problem
from ..errors import ConfigError, InputError

RANGES = ("log_uniform", "uniform", "int", "log_int", "choices", "grid")
SWEEP_KEYS = {
    "name": str,  # the study's name in the storage (default: the file's name)
    "folder": str,  # the sweep's folder: trials, logs, journal, results (default: runs/sweeps/<name>)
    "trials": int,
    "steps": int,
    "metric": str,
    "direction": str,
    "config": str,
    "processes": int,
    "storage": str,  # "" = a journal file in the folder; or an RDB URL (sqlite:///x.db, postgresql://...)
    "seed": int,  # the sampler's seed (each worker adds a random number of its own, but a grid's order)
    "sampler": str,  # tpe or random (a grid of every knob uses Optuna's grid sampler)
    "pruner": str,  # median or none
    "startup_trials": int,  # trials completed before the pruner judges any
    "prune_after_steps": int,  # steps a trial trains before it can be pruned
    "heartbeat_seconds": int,  # a worker silent for 3 of these is dead: its trial is retried (its run ended)
    "retries": int,  # how often a trial whose worker died is run again (resuming its checkpoint)
}
FIELDS_OF_SWEEP = {"[sweep]", "[knobs]", "[flags]"}


@dataclass(frozen=True)
class Knob:
    name: str
    kind: str  # one of RANGES
    values: tuple  # (low, high) of a range, or the choices or grid

    @property
    def log(self):
        return self.kind in ("log_uniform", "log_int")


@dataclass
class Sweep:
    path: Path
    name: str
    folder: Path
    trials: int
    steps: int
    metric: str = "val_loss"
    direction: str = "minimize"
    config: str = ""
    processes: int = 1
    storage: str = ""
    seed: int = 0
    sampler: str = "tpe"
    pruner: str = "median"
    startup_trials: int = 3
    prune_after_steps: int = 0
    heartbeat_seconds: int = 10
    retries: int = 2
    knobs: dict = field(default_factory=dict)
    flags: dict = field(default_factory=dict)

    @property
    def grid(self):
        """{knob: values} when every knob is a grid, else None."""
        if self.knobs and all(k.kind == "grid" for k in self.knobs.values()):
            return {name: list(k.values) for name, k in self.knobs.items()}
        return None

    @property
    def journal(self):
        return self.folder / "journal.log"

    def trial_flags(self, params, output_dir):
        """train.py's flags for one trial: --config, the other flags, the steps, the knobs' values."""
        argv = ["--config", self.config] if self.config else []
        values = {**self.flags, "max_steps": self.steps, "progress_bar": False, **params, "output_dir": str(output_dir)}
        for name, value in values.items():
            argv += [f"--{name}", str(value).lower() if isinstance(value, bool) else str(value)]
        return argv


def read_sweep(path, config_class):
    """The checked Sweep of the file at `path`; raises InputError with one line naming the file
    and every bad key."""
    try:
        with open(path, "rb") as f:
            document = tomllib.load(f)
    except OSError as error:
        raise InputError(f"{path}: cannot read it: {error.strerror or error}") from None
    except (tomllib.TOMLDecodeError, UnicodeDecodeError) as error:
        raise InputError(f"{path}: not valid TOML: {error}") from None
    problems = []
    for key in document:
        if f"[{key}]" not in FIELDS_OF_SWEEP:
            close = difflib.get_close_matches(key, ["sweep", "knobs", "flags"], n=1)
            problems.append(f"unknown table [{key}]" + (f" (did you mean [{close[0]}]?)" if close else ""))
    settings = _sweep_settings(document.get("sweep", {}), problems)
    fields = {f.name: f for f in dataclasses.fields(config_class)}
    flags = _flags(path, document.get("flags", {}), settings.get("config", ""), fields, config_class, problems)
    knobs = _knobs(document.get("knobs", {}), fields, flags, config_class, problems)
    if not knobs and not problems:
        problems.append("[knobs] names no Config field to search (such as lr = { log_uniform = [1e-4, 1e-2] })")
    grid = [k.name for k in knobs.values() if k.kind == "grid"]
    if grid and len(grid) < len(knobs):
        ranged = next(name for name in knobs if name not in grid)
        problems.append(f"knob {grid[0]} is a grid and {ranged} a range: a grid needs every knob a grid")
    for name in ("max_steps", "output_dir"):
        if name in knobs or name in document.get("flags", {}):
            problems.append(f"{name} is the sweep's own ([sweep] steps, folder): leave it out of [knobs] and [flags]")
    if problems:
        raise InputError(f"{path}: {'; '.join(problems)}")
    name = settings.pop("name", Path(path).stem)
    folder = Path(settings.pop("folder", f"runs/sweeps/{name}"))
    if "trials" not in settings and grid:
        settings["trials"] = math.prod(len(k.values) for k in knobs.values())
    return Sweep(path=Path(path), name=name, folder=folder, knobs=knobs, flags=flags, **settings)


def _sweep_settings(table, problems):
    if not isinstance(table, dict):
        problems.append("sweep must be a table: [sweep]")
        return {}
    settings = {}
    for key, value in table.items():
        if key not in SWEEP_KEYS:
            close = difflib.get_close_matches(key, SWEEP_KEYS, n=1)
            hint = f" (did you mean {close[0]}?)" if close else f" (keys: {', '.join(SWEEP_KEYS)})"
            problems.append(f"unknown key sweep.{key}{hint}")
            continue
        problem = type_problem(f"sweep.{key}", value, SWEEP_KEYS[key])
        if problem:
            problems.append(problem)
        else:
            settings[key] = value
    for key in ("steps",):
        if key not in settings and not any(p.startswith(f"key sweep.{key} ") for p in problems):
            problems.append(f"sweep.{key} is missing: the --max_steps of each trial")
    for key in ("trials", "steps", "processes", "heartbeat_seconds"):
        if key in settings and settings[key] < 1:
            problems.append(f"sweep.{key} must be at least 1")
    for key in ("startup_trials", "prune_after_steps", "retries"):
        if key in settings and settings[key] < 0:
            problems.append(f"sweep.{key} must not be negative")
    choices = {"direction": ("minimize", "maximize"), "sampler": ("tpe", "random"), "pruner": ("median", "none")}
    for key, allowed in choices.items():
        if key in settings and settings[key] not in allowed:
            problems.append(f"sweep.{key} must be one of {', '.join(allowed)}, not {settings[key]!r}")
    return settings


def _flags(path, table, config_file, fields, config_class, problems):
    """The trials' other flags: Config fields, type-checked like a --config file's."""
    values = {}
    if config_file:
        if not Path(config_file).is_file():
            problems.append(f"sweep.config {config_file}: no such file (paths are relative to the project folder)")
        else:
            try:
                values.update(read_config_file(config_file, config_class))
            except SystemExit:  # read_config_file printed its one line
                problems.append(f"sweep.config {config_file} has the problem printed above")
    if not isinstance(table, dict):
        problems.append("flags must be a table: [flags]")
        return values
    for name, value in table.items():
        if name not in fields:
            problems.append(_unknown(f"flags.{name}", name, fields))
            continue
        problem = type_problem(f"flags.{name}", value, fields[name].type)
        if problem:
            problems.append(problem)
        else:
            values[name] = float(value) if fields[name].type is float else value
    return values


def _unknown(place, name, fields):
    if name in RENAMED:
        return f"key {place} {RENAMED[name]}"
    close = difflib.get_close_matches(name, fields, n=1)
    hint = f" (did you mean {close[0]}?)" if close else " (knobs and flags are Config fields: train.py --help)"
    return f"unknown key {place}{hint}"


def _knobs(table, fields, flags, config_class, problems):
    knobs = {}
    if not isinstance(table, dict):
        problems.append("knobs must be a table: [knobs]")
        return knobs
    for name, spec in table.items():
        place = f"knobs.{name}"
        if name not in fields:
            problems.append(_unknown(place, name, fields))
            continue
        if not (isinstance(spec, dict) and len(spec) == 1):
            problems.append(
                f"{place} must be one range, such as log_uniform = [1e-4, 1e-2] in braces ({', '.join(RANGES)})"
            )
            continue
        (kind, values), wanted = next(iter(spec.items())), fields[name].type
        problem = _range_problem(place, kind, values, wanted)
        if problem:
            problems.append(problem)
            continue
        values = tuple(float(v) if wanted is float else v for v in values)
        # Each end of a range (each choice) must make a config the run accepts: a negative lr
        # is refused here, not in the trial that happens to draw it.
        for value in values:
            try:
                config_class(**{**flags, name: value})
            except ConfigError as error:
                if error.field == name:
                    problems.append(f"{place}: {value!r} is refused: {error}")
                    break
            except InputError:
                pass
        knobs[name] = Knob(name, kind, values)
    return knobs


def _range_problem(place, kind, values, wanted):
    """Why `{kind = values}` is not a range of a field of type `wanted`, or None."""
    if kind not in RANGES:
        close = difflib.get_close_matches(kind, RANGES, n=1)
        hint = f"did you mean {close[0]}?" if close else f"one of {', '.join(RANGES)}"
        return f"{place}: unknown range {kind} ({hint})"
    if not isinstance(values, list) or not values:
        return f"{place}.{kind} must be a list of values, such as [1e-4, 1e-2]"
    if kind in ("choices", "grid"):
        for value in values:
            problem = type_problem(place, value, wanted)
            if problem:
                return problem.replace("key ", "", 1).replace(" must be ", f".{kind} values must each be ", 1)
        return None
    names = {float: "a number", int: "an integer", bool: "true or false", str: "text"}
    if kind in ("log_uniform", "uniform") and wanted is not float:
        fix = "int or log_int" if wanted is int else "choices or grid"
        return f"{place}: {kind} draws numbers, but {place[6:]} is {names[wanted]}: use {fix}"
    if kind in ("int", "log_int") and wanted is not int:
        fix = "log_uniform or uniform" if wanted is float else "choices or grid"
        return f"{place}: {kind} draws integers, but {place[6:]} is {names[wanted]}: use {fix}"
    if len(values) != 2 or any(isinstance(v, bool) or not isinstance(v, (int, float)) for v in values):
        return f"{place}.{kind} must be [low, high], two numbers"
    if kind in ("int", "log_int") and not all(isinstance(v, int) for v in values):
        return f"{place}.{kind} must be [low, high], two integers"
    low, high = values
    if not low < high:
        return f"{place}.{kind} must be [low, high] with low < high, not {values}"
    if kind.startswith("log") and low <= 0:
        return f"{place}.{kind} must start above 0 (a log scale), not at {low}"
    return None
