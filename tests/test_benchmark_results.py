"""The results table trains through ``iresflow train``'s loop: the same numbers as the product."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from benchmarks.results import fit_row, score_row
from benchmarks.results_specs import QUICK, SPECS, train_config
from iresflow.train.checkpoint import load_checkpoint
from iresflow.train.factories import build_model, load_data
from iresflow.train.likelihood import split_log_prob
from iresflow.train.loop import train


def test_results_table_and_iresflow_train_agree_on_the_default_model(tmp_path: Path) -> None:
    """Same seed, same budget, float64: the table's test NLL is that of ``iresflow train``."""
    budget = dataclasses.replace(QUICK, max_epochs=2, max_seconds=0.0, patience=2)
    spec, lr, seed = SPECS["iresflow"], 3e-3, 1
    config = train_config(spec, "japanese_vowels", lr, seed, budget,
                          max_train=8, max_eval=4)  # the tiny slice both paths see
    default = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        data = load_data(config)
        model, record = fit_row(spec, None, data, lr, seed, budget)
        table = score_row(model, spec, data, budget)
        run = train(config, tmp_path / "run", progress=False)
        flow = build_model(config, data)
        flow.load_state_dict(load_checkpoint(run.paths.best)["model"])
        log_prob, _ = split_log_prob(flow, data.test, method="exact")
    finally:
        torch.set_default_dtype(default)
    assert next(model.parameters()).dtype == torch.float64
    assert model.config == flow.config  # the default recipe, built from the same settings
    assert record["epochs"] == len(run.history) == 2 and record["best_epoch"] == run.best_epoch
    assert record["val_nll"] == pytest.approx(run.best_val_nll, abs=1e-6)
    assert table["test_nll"] == pytest.approx(data.nll(log_prob, data.test), abs=1e-6)
