"""Choosing among models on the validation split: the configured one and alternatives.

A run whose ``alternative`` setting names one (``auto`` does when ``layers`` is left at its
default) trains its candidates one after the other on the same split and seed: the model as
configured, then the same settings with each alternative's changes (:data:`ALTERNATIVES`). Each
candidate is an ordinary run in ``RUN/candidates/NAME``; the one with the lowest best validation
NLL is kept (the earlier one on a tie, the configured one first; a failed one never): its
settings, checkpoints and metrics are copied into ``RUN``, which then is a plain run of the kept
model, and ``RUN/selection.json`` records every candidate (docs/guide.md#model-selection).

The residual blocks of the default read a few frames on either side and fit many small
multivariate sets best; autoregressive steps conditioned by a GRU on every past frame fit one-
feature series with long memory best (docs/small_data.md#recurrent-conditioner); frames of
several features whose joint law given the past is far from Gaussian want a MAF over the features
given the past (docs/small_data.md#maf). None wins everywhere and the validation split tells them
apart, so the default run tries them all.
"""

from __future__ import annotations

import json
import math
import shutil
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any, TypeVar

from iresflow.models.config import ModelConfig
from iresflow.train.config import TrainConfig
from iresflow.train.epoch import TrainingDivergedError
from iresflow.train.paths import RunPaths

__all__ = [
    "ALTERNATIVES",
    "CONFIGURED",
    "CandidateResult",
    "adopt_candidate",
    "candidate_paths",
    "candidates",
    "choose",
    "read_selection",
    "resolved_alternatives",
    "train_candidates",
    "write_selection",
]

T = TypeVar("T")

#: Name of the candidate trained with the settings as given.
CONFIGURED = "configured"

#: The alternatives a run can try beside its configured model, as changes of its settings:
#: ``recurrent``, autoregressive steps conditioned by a GRU before the residual blocks; ``maf``,
#: steps that are a MAF over the features of each frame given the past, without the
#: autoregressive input layer, trained by AdamW (docs/small_data.md#maf).
ALTERNATIVES: dict[str, dict[str, Any]] = {
    "recurrent": {"layers": ("autoregressive", "conv", "mlp"), "conditioner": "gru",
                  "lr": 1e-3},
    "maf": {"layers": ("maf", "maf"), "conditioner": "gru", "ar_order": 0,
            "optimizer": "adamw", "lr": 3e-3, "weight_decay": 0.05},
}


def resolved_alternatives(config: TrainConfig, features: int) -> tuple[str, ...]:
    """The alternatives a run trains on frames of ``features`` features: ``config.alternative``,
    with ``auto`` resolved (when ``layers`` is the default: the recurrent one, and the maf one
    for frames of more than one feature; else none).

    Example:
        >>> resolved_alternatives(TrainConfig(), 1), resolved_alternatives(TrainConfig(), 6)
        (('recurrent',), ('recurrent', 'maf'))
        >>> resolved_alternatives(TrainConfig.from_dict({"layers": ["attention", "mlp"]}), 6)
        ()
    """
    if config.alternative != "auto":
        return () if config.alternative == "none" else (config.alternative,)
    if config.model.layers != ModelConfig().layers:
        return ()
    return ("recurrent", "maf") if features > 1 else ("recurrent",)


def candidates(config: TrainConfig, features: int) -> list[tuple[str, TrainConfig]]:
    """The models a run trains, by name, each with settings of a plain run (``alternative =
    "none"``): the configured one first, then the alternatives, if any.

    Args:
        config: The settings of the run.
        features: Frame size ``D`` of its data.

    Returns:
        ``(name, settings)`` pairs, one to three.

    Example:
        >>> (configured, first), (recurrent, second) = candidates(TrainConfig(), features=1)
        >>> configured, first.model.layers, first.lr
        ('configured', ('conv', 'mlp'), 0.005)
        >>> recurrent, second.model.layers, second.model.conditioner, second.lr
        ('recurrent', ('autoregressive', 'conv', 'mlp'), 'gru', 0.001)
        >>> ", ".join(name for name, _ in candidates(TrainConfig(), features=6))
        'configured, recurrent, maf'
    """
    plain = config.replace(alternative="none")
    return [(CONFIGURED, plain)] + [
        (name, TrainConfig.from_dict({**plain.to_dict(), **ALTERNATIVES[name]}))
        for name in resolved_alternatives(config, features)]


