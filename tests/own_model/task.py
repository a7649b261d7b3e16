"""The task of the model a user drops in (tests/own_model/model.py, in a tabular project): what
task.py hands over when model.py has its own build_model and shapes, and no loss or metrics of
its own (the defaults: cross-entropy and accuracy over the table's classes)."""

import dataset
import model
from config import Config
from ddp_utils.contract import Task

TASK = Task(
    config=Config,
    build_model=model.build_model,
    build_datasets=dataset.build_datasets,
    shape_fields=model.SHAPE_FIELDS,
)
