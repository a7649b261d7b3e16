"""`pip install .` installs every module at the top of the project: pyproject.toml says the
rest. setuptools finds packages by itself, but not several top-level modules."""

from pathlib import Path

from setuptools import setup

setup(py_modules=sorted(path.stem for path in Path(__file__).parent.glob("*.py") if path.stem != "setup"))
