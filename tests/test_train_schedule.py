"""The learning-rate warm-up, the schedule after it, and early stopping measured against it."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.distributed import World
from iresflow.train.epoch import COSINE_FLOOR, PATIENCE_LR_FRACTION, TrainingSession
from iresflow.train.factories import load_data
from iresflow.train.loop import train
from tests.tiny_runs import TINY, forget_setting


def _record_step_lrs(monkeypatch: pytest.MonkeyPatch) -> list[float]:
    """The learning rate of every optimiser step, in order."""
    seen: list[float] = []
    original = torch.optim.Adam.step

    def step(self: torch.optim.Adam, *args: object, **kwargs: object) -> object:
        seen.append(self.param_groups[0]["lr"])
        return original(self, *args, **kwargs)

    monkeypatch.setattr(torch.optim.Adam, "step", step)
    return seen


@pytest.mark.parametrize(("epochs", "anneal"), [(5, 60), (5, 0), (5, 5), (9, 5)])
def test_warmup_is_linear_per_step_then_cosine_until_anneal_then_the_floor(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, epochs: int, anneal: int
) -> None:
    """The cosine reaches its floor by epoch ``min(anneal, epochs)`` (``epochs`` with
    ``anneal = 0``); the epochs after it train at the floor."""
    seen = _record_step_lrs(monkeypatch)
    lr = 0.01
    # 12 sequences in batches of 6: 2 steps per epoch, so 2 warm-up epochs are 4 steps
    config = TINY.replace(
        epochs=epochs, anneal=anneal, warmup=2, lr=lr, scheduler="cosine", patience=0
    )
    result = train(config, tmp_path / "run", progress=False)
    warm = [lr * k / 5 for k in range(1, 5)]  # step k of W = 4 runs at lr k / (W + 1)
    floor = lr * COSINE_FLOOR
    cosine = [floor + (lr - floor) * (1 + math.cos(math.pi * t / 3)) / 2 for t in range(3)]
    cosine += [floor] * (epochs - 5)
    expected = warm + [value for value in cosine for _ in range(2)]
    assert seen == pytest.approx(expected, rel=1e-12)
    # the recorded lr of an epoch is the lr after its last step (before the epoch schedule)
    assert [row["lr"] for row in result.history] == pytest.approx(
        [lr * 3 / 5, lr] + cosine, rel=1e-12
    )


def test_the_warmup_help_states_the_learning_rate_of_every_warmup_step() -> None:
    """The help of ``warmup`` (the flag's, and docs/cli.md's table) names the schedule's rates."""
    (help_text,) = [f.metadata["help"] for f, _ in TrainConfig.settings() if f.name == "warmup"]
    assert ("with W optimiser steps in these epochs, step k runs at k lr / (W + 1), the first at "
            "lr / (W + 1), the step after them at lr") in help_text
    lr = 0.01
    config = TINY.replace(warmup=2, lr=lr, scheduler="none")
    session = TrainingSession(config, load_data(config), torch.nn.Linear(1, 1),
                              torch.device("cpu"), World(0, 1))
    steps = config.warmup * math.ceil(config.max_train / config.batch_size)  # W = 2 * 2
    assert session.warmup_steps == steps
    rates = []
    for _ in range(steps + 1):  # the optimiser's rate at step k = 1 .. W + 1
        rates.append(session.optimizer.param_groups[0]["lr"])
        session.optimizer.step()  # no gradients: a step that changes nothing
        session.warmup.step()
    assert rates[0] == pytest.approx(lr / (steps + 1), rel=1e-12)
    assert rates == pytest.approx([k * lr / (steps + 1) for k in range(1, steps + 2)], rel=1e-12)


def test_an_epoch_takes_min_steps_in_whole_passes(tmp_path: Path) -> None:
    # 12 sequences in batches of 6: 2 steps per pass, so at least 5 steps are 3 passes
    config = TINY.replace(min_steps=5, epochs=2, warmup=1, scheduler="none")
    result = train(config, tmp_path / "run", progress=False)
    assert [row["steps"] for row in result.history] == [6.0, 6.0]
    session = TrainingSession(config, load_data(config), torch.nn.Linear(1, 1),
                              torch.device("cpu"), World(0, 1))
    assert session.steps_per_epoch == 6 and session.warmup_steps == 6
    with pytest.raises(ConfigError, match="min_steps"):
        TINY.replace(min_steps=0)


