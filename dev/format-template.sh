#!/usr/bin/env bash
# Apply ruff's formatting and fixes to the template's Python files: render each task with the
# defaults, run ruff on the result, copy back every file whose template source holds no Jinja
# (a shared file, or the task's own under tasks/<task>/).
# Arguments (paths inside the generated project, e.g. train.py) limit it to those files.
set -euo pipefail
cd "$(dirname "$0")/.."
bash dev/setup.sh
out=$(mktemp -d)
trap 'rm -rf "$out"' EXIT
template='{{cookiecutter.project_slug}}'
for task in language vision tabular; do
    .venv/bin/cookiecutter --no-input . --output-dir "$out/$task" task="$task" >/dev/null
    project=$(find "$out/$task" -mindepth 1 -maxdepth 1 -type d)
    .venv/bin/ruff check --fix --quiet "$project" || true
    .venv/bin/ruff format --quiet "$project"
    if (( $# )); then printf './%s\n' "$@"; else (cd "$project" && find . -name '*.py' -not -path '*/__pycache__/*'); fi |
    while read -r file; do
        source_file="$template/${file#./}"
        [[ -f $source_file ]] || source_file="$template/tasks/$task/${file#./}"
        if [[ -f $source_file ]] && ! grep -qE '\{\{|\{%' "$source_file"; then
            cmp -s "$project/$file" "$source_file" || { cp "$project/$file" "$source_file"; echo "formatted $source_file"; }
        fi
    done
done
.venv/bin/ruff check --fix --quiet tests hooks local_extensions.py dev || true
.venv/bin/ruff format --quiet tests hooks local_extensions.py dev
