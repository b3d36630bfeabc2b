"""The initial-models benchmark: the product's initial model, validated, against the reference."""

from __future__ import annotations

import pytest
import torch

from benchmarks.initial import initial_models, markdown_table
from benchmarks.small_data import data_settings, load
from iresflow.runs.reference import fit_reference
from iresflow.train.config import TrainConfig
from iresflow.train.factories import build_model
from iresflow.train.fit import seeded_training
from iresflow.train.selection import candidates


def _row(reference: float, **initial: float) -> dict:
    return {"dataset": "d", "seed": 0, "unit": "nats/frame",
            "reference": {"model": "AR(1) Gaussian", "val_nll": reference}, "initial": initial}


def test_the_table_gives_differences_to_the_reference_and_counts_those_above() -> None:
    table = markdown_table([_row(1.0, configured=1.25, recurrent=0.5),
                            _row(-2.0, configured=-2.5, recurrent=-1.0, maf=3.0)])
    lines = table.splitlines()
    assert lines[2] == ("| d | 0 | nats/frame | AR(1) Gaussian 1.0000 | 1.2500 (+0.2500) | "
                        "0.5000 (-0.5000) | — |")
    assert "| 3.0000 (+5.0000) |" in lines[3]
    assert lines[-1] == "Initial models above the reference: 3 of 5."


@pytest.mark.slow
def test_the_record_is_the_run_before_its_first_step_scored_exactly() -> None:
    """Oracle: each candidate built under the run's seed, its data-dependent layers initialised
    on the training sequences, scored on validation by the flow's exact log-density."""
    record = initial_models("co2_windows", 0)
    dataset = load("co2_windows", 0)
    assert record["reference"]["val_nll"] == pytest.approx(
        fit_reference(dataset, "val")["val_nll"], rel=1e-12)
    config = TrainConfig.from_dict({**data_settings("co2_windows"), "seed": 0})
    assert set(record["initial"]) == {name for name, _ in candidates(config, 1)}
    val = dataset.val
    for name, candidate in candidates(config, 1):
        with seeded_training(0, torch.device("cpu")):
            flow = build_model(candidate, dataset)
        train = dataset.train
        flow.initialize(train.x, train.mask)
        flow.eval()
        with torch.no_grad():
            log_prob = flow.log_prob(val.x, val.mask, method="exact")
        assert record["initial"][name] == pytest.approx(dataset.nll(log_prob, val), abs=1e-4)
