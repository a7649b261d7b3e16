"""A sweep's results, written into its folder from the storage at any time (sweep.py --report,
and by each worker when it ends): trials.csv and the table printed, best_config.toml (the best
trial's config, which --config takes as it is), metric_vs_knobs.png and best_curves.png; and
the same loss-curve picture for any runs (sweep.py --curves)."""

import csv
import io
import json
import os
import shlex
import uuid
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from ..configuration import toml_value
from ..errors import InputError

BEST_CURVES = 5  # trials drawn in best_curves.png


def write_file(path, data):
    """`path` written whole, through a temporary file of this write's own: several workers may
    write the results at once (a random name: workers in containers often share one pid)."""
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def table_rows(sweep, study):
    rows = []
    for t in study.get_trials(deepcopy=False):
        row = {"trial": t.number, "state": t.state.name.lower()}
        row.update({name: t.params.get(name, "") for name in sweep.knobs})
        row[sweep.metric] = last_value(t) if t.value is not None or t.intermediate_values else ""
        row["steps"] = t.user_attrs.get("steps", "")
        row["seconds"] = t.user_attrs.get("seconds", "")
        row["retry_of"] = t.user_attrs.get("retry_of", "")
        row["reason"] = t.user_attrs.get("reason", "")
        row["output_dir"] = t.user_attrs.get("output_dir", "")
        rows.append(row)
    return rows


def best_trial(sweep, study):
    done = [t for t in study.get_trials(deepcopy=False) if t.state.name == "COMPLETE"]
    if not done:
        return None
    return (min if sweep.direction == "minimize" else max)(done, key=lambda t: t.value)


def write_results(sweep, study):
    folder = sweep.folder
    folder.mkdir(parents=True, exist_ok=True)
    rows = table_rows(sweep, study)
    if not rows:
        print(f"sweep.py: no trials yet in study {sweep.name}")
        return
    text = io.StringIO()
    writer = csv.DictWriter(text, fieldnames=list(rows[0]))
    writer.writeheader()
    writer.writerows(rows)
    write_file(folder / "trials.csv", text.getvalue().encode())
    print(format_table(rows, exclude=("output_dir",)))
    best = best_trial(sweep, study)
    if best is not None:
        write_best_config(best, sweep)
        print(f"sweep.py: best trial {best.number}: {sweep.metric} {best.value:.6g}; "
              f"its config: {folder / 'best_config.toml'}")  # fmt: skip
    try:
        write_metric_vs_knobs(sweep, study, folder / "metric_vs_knobs.png")
        ranked = rank_trials(sweep, study)[:BEST_CURVES]
        runs = [Path(t.user_attrs["output_dir"]) for t in ranked]
        if runs:
            labels = [f"trial {t.number}: {params_label(t.params)}" for t in ranked]
            write_curves(runs, folder / "best_curves.png", labels=labels, metric=sweep.metric)
    except InputError as error:  # no matplotlib: the table and the config are written all the same
        print(f"sweep.py: no pictures: {error}")


def rank_trials(sweep, study):
    """Completed trials best first, then pruned ones by their last value."""
    sign = 1 if sweep.direction == "minimize" else -1
    ranked = []
    for t in study.get_trials(deepcopy=False):
        if t.state.name in ("COMPLETE", "PRUNED") and t.intermediate_values and "output_dir" in t.user_attrs:
            ranked.append((t.state.name != "COMPLETE", sign * last_value(t), t))
    return [t for *_, t in sorted(ranked, key=lambda r: r[:2])]


def params_label(params):
    return ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in params.items())


def format_table(rows, exclude=()):
    names = [n for n in rows[0] if n not in exclude]
    cells = [[f"{r[n]:.4g}" if isinstance(r[n], float) else str(r[n]) for n in names] for r in rows]
    widths = [max(len(n), *(len(c[i]) for c in cells)) for i, n in enumerate(names)]
    lines = ["  ".join(n.ljust(w) for n, w in zip(names, widths))]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in cells]
    return "\n".join(line.rstrip() for line in lines)


