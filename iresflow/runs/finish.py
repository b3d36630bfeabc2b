"""``iresflow train`` from Python: train a run, then its test NLL and figures on the same model.

:func:`train_and_evaluate` trains (:func:`~iresflow.train.loop.train_and_finish`, in the
processes of the run) and then, in every process, evaluates the best checkpoint on the test
split with the model and the data of training (:func:`~iresflow.runs.load.trained_run`): one
model build and one data load per process. Rank 0 writes the figures.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from iresflow.runs.evaluate import evaluate_run
from iresflow.runs.figures import write_plots
from iresflow.runs.load import trained_run
from iresflow.runs.settings import EvaluateSettings
from iresflow.train.config import TrainConfig
from iresflow.train.distributed import current_world
from iresflow.train.loop import FittedRun, TrainResult, train_and_finish

__all__ = ["FinishedRun", "train_and_evaluate"]


@dataclass(frozen=True)
class FinishedRun:
    """What ``iresflow train`` reports.

    Attributes:
        result: The summary of the training.
        evaluation: The test NLL of the best checkpoint (:func:`~iresflow.runs.evaluate.
            evaluate_run` with ``method="auto"``), also saved in ``evaluation.json``.
        plots: The figures written (:func:`~iresflow.runs.figures.write_plots`).
    """

    result: TrainResult
    evaluation: dict[str, Any]
    plots: list[Path]


def train_and_evaluate(
    config: TrainConfig,
    run_dir: str | os.PathLike,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
) -> FinishedRun:
    """Train a run, then measure its test NLL and draw its figures (``iresflow train``).

    The test NLL uses ``method="auto"`` with ``config.eval_n_samples`` pilot estimates and
    ``config.seed``; the figures are sampled with ``config.seed``.

    Args:
        config: All settings.
        run_dir: Run folder.
        resume: As in :func:`~iresflow.train.loop.train`.
        overwrite: As in :func:`~iresflow.train.loop.train`.
        progress: As in :func:`~iresflow.train.loop.train`.

    Returns:
        A :class:`FinishedRun` (rank 0's when processes were started).

    Raises:
        ConfigError, CheckpointError, TrainingDivergedError: as in
            :func:`~iresflow.train.loop.train`.
    """
    return train_and_finish(
        config, run_dir, _evaluate_and_plot, resume=resume, overwrite=overwrite,
        progress=progress,
    )


def _evaluate_and_plot(fitted: FittedRun) -> FinishedRun:
    """The end of ``iresflow train`` on one rank: the test NLL (shared by the ranks), figures."""
    run = trained_run(fitted)
    config = fitted.config
    settings = EvaluateSettings(method="auto", n_samples=config.eval_n_samples, seed=config.seed)
    evaluation = evaluate_run(run, settings)
    plots = write_plots(run, seed=config.seed) if current_world().main else []
    return FinishedRun(fitted.result, evaluation, plots)
