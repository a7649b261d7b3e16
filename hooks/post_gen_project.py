"""Remove the optional files the answers did not ask for.

Only removals listed in OPTIONAL_FILES, each tolerant of an already missing file: cruft
re-runs this hook on every update, and running it twice must change nothing.
"""

import json
from pathlib import Path

# file in the generated project -> (prompt, the answer that keeps it)
OPTIONAL_FILES = {
    "scripts/slurm.sbatch": ("slurm", "yes"),
}


def remove_unwanted(project_dir, answers):
    for relative_path, (prompt, keep_when) in OPTIONAL_FILES.items():
        if answers[prompt] != keep_when:
            (Path(project_dir) / relative_path).unlink(missing_ok=True)


def main():
    answers = json.loads(r"""{"slurm": {{ cookiecutter.slurm | tojson }}}""")
    remove_unwanted(Path.cwd(), answers)


if __name__ == "__main__":
    main()
