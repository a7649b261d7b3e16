"""Yours to run: predict the target of each row of a table with a trained checkpoint, in one process.

    python predict.py --checkpoint runs/default/checkpoints/last.pt --data_file rows.csv

Prints one prediction per row, in order: a class label and its probability, or a number
(regression). The rows need the feature columns the model was trained on, by name (other
columns, the target among them, are ignored); they are standardised with the training rows'
statistics, which the checkpoint holds (Table.data_state in ddp_utils/data/tables.py).
"""

import argparse
import sys

import torch

from ddp_utils.data.tables import read_table, standardise
from ddp_utils.errors import InputError
from ddp_utils.inference import load_trained
from ddp_utils.knobs import exit_with_error
from model import build_model


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--checkpoint", required=True, help="a checkpoint written by train.py (or export.py)")
    parser.add_argument("--data_file", required=True, help="a CSV or Parquet table of rows to predict")
    args = parser.parse_args(argv)

    model, _, state = load_trained(args.checkpoint, build_model, torch.device("cpu"))
    data = state.get("data")
    if not data:
        exit_with_error(f"--checkpoint {args.checkpoint} was not trained on a table (--data_file): no columns to read")
    try:
        table = read_table(args.data_file, "data_file")
        inputs = standardise(table.features(data["features"], "features must be numbers"), data)
    except InputError as error:
        exit_with_error(str(error))

    with torch.no_grad():
        outputs = model(inputs).float()
    if data["target_kind"] == "regression":
        for value in outputs[:, 0] * data["target_std"] + data["target_mean"]:
            print(f"{value.item():.6g}")
    else:
        probabilities, labels = outputs.softmax(dim=-1).max(dim=-1)
        for probability, label in zip(probabilities.tolist(), labels.tolist()):
            print(f"{data['classes'][label]}\t{probability:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
