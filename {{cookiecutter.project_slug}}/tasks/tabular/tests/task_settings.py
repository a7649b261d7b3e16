"""This project's data, for the shared tests (the model's tiny sizes: experiments/tiny.toml; the
rest the tests read from model.py and dataset.py). With your own data, set these for it."""

import csv
import math

import numpy as np

# Randomness inside the data pipeline, for the seeding tests: training inputs get noise.
AUGMENT = ["--input_noise_std", "0.3"]
# The validation loss of a uniform guess: training must end below it.
CHANCE_LOSS = math.log(3)  # 3 classes (write_table)

# The network tests' model (tests/cluster/test_network.py): 0.41M parameters, 1.7 MB of fp32 gradients a
# step, which a 20 Mbit/s link needs ~0.7 s to all-reduce; a batch large enough for the
# compute (not the loop's own overhead) to set the step time at full link speed.
NETWORK_ARGS = ["--hidden_dim", "640", "--batch_size", "1024", "--train_samples", "32768"]


def prepare_data(folder):
    """Every shared test trains on a CSV file, as a user's run does (write_table)."""
    path = folder / "table.csv"
    write_table(path, rows=40000)
    return ["--data_file", str(path), "--target", "grade", "--ignore_columns", "score"]


COLUMNS = ["income", "ratio", "temperature", "noise"]


def table(rows, seed=0):
    """(features [rows, 4], grade labels, score) of a made-up table: features on wildly different
    scales and offsets (income ~5000 +- 1000, ratio ~0 +- 0.001), a text label, "low", "mid" or
    "high", set mostly by the smallest-scale feature (only standardised features let a model see
    it), and a numeric column `score`, the same rule as a number (for regression)."""
    generator = np.random.default_rng(seed)
    raw = generator.normal(size=(rows, len(COLUMNS)))
    score = raw[:, 1] + 0.5 * raw[:, 0] - 0.3 * raw[:, 2]
    grade = np.where(score > 0.5, "high", np.where(score < -0.5, "low", "mid"))
    features = raw * np.array([1000.0, 0.001, 50.0, 1.0]) + np.array([5000.0, 0.0, -200.0, 3.0])
    return features, grade, score


def write_table(path, rows, seed=0, label=True):
    """The table as a CSV file: COLUMNS, then grade and score (without them: label=False)."""
    features, grade, score = table(rows, seed)
    with open(path, "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow([*COLUMNS, "grade", "score"] if label else COLUMNS)
        for values, text, number in zip(features.tolist(), grade, score.tolist()):
            writer.writerow([*values, text, number] if label else values)
    return path
