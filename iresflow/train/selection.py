"""Choosing between two models on the validation split: the configured one and an alternative.

A run whose ``alternative`` setting names one (``auto`` does when ``layers`` is left at its
default) trains two candidates one after the other on the same split and seed: the model as
configured, and the same settings with the alternative's changes (:data:`ALTERNATIVES`). Each
candidate is an ordinary run in ``RUN/candidates/NAME``; the one with the lower best validation
NLL is kept (the configured one on a tie, or when the other failed): its settings, checkpoints and
metrics are copied into ``RUN``, which then is a plain run of the kept model, and
``RUN/selection.json`` records both candidates (docs/guide.md#model-selection).

The residual blocks of the default read a few frames on either side and fit many small
multivariate sets best; autoregressive steps conditioned by a GRU on every past frame fit one-
feature series with long memory best (docs/small_data.md#recurrent-conditioner). Neither wins
everywhere and the validation split tells them apart, so the default run tries both.
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
    "resolved_alternative",
    "train_candidates",
    "write_selection",
]

T = TypeVar("T")

#: Name of the candidate trained with the settings as given.
CONFIGURED = "configured"

#: The alternatives a run can try beside its configured model, as changes of its settings.
ALTERNATIVES: dict[str, dict[str, Any]] = {
    "recurrent": {"layers": ("autoregressive", "conv", "mlp"), "conditioner": "gru",
                  "lr": 1e-3},
}


def resolved_alternative(config: TrainConfig) -> str:
    """The alternative a run trains: ``config.alternative``, with ``auto`` resolved (the
    recurrent one when ``layers`` is the default, else ``none``).

    Example:
        >>> resolved_alternative(TrainConfig())
        'recurrent'
        >>> resolved_alternative(TrainConfig.from_dict({"layers": ["attention", "mlp"]}))
        'none'
    """
    if config.alternative != "auto":
        return config.alternative
    return "recurrent" if config.model.layers == ModelConfig().layers else "none"


def candidates(config: TrainConfig) -> list[tuple[str, TrainConfig]]:
    """The models a run trains, by name, each with settings of a plain run (``alternative =
    "none"``): the configured one first, then the alternative, if any.

    Args:
        config: The settings of the run.

    Returns:
        One or two ``(name, settings)`` pairs.

    Example:
        >>> (configured, first), (recurrent, second) = candidates(TrainConfig())
        >>> configured, first.model.layers, first.lr
        ('configured', ('conv', 'mlp'), 0.005)
        >>> recurrent, second.model.layers, second.model.conditioner, second.lr
        ('recurrent', ('autoregressive', 'conv', 'mlp'), 'gru', 0.001)
    """
    name = resolved_alternative(config)
    plain = config.replace(alternative="none")
    if name == "none":
        return [(CONFIGURED, plain)]
    return [(CONFIGURED, plain),
            (name, TrainConfig.from_dict({**plain.to_dict(), **ALTERNATIVES[name]}))]


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
