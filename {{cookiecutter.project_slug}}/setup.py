"""`pip install .` installs the scripts at the top of the project (train.py, config.py, model.py,
...) and the ddp_utils package; pyproject.toml says the rest. setuptools finds packages by
itself, but not several top-level modules."""

from pathlib import Path

from setuptools import find_packages, setup

setup(
    py_modules=sorted(path.stem for path in Path(__file__).parent.glob("*.py") if path.stem != "setup"),
    packages=find_packages(include=["ddp_utils", "ddp_utils.*"]),
)
