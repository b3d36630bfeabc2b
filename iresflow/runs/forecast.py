"""Forecasts of a finished causal run in the data's original units, scored where the truth is
known.

:func:`forecast_run` draws the next frames of sequences given their observed ones with
:meth:`~iresflow.models.flow.SequenceFlow.forecast` (docs/forecasting.md): either after the end
of every sequence of a user file (``data``), or, by default, in place of the last ``horizon``
frames of every sequence of one of the run's splits, which are then scored against the draws
(:func:`~iresflow.runs.scoring.forecast_scores`). :func:`save_forecast` writes the draws, their
quantiles and the scores to an ``.npz`` file. The settings are a
:class:`~iresflow.runs.settings.ForecastSettings`.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import Tensor

from iresflow.data.splits import SequenceDataset, SequenceSplit
from iresflow.data.store import StoredSplit
from iresflow.data.user_files import read_user_file, user_file_kind
from iresflow.models.forecasting import FORECAST_NOISE
from iresflow.runs.load import LoadedRun, load_candidate
from iresflow.runs.sample import worst_solve
from iresflow.runs.scoring import QUANTILES, forecast_scores
from iresflow.runs.settings import KEPT, ForecastSettings
from iresflow.train.config import ConfigError
from iresflow.train.likelihood import batch_context, trimmed_batch
from iresflow.train.selection import candidate_paths, choose, read_selection

__all__ = [
    "Forecast", "HeldOut", "choose_forecaster", "forecast_run", "held_out_truth", "hold_out",
    "raw_frames", "save_forecast",
]


@dataclass(frozen=True)
class Forecast:
    """Draws of the frames that follow observed sequences.

    Attributes:
        samples: Draws ``(S, B, H, D)`` in the data's original units.
        observed: The observed sequences ``(B, N, D)`` in original units, zero where not
            observed.
        mask: Their observed frames ``(B, N)``.
        start: Position of every sequence's first forecast frame, one past its last observed
            frame, ``(B,)`` int64.
        index: The sequences' indices in the split or file ``(B,)`` int64.
        truth: The frames that followed, ``(B, H, D)`` in original units (held-out forecasts;
            ``None`` for a file's future).
        truth_mask: Which of them are real frames ``(B, H)``, or ``None``.
        scores: :func:`~iresflow.runs.scoring.forecast_scores` of the draws against ``truth``,
            or ``None``.
        diagnostics: ``{"residual", "tolerance", "converged"}``: the fixed-point solve closest
            to failing over every batch (:func:`~iresflow.runs.sample.worst_solve`) and whether
            its residual is below its tolerance.
        source: The split's name or the file's path.
        scale: The base's scale of every sequence's new noise given its observed noise
            ``(B,)`` (:meth:`~iresflow.models.base_density.SequenceBase.given_scale`; 1 for a
            base whose frames are independent), or ``None`` for a base that does not report it.
        noise: Where the new frames' noise was drawn from, ``"given"`` or ``"prior"``
            (:data:`~iresflow.models.forecasting.FORECAST_NOISE`).
        candidate: The model that drew it: the name of a candidate of the run's model
            selection, or ``"kept"`` (:data:`~iresflow.runs.settings.KEPT`) for a run of one
            model.
        epoch: The epoch of that model's checkpoint.
        validation_crps: Where the validation split chose the model or the noise
            (:func:`choose_forecaster`), the mean CRPS of the forecasts of every option,
            keyed ``"CANDIDATE/NOISE"``; else ``None``.
    """

    samples: Tensor
    observed: Tensor
    mask: Tensor
    start: Tensor
    index: Tensor
    truth: Tensor | None
    truth_mask: Tensor | None
    scores: dict[str, Any] | None
    diagnostics: dict[str, Any]
    source: str
    scale: Tensor | None = None
    noise: str = FORECAST_NOISE[0]
    candidate: str = KEPT
    epoch: int = 0
    validation_crps: dict[str, float] | None = None


def forecast_run(run: LoadedRun, settings: ForecastSettings | None = None,
                 **changes: Any) -> Forecast:
    """Forecast the next frames of sequences with a causal run's model.

    Args:
        run: A loaded run whose model is causal (trained with ``causal = true``).
        settings: Horizon ``H``, draws ``S``, the data (a file's sequences, forecast after their
            ends, each conditioned on its latest ``max_len - H`` frames, a table read as whole
            series with the run's columns; default: the ``split``'s sequences, forecast in
            place of their last ``H`` frames, which are scored), seed, temperature and source
            (``noise``) of the noise and the model that draws (``candidate``; for ``"auto"``
            of either, :func:`choose_forecaster`); default:
            :class:`~iresflow.runs.settings.ForecastSettings`.
        **changes: Fields of the settings to change (``horizon=6``).

    Returns:
        A :class:`Forecast`. Held-out sequences with no frame before their last ``H`` are left
        out (``index`` names those kept).

    Raises:
        ConfigError: a run that is not causal, a file for a conditional run, a file whose
            features differ from the run's, ``H`` not below the model's ``max_len`` (its
            longest training sequence) with a file, a split with no sequence longer than
            ``H``, or a candidate the run did not train.
        InversionError: a fixed-point inverse did not converge.
    """
    settings = (settings or ForecastSettings()).replace(**changes)
    if not run.model.causal:
        raise ConfigError(f"{run.paths.root} is not causal: only a run trained with causal = "
                          "true (--causal) forecasts")
    held = None
    if settings.data is None:
        held = hold_out(getattr(run.dataset, settings.split), settings.horizon,
                        settings.origins)
        source, x, observed, index = settings.split, held.x, held.observed, held.index
    else:
        source, (x, observed) = settings.data, _read_observed(run, Path(settings.data),
                                                              settings.horizon)
        index = torch.arange(len(x))
    run, candidate, noise, validation_crps = choose_forecaster(run, settings)
    parameter = next(run.model.parameters())
    generator = torch.Generator(parameter.device).manual_seed(settings.seed)
    parts, scales, worst = [], [], {"residual": 0.0, "tolerance": math.inf}
    past = torch.where(observed[..., None], x, 0.0)
    for batch in torch.arange(len(x)).split(run.config.batch_size):
        context = None if settings.data is not None else batch_context(
            run.model, getattr(run.dataset, settings.split), index[batch], parameter.device)
        seen = (past[batch].to(parameter), observed[batch].to(parameter.device))
        draws = run.model.forecast(
            *seen, horizon=settings.horizon, num_samples=settings.num, generator=generator,
            temperature=settings.temperature, context=context, noise=noise,
        )
        parts.append(draws.cpu())
        scales.append(_given_scale(run, *seen, context))
        solve = worst_solve(run.model)
        if solve["residual"] / solve["tolerance"] >= worst["residual"] / worst["tolerance"]:
            worst = solve
    samples = raw_frames(run.dataset, torch.cat(parts, dim=1))  # (S, B, H, D)
    start = (observed * torch.arange(1, x.shape[1] + 1)).amax(1)
    truth = truth_mask = scores = None
    if held is not None:
        truth, truth_mask = held_out_truth(run.dataset, held), held.truth_mask
        scores = forecast_scores(samples, truth, truth_mask)
    diagnostics = {**worst, "converged": worst["residual"] < worst["tolerance"]}
    scale = None if any(part is None for part in scales) else torch.cat(scales)
    return Forecast(samples, run.dataset.to_raw(past, observed), observed, start, index, truth,
                    truth_mask, scores, diagnostics, source, scale, noise, candidate, run.epoch,
                    validation_crps)


def choose_forecaster(
    run: LoadedRun, settings: ForecastSettings
) -> tuple[LoadedRun, str, str, dict[str, float] | None]:
    """The model and the noise of a causal run's forecast (docs/forecasting.md#choosing).

    Where ``candidate`` or ``noise`` is ``"auto"``, every option (each candidate of the run's
    model selection that has a checkpoint, with the run's own model first, times each noise of
    :data:`~iresflow.models.forecasting.FORECAST_NOISE`) forecasts the last ``H`` frames of
    the validation sequences, and the ``H`` before them and so on from ``validation_origins``
    origins (:func:`hold_out`), with the forecast's other settings, and the option of the
    lowest mean CRPS over every frame forecast is kept, the first on a tie.

    Args:
        run: A loaded causal run.
        settings: The forecast's settings (``candidate``, ``noise``).

    Returns:
        ``(model, candidate, noise, validation_crps)``: the run or candidate that draws (on the
        run's data), its name (:attr:`Forecast.candidate`), the noise, and the validation CRPS
        of every option keyed ``"CANDIDATE/NOISE"`` where there was a choice; ``None`` where
        there was none or the validation split has no sequence longer than ``H`` (then the
        first option draws: the run's own model, with the ``given`` noise for ``"auto"``).

    Raises:
        ConfigError: a ``candidate`` the run did not train.
    """
    models = _candidate_models(run, settings.candidate)
    noises = FORECAST_NOISE if settings.noise == "auto" else (settings.noise,)
    options = [(name, noise) for name in models for noise in noises]
    if len(options) == 1:
        name, noise = options[0]
        return models[name], name, noise, None
    crps = {}
    try:
        for name, noise in options:
            scores = forecast_run(models[name], settings, data=None, split="val", noise=noise,
                                  candidate=KEPT, origins=settings.validation_origins).scores
            assert scores is not None  # a held-out forecast is scored
            crps[name, noise] = scores["crps_mean"]
    except ConfigError:  # no validation sequence longer than the horizon
        name, noise = options[0]
        return models[name], name, noise, None
    name, noise = min(crps, key=crps.__getitem__)
    return models[name], name, noise, {f"{n}/{z}": value for (n, z), value in crps.items()}


def _candidate_models(run: LoadedRun, which: str) -> dict[str, LoadedRun]:
    """The models a forecast may draw with, by name: the run's own (under the name of the
    candidate it kept, or ``"kept"``) and, for ``which = "auto"``, every other candidate with
    a checkpoint; only the one named otherwise."""
    selection = read_selection(run.paths)
    kept = KEPT if selection is None else choose(selection).name
    trained = [] if selection is None else [
        result.name for result in selection if result.name != kept
        and candidate_paths(run.paths, result.name).last.is_file()]
    if which in (KEPT, kept):
        return {kept: run}
    if which == "auto":
        return {kept: run} | {name: load_candidate(run, name) for name in trained}
    if which not in trained:
        raise ConfigError(f"{run.paths.root} holds no trained candidate {which!r}: its models "
                          f"are {', '.join([kept, *trained])}")
    return {which: load_candidate(run, which)}


def _given_scale(
    run: LoadedRun, x: Tensor, observed: Tensor, context: Tensor | None
) -> Tensor | None:
    """The base's scale of the new noise of a batch given its observed frames ``(b,)`` on the
    CPU, or ``None`` for a base that does not report it."""
    with torch.no_grad():
        z = run.model.transform_to_noise(x, observed, context=context)
        try:
            return run.model.base.given_scale(z, observed).cpu()
        except NotImplementedError:
            return None


@dataclass(frozen=True)
class HeldOut:
    """Sequences whose last frames are held out, in model space.

    Attributes:
        x: The whole sequences ``(B, N, D)``, held-out frames included.
        mask: Their real frames ``(B, N)``.
        observed: The frames a forecast may condition on: the real frames before the last
            ``H`` positions of every sequence ``(B, N)``.
        index: Every row's sequence in its split ``(B,)`` (those with an observed frame; one
            sequence may give several rows, one per forecast origin).
        start: One past every sequence's last observed frame ``(B,)``: the forecast's first
            position.
        truth: The ``H`` frames from ``start`` on ``(B, H, D)``, zero where not real.
        truth_mask: Which of them are real frames ``(B, H)``.
    """

    x: Tensor
    mask: Tensor
    observed: Tensor
    index: Tensor
    start: Tensor
    truth: Tensor
    truth_mask: Tensor


def hold_out(split: SequenceSplit | StoredSplit, horizon: int, origins: int = 1) -> HeldOut:
    """Hold out the last ``horizon`` positions of every sequence of a split, for forecasts
    scored against them; with ``origins = k``, also the ``horizon`` positions before those, and
    so on, each window a row of its own conditioned on the frames before it.

    Args:
        split: Sequences with their mask.
        horizon: ``H >= 1``.
        origins: Windows per sequence ``k >= 1``: the last ``H`` positions, then the ``H``
            before them, ... (the rows of the last windows of every sequence come first).

    Returns:
        A :class:`HeldOut` of the windows with at least one frame before them, on the CPU
        (``index`` names each row's sequence).

    Raises:
        ConfigError: no sequence is longer than ``H``.

    Example:
        >>> mask = torch.tensor([[True] * 4, [True, True, False, False]])
        >>> split = SequenceSplit(mask[..., None].float(), mask, torch.zeros(2))
        >>> held = hold_out(split, 2)
        >>> held.start.tolist(), held.truth_mask.tolist()
        ([2], [[True, True]])
        >>> hold_out(split, 1, origins=3).start.tolist(), hold_out(split, 1, origins=3).index
        ([3, 1, 2, 1], tensor([0, 1, 0, 0]))
    """
    x, mask = trimmed_batch(split, torch.arange(len(split)), torch.device("cpu"))
    positions = torch.arange(x.shape[1])
    end = (mask * (positions + 1)).amax(1)
    cut = end - horizon * torch.arange(1, origins + 1)[:, None]  # (k, B)
    observed = (mask & (positions < cut[..., None])).flatten(0, 1)  # origin after origin
    rows = observed.any(1).nonzero().flatten()
    if len(rows) == 0:
        raise ConfigError(f"no sequence of the split has more than horizon = {horizon} frames "
                          "to condition on")
    keep = rows % len(x)
    x, mask, observed = x[keep], mask[keep], observed[rows]
    start = (observed * (positions + 1)).amax(1)
    spots = start[:, None] + torch.arange(horizon)  # (B, H)
    inside = spots < x.shape[1]
    spots = spots.clamp(max=x.shape[1] - 1)
    truth = torch.gather(x, 1, spots[..., None].expand(-1, -1, x.shape[2]))
    real = torch.gather(mask, 1, spots) & inside
    return HeldOut(x, mask, observed, keep, start, torch.where(real[..., None], truth, 0.0), real)


def _read_observed(run: LoadedRun, path: Path, horizon: int) -> tuple[Tensor, Tensor]:
    """A user file's sequences in the run's model space and their observed frames: a table's
    whole series (its windows are for training), every sequence cut to its latest frames that
    leave room for the horizon in the model's longest sequence."""
    if run.config.condition != "none":
        raise ConfigError(f"{run.paths.root} is conditional (condition {run.config.condition}): "
                          "forecast the sequences of its splits (leave data unset)")
    kind = user_file_kind(path.name)
    if kind is None:
        raise ConfigError(f"data must be a .npz, .ts, .csv or .parquet file, got {str(path)!r}")
    longest = run.model.max_len
    if longest is not None and horizon >= longest:
        raise ConfigError(f"horizon = {horizon} leaves no frame to condition on in the longest "
                          f"sequence this model takes ({longest} frames, its training data's)")
    try:
        raw, mask = read_user_file(kind, path.expanduser(),
                                   run.config.table.replace(window=None, stride=None))
    except ValueError as error:
        raise ConfigError(f"{path}: {error}") from None
    if raw.shape[2] != run.dataset.features:
        raise ConfigError(f"{path} has {raw.shape[2]} features per frame, the run "
                          f"{run.dataset.features}")
    if longest is not None:
        raw, mask = _latest(raw, mask, longest - horizon)
    if run.dataset.preprocessing is None:
        return torch.where(mask[..., None], raw, 0.0).float(), mask
    return run.dataset.preprocessing.forward(raw.float(), mask)[0], mask


def _latest(raw: Tensor, mask: Tensor, keep: int) -> tuple[Tensor, Tensor]:
    """Every sequence's last ``keep`` positions up to its last real frame, moved to the start,
    and their mask."""
    positions = torch.arange(raw.shape[1])
    end = (mask * (positions + 1)).amax(1)
    width = min(keep, raw.shape[1])
    spots = (end - width).clamp(min=0)[:, None] + torch.arange(width)
    frames = torch.gather(raw, 1, spots[..., None].expand(-1, -1, raw.shape[2]))
    return frames, torch.gather(mask, 1, spots)


def raw_frames(dataset: SequenceDataset, frames: Tensor) -> Tensor:
    """Forecast frames in the data's original units.

    Args:
        dataset: The data whose preprocessing the frames are in.
        frames: Model-space frames ``(S, B, H, D)``, every one real.

    Returns:
        The same frames in original units, ``(S, B, H, D)`` in ``frames``' dtype.
    """
    flat = frames.flatten(0, 1)
    raw = dataset.to_raw(flat, torch.ones(flat.shape[:2], dtype=torch.bool))
    return raw.reshape(frames.shape)


def held_out_truth(dataset: SequenceDataset, held: HeldOut) -> Tensor:
    """The held-out frames of :func:`hold_out` in original units ``(B, H, D)``, zero where
    they are not real."""
    truth = raw_frames(dataset, held.truth[None])[0]
    return torch.where(held.truth_mask[..., None], truth, 0.0)


def save_forecast(forecast: Forecast, path: str | os.PathLike) -> Path:
    """Write a forecast to an ``.npz`` file.

    The arrays: ``samples (S, B, H, D)``, ``quantiles (Q, B, H, D)`` at the ``levels (Q,)`` of
    :data:`~iresflow.runs.scoring.QUANTILES`, ``observed (B, N, D)``, ``mask (B, N)``,
    ``start (B,)``, ``index (B,)``, ``noise`` (its name), ``scale (B,)`` (where the base
    reports it), ``candidate`` (the model that drew), ``options (K,)`` and ``validation_crps
    (K,)`` (where the validation split chose: every option ``"CANDIDATE/NOISE"`` and the mean
    CRPS of its validation forecasts);
    for a held-out forecast also ``truth (B, H, D)``, ``truth_mask (B, H)``, ``crps (D,)``,
    ``energy``, ``coverage_50`` and ``coverage_90``.

    Args:
        forecast: What :func:`forecast_run` drew.
        path: The ``.npz`` file; its folder is created.

    Returns:
        The path written.
    """
    path = Path(path)
    levels = torch.tensor(QUANTILES, dtype=forecast.samples.dtype)
    arrays: dict[str, np.ndarray] = {
        "samples": forecast.samples.numpy(),
        "quantiles": torch.quantile(forecast.samples, levels, dim=0).numpy(),
        "levels": levels.numpy(),
        "observed": forecast.observed.numpy(), "mask": forecast.mask.numpy(),
        "start": forecast.start.numpy(), "index": forecast.index.numpy(),
        "noise": np.array(forecast.noise), "candidate": np.array(forecast.candidate),
    }
    if forecast.validation_crps is not None:
        arrays["options"] = np.array(list(forecast.validation_crps))
        arrays["validation_crps"] = np.array(list(forecast.validation_crps.values()))
    if forecast.scale is not None:
        arrays["scale"] = forecast.scale.numpy()
    if forecast.truth is not None and forecast.truth_mask is not None and forecast.scores:
        arrays |= {"truth": forecast.truth.numpy(), "truth_mask": forecast.truth_mask.numpy(),
                   "crps": np.array(forecast.scores["crps"]),
                   "energy": np.array(forecast.scores["energy"])}
        arrays |= {f"coverage_{level}": np.array(value)
                   for level, value in forecast.scores["coverage"].items()}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(path, **arrays)
    return path
