"""Template tests: bake the template with pytest-cookies and check what users get."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

TEMPLATE = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def run(command, cwd, timeout=900, env_override=None):
    """Run a command with this environment's tools (cookiecutter, ruff, python) first on PATH."""
    env = dict(os.environ if env_override is None else env_override)
    env.update(OMP_NUM_THREADS="1", PATH=f"{BIN}{os.pathsep}{env.get('PATH', '')}")
    return subprocess.run(command, check=False, cwd=cwd, env=env, capture_output=True, text=True, timeout=timeout)


def bake_ok(cookies, **answers):
    result = cookies.bake(extra_context=answers)
    assert result.exit_code == 0, result.exception
    assert result.exception is None
    return result.project_path


@pytest.fixture(scope="session")
def default_project(cookies_session):
    return bake_ok(cookies_session)


def project_files(project):
    return sorted(p for p in project.rglob("*") if p.is_file() and "__pycache__" not in p.parts)
