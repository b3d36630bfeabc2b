"""Helpers of the small-and-medium data suite (benchmarks/small_data.py)."""

from __future__ import annotations

import importlib.util
import json
import math
import shlex
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from benchmarks import cli, small_data
from benchmarks.held_out import (
    HELD_OUT,
    aeon_file,
    read_tsf_series,
    table_settings,
    train_command,
)
from benchmarks.records import merge_records
from benchmarks.small_data import (
    ARCHIVE,
    KEY,
    MIN_MATCHED_BUDGET,
    archive_files,
    load,
    markdown_table,
    run_dataset,
    run_references,
    sequence_gaussian_applies,
)
from iresflow.cli import parse_train_config
from iresflow.data.datasets import load_dataset
from iresflow.train.config import TrainConfig

HAS_AEON = importlib.util.find_spec("aeon") is not None
HAS_HELD_OUT = all(importlib.util.find_spec(m) is not None
                   for m in ("aeon", "statsmodels", "pandas"))
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


def test_table_has_a_transformer_column_where_a_record_has_one() -> None:
    records = [_record("a", 0, 1.0, 2.0, 3.0)]
    assert "Transformer" not in markdown_table(records).splitlines()[0]
    records[0]["transformer_maf"] = {"test_nll": 0.5, "stopped": "time"}
    lines = markdown_table(records).splitlines()
    header = [cell.strip() for cell in lines[0].split("|")[1:-1]]
    row = [cell.strip() for cell in lines[2].split("|")[1:-1]]
    assert header[8:10] == ["GRU + MAF", "Transformer + MAF"] and len(row) == len(header)
    assert row[8] == "3.000" and row[9] == "**0.500** †"


def test_budget_is_seconds_or_the_flows_wall_time() -> None:
    assert cli.parse(["small_data", "--budget", "flow"]).budget == "flow"
    assert cli.parse(["small_data", "--budget", "12"]).budget == 12.0
    for bad in ("-1", "soon", "nan"):
        with pytest.raises(SystemExit):
            cli.parse(["small_data", "--budget", bad])
    args = cli.parse(["small_data", "--datasets", "elnino", "--peers", "gru", "transformer"])
    assert args.datasets == ["elnino"] and args.peers == ["gru", "transformer"]
    assert cli.parse(["small_data"]).datasets == list(small_data.DATASETS)


@pytest.mark.parametrize(("flow_seconds", "budget"), [(75.0, 75.0), (10.0, MIN_MATCHED_BUDGET)])
def test_peers_matched_to_the_flow_get_its_wall_time(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, flow_seconds: float, budget: float
) -> None:
    ds = load_dataset(str(_npz(tmp_path, 60, 4)), seed=0)
    calls: list[tuple[str, float]] = []
    monkeypatch.setattr(small_data, "load", lambda name, seed: ds)
    monkeypatch.setattr(small_data, "run_flow",
                        lambda *args: {"test_nll": 0.0, "seconds": flow_seconds})
    monkeypatch.setattr(small_data, "run_peer", lambda name, ds, seed, seconds, encoder: (
        calls.append((encoder, seconds)) or {"test_nll": 1.0}))
    record = run_dataset("a", 0, "flow", None, tmp_path, peers=("gru", "transformer"))
    assert calls == [("gru", budget), ("transformer", budget)]
    assert record["gru_maf"] == record["transformer_maf"] == {"test_nll": 1.0}
    calls.clear()
    assert "gru_maf" not in run_dataset("a", 0, 0.0, None, tmp_path) and not calls


def test_tsf_series_are_read_after_the_data_line(tmp_path: Path) -> None:
    path = tmp_path / "toy.tsf"
    path.write_text("# a comment\n@attribute series_name string\n@data\n"
                    "T1:1979-01-01 00-00-00:1,2.5,4\nT2:1980-01-01 00-00-00:7,8\n")
    series = read_tsf_series(path)
    assert [s.tolist() for s in series] == [[1.0, 2.5, 4.0], [7.0, 8.0]]
    with pytest.raises(ValueError, match="uschange"):
        table_settings("nope", tmp_path)


@pytest.mark.skipif(not HAS_HELD_OUT, reason="the held-out datasets need aeon and statsmodels")
def test_held_out_datasets_are_read_from_their_tables(tmp_path: Path) -> None:
    shapes = {"uschange": (5, 12), "m1_yearly": (1, 57), "daphnet": (9, 200),
              "bleeding": (1, 200), "elnino": (1, 12), "fertility": (1, 52)}
    assert tuple(shapes) == HELD_OUT
    for name, shape in shapes.items():
        ds = load(name, seed=0)
        assert (ds.features, ds.max_len) == shape, name
        assert torch.isfinite(ds.test.x).all() and len(ds.test) >= 4
    ragged = load("m1_yearly", seed=0).train.mask.sum(1)
    assert int(ragged.min()) < int(ragged.max())  # variable length
    settings = table_settings("m1_yearly", tmp_path)  # log growth of the competition's series
    first = read_tsf_series(aeon_file("m1_yearly_dataset", "m1_yearly_dataset.tsf"))[0]
    table = np.genfromtxt(settings["data"], delimiter=",", names=True)
    np.testing.assert_allclose(table["growth"][table["series"] == 0], np.diff(np.log(first)))


