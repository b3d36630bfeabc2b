"""Sequences drawn from a finished run, in the data's original units, and their inversion report.

The flow is inverted by fixed-point iteration (:meth:`~iresflow.models.flow.SequenceFlow.sample`);
:class:`Samples` carries the convergence of those solves. A conditional run samples under the
context of its settings: a class name (``label``) or covariate values (``covariates``), or an
explicit context tensor. The settings are a :class:`~iresflow.runs.settings.SampleSettings`.
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

from iresflow.models.flow import SequenceFlow
from iresflow.runs.load import LoadedRun
from iresflow.runs.settings import SampleSettings
from iresflow.train.config import ConfigError

__all__ = ["Samples", "sample_context", "sample_run", "save_samples", "worst_solve"]


@dataclass(frozen=True)
class Samples:
    """Sequences drawn from a run's model.

    Attributes:
        x: Samples in the data's original units, ``(num, N, D)``, zero at padding.
        mask: Padding mask ``(num, N)``, ``True`` for real frames.
        lengths: Length of every sample, ``(num,)``, int64.
        diagnostics: The model's ``inverse_diagnostics()`` after the inversion that produced
            them (iterations and residuals of the fixed-point solves), with ``"residual"`` and
            ``"tolerance"`` added: the true residual and the tolerance of the solve (over every
            residual step and sample) whose residual is largest relative to its tolerance, so
            ``"converged"`` holds iff ``residual < tolerance`` there.
        context: The context every sample was drawn with (labels ``(num,)`` or covariates
            ``(num, C)``, on the CPU), ``None`` for an unconditional run.
    """

    x: Tensor
    mask: Tensor
    lengths: Tensor
    diagnostics: dict[str, Any]
    context: Tensor | None = None


def sample_run(
    run: LoadedRun,
    settings: SampleSettings | None = None,
    *,
    context: Tensor | None = None,
    **changes: Any,
) -> Samples:
    """Draw sequences from a run's model by inverting the flow.

    Args:
        run: A loaded run.
        settings: Number, length (``None``: drawn from the training split's lengths), seed (of
            the lengths and of the base noise), temperature of the base noise and, for a
            conditional run, the ``label`` or ``covariates`` of every sample; default:
            :class:`~iresflow.runs.settings.SampleSettings`.
        context: Instead of ``label``/``covariates``, the context of every sample: class indices
            ``(num,)`` (int64) or covariates ``(num, C)``.
        **changes: Fields of the settings to change (``num=4``).

    Returns:
        :class:`Samples` in the data's original units.

    Raises:
        ConfigError: invalid settings, a ``length`` above the model's ``max_len``, or a context
            missing for a conditional run, given to an unconditional one, or not the run's.
        ValueError: a context tensor of the wrong shape.
        InversionError: a fixed-point inverse did not converge.
    """
    settings = (settings or SampleSettings()).replace(**changes)
    longest = run.model.max_len
    if settings.length is not None and longest is not None and settings.length > longest:
        raise ConfigError(f"length must be <= {longest} for this model, got {settings.length}")
    if context is None:
        context = sample_context(run, settings)
    elif settings.label is not None or settings.covariates is not None:
        raise ConfigError("give the context either as a tensor or as label/covariates")
    num, seed = settings.num, settings.seed
    device = next(run.model.parameters()).device
    generator = torch.Generator(device).manual_seed(seed)
    on_device = None if context is None else context.to(device)
    if settings.length is None:
        lengths = run.dataset.sample_lengths(num, generator=torch.Generator().manual_seed(seed))
        x, mask = run.model.sample(num, lengths=lengths, generator=generator, context=on_device,
                                   temperature=settings.temperature)
    else:
        x, mask = run.model.sample(num, seq_len=settings.length, generator=generator,
                                   context=on_device, temperature=settings.temperature)
        lengths = torch.full((num,), settings.length, dtype=torch.int64)
    diagnostics = {**run.model.inverse_diagnostics(), **worst_solve(run.model)}
    return Samples(
        run.dataset.to_raw(x, mask).cpu(), mask.cpu(), lengths.cpu(), diagnostics,
        None if context is None else context.cpu(),
    )


def sample_context(run: LoadedRun, settings: SampleSettings) -> Tensor | None:
    """The context of every sample from ``label`` or ``covariates``; ``None`` when unconditional.

    Args:
        run: A loaded run.
        settings: The sample settings.

    Returns:
        Class indices ``(num,)`` (int64), covariates ``(num, C)`` (float32) or ``None``.

    Raises:
        ConfigError: ``label``/``covariates`` for an unconditional run, the other one or neither
            for a conditional run, a class the data do not have, or the wrong number of
            covariates.
    """
    condition, root = run.config.condition, run.paths.root
    given = [name for name in ("label", "covariates") if getattr(settings, name) is not None]
    if condition == "none":
        if given:
            raise ConfigError(f"{given[0]} (--{given[0]}) needs a conditional run; {root} is "
                              "unconditional")
        return None
    classes = run.dataset.classes or ()
    width = run.model_config.context_features
    if given != [condition]:
        what, choice = (("class labels", f"one of the classes {', '.join(classes)}")
                        if condition == "label" else ("covariates", f"{width} values"))
        raise ConfigError(
            f"{root} is conditioned on {what}: sample it with {condition} (--{condition}; "
            f"{choice})" + (f", not {given[0]} (--{given[0]})" if given else "")
        )
    if condition == "label":
        if settings.label not in classes:
            raise ConfigError(f"label must be one of {', '.join(classes)}, got {settings.label!r}")
        return torch.full((settings.num,), classes.index(settings.label), dtype=torch.int64)
    covariates = settings.covariates or ()
    if len(covariates) != width:
        raise ConfigError(
            f"covariates must have {width} values for this run, got {len(covariates)}"
        )
    return torch.tensor(covariates, dtype=torch.float32).expand(settings.num, width)


def save_samples(samples: Samples, path: str | os.PathLike, settings: SampleSettings) -> Path:
    """Write samples to an ``.npz`` file: ``x``, ``mask``, ``lengths`` and their condition
    (``label`` and the class indices ``labels``, or ``covariates``).

    Args:
        samples: What :func:`sample_run` drew.
        path: The ``.npz`` file; its folder is created.
        settings: The settings they were drawn with.

    Returns:
        The path written.
    """
    path = Path(path)
    recorded: dict[str, np.ndarray] = {}
    if settings.label is not None and samples.context is not None:
        recorded = {"label": np.array(settings.label), "labels": samples.context.numpy()}
    elif settings.covariates is not None:
        recorded = {"covariates": np.array(settings.covariates, dtype=np.float32)}
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez(
        path, x=samples.x.numpy(), mask=samples.mask.numpy(), lengths=samples.lengths.numpy(),
        **recorded,
    )
    return path


def worst_solve(model: SequenceFlow) -> dict[str, float]:
    """Residual and tolerance of the last inverse's solve closest to failing.

    Args:
        model: A flow after an inverse (a sample or a forecast).

    Returns:
        ``{"residual", "tolerance"}`` of the solve, over every residual step and sequence, whose
        residual is largest relative to its tolerance (a solve that diverged counts as worst).
    """
    worst = {"residual": 0.0, "tolerance": math.inf}
    for module in model.modules():
        stats = getattr(module, "last_inverse_stats", None)
        if stats is None:
            continue
        ratio = stats.residual.double() / stats.tolerance.double()
        ratio = torch.where(torch.isnan(ratio), math.inf, ratio)  # a diverged solve is worst
        index = int(ratio.argmax())
        if float(ratio[index]) >= worst["residual"] / worst["tolerance"]:
            worst = {
                "residual": float(stats.residual[index]),
                "tolerance": float(stats.tolerance[index]),
            }
    return worst