def write_best_config(best, sweep):
    """best_config.toml: the best trial's own resolved config (its config.toml), with an output
    folder of its own, and the line that reruns it: with the trial's number of processes (its
    global batch), not launch.sh's default."""
    folder = sweep.folder
    source = Path(best.user_attrs["output_dir"]) / "config.toml"
    values = tomllib.loads(source.read_text())
    values["output_dir"] = str(folder / "best")
    processes = best.user_attrs.get("processes", sweep.processes)
    lines = [
        f"# The best trial of the sweep (trial {best.number}, value {best.value!r}): its whole config.",
        f"# Rerun it with: NNODES=1 NPROC_PER_NODE={processes} scripts/launch.sh "
        f"--config {shlex.quote(str(folder / 'best_config.toml'))}",
    ]
    lines += [f"{name} = {toml_value(value)}" for name, value in values.items()]
    write_file(folder / "best_config.toml", ("\n".join(lines) + "\n").encode())


def pyplot():
    try:
        import matplotlib
    except ImportError:
        raise InputError('pictures need matplotlib: pip install -e ".[sweep]"') from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def write_metric_vs_knobs(sweep, study, path):
    """The metric against each searched knob: completed trials filled, pruned ones hollow at
    their last reported value."""
    plt = pyplot()
    knobs = list(sweep.knobs.values())
    fig, axes = plt.subplots(1, len(knobs), figsize=(4.5 * len(knobs), 3.6), squeeze=False)
    for ax, knob in zip(axes[0], knobs):
        for state, style in (("COMPLETE", {"color": "C0"}), ("PRUNED", {"facecolors": "none", "edgecolors": "C1"})):
            points = [(t.params[knob.name], last_value(t)) for t in study.get_trials(deepcopy=False)
                      if t.state.name == state and knob.name in t.params and t.intermediate_values]  # fmt: skip
            if points:
                xs = [x if isinstance(x, (int, float)) else str(x) for x, _ in points]
                ax.scatter(xs, [y for _, y in points], label=state.lower(), **style)
        if knob.log:
            ax.set_xscale("log")
        ax.set_xlabel(knob.name)
        ax.set_ylabel(sweep.metric)
        ax.legend(fontsize="small")
    fig.suptitle(f"{sweep.name}: {sweep.metric} ({sweep.direction})", fontsize="medium")
    fig.tight_layout()
    save_figure(fig, path)


def last_value(t):
    """A trial's value, or a pruned one's last reported value."""
    return t.value if t.value is not None else t.intermediate_values[max(t.intermediate_values)]


def read_metrics(run):
    """(train lines, evaluation lines) of a run's metrics.jsonl (a folder or the file)."""
    path = run / "metrics.jsonl" if run.is_dir() else run
    try:
        text = path.read_text()
    except OSError as error:
        raise InputError(f"{run}: no metrics.jsonl to read: {error.strerror}") from None
    records = []
    for line in text.splitlines():
        try:
            records.append(json.loads(line))
        except ValueError:
            continue
    return [r for r in records if isinstance(r, dict) and "step" in r]


def write_curves(runs, path, labels=None, metric="val_loss"):
    """The loss curves of `runs` side by side: train_loss, and `metric` (or every val_ number
    the first run reports when it has no `metric`), against the optimizer step."""
    plt = pyplot()
    data = [read_metrics(run) for run in runs]
    names = ["train_loss", metric]
    if not any(metric in r for records in data for r in records):
        names = ["train_loss"] + sorted({k for r in data[0] for k in r if k.startswith("val_") and k != "val_samples"})
    fig, axes = plt.subplots(1, len(names), figsize=(5 * len(names), 3.8), squeeze=False)
    for ax, name in zip(axes[0], names):
        for i, records in enumerate(data):
            points = [(r["step"], r[name]) for r in records if isinstance(r.get(name), (int, float))]
            if points:
                ax.plot(*zip(*points), marker=".", label=labels[i] if labels else str(runs[i]))
        ax.set_xlabel("step")
        ax.set_ylabel(name)
    axes[0][0].legend(fontsize="x-small")
    fig.tight_layout()
    save_figure(fig, path)


def save_figure(fig, path):
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", dpi=100)
    pyplot().close(fig)
    write_file(Path(path), buffer.getvalue())