@pytest.mark.skipif(not HAS_HELD_OUT, reason="the held-out datasets need aeon and statsmodels")
def test_held_out_command_writes_the_files_a_printed_command_trains_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert cli.main(["held_out", "--out", str(tmp_path), "--datasets", "fertility",
                     "uschange"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(":")[0] for line in lines] == ["fertility", "uschange"]
    for name, line in zip(("fertility", "uschange"), lines, strict=True):
        words = shlex.split(line.split(": ", 1)[1])
        assert words[:2] == ["iresflow", "train"]
        settings = table_settings(name, tmp_path)
        assert train_command(settings) == shlex.join(words)
        assert parse_train_config(words[2:]) == TrainConfig.from_dict(settings)


def test_an_ablation_table_names_its_settings_and_goes_into_its_block(tmp_path: Path) -> None:
    records = [_record("a", 0, 1.0, 2.0, 3.0), _record("a", 1, 1.5, 2.0, 3.0)]
    for r in records:
        r["flow"]["settings"] = {"layers": ["autoregressive", "mlp"]}
    records[0]["flow"]["settings"]["epochs"] = 5  # not shared: not in the label
    header = markdown_table(records).splitlines()[0].split("|")[6].strip()
    assert header == "iresflow, layers = autoregressive,mlp"
    records[1]["flow"]["settings"] = {}
    assert markdown_table(records).splitlines()[0].split("|")[6].strip() == "iresflow default"
    stored, page = tmp_path / "records.json", tmp_path / "page.md"
    stored.write_text(json.dumps({"records": records}))
    page.write_text("# p\n<!-- other:start -->\n<!-- other:end -->\n")
    assert cli.main(["small_data", "--table-from", str(stored), "--doc", str(page),
                     "--block", "other"]) == 0
    assert "| a | 8/1/5 |" in page.read_text()


def test_the_flow_record_gives_every_candidate_of_the_default(tmp_path: Path) -> None:
    settings = {"n_blocks": 1, "hidden": 8, "max_train": 12, "max_eval": 6, "batch_size": 6,
                "epochs": 1, "min_steps": 1, "device": "cpu"}
    record = small_data.run_flow("japanese_vowels", 0, tmp_path / "run", settings)
    names = [candidate["name"] for candidate in record["candidates"]]
    assert names == ["configured", "recurrent", "maf"] and record["kept"] in names  # D = 12
    kept = next(c for c in record["candidates"] if c["name"] == record["kept"])
    assert kept["test_nll"] == record["test_nll"]
    assert kept["best_val_nll"] == min(c["best_val_nll"] for c in record["candidates"])
    for other in record["candidates"]:
        if other["name"] != record["kept"]:
            assert math.isfinite(other["test_nll"]) and other["test_nll"] != kept["test_nll"]
    rows = [_record("a", seed, 1.0, 2.0, None) for seed in (0, 1)]
    rows[0]["flow"]["kept"], rows[1]["flow"]["kept"] = "recurrent", "configured"
    assert "**1.000 ± 0.000** (r/c)" in markdown_table(rows)
    alone = small_data.run_flow("japanese_vowels", 0, tmp_path / "alone",
                                {**settings, "alternative": "none"})
    assert "kept" not in alone and "candidates" not in alone


def test_the_candidates_table_says_when_validation_kept_the_best() -> None:
    rows = [_record("a", seed, kept, 2.0, None) for seed, kept in ((0, 1.0), (1, 0.5))]
    for row, (kept, configured, recurrent) in zip(
            rows, (("configured", 1.0, 1.5), ("configured", 0.5, 0.25)), strict=True):
        row["flow"].update(kept=kept, candidates=[
            {"name": "configured", "test_nll": configured},
            {"name": "recurrent", "test_nll": recurrent}])
    three = _record("c", 0, 0.5, 2.0, None)  # a dataset with a third candidate, kept
    three["flow"].update(kept="maf", candidates=[
        {"name": "configured", "test_nll": 1.0}, {"name": "recurrent", "test_nll": 2.0},
        {"name": "maf", "test_nll": 0.5}])
    lines = small_data.candidates_table(
        [*rows, _record("b", 0, 1.0, 2.0, None), three]).splitlines()
    assert len(lines) == 4  # the run of one model has no row
    assert [cell.strip() for cell in lines[0].split("|")[1:-1]][1:4] == [
        "configured", "recurrent", "maf"]
    cells = [cell.strip() for cell in lines[2].split("|")[1:-1]]
    assert cells == ["a", "0.750 ± 0.354", "0.875 ± 0.884", "—", "c/c", "0.750 ± 0.354",
                     "0.625 ± 0.530", "1 of 2"]
    cells = [cell.strip() for cell in lines[3].split("|")[1:-1]]
    assert cells == ["c", "1.000", "2.000", "0.500", "m", "0.500", "0.500", "1 of 1"]
