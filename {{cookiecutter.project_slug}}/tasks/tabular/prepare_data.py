"""Yours to run: write a demo table: real data that needs no download.

    python prepare_data.py [--output data/breast_cancer.csv]

scikit-learn ships the Wisconsin breast cancer table inside the package: 569 rows, 30 numeric
features on very different scales (areas in the hundreds, smoothness around 0.1) and a text
label, `diagnosis` (benign or malignant). It is written as a CSV file, the layout train.py's
--data_file reads; a few rows without the label go beside it, for predict.py. To train on your
own table, pass it instead; this script is not needed then.
"""

import argparse
import csv
import sys
from pathlib import Path

from ddp_utils.core.files import write_atomically


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", default="data/breast_cancer.csv", help="the CSV file to write")
    args = parser.parse_args(argv)
    try:
        from sklearn.datasets import load_breast_cancer  # only here: training never needs scikit-learn
    except ImportError:
        print("prepare_data.py needs scikit-learn for the demo table: pip install scikit-learn", file=sys.stderr)
        return 2

    data = load_breast_cancer()
    header = [*data.feature_names, "diagnosis"]
    rows = [[*map(float, features), data.target_names[label]] for features, label in zip(data.data, data.target)]
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    write_csv(output, header, rows)
    unlabelled = output.with_name(f"{output.stem}_rows.csv")
    write_csv(unlabelled, header[:-1], [row[:-1] for row in rows[:5]])  # the first rows, for predict.py
    print(f"wrote {len(rows)} rows of {len(header) - 1} features to {output}, and 5 rows without a label to "
          f"{unlabelled}; train with: torchrun --standalone --nproc_per_node=2 train.py --data_file {output} "
          "--target diagnosis")  # fmt: skip
    return 0


def write_csv(path, header, rows):
    def write(f):
        writer = csv.writer(f)
        writer.writerow(header)
        writer.writerows(rows)

    write_atomically(path, write, "w", newline="")


if __name__ == "__main__":
    sys.exit(main())
