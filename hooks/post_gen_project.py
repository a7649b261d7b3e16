"""Put the chosen task's files in place and remove the optional files the answers did not ask for.

Each task (language, vision, tabular) has its own whole files under tasks/<task>/ in the
template (model.py, dataset.py, its scripts and tests); they move to the same places in the
project and tasks/ goes. Then only removals listed in OPTIONAL_FILES. Both are idempotent:
cruft re-runs this hook on every update, and running it twice must change nothing.
"""

import json
import shutil
from pathlib import Path

# file in the generated project -> (prompt, the answer that keeps it)
OPTIONAL_FILES = {
    "scripts/slurm.sbatch": ("slurm", "yes"),
    "k8s": ("kubernetes", "yes"),  # a folder: removed whole
    "Dockerfile": ("kubernetes", "yes"),
    ".dockerignore": ("kubernetes", "yes"),
    "tests/cluster/test_kubernetes.py": ("kubernetes", "yes"),
    "docs/slurm.md": ("slurm", "yes"),
    "docs/kubernetes.md": ("kubernetes", "yes"),
    "sky.yaml": ("skypilot", "yes"),
    "docs/skypilot.md": ("skypilot", "yes"),
    "tests/cluster/test_skypilot.py": ("skypilot", "yes"),
}


def place_task_files(project_dir, task):
    """Move tasks/<task>/* to the project's root (same relative paths) and drop tasks/."""
    tasks = Path(project_dir) / "tasks"
    if not tasks.is_dir():  # already placed (a re-run)
        return
    chosen = tasks / task
    for source in sorted(p for p in chosen.rglob("*") if p.is_file()):
        target = Path(project_dir) / source.relative_to(chosen)
        target.parent.mkdir(parents=True, exist_ok=True)
        source.replace(target)
    shutil.rmtree(tasks)


def remove_unwanted(project_dir, answers):
    for relative_path, (prompt, keep_when) in OPTIONAL_FILES.items():
        path = Path(project_dir) / relative_path
        if answers[prompt] == keep_when:
            continue
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def main():
    answers = json.loads(
        r"""{"task": {{ cookiecutter.task | tojson }}, "slurm": {{ cookiecutter.slurm | tojson }},
        "kubernetes": {{ cookiecutter.kubernetes | tojson }}, "skypilot": {{ cookiecutter.skypilot | tojson }}}"""
    )
    place_task_files(Path.cwd(), answers["task"])
    remove_unwanted(Path.cwd(), answers)


if __name__ == "__main__":
    main()
