"""The long-range benchmark: its references and one tiny trained row."""

from __future__ import annotations

from pathlib import Path

import pytest

from benchmarks.long_range import DEFAULT_RECIPES, references, run_seed, table
from iresflow.train.config import TrainConfig


def test_floor_lies_far_below_the_ar_gaussian() -> None:
    for name in ("repeated_motif", "nonlinear_seasonal"):
        result = references(TrainConfig(data=name, max_train=200, max_eval=100))
        assert result["floor"] < result["ar"] - 2.0, result  # nats/frame


@pytest.mark.slow
def test_one_tiny_seed_prints_a_row_per_model(tmp_path: Path) -> None:
    settings = {"epochs": 1, "max_train": 8, "max_eval": 4, "n_blocks": 1, "hidden": 8,
                "batch_size": 4}
    result = run_seed("repeated_motif", 0, list(DEFAULT_RECIPES), settings, tmp_path)
    attention = result["models"][DEFAULT_RECIPES[1]]
    assert 0 < attention["attention_usage"] <= 1
    assert 0 < attention["attention_use_full_length"] <= 1
    assert result["models"][DEFAULT_RECIPES[0]]["attention_usage"] is None
    text = table("repeated_motif", [result])
    assert text.count("\n| ") == 5  # header rule, floor, AR and two models
