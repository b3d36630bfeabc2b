"""Conditional runs through the ``iresflow`` command: ``--condition``, ``evaluate --classify``,
``sample --label`` / ``--covariates``, resume."""

from __future__ import annotations

import csv
import json
import math
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from iresflow.cli import main
from iresflow.runs.load import load_run
from iresflow.train.checkpoint import load_checkpoint
from iresflow.train.config import TrainConfig

#: A label-conditional JapaneseVowels run: one block of width 8, 40 training sequences.
LABEL_RUN = [
    "--condition", "label", "--max-train", "40", "--max-eval", "20", "--epochs", "1",
    "--n-blocks", "1", "--hidden", "8", "--batch-size", "20", "--eval-method", "exact",
    "--device", "cpu", "--quiet",
]
#: Enough optimisation for a tiny flow to learn where two well-separated groups lie.
SYNTHETIC_RUN = [
    "--epochs", "4", "--n-blocks", "1", "--hidden", "8", "--batch-size", "20", "--lr", "0.03",
    "--warmup", "0", "--eval-method", "exact", "--device", "cpu", "--quiet",
]


def _two_groups(path: Path, key: str) -> Path:
    """300 sequences around +2 or -2, the group given as labels ``y`` or covariates ``c``."""
    rng = np.random.default_rng(0)
    group = rng.integers(0, 2, 300)
    x = np.where(group[:, None, None] == 1, 2.0, -2.0) + 0.3 * rng.standard_normal((300, 6, 2))
    context = group if key == "y" else (2.0 * group - 1.0)[:, None]
    np.savez(path, x=x, **{key: context})
    return path


@pytest.fixture(scope="module")
def label_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("label") / "run"
    assert main(["train", "--out", str(out), *LABEL_RUN]) == 0
    return out


@pytest.fixture(scope="module")
def covariate_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("covariates")
    data = _two_groups(folder / "groups.npz", "c")
    out = folder / "run"
    assert main(["train", "--data", str(data), "--condition", "covariates", "--out", str(out),
                 *SYNTHETIC_RUN]) == 0
    return out


def _error_line(capsys: pytest.CaptureFixture[str]) -> str:
    err = capsys.readouterr().err.strip()
    lines = err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("iresflow: error: "), err
    return lines[0]


