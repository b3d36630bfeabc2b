"""Helpers of the small-and-medium data suite (benchmarks/small_data.py)."""

from __future__ import annotations

import importlib.util
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks import cli
from benchmarks.records import merge_records
from benchmarks.small_data import (
    ARCHIVE,
    KEY,
    archive_files,
    load,
    markdown_table,
    run_references,
    sequence_gaussian_applies,
)
from iresflow.data.datasets import load_dataset

HAS_AEON = importlib.util.find_spec("aeon") is not None
pytestmark = pytest.mark.filterwarnings("ignore:.*fewer than 30:UserWarning")


def _npz(tmp_path: Path, batch: int, length: int, lengths: list[int] | None = None) -> Path:
    x = np.random.default_rng(0).standard_normal((batch, length, 1)).cumsum(1)
    path = tmp_path / f"d{batch}x{length}.npz"
    if lengths is None:
        np.savez(path, x=x)
    else:
        np.savez(path, x=x, lengths=np.array(lengths))
    return path


def _record(name: str, seed: int, flow: float, ar: float, gru: float | None,
            far: int = 0) -> dict[str, Any]:
    summary = {"median": 1.0, "worst": 2.5 + seed, "far_above": far}
    record: dict[str, Any] = {
        "dataset": name, "seed": seed, "features": 2, "max_len": 10, "sizes": [8, 1, 5],
        "unit": "nats/frame", "variable_length": False,
        "flow": {"test_nll": flow, "sequences": summary},
        "ar": {"test_nll": ar, "order": 1, "sequences": {**summary, "far_above": 0}},
        "sequence_gaussian": {"skipped": "variable length"}}
    if gru is not None:
        record["gru_maf"] = {"test_nll": gru}
    return record


def test_table_averages_seeds_and_bolds_the_best() -> None:
    records = [_record("a", 0, 1.0, 2.0, 3.0, far=1), _record("a", 1, 3.0, 2.0, 3.0, far=2),
               _record("b", 0, 1234.5, -0.5, None)]
    lines = markdown_table(records).splitlines()
    assert len(lines) == 4 and lines[0].count("|") == lines[2].count("|")
    row_a = [cell.strip() for cell in lines[2].split("|")[1:-1]]
    assert row_a[:5] == ["a", "8/1/5", "2", "10", "nats/frame"]
    assert row_a[5] == "**2.000 ± 1.414**" and row_a[6] == "**2.000 ± 0.000** (1/1)"  # tie
    assert row_a[7] == "—" and row_a[8] == "3.000 ± 0.000"
    assert row_a[9] == "1.00 / 3.50 / 3"  # mean median, worst of all seeds, far summed
    row_b = [cell.strip() for cell in lines[3].split("|")[1:-1]]
    assert row_b[5] == "1234.5" and row_b[6] == "**-0.500** (1)" and row_b[8] == "—"


def test_flow_only_and_baseline_only_runs_merge_by_dataset_and_seed() -> None:
    flow_only = [_record("a", 0, 1.0, 2.0, None), _record("a", 1, 1.5, 2.0, None)]
    baseline = [_record("a", 1, 9.0, 2.0, 3.0), _record("b", 0, 9.0, 2.0, 4.0)]
    for r in baseline:
        r["gru_maf"]["stopped"] = "time"
    baseline[0]["gru_maf"]["stopped"] = "patience"
    merged = merge_records([flow_only, baseline], KEY)
    assert [(r["dataset"], r["seed"]) for r in merged] == [("a", 0), ("a", 1), ("b", 0)]
    assert [r["flow"]["test_nll"] for r in merged] == [1.0, 1.5, 9.0]  # the first file wins
    assert "gru_maf" not in merged[0] and merged[1]["gru_maf"]["test_nll"] == 3.0
    rows = markdown_table(merged).splitlines()[2:]
    assert rows[0].split("|")[9].strip() == "3.000"  # a's GRU + MAF stopped by patience
    assert rows[1].split("|")[9].strip() == "4.000 †"  # b's reached its time budget
    del merged[2]["flow"]  # a baseline-only record leaves the flow columns empty
    assert markdown_table(merged[2:]).splitlines()[2].split("|")[6].strip() == "—"


def test_set_gives_the_flow_settings_of_an_ablation() -> None:
    args = cli.parse(["small_data", "--set", "position_norm=off", "ar_order=12", "--epochs", "5"])
    assert cli.settings(args) == {"epochs": 5, "position_norm": "off", "ar_order": 12}
    assert cli.settings(cli.parse(["small_data"])) == {}
    with pytest.raises(SystemExit):
        cli.parse(["small_data", "--set", "position_norm"])


def test_sequence_gaussian_needs_fixed_length_and_enough_sequences(tmp_path: Path) -> None:
    many = load_dataset(str(_npz(tmp_path, 60, 4)), seed=0)
    assert sequence_gaussian_applies(many) is None
    few = load_dataset(str(_npz(tmp_path, 20, 30)), seed=0)
    assert "N D = 30" in str(sequence_gaussian_applies(few))
    ragged = load_dataset(str(_npz(tmp_path, 60, 4, [4, 2] * 30)), seed=0)
    assert sequence_gaussian_applies(ragged) == "variable length"


def test_references_score_the_test_split(tmp_path: Path) -> None:
    ds = load_dataset(str(_npz(tmp_path, 60, 4)), seed=0)
    record = run_references(ds)
    ar = record["ar"]
    assert 0 <= ar["order"] <= 3 and len(ar["order_val_nll"]) == 4
    assert ar["sequences"]["sequences"] == len(ds.test)
    # a random walk: the AR(p) Gaussian beats the frame Gaussian (p = 0) on validation
    assert ar["order_val_nll"][1] < ar["order_val_nll"][0]
    assert np.isfinite(record["sequence_gaussian"]["test_nll"])


def test_archive_files_reject_unknown_names() -> None:
    with pytest.raises(ValueError, match="BasicMotions"):
        archive_files("NotADataset")


@pytest.mark.skipif(not HAS_AEON, reason="the archive datasets ship with aeon")
def test_archive_datasets_load_with_their_official_splits() -> None:
    train_path, test_path = archive_files("BasicMotions")
    assert train_path.name == "BasicMotions_TRAIN.ts" and test_path.is_file()
    ds = load("BasicMotions", seed=0)
    assert (len(ds.train) + len(ds.val), len(ds.test)) == (40, 40)
    assert (ds.features, ds.max_len) == (6, 100)
    assert all(archive_files(name)[0].is_file() for name in ARCHIVE)
    assert torch.isfinite(ds.test.x).all()
