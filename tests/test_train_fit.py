"""Training in memory from Python (iresflow.train.fit), the time budget, any density model."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from benchmarks.baselines.nflows_models import frame_maf
from iresflow.cli import parse_train_config
from iresflow.data.datasets import SequenceSplit
from iresflow.train import fit as fit_module
from iresflow.train.checkpoint import load_checkpoint
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.distributed import World
from iresflow.train.epoch import TrainingSession
from iresflow.train.factories import build_model, load_data
from iresflow.train.fit import fit
from iresflow.train.likelihood import DensityModel, placement, split_log_prob, trimmed_batch
from iresflow.train.loop import train
from iresflow.train.paths import RunPaths
from tests.oracles import assert_close_runs
from tests.tiny_runs import TINY


def _without_seconds(history: list[dict[str, float]]) -> list[dict[str, float]]:
    return [{k: v for k, v in row.items() if k != "train_seconds"} for row in history]


def test_fit_trains_the_weights_of_iresflow_train(tmp_path: Path) -> None:
    config = TINY.replace(epochs=2, seed=4)
    rng = torch.get_rng_state()
    result = fit(config, load_data(config))
    assert torch.equal(torch.get_rng_state(), rng)  # the caller's generators are restored
    run = train(config, tmp_path / "run", progress=False)
    assert _without_seconds(result.history) == _without_seconds(run.history)
    assert (result.best_epoch, result.best_val_nll) == (run.best_epoch, run.best_val_nll)
    best = load_checkpoint(RunPaths(tmp_path / "run").best)["model"]
    state = result.model.state_dict()
    assert state.keys() == best.keys()
    assert all(torch.equal(state[k], best[k]) for k in best)
    assert result.stopped == "epochs" and not result.model.training


def test_fit_hook_does_not_change_training() -> None:
    config = TINY.replace(epochs=2)
    data = load_data(config)
    seen: list[int] = []

    def draw(session: TrainingSession, row: dict[str, float]) -> None:
        torch.randn(3)  # torch's generator, and the flow's roulette estimators:
        split_log_prob(session.model, data.test)
        seen.append(int(row["epoch"]))

    plain = fit(config, data)
    hooked = fit(config, data, on_epoch=draw)
    assert seen == [1, 2]
    assert _without_seconds(hooked.history) == _without_seconds(plain.history)


@pytest.mark.parametrize("causal", [True, False])
def test_auto_validation_is_exact_where_the_log_determinant_splits_by_frames(
    causal: bool,
) -> None:
    config = TINY.replace(eval_method="auto", eval_n_samples=2)
    config = config.replace(model=config.model.replace(causal=causal))
    data = load_data(config)
    result = fit(config, data)
    assert result.model.exact_by_frames is causal
    # exact: no standard error, and the NLL of the exact log-densities; else two estimates
    assert ("val_nll_stderr" in result.history[0]) is not causal
    exact = data.nll(split_log_prob(result.model, data.val, method="exact")[0], data.val)
    if causal:
        assert result.best_val_nll == pytest.approx(exact, rel=1e-6)
    else:
        assert result.best_val_nll != pytest.approx(exact, rel=1e-6)


def test_fit_refuses_a_process_group(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(fit_module, "current_world", lambda: World(1, 2))
    config = TINY
    with pytest.raises(RuntimeError, match="one process"):
        fit(config, load_data(config))


def test_max_seconds_ends_the_epoch_after_a_step_and_resumes(tmp_path: Path) -> None:
    config = TINY.replace(epochs=3, batch_size=3, max_seconds=1e-9)
    run = train(config, tmp_path / "run", progress=False)
    assert len(run.history) == 1 and not run.stopped_early
    assert run.history[0]["steps"] == 1.0 and run.history[0]["skipped_steps"] == 0.0
    assert torch.isfinite(torch.tensor(run.history[0]["train_nll"]))  # over the step's sequences
    again = train(config, tmp_path / "run", resume=True, progress=False)
    assert len(again.history) == 1  # the budget is spent
    longer = train(config.replace(max_seconds=0.0), tmp_path / "run", resume=True, progress=False)
    assert [row["steps"] for row in longer.history] == [1.0, 4.0, 4.0]
    result = fit(config, load_data(config))
    assert result.stopped == "time" and result.steps == 1


def test_max_seconds_is_a_checked_setting() -> None:
    assert TrainConfig().max_seconds == 3600.0  # the time budget of one model
    assert TrainConfig(max_seconds=30).max_seconds == 30
    for bad in (-1.0, float("inf"), float("nan")):
        with pytest.raises(ConfigError, match="max_seconds"):
            TrainConfig(max_seconds=bad)
    assert "max_seconds = 3600.0" in TrainConfig().to_toml()
    assert parse_train_config(["--max-seconds", "2.5"]).max_seconds == 2.5  # a flag too


def test_fit_trains_any_density_model_in_float64() -> None:
    config = TINY.replace(epochs=2, lr=1e-2)
    data = load_data(config)
    maf = frame_maf(data.features, data.max_len, hidden=8, n_layers=1).double()
    assert isinstance(maf, DensityModel) and isinstance(build_model(config, data), DensityModel)
    result = fit(config, data, maf)
    assert placement(maf) == (torch.device("cpu"), torch.float64)
    assert len(result.history) == 2 and "reconstruction_error" not in result.history[0]
    values, stderr = split_log_prob(maf, data.val)
    assert stderr is None and values.dtype == torch.float64
    assert data.nll(values, data.val) == pytest.approx(result.best_val_nll, rel=1e-12)


def test_trimmed_batch_takes_the_dtype_and_split_log_prob_checks_the_method() -> None:
    mask = torch.tensor([[True, True, False], [True, False, False]])
    split = SequenceSplit(torch.randn(2, 3, 2) * mask[..., None], mask, torch.zeros(2))
    x, m = trimmed_batch(split, torch.tensor([0, 1]), torch.device("cpu"), torch.float64)
    assert x.dtype == torch.float64 and x.shape == (2, 2, 2) and m.tolist() == mask[:, :2].tolist()
    assert torch.equal(x, split.x[:, :2].double())
    with pytest.raises(ValueError, match="method"):
        split_log_prob(frame_maf(2, 3, hidden=4, n_layers=1), split, method="dense")


@pytest.mark.slow
def test_max_seconds_stops_every_rank_after_the_same_step(tmp_path: Path) -> None:
    config = TINY.replace(
        epochs=2, batch_size=3, max_seconds=1e-9, model=TINY.model.replace(logdet="exact"),
        nproc=2,
    )
    ddp = train(config, tmp_path / "ddp", progress=False)
    assert len(ddp.history) == 1 and ddp.history[0]["steps"] == 1.0
    train(config.replace(nproc=1), tmp_path / "single", progress=False)
    assert_close_runs(tmp_path / "single", tmp_path / "ddp", 1e-5)
