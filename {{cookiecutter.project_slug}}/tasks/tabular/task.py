"""Yours: the task, the one object every entry point (train.py, doctor.py, preflight.py,
export.py) hands to the machinery, which never imports your files itself. Only config,
build_model and build_datasets are required; ddp_utils/contract.py's docstring lists every
other hook and its default. A name that is not a hook is an error naming the nearest one.
"""

import dataset
import model
from config import Config
from ddp_utils.contract import Task

TASK = Task(
    config=Config,
    build_model=model.build_model,
    build_datasets=dataset.build_datasets,
    loss_fn=model.loss_fn,
    evaluation_sums=model.evaluation_sums,
    evaluation_metrics=model.evaluation_metrics,
    shape_fields=model.SHAPE_FIELDS,
)
