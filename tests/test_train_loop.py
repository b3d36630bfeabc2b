"""The training loop: run folders, exact resume, numerical health."""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
import torch

from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.train.checkpoint import CheckpointError, load_checkpoint
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.epoch import TrainingDivergedError
from iresflow.train.loop import train
from iresflow.train.paths import RunPaths
from tests.tiny_runs import TINY


def test_train_writes_run_folder_and_restores_global_state(
    tmp_path: Path, device: torch.device
) -> None:
    config = TINY.replace(epochs=2, device=str(device))
    before, rng = torch.are_deterministic_algorithms_enabled(), torch.get_rng_state()
    result = train(config, tmp_path / "run", progress=False)
    assert torch.are_deterministic_algorithms_enabled() == before
    assert torch.equal(torch.get_rng_state(), rng)
    paths = RunPaths(tmp_path / "run")
    # what auto resolved to
    recorded = config.replace(val_fraction=0.1, model=config.model.replace(position_norm="off"))
    assert TrainConfig.from_toml(paths.config) == recorded
    rows = [json.loads(line) for line in paths.metrics_jsonl.read_text().splitlines()]
    assert rows == result.history and [r["epoch"] for r in rows] == [1, 2]
    header = paths.metrics_csv.read_text().splitlines()[0].split(",")
    assert header == list(rows[0])
    best = load_checkpoint(paths.best)
    assert best["epoch"] == result.best_epoch
    assert best["best_metric"] == min(r["val_nll"] for r in rows) == result.best_val_nll
    assert load_checkpoint(paths.last)["epoch"] == 2
    for row in rows:
        assert row["reconstruction_error"] < 1e-3 and row["inverse_iterations"] >= 1
    with pytest.raises(ConfigError, match="not empty"):
        train(config, paths.root, progress=False)
    with pytest.raises(ConfigError, match="heads must divide"):  # checked before deleting
        train(config.replace(model=config.model.replace(heads=5)), paths.root, overwrite=True,
              progress=False)
    assert load_checkpoint(paths.last)["epoch"] == 2
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="does not hold a run"):
        train(config, tmp_path / "other", overwrite=True, progress=False)
    assert (tmp_path / "other" / "notes.txt").exists()


def test_resume_continues_exactly(tmp_path: Path, device: torch.device) -> None:
    # Every piece of state: roulette training, moving average, clipping, plateau schedule.
    config = TINY.replace(
        ema=0.9, clip=1.0, seed=3, max_train=8, batch_size=4, device=str(device)
    )
    train(config, tmp_path / "a", progress=False)
    resumed = train(config.replace(epochs=3), tmp_path / "a", resume=True, progress=False)
    uninterrupted = train(config.replace(epochs=3), tmp_path / "b", progress=False)

    def curve(history: list[dict[str, float]]) -> list[dict[str, float]]:
        return [{k: v for k, v in row.items() if k != "train_seconds"} for row in history]

    assert len(resumed.history) == 3
    assert curve(resumed.history) == curve(uninterrupted.history)
    a = load_checkpoint(RunPaths(tmp_path / "a").last)
    b = load_checkpoint(RunPaths(tmp_path / "b").last)
    for key in ("model", "ema", "rng"):
        for name, value in b[key].items():
            assert torch.equal(a[key][name], value), (key, name)
    for key in ("scheduler", "epoch", "best_epoch", "best_metric", "bad_epochs"):
        assert a[key] == b[key], key
    assert a["optimizer"]["state"].keys() == b["optimizer"]["state"].keys()
    for index, slots in b["optimizer"]["state"].items():
        for name, value in slots.items():
            assert torch.equal(a["optimizer"]["state"][index][name], value)


def test_resume_refuses_changed_model_settings(tmp_path: Path) -> None:
    config = TINY.replace(tensorboard=True)
    train(config, tmp_path / "run", progress=False)
    assert any(RunPaths(tmp_path / "run").tensorboard.glob("events.out.tfevents.*"))
    with pytest.raises(ConfigError, match="cannot resume .*hidden"):
        train(config.replace(model=config.model.replace(hidden=16), epochs=2), tmp_path / "run",
              resume=True, progress=False)
    with pytest.raises(CheckpointError, match="not found"):
        train(config, tmp_path / "empty", resume=True, progress=False)


