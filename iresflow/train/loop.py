r"""The training loop: minibatch maximum likelihood with early stopping and exact resume.

:func:`train` prepares the run folder, starts the processes of the run
(:func:`~iresflow.train.distributed.launch`: ``nproc`` processes or a ``torchrun`` launch), builds
the data and the model once per process (:mod:`iresflow.train.factories`) and runs epochs of a
:class:`~iresflow.train.epoch.TrainingSession` (the objective, numerical health checks and the
state of exact resume are described there) until ``epochs``, early stopping or ``max_seconds``
(:func:`~iresflow.train.fit.run_epochs`, which :func:`~iresflow.train.fit.fit` also runs to train
in memory from Python, without a run folder). With an ``alternative`` (the default's) it trains
each candidate so, in a run folder of its own, and keeps the one of the lowest validation NLL
(:mod:`iresflow.train.selection`). After every epoch
the ``last`` (and, on improvement, ``best``) checkpoint is written atomically
(:mod:`iresflow.train.checkpoint`) and the metrics are rewritten (:mod:`iresflow.train.metrics`).
:func:`train_and_finish` hands every process its trained model and data for more work (the
test NLL and figures of ``iresflow train``, :func:`iresflow.runs.finish.train_and_evaluate`).
"""

from __future__ import annotations

import dataclasses
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from tqdm.auto import tqdm

from iresflow.data.datasets import SequenceDataset
from iresflow.models.flow import SequenceFlow
from iresflow.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.distributed import broadcast_object, current_world, launch, process_count
from iresflow.train.epoch import TrainingSession
from iresflow.train.factories import build_model, load_data, resolve_device, resolve_model_config
from iresflow.train.fit import run_epochs, seeded_training
from iresflow.train.metrics import tensorboard_writer, write_metrics
from iresflow.train.paths import (
    RunPaths,
    check_run_folder,
    empty_run_folder,
    prepare_run_folder,
)
from iresflow.train.selection import (
    CandidateResult,
    adopt_candidate,
    candidate_paths,
    candidates,
    train_candidates,
    write_selection,
)

__all__ = ["FittedRun", "TrainResult", "train", "train_and_finish"]

T = TypeVar("T")


@dataclass(frozen=True)
class TrainResult:
    """Summary of a finished :func:`train` call.

    Attributes:
        paths: The run folder.
        epochs: Epochs completed in total (including those before a resume).
        best_epoch: Epoch of the lowest validation NLL.
        best_val_nll: That NLL, in the dataset's unit.
        stopped_early: Whether early stopping ended the run (not ``epochs`` or ``max_seconds``).
        history: One metrics dict per completed epoch.
        selection: With an ``alternative``, how every candidate ended (the kept one's
            summary is the rest of this record); empty for a run of one model.
    """

    paths: RunPaths
    epochs: int
    best_epoch: int
    best_val_nll: float
    stopped_early: bool
    history: list[dict[str, float]]
    selection: tuple[CandidateResult, ...] = ()


@dataclass(frozen=True)
class FittedRun:
    """A run just trained, in a process that trained it (what :func:`train_and_finish` hands on).

    Attributes:
        config: The settings of the run (``nproc`` the processes it ran in).
        result: Its summary.
        model: The flow with the weights of the last epoch, on the training device.
        dataset: The data it was trained on.
    """

    config: TrainConfig
    result: TrainResult
    model: SequenceFlow
    dataset: SequenceDataset