def test_a_run_written_before_min_steps_resumes_one_pass_per_epoch(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    train(TINY, folder, progress=False)  # one pass per epoch, as before min_steps
    paths = forget_setting(folder, "min_steps")
    saved = TrainConfig.from_toml(paths.config, stored=True)
    assert saved.min_steps == 1 and TrainConfig().min_steps > 1
    resumed = train(saved.replace(epochs=2), folder, resume=True, progress=False)
    assert [row["steps"] for row in resumed.history] == [2.0, 2.0]


def test_a_run_written_before_anneal_resumes_annealing_over_all_epochs(tmp_path: Path) -> None:
    folder = tmp_path / "run"
    train(TINY.replace(scheduler="cosine", warmup=1, patience=0, epochs=2), folder,
          progress=False)
    saved = TrainConfig.from_toml(forget_setting(folder, "anneal").config, stored=True)
    assert saved.anneal == 0 and TrainConfig().anneal > 0
    for anneal, horizon in ((0, 99), (TrainConfig().anneal, TrainConfig().anneal - 1)):
        config = saved.replace(epochs=100, anneal=anneal)
        session = TrainingSession(config, load_data(config), torch.nn.Linear(1, 1),
                                  torch.device("cpu"), World(0, 1))
        assert session.cosine_epochs == horizon and session.scheduler.T_max == horizon
    with pytest.raises(ConfigError, match="anneal"):
        TINY.replace(anneal=-1)


def test_a_run_extended_past_its_annealing_resumes_exactly(tmp_path: Path) -> None:
    config = TINY.replace(scheduler="cosine", anneal=3, warmup=1, patience=0, epochs=4)
    train(config, tmp_path / "a", progress=False)
    resumed = train(config.replace(epochs=6), tmp_path / "a", resume=True, progress=False)
    whole = train(config.replace(epochs=6), tmp_path / "b", progress=False)
    for key in ("lr", "train_nll"):
        assert [row[key] for row in resumed.history] == [row[key] for row in whole.history]


def test_warmup_resumes_exactly(tmp_path: Path) -> None:
    config = TINY.replace(warmup=3, scheduler="cosine", patience=0, epochs=1)
    train(config, tmp_path / "a", progress=False)  # stops in the middle of the warm-up
    resumed = train(config.replace(epochs=4), tmp_path / "a", resume=True, progress=False)
    whole = train(config.replace(epochs=4), tmp_path / "b", progress=False)
    assert [row["lr"] for row in resumed.history] == [row["lr"] for row in whole.history]
    assert [row["train_nll"] for row in resumed.history] == [
        row["train_nll"] for row in whole.history
    ]


def _scripted_validation(monkeypatch: pytest.MonkeyPatch, nll: Callable[[int], float]) -> None:
    """Every epoch's validation NLL is ``nll(epoch)``, with an inverse that reconstructs."""

    def validate(self: TrainingSession) -> dict[str, float]:
        return {"val_nll": nll(self.epoch), "inverse_iterations": 1.0,
                "inverse_residual": 0.0, "reconstruction_error": 0.0}

    monkeypatch.setattr(TrainingSession, "validate", validate)


def test_a_run_trains_on_at_the_floor_while_validation_improves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Validation improves until epoch 9, past the annealing (epoch 4): the run goes on at the
    floor rate and stops ``patience`` epochs after its best, far below ``epochs``; its progress
    lines name the best epoch so far, not the cap."""
    _scripted_validation(monkeypatch, lambda epoch: float(abs(epoch - 9)))
    config = TINY.replace(epochs=1000, anneal=4, warmup=1, patience=3, lr=0.01,
                          scheduler="cosine")
    result = train(config, tmp_path / "run", progress=True)
    assert result.best_epoch == 9 and result.stopped_early and result.epochs == 12
    assert [row["lr"] for row in result.history][4:] == pytest.approx(
        [config.lr * COSINE_FLOOR] * 8, rel=1e-12)
    lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("epoch")]
    assert [line.split("  ")[0] for line in lines] == [
        f"epoch {epoch} (best {min(epoch, 9)})" for epoch in range(1, 13)]


@pytest.mark.parametrize(
    ("scheduler", "warmup", "epochs", "patience"),
    [("none", 3, 20, 2), ("plateau", 0, 20, 3), ("cosine", 2, 12, 2), ("cosine", 0, 8, 1)],
)
def test_patience_counts_after_warmup_and_once_cosine_lr_is_half(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, scheduler: str, warmup: int, epochs: int,
    patience: int,
) -> None:
    _scripted_validation(monkeypatch, float)  # each epoch worse: epoch 1 stays the best
    config = TINY.replace(
        scheduler=scheduler, warmup=warmup, epochs=epochs, patience=patience, lr=0.01
    )
    result = train(config, tmp_path / "run", progress=False)
    # oracle: the first epoch that counts follows the best (1) and the warm-up and, for cosine,
    # is the first whose learning rate is at most half of lr; the run stops `patience` counted
    # epochs later
    first = max(warmup + 1, 2)
    if scheduler == "cosine":
        floor, span = config.lr * COSINE_FLOOR, epochs - warmup

        def rate(epoch: int) -> float:
            t = epoch - warmup - 1
            return floor + (config.lr - floor) * (1 + math.cos(math.pi * t / span)) / 2

        first = next(e for e in range(first, epochs + 1)
                     if rate(e) <= PATIENCE_LR_FRACTION * config.lr)
    assert result.best_epoch == 1
    assert result.stopped_early and result.epochs == first + patience - 1


def test_an_epoch_whose_inverse_does_not_reconstruct_is_not_the_best(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Epoch 3 has the lowest validation NLL, but its inverse is off by 1 (solver converged)."""

    def validate(self: TrainingSession) -> dict[str, float]:
        error = 1.0 if self.epoch == 3 else 1e-5
        return {"val_nll": float(10 - self.epoch) if self.epoch < 4 else 9.5,
                "inverse_iterations": 1.0, "inverse_residual": 0.0,
                "reconstruction_error": error}

    monkeypatch.setattr(TrainingSession, "validate", validate)
    result = train(TINY.replace(epochs=5, patience=0), tmp_path / "run", progress=False)
    assert result.best_epoch == 2 and result.best_val_nll == 8.0


def test_warmup_and_test_data_settings_are_checked(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="warmup must be >= 0"):
        TrainConfig(warmup=-1)
    with pytest.raises(ConfigError, match="test_data needs data and test_data to be .npz or .ts"):
        TrainConfig(test_data="toy_TEST.ts")  # data is a shipped dataset
    with pytest.raises(ConfigError, match="test_data = 'test.csv'"):
        TrainConfig(data="toy_TRAIN.ts", test_data="test.csv")
    config = TrainConfig(data="toy_TRAIN.ts", test_data="toy_TEST.ts", warmup=0)
    path = tmp_path / "run.toml"
    config.save(path)
    assert TrainConfig.from_toml(path) == config
    assert 'test_data = "toy_TEST.ts"' in path.read_text()
