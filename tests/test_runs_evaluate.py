"""Reloading a run and its NLL: the stored settings, the moving-average weights, method auto."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from iresflow.models.config import ModelConfig
from iresflow.models.distributions import StandardNormalSequence
from iresflow.runs import evaluate
from iresflow.runs.evaluate import evaluate_run
from iresflow.runs.load import full_history, load_run
from iresflow.train.averaging import load_average, moving_average
from iresflow.train.checkpoint import load_checkpoint
from iresflow.train.config import TrainConfig
from iresflow.train.epoch import TrainingSession
from iresflow.train.factories import load_data, resolve_model_config
from iresflow.train.likelihood import log_prob_cost
from iresflow.train.loop import train
from iresflow.train.paths import RunPaths
from tests.tiny_runs import TINY, forget_setting


def test_load_run_rebuilds_the_stored_model_with_averaged_weights(tmp_path: Path) -> None:
    config = TINY.replace(ema=0.5)
    train(config, tmp_path / "run", progress=False)
    state = load_checkpoint(RunPaths(tmp_path / "run").best)
    # Stored once, with the automatic val_fraction the split used and what position_norm's
    # auto decided.
    recorded = config.replace(
        val_fraction=0.1, model=config.model.replace(position_norm="off")).to_dict()
    assert state["config"] == recorded and "model_config" not in state
    run = load_run(tmp_path / "run", device="cpu")
    assert run.model_config == resolve_model_config(config, load_data(config))
    resolved = run.model_config
    assert (resolved.features, resolved.max_len, resolved.heads) == (12, 29, 4)

    average = moving_average(run.model, config.ema)
    load_average(average, state["ema"])
    averaged = dict(average.module.named_parameters())
    for name, parameter in run.model.named_parameters():
        assert torch.equal(parameter, averaged[name])
    # The averages differ from the trained weights, so the check above can fail.
    assert any(not torch.equal(state["model"][name], averaged[name]) for name in averaged)
    for name, buffer in run.model.named_buffers():
        assert torch.equal(buffer, state["model"][name])


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("evaluate") / "run"
    train(TINY.replace(epochs=3, patience=0), folder, progress=False)
    return folder


def test_auto_is_exact_when_affordable(tiny_run: Path) -> None:
    run = load_run(tiny_run, device="cpu")
    exact = evaluate_run(run, method="exact", save=False)
    auto = evaluate_run(run, method="auto", save=False)
    assert auto["method"] == "exact" and auto["nll"] == exact["nll"]
    assert auto["choice"].startswith("exact: estimated cost")


def test_auto_roulette_meets_the_target_and_agrees_with_exact(
    tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = load_run(tiny_run, device="cpu")
    exact = evaluate_run(run, method="exact", save=False)["nll"]
    monkeypatch.setattr(evaluate, "EXACT_BUDGET", 0.0)
    pilot = evaluate_run(run, method="auto", target_stderr=10.0, save=False)
    assert pilot["method"] == "roulette" and pilot["n_samples"] == 4
    assert pilot["stderr"] <= 10.0 and "with 4 estimates" in pilot["choice"]
    # a target below the pilot's standard error: more estimates, the error shrinks to it
    target = pilot["stderr"] / 3
    real_cost = evaluate.log_prob_cost

    def cost(*args: object, method: str, **kwargs: object) -> float:  # exact: unaffordable
        return math.inf if method == "exact" else real_cost(*args, method=method, **kwargs)

    monkeypatch.setattr(evaluate, "log_prob_cost", cost)
    refined = evaluate_run(run, method="auto", target_stderr=target, save=False)
    assert refined["method"] == "roulette" and refined["n_samples"] > 4
    assert refined["stderr"] < 1.5 * target  # the per-sequence variances are themselves noisy
    # z-test against the exact value (unbiased estimator)
    assert abs(refined["nll"] - exact) < 4 * refined["stderr"]
    monkeypatch.setattr(evaluate, "MAX_ROULETTE_SAMPLES", 6)
    capped = evaluate_run(run, method="auto", target_stderr=target / 100, save=False)
    assert capped["n_samples"] == 6 and "(capped;" in capped["choice"]


def test_auto_prefers_exact_to_too_many_roulette_estimates(
    tiny_run: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run = load_run(tiny_run, device="cpu")
    monkeypatch.setattr(evaluate, "EXACT_BUDGET", 0.0)
    result = evaluate_run(run, method="auto", target_stderr=1e-9, save=True)
    assert result["method"] == "exact" and result["choice"].startswith("exact: cheaper")
    saved = json.loads(RunPaths(tiny_run).evaluation.read_text())["test"]["exact"]
    assert saved["choice"] == result["choice"]
    with pytest.raises(ValueError, match="target_stderr must be > 0"):
        evaluate_run(run, method="auto", target_stderr=0.0)
    with pytest.raises(ValueError, match="n_samples must be >= 1, got 0"):
        evaluate_run(run, method="roulette", n_samples=0)
    with pytest.raises(ValueError, match="method must be one of exact, roulette, auto, got 'se"):
        evaluate_run(run, method="series")


def test_log_prob_cost_scales_as_its_terms() -> None:
    mask = torch.ones(3, 10, dtype=torch.bool)
    config = ModelConfig(n_blocks=2, hidden=8, layers=("attention", "mlp"))
    exact, roulette = (log_prob_cost(config, 4, mask, method=m) for m in ("exact", "roulette"))
    assert log_prob_cost(config.replace(n_blocks=4), 4, mask, method="exact") == 2 * exact
    assert log_prob_cost(config, 4, mask, method="roulette", n_samples=5) == 5 * roulette
    assert log_prob_cost(config, 4, mask[:1], method="exact") == pytest.approx(exact / 3)
    # attention: the dense Jacobian grows like (N D)^3; position-wise steps only like N
    longer = torch.ones(3, 40, dtype=torch.bool)
    assert log_prob_cost(config, 4, longer, method="exact") > 40 * exact
    frames = config.replace(layers=("mlp",))
    assert log_prob_cost(frames, 4, longer, method="exact") == pytest.approx(
        4 * log_prob_cost(frames, 4, mask, method="exact")
    )
    # a convolution's banded Jacobian costs a fixed number of passes, not N D of them
    conv = config.replace(layers=("conv",))
    assert log_prob_cost(conv, 4, longer, method="exact") < log_prob_cost(
        config.replace(layers=("attention",)), 4, longer, method="exact")
    # a causal flow factorises the n diagonal D x D blocks of its Jacobian, not the whole
    causal = conv.replace(causal=True)
    saved = log_prob_cost(conv, 4, longer, method="exact") - log_prob_cost(
        causal, 4, longer, method="exact")
    assert saved == pytest.approx(2 * 3 * ((40 * 4) ** 3 - 40 * 4**3) / 3)
    with pytest.raises(ValueError, match="method must be exact or roulette"):
        log_prob_cost(config, 4, mask, method="auto")


def test_full_history_shows_epochs_after_the_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def validate(self: TrainingSession) -> dict[str, float]:  # best at epoch 2, worse after
        return {"val_nll": abs(self.epoch - 2.0), "inverse_iterations": 1.0,
                "inverse_residual": 0.0, "reconstruction_error": 0.0}

    monkeypatch.setattr(TrainingSession, "validate", validate)
    train(TINY.replace(epochs=4, patience=0), tmp_path / "run", progress=False)
    run = load_run(tmp_path / "run", device="cpu")
    assert (run.checkpoint, run.epoch, len(run.history)) == ("best", 2, 2)
    history, best = full_history(run)
    assert [row["epoch"] for row in history] == [1, 2, 3, 4] and best == 2
    assert history == [json.loads(line) for line in
                       RunPaths(tmp_path / "run").metrics_jsonl.read_text().splitlines()]


def test_a_run_written_before_the_base_setting_loads_with_a_normal_base(tmp_path: Path) -> None:
    # Runs written before `base` existed record no base: they had a standard normal noise
    # density, not today's default, and must load (and resume) as they were trained.
    folder = tmp_path / "run"
    train(TINY.replace(epochs=1, model=TINY.model.replace(base="normal")), folder,
          progress=False)
    paths = forget_setting(folder, "base")
    assert TrainConfig().model.base == "sequence-t"
    assert type(load_run(folder, device="cpu").model.base) is StandardNormalSequence
    train(TrainConfig.from_toml(paths.config, stored=True).replace(epochs=2), folder,
          resume=True, progress=False)
