"""A finished run, ready to use: its settings, data and flow with the weights of a checkpoint.

:func:`load_run` rebuilds a run from its folder: the settings stored in the checkpoint, the data
and the model of those settings (:func:`~iresflow.train.factories.load_data`,
:func:`~iresflow.train.factories.build_model`) and the weights of the checkpoint (the moving
average of the weights when the run kept one). :func:`trained_run` does the same for a run just
trained, reusing the model and the data of its training instead of building them again, and
:func:`load_candidate` for one candidate of a run's model selection, on the run's data. Every
way the loaded model's invertibility guarantees are re-checked (:func:`check_guarantees`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from iresflow.data.datasets import SequenceDataset
from iresflow.models.config import ModelConfig
from iresflow.models.flow import SequenceFlow
from iresflow.runs.settings import RunSettings
from iresflow.train.averaging import copy_parameters, load_average, moving_average
from iresflow.train.checkpoint import CheckpointError, load_checkpoint
from iresflow.train.config import ConfigError, TrainConfig
from iresflow.train.factories import build_model, load_data, resolve_device, resolve_model_config
from iresflow.train.loop import FittedRun
from iresflow.train.paths import RunPaths
from iresflow.train.selection import candidate_paths

__all__ = [
    "LoadedRun", "check_guarantees", "full_history", "load_candidate", "load_run", "trained_run",
]


@dataclass(frozen=True)
class LoadedRun:
    """A trained run, ready for evaluation and sampling.

    Attributes:
        paths: The run folder.
        config: Its settings.
        dataset: The data it was trained on (same split).
        model: The flow in evaluation mode, with the moving-average weights when the run kept
            them.
        checkpoint: ``"best"`` or ``"last"``.
        epoch: The epoch the checkpoint was written after.
        history: The metrics of every epoch up to that checkpoint.
    """

    paths: RunPaths
    config: TrainConfig
    dataset: SequenceDataset
    model: SequenceFlow
    checkpoint: str
    epoch: int
    history: list[dict[str, float]]

    @property
    def model_config(self) -> ModelConfig:
        """The model settings of the run completed from its data (features, context sizes)."""
        return resolve_model_config(self.config, self.dataset)


def load_run(
    run_dir: str | os.PathLike, settings: RunSettings | None = None, **changes: Any
) -> LoadedRun:
    """Rebuild a run's model and data from its checkpoint.

    Args:
        run_dir: The run folder written by :func:`~iresflow.train.loop.train`.
        settings: Which checkpoint and device (default: :class:`RunSettings`'s defaults:
            ``best``, the lowest validation NLL, or ``last`` when there is no ``best.pt``; the
            run's ``device`` setting).
        **changes: Fields of :class:`RunSettings` to change (``checkpoint="last"``).

    Returns:
        A :class:`LoadedRun`.

    Raises:
        FileNotFoundError: ``run_dir`` is not a run folder.
        CheckpointError: the checkpoint is unreadable, does not match its model, or breaks the
            model's guarantees (:func:`check_guarantees`).
        ConfigError: invalid settings (stored or given), or the device is unavailable.
    """
    settings = (settings or RunSettings()).replace(**changes)
    paths = RunPaths(Path(run_dir))
    if not paths.root.is_dir():
        raise FileNotFoundError(f"run folder not found: {paths.root}")
    if not paths.last.is_file():
        raise FileNotFoundError(f"{paths.root} holds no checkpoint (checkpoints/last.pt)")
    path = paths.checkpoint(settings.checkpoint)
    state = load_checkpoint(path)
    config = _stored_settings(state, path)
    device = resolve_device(settings.device if settings.device is not None else config.device)
    dataset = load_data(config)
    return _restored(paths, config, dataset, build_model(config, dataset), path, state, device)


def trained_run(fitted: FittedRun, settings: RunSettings | None = None) -> LoadedRun:
    """A run just trained, with the weights of a checkpoint, without building it again.

    The model and the data of the training process (:class:`~iresflow.train.loop.FittedRun`)
    are reused: the checkpoint's weights are loaded into the model, which stays on its device,
    so the result equals :func:`load_run` of the folder.

    Args:
        fitted: The run, in a process that trained it.
        settings: Which checkpoint (its ``device`` must be unset).

    Returns:
        A :class:`LoadedRun` holding ``fitted.model``.

    Raises:
        CheckpointError: as in :func:`load_run`.
    """
    settings = settings or RunSettings()
    if settings.device is not None:
        raise ConfigError("a trained run stays on its training device: leave device unset")
    paths = fitted.result.paths
    path = paths.checkpoint(settings.checkpoint)
    model = fitted.model
    model.set_generator(None)  # as built: the training estimator stream is not the run's
    device = next(model.parameters()).device
    state = load_checkpoint(path)
    return _restored(paths, fitted.config, fitted.dataset, model, path, state, device)


def load_candidate(run: LoadedRun, name: str) -> LoadedRun:
    """One candidate of a run's model selection (``RUN/candidates/NAME``), as a run of its own
    on the run's data, with the same kind of checkpoint (``best`` or ``last``) on the same
    device.

    Args:
        run: A loaded run that trained candidates.
        name: The candidate, ``"configured"`` or an alternative's name.

    Returns:
        A :class:`LoadedRun` whose ``paths`` are the candidate's folder and whose ``dataset`` is
        ``run.dataset``.

    Raises:
        FileNotFoundError: the run holds no checkpoint of that candidate.
        CheckpointError: as in :func:`load_run`.
    """
    paths = candidate_paths(run.paths, name)
    if not paths.last.is_file():
        raise FileNotFoundError(f"{run.paths.root} holds no checkpoint of the candidate {name!r}")
    path = paths.checkpoint(run.checkpoint)
    state = load_checkpoint(path)
    config = _stored_settings(state, path)
    device = next(run.model.parameters()).device
    return _restored(paths, config, run.dataset, build_model(config, run.dataset), path, state,
                     device)


def _stored_settings(state: dict[str, Any], path: Path) -> TrainConfig:
    """The training settings a checkpoint holds."""
    try:
        return TrainConfig.from_dict(state["config"], stored=True)
    except (KeyError, TypeError) as error:
        raise CheckpointError(f"checkpoint {path} holds no settings: {error}") from None


def _restored(
    paths: RunPaths, config: TrainConfig, dataset: SequenceDataset, model: SequenceFlow,
    path: Path, state: dict[str, Any], device: torch.device,
) -> LoadedRun:
    """The run with the checkpoint's (averaged) weights in ``model``, checked, on ``device``."""
    try:
        model.load_state_dict(state["model"])
        if state["ema"] is not None:
            average = moving_average(model, config.ema)
            load_average(average, state["ema"])
            copy_parameters(model, dict(average.module.named_parameters()))
        epoch, history = int(state["epoch"]), list(state["history"])
    except (KeyError, TypeError, ValueError, RuntimeError) as error:
        raise CheckpointError(f"checkpoint {path} does not match its model: {error}") from None
    check_guarantees(model, path)
    return LoadedRun(paths, config, dataset, model.to(device).eval(), path.stem, epoch, history)


def check_guarantees(model: SequenceFlow, source: str | os.PathLike) -> None:
    """Re-check a loaded model's invertibility guarantees; refuse a model that breaks them.

    The spectrally normalised layers divide their raw weights by the norm in every forward pass,
    so weights edited to violate the Lipschitz constraint are re-normalised structurally and the
    certificates of :meth:`~iresflow.models.flow.SequenceFlow.lipschitz_report` are recomputed
    from them. The model is refused when a parameter or buffer is NaN or infinite, or when a
    certified Lipschitz constant is not finite and below 1 (the residual steps would not be
    invertible, docs/math.md#dot-product-attention).

    Args:
        model: The loaded flow.
        source: The checkpoint it came from, named in the message.

    Raises:
        CheckpointError: a non-finite tensor or a certified bound ``>= 1``.

    Example:
        >>> from iresflow.models.residual_flow import ResidualSequenceFlow
        >>> model = ResidualSequenceFlow(features=2, max_len=4, n_blocks=1, hidden=4)
        >>> check_guarantees(model, "fresh model")
    """
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            raise CheckpointError(f"refusing {source}: {name} holds NaN or Inf values")
    generator = torch.Generator(next(model.parameters()).device).manual_seed(0)
    with torch.no_grad():
        report = model.lipschitz_report(n_inputs=1, generator=generator)
    for row in report:
        if not 0.0 <= row["certified"] < 1.0:  # also false for NaN
            raise CheckpointError(
                f"refusing {source}: the certified Lipschitz constant of {row['name']} is "
                f"{row['certified']:.4g}, not below 1, so the flow is not invertible"
            )


def full_history(run: LoadedRun) -> tuple[list[dict[str, float]], int | None]:
    """The metrics of every epoch of a run and its best epoch, from its ``last`` checkpoint.

    A ``best`` checkpoint holds the history up to the best epoch only; the ``last`` one shows
    what came after (e.g. a later degradation).

    Args:
        run: A loaded run.

    Returns:
        ``(history, best_epoch)``; ``best_epoch`` is ``None`` when no epoch qualified.

    Raises:
        CheckpointError: the ``last`` checkpoint is missing or unreadable.
    """
    state = load_checkpoint(run.paths.last)
    history = list(state["history"])
    best_epoch = int(state["best_epoch"]) or None
    return history, best_epoch
