"""Jinja extension that validates the answers while cookiecutter renders them.

cookiecutter creates the project folder before the pre-gen hook runs, and a bad slug
(empty, or holding "/") leaves folders behind when the hook fails. Rendering the private
``__answers_checked`` variable runs the same validation as hooks/pre_gen_project.py before
anything is written.
"""

import importlib.util
import sys
from pathlib import Path

from jinja2.ext import Extension

_spec = importlib.util.spec_from_file_location(
    "pre_gen_project", Path(__file__).parent / "hooks" / "pre_gen_project.py"
)
pre_gen_project = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pre_gen_project)


def check_answers(answers):
    error = pre_gen_project.first_error(dict(answers))
    if error:
        print(f"error: {error}", file=sys.stderr)
        raise SystemExit(1)
    return "ok"


class AnswerCheck(Extension):
    def __init__(self, environment):
        super().__init__(environment)
        environment.filters["check_answers"] = check_answers