def test_the_run_records_the_automatic_val_fraction(tmp_path: Path) -> None:
    """docs/datasets.md#validation-split: 40 training sequences give 10 for validation, and the
    run's settings keep the fraction, so that it resumes with the same split."""
    rng = np.random.default_rng(0)
    np.savez(tmp_path / "train.npz", x=rng.standard_normal((40, 6, 2)))
    np.savez(tmp_path / "test.npz", x=rng.standard_normal((8, 6, 2)))
    config = TINY.replace(
        data=str(tmp_path / "train.npz"), test_data=str(tmp_path / "test.npz"), max_train=None,
        max_eval=None, batch_size=16,
    )
    assert config.val_fraction is None
    with pytest.warns(UserWarning, match="val split has only 10 sequences"):
        train(config, tmp_path / "run", progress=False)
        resumed = train(config.replace(epochs=2), tmp_path / "run", resume=True, progress=False)
        train(config.replace(val_fraction=0.1), tmp_path / "explicit", progress=False)
    assert len(resumed.history) == 2
    assert TrainConfig.from_toml(RunPaths(tmp_path / "run").config) == config.replace(
        val_fraction=0.25, epochs=2, model=config.model.replace(position_norm="off"))
    assert TrainConfig.from_toml(RunPaths(tmp_path / "explicit").config).val_fraction == 0.1
    with pytest.raises(ConfigError, match="cannot resume .*val_fraction"):
        train(config.replace(epochs=3, val_fraction=0.1), tmp_path / "run", resume=True,
              progress=False)


def _inject_nan(monkeypatch: pytest.MonkeyPatch, *, training: bool, call: int) -> None:
    """Make the ``call``-th log_prob of the model in training (or evaluation) mode return NaN."""
    original = ResidualSequenceFlow.log_prob
    calls = {"n": 0}

    def log_prob(self: ResidualSequenceFlow, *args: object, **kwargs: object) -> torch.Tensor:
        value = original(self, *args, **kwargs)
        if self.training == training:
            calls["n"] += 1
            if calls["n"] == call:
                return value * torch.nan
        return value

    monkeypatch.setattr(ResidualSequenceFlow, "log_prob", log_prob)


def test_nan_loss_skips_the_step_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _inject_nan(monkeypatch, training=True, call=2)  # 2 steps per epoch: the last of epoch 1
    config = TINY.replace(on_nan="skip", epochs=2)
    result = train(config, tmp_path / "run", progress=False)
    assert "warning: non-finite loss or gradient at epoch 1, step 2; skipped" in (
        capsys.readouterr().err
    )
    assert [row["skipped_steps"] for row in result.history] == [1.0, 0.0]
    for row in result.history:
        assert math.isfinite(row["train_nll"]) and math.isfinite(row["grad_norm"])
    for name in ("last", "best"):
        state = load_checkpoint(getattr(RunPaths(tmp_path / "run"), name))
        assert all(torch.isfinite(v).all() for v in state["model"].values())
        assert all(torch.isfinite(s).all() for p in state["optimizer"]["state"].values()
                   for s in p.values())


def test_nan_loss_stops_and_keeps_the_last_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    config = TINY
    train(config, tmp_path / "run", progress=False)
    before = load_checkpoint(RunPaths(tmp_path / "run").last)
    _inject_nan(monkeypatch, training=True, call=1)
    with pytest.raises(TrainingDivergedError, match="non-finite loss .* epoch 2, step 1; training"):
        train(config.replace(epochs=2), tmp_path / "run", resume=True, progress=False)
    after = load_checkpoint(RunPaths(tmp_path / "run").last)
    assert after["epoch"] == 1
    for name, value in before["model"].items():
        assert torch.equal(after["model"][name], value)


def test_nan_validation_is_never_the_best_checkpoint(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _inject_nan(monkeypatch, training=False, call=2)  # one validation batch per epoch: epoch 2
    config = TINY.replace(epochs=2, on_nan="skip")
    result = train(config, tmp_path / "run", progress=False)
    assert "non-finite validation NLL at epoch 2" in capsys.readouterr().err
    assert math.isnan(result.history[1]["val_nll"])
    assert result.best_epoch == 1 and math.isfinite(result.best_val_nll)
    best = load_checkpoint(RunPaths(tmp_path / "run").best)
    assert best["epoch"] == 1 and math.isfinite(best["best_metric"])
    _inject_nan(monkeypatch, training=False, call=1)  # the validation of epoch 3
    with pytest.raises(TrainingDivergedError, match="non-finite validation NLL at epoch 3"):
        train(config.replace(epochs=3, on_nan="stop"), tmp_path / "run", resume=True,
              progress=False)
