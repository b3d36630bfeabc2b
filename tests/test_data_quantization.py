"""Quantised features of user data: the grid's step, the dequantisation and the loader's setting."""

from __future__ import annotations

import math
import subprocess
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from test_data import write_ts
from test_data_tables import write_csv
from tiny_runs import forget_setting

from iresflow.cli import main
from iresflow.data.datasets import load_dataset
from iresflow.data.quantization import (
    MAX_LEVEL_FRACTION,
    dequantize_features,
    grid_step,
    repeats,
)
from iresflow.runs.load import load_run
from iresflow.train.config import TrainConfig
from iresflow.train.factories import load_data

# --- the grid ----------------------------------------------------------------------------------


def test_grid_step_finds_integer_counts_and_shifted_grids() -> None:
    counts = torch.poisson(torch.full((500,), 3.0), generator=torch.Generator().manual_seed(0))
    assert grid_step(counts) == 1.0
    levels = 0.5 + 0.25 * torch.tensor([0, 1, 3, 7, 8, 20], dtype=torch.float64)
    assert grid_step(levels.repeat(10)) == pytest.approx(0.25, rel=1e-12)


def test_grid_step_keeps_the_step_of_a_grid_rounded_to_a_few_decimals() -> None:
    # Readings on a grid of 1/26 printed with three decimals (0.962, 1.0, 1.038, ...): no gap is
    # exactly a step, and the smallest gap (0.038) is not one.
    k = torch.randint(0, 60, (1000,), generator=torch.Generator().manual_seed(1))
    values = torch.round(k / 26.0 * 1000.0) / 1000.0
    assert grid_step(values.double()) == pytest.approx(1 / 26, rel=1e-3)