@dataclass(frozen=True)
class CandidateResult:
    """How one candidate of a run ended.

    Attributes:
        name: ``"configured"`` or the alternative's name.
        best_val_nll: Its lowest validation NLL (``nan``: it failed or had no candidate epoch).
        best_epoch: The epoch of that NLL.
        epochs: Epochs trained.
        error: Why it failed (a diverged training), else ``None``.
    """

    name: str
    best_val_nll: float
    best_epoch: int
    epochs: int
    error: str | None = None


def choose(results: Sequence[CandidateResult]) -> CandidateResult:
    """The candidate with the lowest finite best validation NLL (the first on a tie).

    Raises:
        TrainingDivergedError: no candidate has a finite validation NLL (each failure named).

    Example:
        >>> a = CandidateResult("configured", 1.5, best_epoch=9, epochs=19)
        >>> choose([a, CandidateResult("recurrent", 1.2, best_epoch=4, epochs=14)]).name
        'recurrent'
    """
    finite = [result for result in results if math.isfinite(result.best_val_nll)]
    if not finite:
        failures = "; ".join(f"{result.name}: {result.error or 'no finite validation NLL'}"
                             for result in results)
        raise TrainingDivergedError(f"no candidate of the run trained: {failures}")
    return min(finite, key=lambda result: result.best_val_nll)


def train_candidates(
    choices: Sequence[tuple[str, TrainConfig]],
    train_one: Callable[[str, TrainConfig], T],
    summary: Callable[[T], tuple[float, int, int]],
) -> tuple[str, T, tuple[CandidateResult, ...]]:
    """Train every candidate in turn and choose (:func:`choose`).

    Args:
        choices: The candidates (:func:`candidates`).
        train_one: Trains one, given its name and settings; a
            :class:`~iresflow.train.epoch.TrainingDivergedError` marks it failed.
        summary: Its ``(best_val_nll, best_epoch, epochs)``.

    Returns:
        The kept candidate's name and what ``train_one`` returned for it, and every result.

    Raises:
        TrainingDivergedError: every candidate failed.
    """
    trained: dict[str, T] = {}
    results: list[CandidateResult] = []
    for name, config in choices:
        try:
            trained[name] = train_one(name, config)
        except TrainingDivergedError as error:
            results.append(CandidateResult(name, math.nan, 0, 0, str(error)))
            continue
        results.append(CandidateResult(name, *summary(trained[name])))
    kept = choose(results).name
    return kept, trained[kept], tuple(results)


def candidate_paths(paths: RunPaths, name: str) -> RunPaths:
    """The run folder of the candidate ``name`` of a run: ``RUN/candidates/NAME``."""
    return RunPaths(paths.candidates / name)


def adopt_candidate(paths: RunPaths, name: str) -> None:
    """Copy the settings, checkpoints and metrics of candidate ``name`` into the run folder."""
    source = candidate_paths(paths, name).root
    for item in source.iterdir():
        target = paths.root / item.name
        if item.is_dir():
            if target.exists():
                shutil.rmtree(target)
            shutil.copytree(item, target)
        else:
            shutil.copy2(item, target)


def write_selection(paths: RunPaths, results: Sequence[CandidateResult]) -> None:
    """Write ``selection.json``: every candidate's result and the name of the one kept
    (:func:`choose`'s)."""
    record = {"kept": choose(results).name, "candidates": [asdict(result) for result in results]}
    paths.selection.write_text(json.dumps(record, indent=2) + "\n", encoding="utf-8")


def read_selection(paths: RunPaths) -> tuple[CandidateResult, ...] | None:
    """The candidates of a run (the kept one is :func:`choose`'s), or ``None`` for a run of
    one model."""
    if not paths.selection.is_file():
        return None
    record = json.loads(paths.selection.read_text(encoding="utf-8"))
    return tuple(CandidateResult(**result) for result in record["candidates"])