def train(
    config: TrainConfig,
    run_dir: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> TrainResult:
    """Train the flow of a configuration (:func:`~iresflow.train.factories.build_model`).

    Args:
        config: All settings.
        run_dir: Run folder for the configuration, checkpoints and metrics.
        resume: Continue from ``run_dir/checkpoints/last.pt``; only the settings in
            :data:`~iresflow.train.config.RESUMABLE_FIELDS` (e.g. ``epochs``) may differ from
            the checkpoint's.
        overwrite: Replace an existing run in ``run_dir``.
        progress: Show a progress bar (on a terminal) and one summary line per epoch (stderr).

    With ``config.nproc > 1`` and no process group yet, ``nproc`` processes are started, each
    runs one rank of a data-parallel run, and rank 0's result is returned; an error of any rank
    is re-raised here. In a process started by ``torchrun`` this function joins the ``env://``
    process group as its rank instead; ``nproc`` must then be 1 (it becomes ``WORLD_SIZE``) or
    equal ``WORLD_SIZE`` (:func:`~iresflow.train.distributed.launch`).

    With an ``alternative`` (:mod:`iresflow.train.selection`) the candidates train one after
    the other in ``run_dir/candidates/NAME`` and ``run_dir`` ends as a run of the one kept.

    Returns:
        A :class:`TrainResult` (the kept candidate's, with every candidate's in ``selection``).

    Raises:
        ConfigError: ``run_dir`` already holds a run (without ``resume``/``overwrite``), is not
            a run folder, or the settings are incompatible with the checkpoint.
        CheckpointError: the checkpoint to resume from is missing or unreadable.
        TrainingDivergedError: a non-finite loss, gradient or validation NLL, or an inverse
            that stopped converging, with ``on_nan = "stop"``
            (:class:`~iresflow.train.epoch.TrainingDivergedError`).
    """
    return train_and_finish(
        config, run_dir, _result, resume=resume, overwrite=overwrite, progress=progress
    )


def train_and_finish(
    config: TrainConfig,
    run_dir: str | os.PathLike,
    finish: Callable[[FittedRun], T],
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> T:
    """:func:`train`, then ``finish`` on every process with the model and data it trained.

    Args:
        config: All settings.
        run_dir: Run folder.
        finish: A module-level function (it is pickled by name for started processes) called
            on every rank with its :class:`FittedRun`, inside the process group.
        resume: As in :func:`train`.
        overwrite: As in :func:`train`.
        progress: As in :func:`train`.

    Returns:
        What ``finish`` returned here (on rank 0 when processes were started).

    Raises:
        ConfigError, CheckpointError, TrainingDivergedError: as in :func:`train`.
    """
    paths = RunPaths(Path(run_dir))
    if current_world().main:  # a folder that cannot be used is refused before anything starts
        check_run_folder(paths, resume=resume, overwrite=overwrite)
    config = config.replace(nproc=process_count(config.nproc))
    return launch(
        _fit_and_finish, config.nproc, resolve_device(config.device).type, finish, config,
        paths, resume, overwrite, progress,
    )


def _result(fitted: FittedRun) -> TrainResult:
    return fitted.result


def _fit_and_finish(
    finish: Callable[[FittedRun], T], config: TrainConfig, paths: RunPaths, resume: bool,
    overwrite: bool, progress: bool,
) -> T:
    if config.alternative == "none":
        fitted = _fit(config, paths, resume=resume, overwrite=overwrite, progress=progress)
    else:
        fitted = _select(config, paths, resume=resume, overwrite=overwrite, progress=progress)
    return finish(fitted)


def _select(
    config: TrainConfig, paths: RunPaths, *, resume: bool, overwrite: bool, progress: bool,
) -> FittedRun:
    """Train every candidate in its own folder; keep the one of the lowest validation NLL.

    The run folder holds the given settings while the candidates train (so ``--resume``
    continues each candidate where it stopped); afterwards it holds the kept candidate's run
    and ``selection.json`` (:mod:`iresflow.train.selection`). With one candidate (``auto`` and
    layers of the user's choice) the run is that candidate's plain run.
    """
    world = current_world()
    dataset = load_data(config)  # data and settings are checked before the folder changes
    choices = candidates(config, dataset.features)
    if len(choices) == 1:
        return _fit(choices[0][1], paths, resume=resume, overwrite=overwrite, progress=progress,
                    dataset=dataset)
    for _, candidate in choices:
        resolve_model_config(candidate, dataset)
    outcome: Any = None
    if world.main and resume and not paths.config.is_file():
        outcome = CheckpointError(f"checkpoint not found: {paths.last} (nor the settings of a "
                                  f"run in {paths.root})")
    elif world.main:
        try:
            if not resume:  # a folder to resume holds the settings (checked above)
                empty_run_folder(paths)
            config.save(paths.config)
        except OSError as error:
            outcome = ConfigError(f"cannot prepare run folder {paths.root}: {error}")
    outcome = broadcast_object(outcome)
    if outcome is not None:
        raise outcome
    names = [name for name, _ in choices]

    def train_one(name: str, candidate: TrainConfig) -> FittedRun:
        folder = candidate_paths(paths, name)
        if progress and world.main:
            tqdm.write(f"candidate {names.index(name) + 1} of {len(names)}: {name} ({folder.root})",
                       file=sys.stderr)
        again = resume and folder.is_run()  # a candidate not started yet starts afresh
        return _fit(candidate, folder, resume=again, overwrite=False, progress=progress,
                    dataset=dataset)

    kept, run, results = train_candidates(
        choices, train_one,
        lambda run: (run.result.best_val_nll, run.result.best_epoch, run.result.epochs))
    if world.main:
        adopt_candidate(paths, kept)
        write_selection(paths, results)
    broadcast_object(None)  # no rank reads the run folder before rank 0 has filled it
    result = dataclasses.replace(run.result, paths=paths, selection=results)
    return FittedRun(run.config, result, run.model, run.dataset)


def _fit(
    config: TrainConfig, paths: RunPaths, *, resume: bool, overwrite: bool, progress: bool,
    dataset: SequenceDataset | None = None,
) -> FittedRun:
    """One process's part of the run: its data (unless given), its model and the epochs."""
    world = current_world()
    if world.size != config.nproc:
        raise ConfigError(
            f"nproc={config.nproc} but the process group has {world.size} ranks (under torchrun, "
            "nproc must equal WORLD_SIZE)"
        )
    device = resolve_device(config.device)
    if dataset is None:
        dataset = load_data(config)
    if config.val_fraction is None:  # the run records the automatic fraction its split used
        config = config.replace(val_fraction=dataset.val_fraction)
    if config.model.position_norm == "auto":  # and what the data decided
        decided = resolve_model_config(config, dataset).position_norm
        config = config.replace(model=config.model.replace(position_norm=decided))
    # The run owns torch's global generators while it trains; the caller's are restored after.
    with seeded_training(config.seed, device):
        model = build_model(config, dataset).to(device)  # settings checked before any deletion
        state = _prepare_folder(paths, config, resume=resume, overwrite=overwrite)
        session = TrainingSession(config, dataset, model, device, world)
        if state is not None:
            session.restore(state)
        if world.main:
            paths.checkpoints.mkdir(parents=True, exist_ok=True)
            for stale in paths.checkpoints.glob(".*.tmp"):  # a write cut short by a killed run
                stale.unlink()
            config.save(paths.config)
            write_metrics(paths, session.history)
        result = _run_epochs(session, paths, progress and world.main)
        if world.size > 1:  # no rank returns before rank 0 has written the last files
            torch.distributed.barrier()
    return FittedRun(config, result, model, dataset)


def _prepare_folder(
    paths: RunPaths, config: TrainConfig, *, resume: bool, overwrite: bool
) -> dict[str, Any] | None:
    """Rank 0 prepares the run folder; every rank gets the outcome and the state to resume."""
    world = current_world()
    outcome: Any = None
    state: dict[str, Any] | None = None
    if world.main:  # only rank 0 touches the folder; the others learn the outcome
        try:
            state = prepare_run_folder(paths, config, resume=resume, overwrite=overwrite)
        except (ConfigError, CheckpointError, OSError) as error:
            outcome = error
    outcome, resumed = broadcast_object((outcome, state is not None))
    if outcome is not None:
        raise outcome
    if not world.main and resumed:
        state = load_checkpoint(paths.last)
    return state


def _run_epochs(session: TrainingSession, paths: RunPaths, progress: bool) -> TrainResult:
    """:func:`~iresflow.train.fit.run_epochs`; rank 0 writes checkpoints and metrics."""
    config, main = session.config, session.world.main
    writer = tensorboard_writer(paths, session.epoch) if config.tensorboard and main else None

    def after_epoch(session: TrainingSession, row: dict[str, float]) -> None:
        state = session.state()
        if main:
            save_checkpoint(state, paths.last)
            if session.best_epoch == session.epoch:
                save_checkpoint(state, paths.best)
            write_metrics(paths, session.history)
        if writer is not None:
            for key, value in row.items():
                if key != "epoch":
                    writer.add_scalar(key, value, session.epoch)
            writer.flush()

    try:
        reason = run_epochs(session, progress=progress, after_epoch=after_epoch)
    finally:
        if writer is not None:
            writer.close()
    return TrainResult(
        paths, session.epoch, session.best_epoch, session.best_metric, reason == "patience",
        session.history,
    )
