"""The conditional benchmark trains with ``iresflow train``'s settings and loop, and scores its
flows with the product's evaluation and classification."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks import cli
from benchmarks.conditional import evaluate_flow, plot_class_samples, train_configs
from iresflow.cli import parse_train_config
from iresflow.data.datasets import load_dataset
from iresflow.runs.classify import class_log_likelihoods
from iresflow.train.factories import load_data
from iresflow.train.fit import fit
from tests.tiny_runs import TINY

RECIPE = ["--data", "japanese_vowels", "--n-blocks", "2", "--hidden", "32", "--ar-order", "1",
          "--device", "cpu", "--seed", "2", "--max-seconds", "150"]


def test_flows_are_the_iresflow_train_command_lines() -> None:
    configs = train_configs(cli.parse(["conditional", "--set", "max_seconds=150"]), seed=2)
    assert configs["unconditional"] == parse_train_config(RECIPE)
    assert configs["conditional"] == parse_train_config(
        [*RECIPE, "--condition", "label", "--context-features", "16"]
    )
    assert train_configs(cli.parse(["conditional", "--quick"]), seed=0)["conditional"].epochs == 2


@pytest.fixture(scope="module")
def tiny_conditional() -> tuple[torch.nn.Module, object]:
    config = TINY.replace(condition="label", model=TINY.model.replace(context_features=4))
    data = load_data(config)
    return fit(config, data).model, data


def test_evaluate_flow_scores_the_true_class_and_applies_bayes_rule(tiny_conditional) -> None:
    model, data = tiny_conditional
    result = evaluate_flow(model, data)
    scores = class_log_likelihoods(model, data.test)  # (B, K): every class, not only the true
    true = scores.gather(1, data.test.labels[:, None]).squeeze(1)
    assert result["test NLL"] == pytest.approx(data.nll(true, data.test), abs=1e-5)
    counts = torch.bincount(data.train.labels, minlength=len(data.classes)).double()
    predicted = (scores + counts.log()).argmax(1)  # prior: the training split's frequencies
    accuracy = float((predicted == data.test.labels).double().mean())
    assert result["generative accuracy"] == pytest.approx(accuracy)
    confusion = torch.tensor(result["confusion"])
    assert confusion.sum() == len(data.test)
    assert confusion.trace() / len(data.test) == pytest.approx(accuracy)


def test_evaluate_flow_without_labels_gives_only_the_nll() -> None:
    config = TINY
    data = load_data(config)
    assert set(evaluate_flow(fit(config, data).model, data)) == {"test NLL"}


def test_class_samples_figure(tiny_conditional, tmp_path: Path) -> None:
    model, _ = tiny_conditional
    path = plot_class_samples(model, load_dataset("japanese_vowels"), tmp_path / "c.png",
                              per_class=1)
    assert path.stat().st_size > 0
