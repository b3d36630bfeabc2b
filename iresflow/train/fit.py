"""The epochs of a training run, and training in this process from Python.

:func:`run_epochs` is the loop of every run: epochs of a
:class:`~iresflow.train.epoch.TrainingSession` until ``epochs``, early stopping (``patience``)
or the time budget (``max_seconds``). ``iresflow train`` (:func:`iresflow.train.loop.train`)
runs it with a run folder, writing checkpoints and metrics after every epoch; :func:`fit` runs
it in memory on a dataset and a model given from Python (the benchmarks train every model of
their tables with it, the flows of iresflow and the baselines alike) and ends with the weights
of the best validation epoch.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn
from tqdm.auto import tqdm

from iresflow.data.datasets import SequenceDataset
from iresflow.train.averaging import averaged_parameters
from iresflow.train.config import TrainConfig
from iresflow.train.distributed import World, current_world
from iresflow.train.epoch import TrainingSession
from iresflow.train.factories import build_model, resolve_device
from iresflow.train.metrics import epoch_summary
from iresflow.train.selection import CandidateResult, candidates, train_candidates

__all__ = ["FitResult", "fit", "run_epochs", "seeded_training"]

#: Called after every epoch with the session and the epoch's metrics.
EpochHook = Callable[[TrainingSession, dict[str, float]], None]


@dataclass(frozen=True)
class FitResult:
    """Summary of a :func:`fit` call.

    Attributes:
        model: The trained model, with the weights of the best validation epoch (the averaged
            weights with ``ema``), in ``eval()`` mode.
        best_epoch: Epoch of the lowest validation NLL (0: no epoch was a candidate).
        best_val_nll: That NLL, in the dataset's unit.
        stopped: Why training ended: ``"epochs"``, ``"patience"`` or ``"time"``.
        history: One metrics dict per epoch (as in ``metrics.jsonl``).
        config: The settings the model was trained with (the kept candidate's, with an
            ``alternative``).
        selection: With an ``alternative``, how every candidate ended; else empty.
    """

    model: nn.Module
    best_epoch: int
    best_val_nll: float
    stopped: str
    history: list[dict[str, float]]
    config: TrainConfig
    selection: tuple[CandidateResult, ...] = ()

    @property
    def train_seconds(self) -> float:
        """Optimisation seconds over all epochs (validation excluded)."""
        return sum(row["train_seconds"] for row in self.history)

    @property
    def steps(self) -> int:
        """Optimiser steps over all epochs (taken or skipped)."""
        return int(sum(row["steps"] for row in self.history))


def run_epochs(session: TrainingSession, *, progress: bool, after_epoch: EpochHook) -> str:
    """Epochs until ``epochs``, early stopping or ``max_seconds``.

    Every epoch trains, validates, advances the schedule and early stopping, appends its
    metrics to ``session.history`` and calls ``after_epoch(session, row)`` (on every rank).

    Args:
        session: The run, fresh or restored.
        progress: Show a progress bar (on a terminal) and a summary line per epoch (stderr).
        after_epoch: Called after every epoch (checkpoints, metrics, learning curves).

    Returns:
        Why training ended (:meth:`~iresflow.train.epoch.TrainingSession.stop_reason`).
    """
    config = session.config
    while (reason := session.stop_reason()) is None:
        session.epoch += 1
        bar = tqdm(
            total=session.steps_per_epoch,
            desc=f"epoch {session.epoch}",
            disable=None if progress else True,
            leave=False,
        )
        row = session.train_epoch(bar)
        bar.set_postfix_str(f"train {row['train_nll']:.4g}, validating")
        row.update(session.validate())
        bar.close()  # the summary line below replaces it
        session.advance(row)
        session.history.append(row)
        after_epoch(session, row)
        if progress:  # stderr: unbuffered, so logs of background runs stay current
            tqdm.write(epoch_summary(row, session.best_epoch), file=sys.stderr)
    if progress and reason == "patience":
        tqdm.write(
            f"early stop: no better validation NLL for {config.patience} counted epochs",
            file=sys.stderr,
        )
    if progress and reason == "time":
        tqdm.write(f"time budget of {config.max_seconds:g} s reached", file=sys.stderr)
    return reason


def fit(
    config: TrainConfig,
    dataset: SequenceDataset,
    model: nn.Module | None = None,
    *,
    on_epoch: EpochHook | None = None,
    progress: bool = False,
) -> FitResult:
    """Train in this process, in memory: the loop of ``iresflow train`` without a run folder.

    The same steps as :func:`iresflow.train.loop.train` with one process: torch's generators
    seeded with ``seed`` (and restored afterwards), the model built from the settings
    (:func:`~iresflow.train.factories.build_model`) unless given, then :func:`run_epochs`; with
    an ``alternative`` (and no ``model`` given) each candidate in turn, keeping the one of the
    lowest validation NLL (:mod:`iresflow.train.selection`). So for the same settings and data
    it trains the same weights as ``iresflow train``, whose ``best`` checkpoint holds what
    :attr:`FitResult.model` holds.

    Args:
        config: All settings (the model settings build the flow when ``model`` is ``None``).
        dataset: The data (its train and validation splits are used).
        model: Any :class:`~iresflow.train.likelihood.DensityModel` to train instead, e.g. a
            baseline; moved to ``config.device`` and trained in its own dtype (``alternative``
            does not apply: the model is trained as given).
        on_epoch: Called after every epoch as ``on_epoch(session, row)``, with the model in
            ``eval()`` mode, e.g. to record a learning curve. It cannot change the course of
            training: torch's generators and the session's estimator generator are restored
            after it.
        progress: Show a progress bar and a summary line per epoch (stderr).

    Returns:
        A :class:`FitResult`.

    Raises:
        RuntimeError: called in a process group (train data-parallel with
            :func:`~iresflow.train.loop.train` and ``nproc``).

    Example:
        >>> from iresflow.models.config import ModelConfig
        >>> from iresflow.train.factories import load_data
        >>> config = TrainConfig(model=ModelConfig(n_blocks=1, hidden=8), max_train=8,
        ...                      max_eval=4, epochs=1, device="cpu")
        >>> result = fit(config, load_data(config))
        >>> result.best_epoch, result.stopped, result.model.training, len(result.selection)
        (1, 'epochs', False, 3)
    """
    if current_world().size > 1:
        raise RuntimeError("fit trains in one process; in a process group use train()")
    if model is not None:
        return _fit_one(config.replace(alternative="none"), dataset, model, on_epoch, progress)
    choices = candidates(config, dataset.features)
    if len(choices) == 1:
        return _fit_one(choices[0][1], dataset, None, on_epoch, progress)
    _, result, results = train_candidates(
        choices, lambda name, candidate: _fit_one(candidate, dataset, None, on_epoch, progress),
        lambda result: (result.best_val_nll, result.best_epoch, len(result.history)))
    return dataclasses.replace(result, selection=results)


def _fit_one(config: TrainConfig, dataset: SequenceDataset, model: nn.Module | None,
             on_epoch: EpochHook | None, progress: bool) -> FitResult:
    """:func:`fit` of one model (settings with ``alternative = "none"``)."""
    device = resolve_device(config.device)
    devices = [device] if device.type == "cuda" else []
    with seeded_training(config.seed, device):
        if model is None:
            model = build_model(config, dataset)
        model = model.to(device)
        session = TrainingSession(config, dataset, model, device, World(0, 1))
        best: dict[str, Any] = {}

        def after_epoch(session: TrainingSession, row: dict[str, float]) -> None:
            if session.best_epoch == session.epoch:  # the weights validation saw
                with averaged_parameters(model, session.average):
                    best["state"] = copy.deepcopy(model.state_dict())
            if on_epoch is not None:
                estimator = session.estimator_generator.get_state()
                with torch.random.fork_rng(devices=devices):
                    on_epoch(session, row)
                session.estimator_generator.set_state(estimator)

        stopped = run_epochs(session, progress=progress, after_epoch=after_epoch)
    if "state" in best:
        model.load_state_dict(best["state"])
    model.eval()
    return FitResult(model, session.best_epoch, session.best_metric, stopped, session.history,
                     config)


@contextmanager
def seeded_training(seed: int, device: torch.device) -> Iterator[None]:
    """The reproducible setting of a run, the caller's restored afterwards.

    Torch's global generators seeded with ``seed`` (forked, so the caller's are untouched),
    deterministic kernels where torch has them (warnings elsewhere) and, on CUDA, deterministic
    cuBLAS workspaces (set before the run's first CUDA matmul).
    """
    if device.type == "cuda":
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    devices = [device] if device.type == "cuda" else []
    enabled = torch.are_deterministic_algorithms_enabled()
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(True, warn_only=True)
    try:
        with torch.random.fork_rng(devices=devices):
            torch.manual_seed(seed)
            yield
    finally:
        torch.use_deterministic_algorithms(enabled, warn_only=warn_only)