def test_a_label_run_stores_its_condition_and_shows_it(
    label_run: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert TrainConfig.from_toml(label_run / "config.toml").condition == "label"
    assert load_run(label_run).model_config.num_classes == 9
    assert (label_run / "plots" / "samples.png").is_file()
    capsys.readouterr()
    assert main(["info", str(label_run)]) == 0
    assert "condition: label (9 classes: 1, 2, 3, 4, 5, 6, 7, 8, 9;" in capsys.readouterr().out


def test_classify_reports_accuracy_and_writes_per_class_scores(
    label_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    scores = tmp_path / "s.csv"
    assert main(["evaluate", str(label_run), "--classify", "--scores", str(scores)]) == 0
    printed = capsys.readouterr().out
    assert "accuracy (Bayes' rule" in printed
    assert "true/predicted    1    2    3    4    5    6    7    8    9" in printed
    with scores.open(newline="") as file:
        rows = list(csv.DictReader(file))
    classes = [str(k) for k in range(1, 10)]
    class_columns = [f"log_prob_{name}" for name in classes]
    assert list(rows[0]) == ["index", "length", "log_prob", "nll", "label", "predicted",
                             *class_columns]
    assert len(rows) == 20 and [int(row["index"]) for row in rows] == list(range(20))
    evaluation = json.loads((label_run / "evaluation.json").read_text())["test"]
    classification = evaluation["classification"]
    assert classification["method"] == "exact" and classification["classes"] == classes
    log_prior = np.log(np.array(classification["prior"]))
    table = np.array([[float(row[c]) for c in class_columns] for row in rows])
    predicted = [classes[k] for k in (table + log_prior).argmax(axis=1)]
    assert predicted == [row["predicted"] for row in rows]
    correct = [row["predicted"] == row["label"] for row in rows]
    assert classification["accuracy"] == pytest.approx(np.mean(correct))
    confusion = np.array(classification["confusion"])
    assert confusion.sum() == 20 and confusion.trace() == sum(correct)
    for row in rows:  # the true class's column is the sequence's log-likelihood
        assert float(row[f"log_prob_{row['label']}"]) == pytest.approx(float(row["log_prob"]))
    frames = np.array([int(row["length"]) for row in rows])
    nll = np.array([float(row["nll"]) for row in rows])
    assert (nll * frames).sum() / frames.sum() == pytest.approx(evaluation["exact"]["nll"])


def test_sample_draws_the_chosen_class(
    label_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "three.npz"
    assert main(["sample", str(label_run), "--label", "3", "--num", "4", "--out", str(out)]) == 0
    samples = np.load(out)
    assert str(samples["label"]) == "3" and samples["labels"].tolist() == [2] * 4
    assert samples["x"].shape[0] == 4
    capsys.readouterr()
    assert main(["sample", str(label_run), "--label", "12", "--out", str(out)]) == 1
    assert "label must be one of 1, 2, 3, 4, 5, 6, 7, 8, 9, got '12'" in _error_line(capsys)
    assert main(["sample", str(label_run), "--out", str(out)]) == 1
    assert "conditioned on class labels: sample it with label (--label;" in _error_line(capsys)
    assert main(["sample", str(label_run), "--covariates", "1", "--out", str(out)]) == 1
    assert "with label (--label; one of the classes 1, 2" in _error_line(capsys)


def test_a_conditional_run_resumes_with_its_condition(
    label_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run = tmp_path / "run"
    shutil.copytree(label_run, run)
    assert main(["train", "--out", str(run), "--resume", "--epochs", "2", "--quiet"]) == 0
    state = load_checkpoint(run / "checkpoints" / "last.pt")
    assert state["epoch"] == 2 and state["config"]["condition"] == "label"
    capsys.readouterr()
    assert main(["train", "--out", str(run), "--resume", "--epochs", "3",
                 "--condition", "none", "--quiet"]) == 1
    assert "condition" in _error_line(capsys)


def test_a_covariate_run_samples_at_the_given_covariates(
    covariate_run: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # trained with its covariates, the flow puts the two groups where their covariate says
    means = {}
    for value in ("1", "-1"):
        out = tmp_path / f"samples{value}.npz"
        assert main(["sample", str(covariate_run), f"--covariates={value}", "--num", "8",
                     "--out", str(out)]) == 0
        samples = np.load(out)
        assert samples["covariates"].tolist() == [float(value)]
        means[value] = samples["x"][samples["mask"]].mean()
    assert means["1"] > 1.0 and means["-1"] < -1.0
    capsys.readouterr()
    assert main(["info", str(covariate_run)]) == 0
    assert "condition: covariates (1 per sequence)" in capsys.readouterr().out
    out = str(tmp_path / "s.npz")
    assert main(["sample", str(covariate_run), "--covariates", "1,2", "--out", out]) == 1
    assert "covariates must have 1 values for this run, got 2" in _error_line(capsys)
    assert main(["sample", str(covariate_run), "--out", out]) == 1
    assert "sample it with covariates (--covariates; 1 values)" in _error_line(capsys)
    assert main(["sample", str(covariate_run), "--label", "1", "--out", out]) == 1
    assert "not label (--label)" in _error_line(capsys)
    assert main(["evaluate", str(covariate_run), "--classify"]) == 1
    assert "classify needs a run trained with condition = label (--condition label)" in (
        _error_line(capsys)
    )


def test_condition_errors_are_one_line_messages(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "run")
    assert main(["train", "--num-classes", "3", "--out", out, *LABEL_RUN[2:]]) == 1
    assert "num_classes = 3 makes a conditional model" in _error_line(capsys)
    assert main(["train", "--data", "co2_windows", "--out", out, *LABEL_RUN]) == 1
    assert "class labels" in _error_line(capsys)
    assert main(["train", "--condition", "labels", "--out", out]) == 2
    assert "invalid choice: 'labels'" in _error_line(capsys)
    assert main(["train", "--num-classes", "5", "--out", out, *LABEL_RUN]) == 1
    assert "num_classes = 5 does not match the 9 classes of japanese_vowels" in (
        _error_line(capsys)
    )


def test_a_label_run_learns_to_classify(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = _two_groups(tmp_path / "groups.npz", "y")
    run = tmp_path / "run"
    assert main(["train", "--data", str(data), "--condition", "label", "--out", str(run),
                 *SYNTHETIC_RUN]) == 0
    assert main(["evaluate", str(run), "--classify", "--method", "roulette"]) == 0
    classification = json.loads((run / "evaluation.json").read_text())["test"]["classification"]
    assert classification["method"] == "roulette" and classification["accuracy"] >= 0.95
    assert math.isclose(sum(classification["prior"]), 1.0)
    assert torch.tensor(classification["confusion"]).sum() == 30
