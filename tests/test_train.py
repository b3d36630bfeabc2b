"""Training machinery: configuration, checkpoints, the loop, evaluation helpers and plots."""

from __future__ import annotations

import json
import math
import os
import pickle
from pathlib import Path

import pytest
import torch
from torch import nn

from iresflow.data.datasets import load_dataset
from iresflow.models.transformer import ResidualFlowTransformer
from iresflow.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.loop import (
    ExponentialMovingAverage,
    RunPaths,
    TrainingDivergedError,
    build_model,
    load_data,
    split_log_prob,
    train,
)
from iresflow.train.plots import plot_learning_curves, plot_marginals, plot_traces

TINY = dict(
    n_blocks=1, hidden=8, max_train=12, max_eval=6, batch_size=6, epochs=1, device="cpu",
    scheduler="plateau", eval_method="exact",
)
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class _Payload:
    """Pickles as a call of ``os.mkdir(marker)``: opening it must never run that call."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return os.mkdir, (str(self.marker),)


# -- configuration --------------------------------------------------------------------------


def test_config_toml_round_trip(tmp_path: Path) -> None:
    config = TrainConfig(
        data='odd "name" é.npz', heads=3, max_train=7, lr=1e-5, ema=0.99, clip=0.0,
        tensorboard=True, scheduler="cosine", coeff=0.5,
    )
    path = tmp_path / "run.toml"
    config.save(path)
    assert TrainConfig.from_toml(path) == config
    assert TrainConfig.from_toml_string(TrainConfig().to_toml()) == TrainConfig()


def test_config_replace_overrides_file_and_validates(tmp_path: Path) -> None:
    path = tmp_path / "run.toml"
    path.write_text('epochs = 3\nhidden = 8\nlr = 1\n', encoding="utf-8")
    config = TrainConfig.from_toml(path).replace(epochs=1)
    assert (config.epochs, config.hidden, config.lr) == (1, 8, 1.0)
    assert isinstance(config.lr, float)  # integers are accepted for float settings
    with pytest.raises(ConfigError, match="coeff"):
        config.replace(coeff=1.0)
    with pytest.raises(ConfigError, match="unknown option 'colour'"):
        config.replace(colour="red")


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("colour = 1\n", "unknown option 'colour'"),
        ("epochs = \n", "invalid TOML"),
        ("[model]\nhidden = 8\n", r"found table \[model\]"),
        ('lr = "fast"\n', "lr must be of type float"),
        ("epochs = true\n", "epochs must be of type int"),
        ("epochs = 0\n", "epochs must be >= 1"),
        ('attention = "dot"\n', "attention must be one of"),
        ('device = "tpu"\n', "device must be"),
        ("lr = inf\n", "lr must be finite"),
    ],
)
def test_config_rejects_bad_files(tmp_path: Path, text: str, message: str) -> None:
    path = tmp_path / "bad.toml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ConfigError, match=message):
        TrainConfig.from_toml(path)


def test_config_missing_file_and_incompatible_fields(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="cannot read config file"):
        TrainConfig.from_toml(tmp_path / "missing.toml")
    config = TrainConfig()
    assert config.incompatible_fields(config.replace(epochs=99, patience=0)) == []
    assert config.incompatible_fields(config.replace(hidden=9, lr=0.1)) == ["hidden", "lr"]


# -- checkpoints ----------------------------------------------------------------------------


def test_checkpoint_round_trip_keeps_plain_data(tmp_path: Path) -> None:
    generator = torch.Generator().manual_seed(3)
    state = {
        "epoch": 2, "best": float("inf"), "name": "x", "missing": None, "list": [1, 2.5],
        "rng": generator.get_state(), "weights": {"w": torch.randn(3, 2, dtype=torch.float64)},
    }
    save_checkpoint(state, tmp_path / "c.pt")
    loaded = load_checkpoint(tmp_path / "c.pt")
    assert loaded.keys() == state.keys()
    assert torch.equal(loaded["weights"]["w"], state["weights"]["w"])
    assert torch.equal(loaded["rng"], state["rng"])
    assert loaded["best"] == float("inf") and loaded["missing"] is None


def test_failed_write_leaves_previous_checkpoint_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    path = tmp_path / "last.pt"
    save_checkpoint({"epoch": 1}, path)

    def broken_save(obj: object, file: object) -> None:
        file.write(b"partial bytes")  # type: ignore[attr-defined]
        raise OSError("disk full")

    monkeypatch.setattr(torch, "save", broken_save)
    with pytest.raises(CheckpointError, match="cannot write checkpoint .*: disk full"):
        save_checkpoint({"epoch": 2}, path)
    monkeypatch.undo()
    assert load_checkpoint(path)["epoch"] == 1
    assert [p.name for p in tmp_path.iterdir()] == ["last.pt"]  # no temporary file left


def test_malicious_checkpoint_is_refused_without_running_code(tmp_path: Path) -> None:
    # The payload is live: plain unpickling runs it.
    live = tmp_path / "live"
    pickle.loads(pickle.dumps(_Payload(live)))
    assert live.is_dir()

    marker = tmp_path / "marker"
    torch.save({"model": _Payload(marker)}, tmp_path / "evil.pt")
    with pytest.raises(CheckpointError, match="refusing checkpoint .*mkdir"):
        load_checkpoint(tmp_path / "evil.pt")
    (tmp_path / "evil.pkl").write_bytes(pickle.dumps(_Payload(marker)))
    with pytest.raises(CheckpointError, match="not a torch archive"):
        load_checkpoint(tmp_path / "evil.pkl")
    assert not marker.exists()


def test_corrupt_or_missing_checkpoint_is_an_error(tmp_path: Path) -> None:
    save_checkpoint({"epoch": 1, "w": torch.ones(100)}, tmp_path / "good.pt")
    data = (tmp_path / "good.pt").read_bytes()
    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="cannot read checkpoint"):
        load_checkpoint(tmp_path / "truncated.pt")
    with pytest.raises(CheckpointError, match="not found"):
        load_checkpoint(tmp_path / "missing.pt")
    torch.save([1, 2], tmp_path / "list.pt")
    with pytest.raises(CheckpointError, match="expected a dict"):
        load_checkpoint(tmp_path / "list.pt")


# -- loop components ------------------------------------------------------------------------


def test_ema_update_and_swap() -> None:
    model = nn.Linear(3, 2)
    ema = ExponentialMovingAverage(model, decay=0.75)
    start = {n: p.detach().clone() for n, p in model.named_parameters()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    ema.update(model)
    for name, p in model.named_parameters():
        torch.testing.assert_close(ema.shadow[name], 0.75 * start[name] + 0.25 * p.detach())
    live = {n: p.detach().clone() for n, p in model.named_parameters()}
    with ema.applied(model):
        for name, p in model.named_parameters():
            assert torch.equal(p, ema.shadow[name])
    for name, p in model.named_parameters():
        assert torch.equal(p, live[name])
    with pytest.raises(ValueError, match="decay"):
        ExponentialMovingAverage(model, decay=1.0)


def test_load_data_limits_and_model_settings() -> None:
    config = TrainConfig(**TINY)
    dataset = load_data(config)
    full = load_dataset("japanese_vowels", seed=0)
    assert (len(dataset.train), len(dataset.val), len(dataset.test)) == (12, 6, 6)
    for part, whole in ((dataset.train, full.train), (dataset.test, full.test)):
        # every kept sequence is one of the split's, with its own mask and log-Jacobian
        match = (part.x.flatten(1)[:, None] == whole.x.flatten(1)[None]).all(-1)
        index = match.float().argmax(1)
        assert bool(match.any(1).all()) and len(set(index.tolist())) == len(part)
        assert torch.equal(part.mask, whole.mask[index])
        assert torch.equal(part.log_jacobian, whole.log_jacobian[index])
    assert torch.equal(load_data(config).train.x, dataset.train.x)  # seeded
    assert not torch.equal(load_data(config.replace(seed=1)).train.x, dataset.train.x)
    with pytest.raises(ConfigError, match="heads must divide"):
        build_model(config.replace(heads=5), dataset)
    with pytest.raises(ConfigError, match="max_len"):
        build_model(config.replace(max_len=10), dataset)
    with pytest.raises(ConfigError, match="unknown dataset"):
        load_data(config.replace(data="no_such_data"))


def test_split_log_prob_matches_full_padded_batch() -> None:
    config = TrainConfig(**TINY)
    dataset = load_data(config)
    torch.manual_seed(0)
    model = build_model(config, dataset)
    model.log_prob(dataset.train.x, dataset.train.mask)  # data-dependent ActNorm initialisation
    log_prob, stderr = split_log_prob(model, dataset.val, method="exact", batch_size=4)
    expected = model.log_prob(dataset.val.x, dataset.val.mask, method="exact").double()
    assert stderr is None and not model.training
    torch.testing.assert_close(log_prob, expected.detach(), rtol=1e-5, atol=1e-4)
    torch.manual_seed(1)
    estimate, stderr = split_log_prob(model, dataset.val, method="roulette", n_samples=3)
    assert stderr is not None and bool((stderr > 0).all())
    assert estimate.shape == stderr.shape == (len(dataset.val),)


def test_train_writes_run_folder_and_restores_global_state(
    tmp_path: Path, device: torch.device
) -> None:
    config = TrainConfig(**TINY).replace(epochs=2, device=str(device))
    before, rng = torch.are_deterministic_algorithms_enabled(), torch.get_rng_state()
    result = train(config, tmp_path / "run", progress=False)
    assert torch.are_deterministic_algorithms_enabled() == before
    assert torch.equal(torch.get_rng_state(), rng)
    paths = RunPaths(tmp_path / "run")
    assert TrainConfig.from_toml(paths.config) == config
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
        train(config.replace(heads=5), paths.root, overwrite=True, progress=False)
    assert load_checkpoint(paths.last)["epoch"] == 2
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("keep me")
    with pytest.raises(ConfigError, match="does not hold a run"):
        train(config, tmp_path / "other", overwrite=True, progress=False)
    assert (tmp_path / "other" / "notes.txt").exists()


def test_resume_continues_exactly(tmp_path: Path, device: torch.device) -> None:
    # Every piece of state: roulette training, moving average, clipping, plateau schedule.
    config = TrainConfig(**TINY).replace(
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
    config = TrainConfig(**TINY).replace(tensorboard=True)
    train(config, tmp_path / "run", progress=False)
    assert any(RunPaths(tmp_path / "run").tensorboard.glob("events.out.tfevents.*"))
    with pytest.raises(ConfigError, match="cannot resume .*hidden"):
        train(config.replace(hidden=16, epochs=2), tmp_path / "run", resume=True, progress=False)
    with pytest.raises(CheckpointError, match="not found"):
        train(config, tmp_path / "empty", resume=True, progress=False)


# -- plots ----------------------------------------------------------------------------------


def test_plots_write_png_files(tmp_path: Path) -> None:
    real = torch.randn(3, 6, 5)
    mask = torch.arange(6) < torch.tensor([[6], [4], [2]])
    real = torch.where(mask.unsqueeze(-1), real, 0.0)
    rows = [
        {"epoch": 1, "train_nll": 2.0, "val_nll": 2.2, "val_nll_stderr": 0.1, "lr": 1e-3},
        {"epoch": 2, "train_nll": 1.5, "val_nll": 1.9, "val_nll_stderr": 0.1, "lr": 5e-4},
    ]
    written = [
        plot_learning_curves(rows, tmp_path / "curves.png"),
        plot_traces(real, mask, real[:2], mask[:2], tmp_path / "traces.png"),
        plot_marginals(real, mask, real[:2], mask[:2], tmp_path / "sub" / "marginals.png"),
    ]
    for path in written:
        assert path.read_bytes()[:8] == PNG_SIGNATURE
    with pytest.raises(ValueError, match="same number of features"):
        plot_traces(real, mask, real[..., :2], mask, tmp_path / "x.png")
    with pytest.raises(TypeError, match="real_mask"):
        plot_marginals(real, None, real, mask, tmp_path / "x.png")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="at least one epoch"):
        plot_learning_curves([], tmp_path / "x.png")


# -- numerical health -----------------------------------------------------------------------


def _inject_nan(monkeypatch: pytest.MonkeyPatch, *, training: bool, call: int) -> None:
    """Make the ``call``-th log_prob of the model in training (or evaluation) mode return NaN."""
    original = ResidualFlowTransformer.log_prob
    calls = {"n": 0}

    def log_prob(self: ResidualFlowTransformer, *args: object, **kwargs: object) -> torch.Tensor:
        value = original(self, *args, **kwargs)
        if self.training == training:
            calls["n"] += 1
            if calls["n"] == call:
                return value * torch.nan
        return value

    monkeypatch.setattr(ResidualFlowTransformer, "log_prob", log_prob)


def test_nan_loss_skips_the_step_with_a_warning(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    _inject_nan(monkeypatch, training=True, call=2)  # 2 steps per epoch: the last of epoch 1
    config = TrainConfig(**TINY).replace(on_nan="skip", epochs=2)
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
    config = TrainConfig(**TINY)
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
    config = TrainConfig(**TINY).replace(epochs=2, on_nan="skip")
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