def test_grid_step_refuses_continuous_data_few_repeats_and_off_grid_levels() -> None:
    generator = torch.Generator().manual_seed(2)
    assert grid_step(torch.randn(1000, generator=generator, dtype=torch.float64)) is None
    assert grid_step(torch.full((50,), 3.0)) is None  # one level: no grid
    # On a grid but repeated too little: more distinct values than the fraction allows.
    levels = int(MAX_LEVEL_FRACTION * 1000) + 1
    assert grid_step(torch.arange(levels, dtype=torch.float64).repeat(1000 // levels + 1)[:1000]
                     ) is None
    assert grid_step(torch.arange(levels - 1, dtype=torch.float64).repeat(1000 // levels + 1)[
        :1000]) == 1.0
    off_grid = torch.tensor([0.0, 1.0, math.pi], dtype=torch.float64).repeat(40)
    assert grid_step(off_grid) is None
    # Eight overlapping windows hold every frame: the copies are not repeats of a level.
    windows = torch.arange(20, dtype=torch.float64).repeat(40)
    assert grid_step(windows) == 1.0 and grid_step(windows, copies=8) is None
    assert repeats(windows) and not repeats(windows, copies=8)


# --- the noise ---------------------------------------------------------------------------------


def _counts_and_noise(batch: int = 40, length: int = 50) -> tuple[torch.Tensor, torch.Tensor]:
    """Sequences of integer counts (feature 0) and continuous values (feature 1), a padded tail."""
    generator = torch.Generator().manual_seed(3)
    counts = torch.poisson(torch.full((batch, length), 4.0), generator=generator)
    raw = torch.stack([counts, torch.randn(batch, length, generator=generator)], -1).double()
    mask = torch.ones(batch, length, dtype=torch.bool)
    mask[:, -5:] = False
    return torch.where(mask[..., None], raw, 0.0), mask


def test_dequantisation_adds_one_centred_uniform_step_to_the_quantised_feature_only() -> None:
    raw, mask = _counts_and_noise()
    with pytest.warns(UserWarning, match=r"feature\(s\) 0 \(step 1\) take few values"):
        out = dequantize_features(raw, mask, len(raw), torch.Generator().manual_seed(0), "toy")
    assert torch.equal(out[..., 1], raw[..., 1])
    assert torch.equal(out[~mask], raw[~mask])  # padding untouched
    noise = (out[..., 0] - raw[..., 0])[mask]
    assert bool((noise.abs() < 0.5).all())
    assert torch.equal(out[..., 0][mask].round(), raw[..., 0][mask])
    # Uniform on [-1/2, 1/2): mean 0 and variance 1/12, z-tests at about 4 standard errors.
    n = noise.numel()
    assert abs(float(noise.mean())) < 4 * math.sqrt(1 / 12 / n)
    assert abs(float(noise.var()) - 1 / 12) < 4 * math.sqrt(1 / 180 / n)


def test_the_grid_comes_from_the_leading_rows_and_the_noise_from_the_generator() -> None:
    raw, mask = _counts_and_noise()
    raw[30:, :, 0] = raw[30:, :, 0] + 0.3  # a test file whose readings are shifted
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        first = dequantize_features(raw, mask, 30, torch.Generator().manual_seed(0), "toy")
        again = dequantize_features(raw, mask, 30, torch.Generator().manual_seed(0), "toy")
        other = dequantize_features(raw, mask, 30, torch.Generator().manual_seed(1), "toy")
    assert torch.equal(first, again) and not torch.equal(first, other)
    assert bool(((first - raw)[30:, :, 0][mask[30:]].abs() < 0.5).all())  # the training step
    with pytest.warns(UserWarning, match=r"feature\(s\) 0 repeat a few values, not on a regular"):
        moved = torch.where(raw[..., :1] == 2.0, 2.0 + 0.5 * math.sqrt(2.0), raw[..., :1])
        kept = dequantize_features(moved, mask, 30, torch.Generator().manual_seed(0), "toy")
    assert torch.equal(kept, moved)  # a level moved off the grid: left as read


# --- the loader and the setting ----------------------------------------------------------------


def _write_counts(tmp_path: Path) -> tuple[Path, Path]:
    raw, mask = _counts_and_noise()
    cases = [raw[b, : int(mask[b].sum())].numpy() for b in range(len(raw))]
    write_ts(tmp_path / "c_TRAIN.ts", cases[:32], None)
    write_ts(tmp_path / "c_TEST.ts", cases[32:], None)
    return tmp_path / "c_TRAIN.ts", tmp_path / "c_TEST.ts"


def test_user_files_are_dequantised_by_default_and_kept_with_off(tmp_path: Path) -> None:
    train, test = _write_counts(tmp_path)
    with pytest.warns(UserWarning, match=r"c_TRAIN.ts: feature\(s\) 0 \(step 1\)"):
        auto = load_dataset(str(train), test_path=str(test), seed=0)
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*dequantised")
        off = load_dataset(str(train), test_path=str(test), seed=0, dequantize="off")
    with pytest.warns(UserWarning, match="dequantised"):
        again = load_dataset(str(train), test_path=str(test), seed=0)
    for name in ("train", "val", "test"):
        a, o = getattr(auto, name), getattr(off, name)
        assert torch.equal(a.mask, o.mask)  # the same split
        raw_a, raw_o = auto.to_raw(a.x, a.mask).double(), off.to_raw(o.x, o.mask).double()
        assert torch.equal(raw_a.round()[..., 0], raw_o.round()[..., 0])
        assert float((raw_a - raw_o)[..., 0].abs().max()) < 0.5 + 1e-4
        assert float((raw_a - raw_o)[..., 0].abs().max()) > 0.1
        assert torch.allclose(raw_a[..., 1], raw_o[..., 1], atol=1e-5)
        assert torch.equal(a.x, getattr(again, name).x)  # deterministic given the seed
    with pytest.raises(ValueError, match="dequantize must be one of"):
        load_dataset(str(train), dequantize="on")


def test_a_csv_and_a_data_frame_of_counts_load_identically(tmp_path: Path) -> None:
    pandas = pytest.importorskip("pandas")
    generator = np.random.default_rng(4)
    rows = [[f"s{s}", day, int(generator.poisson(5.0)), float(generator.standard_normal())]
            for s in range(12) for day in range(30)]
    frame = pandas.DataFrame(rows, columns=["id", "t", "a", "b"])
    write_csv(tmp_path / "s.csv", ["id", "t", "a", "b"], rows)
    config = TrainConfig.from_dict({"data": str(tmp_path / "s.csv"), "id_column": "id",
                                    "time_column": "t", "window": 10, "stride": 5})
    with pytest.warns(UserWarning, match=r"feature\(s\) 0 \(step 1\)"):
        from_file = load_data(config)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        from_frame = load_dataset("table", path=frame, seed=0, table=config.table)
        kept = load_data(config.replace(dequantize="off"))
    assert torch.equal(from_file.train.x, from_frame.train.x)
    assert not torch.equal(from_file.train.x, kept.train.x)


@pytest.mark.filterwarnings("ignore:.*fewer than 30")
def test_the_command_line_records_the_setting_and_older_runs_reload_as_read(
    tmp_path: Path,
) -> None:
    train, test = _write_counts(tmp_path)
    out = tmp_path / "run"
    argv = ["train", "--data", str(train), "--test-data", str(test), "--dequantize", "off",
            "--out", str(out), "--epochs", "1", "--n-blocks", "1", "--hidden", "8",
            "--device", "cpu", "--quiet"]
    with warnings.catch_warnings():
        warnings.filterwarnings("error", ".*dequantised")
        assert main(argv) == 0
        assert TrainConfig.from_toml(out / "config.toml").dequantize == "off"
        # A run written before the setting existed read its data as they are, and reloads so.
        paths = forget_setting(out, "dequantize")
        assert TrainConfig.from_toml(paths.config, stored=True).dequantize == "off"
        run = load_run(out)
    assert TrainConfig().dequantize == "auto"
    with pytest.warns(UserWarning, match="dequantised"):
        auto = load_dataset(str(train), test_path=str(test), seed=0)
    assert not torch.equal(run.dataset.test.x, auto.test.x)
    assert torch.equal(run.dataset.test.x,
                       load_dataset(str(train), test_path=str(test), dequantize="off").test.x)


def test_the_command_line_prints_the_warning_as_one_line(tmp_path: Path) -> None:
    train, test = _write_counts(tmp_path)
    run = tmp_path / "run"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        assert main(["train", "--data", str(train), "--test-data", str(test), "--out", str(run),
                     "--epochs", "1", "--n-blocks", "1", "--hidden", "8", "--device", "cpu",
                     "--quiet"]) == 0
    formatted = warnings.formatwarning
    assert main(["info", str(run)]) == 0
    assert warnings.formatwarning is formatted  # the command puts the format back
    # As a user sees it: `iresflow info` reloads the run's data, which warns again.
    result = subprocess.run([sys.executable, "-m", "iresflow", "info", str(run)],
                            capture_output=True, text=True, check=True, timeout=300)
    lines = result.stderr.splitlines()
    assert "iresflow: warning: c_TRAIN.ts: feature(s) 0 (step 1) take few values on a regular " \
           "grid" in "\n".join(lines)
    assert lines and all(line.startswith("iresflow: warning: ") for line in lines), lines
