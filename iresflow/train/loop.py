r"""The training loop: minibatch maximum likelihood with early stopping and exact resume.

:func:`train` prepares the run folder, builds the data and the model
(:mod:`iresflow.train.factories`), starts the processes of a data-parallel run
(:mod:`iresflow.train.distributed`) and runs epochs of a
:class:`~iresflow.train.epoch.TrainingSession` (the objective, numerical health checks and the
state of exact resume are described there) until ``epochs``, early stopping or ``max_seconds``
(:func:`~iresflow.train.fit.run_epochs`, which :func:`~iresflow.train.fit.fit` also runs to train
in memory from Python, without a run folder). After every epoch
the ``last`` (and, on improvement, ``best``) checkpoint is written atomically
(:mod:`iresflow.train.checkpoint`) and the metrics are rewritten (:mod:`iresflow.train.metrics`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from iresflow.train.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.distributed import (
    broadcast_object,
    current_world,
    run_rank,
    spawn,
    torchrun_launch,
)
from iresflow.train.epoch import TrainingSession
from iresflow.train.factories import build_model, load_data, resolve_device
from iresflow.train.fit import deterministic_algorithms, run_epochs
from iresflow.train.metrics import tensorboard_writer, write_metrics
from iresflow.train.paths import RunPaths, check_run_folder, prepare_run_folder

__all__ = ["TrainResult", "train"]


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
    """

    paths: RunPaths
    epochs: int
    best_epoch: int
    best_val_nll: float
    stopped_early: bool
    history: list[dict[str, float]]


def train(
    config: TrainConfig,
    run_dir: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> TrainResult:
    """Train a :class:`~iresflow.models.transformer.ResidualFlowTransformer`.

    Args:
        config: All settings.
        run_dir: Run folder for the configuration, checkpoints and metrics.
        resume: Continue from ``run_dir/checkpoints/last.pt``; only the settings in
            :data:`~iresflow.train.config.RESUMABLE_FIELDS` (e.g. ``epochs``) may differ from
            the checkpoint's.
        overwrite: Replace an existing run in ``run_dir``.
        progress: Show a progress bar (on a terminal) and one summary line per epoch (stderr).

    With ``config.nproc > 1`` and no process group yet, ``nproc`` processes are started
    (:func:`~iresflow.train.distributed.spawn`), each runs this function as one rank of a
    data-parallel run, and rank 0's result is returned; an error of any rank is re-raised here.
    In a process started by ``torchrun`` (:func:`~iresflow.train.distributed.torchrun_launch`)
    this function joins the ``env://`` process group as its rank instead
    (:func:`~iresflow.train.distributed.run_rank`); ``nproc`` must then equal ``WORLD_SIZE``.

    Returns:
        A :class:`TrainResult`.

    Raises:
        ConfigError: ``run_dir`` already holds a run (without ``resume``/``overwrite``), is not
            a run folder, or the settings are incompatible with the checkpoint.
        CheckpointError: the checkpoint to resume from is missing or unreadable.
        TrainingDivergedError: a non-finite loss, gradient or validation NLL, or an inverse
            that stopped converging, with ``on_nan = "stop"``
            (:class:`~iresflow.train.epoch.TrainingDivergedError`).
    """
    paths = RunPaths(Path(run_dir))
    device = resolve_device(config.device)
    world = current_world()
    launch = torchrun_launch()
    if launch is not None and launch.world_size > 1 and world.size == 1:  # under torchrun
        return run_rank(
            launch, device.type, train, config, run_dir, resume=resume, overwrite=overwrite,
            progress=progress,
        )
    if world.main:  # a folder that cannot be used is refused before the data and model load
        check_run_folder(paths, resume=resume, overwrite=overwrite)
    if config.nproc > 1 and world.size == 1:  # start the processes; each one calls train
        return spawn(
            train, config.nproc, device.type, config, run_dir, resume=resume,
            overwrite=overwrite, progress=progress,
        )
    if world.size != config.nproc:
        raise ConfigError(
            f"nproc={config.nproc} but the process group has {world.size} ranks (under torchrun, "
            "nproc must equal WORLD_SIZE)"
        )
    if world.size > 1 and device.type == "cuda":  # one GPU per process
        device = torch.device("cuda", torch.cuda.current_device())
    if device.type == "cuda":  # deterministic cuBLAS; must be set before the first CUDA matmul
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    dataset = load_data(config)
    # The run owns torch's global generators while it trains; the caller's are restored after.
    devices = [device] if device.type == "cuda" else []
    with deterministic_algorithms(), torch.random.fork_rng(devices=devices):
        torch.manual_seed(config.seed)
        model = build_model(config, dataset).to(device)  # settings checked before any deletion
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
        return result


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
