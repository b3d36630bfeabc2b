"""The figures of a finished run: learning curves, samples next to test sequences, marginals,
fan charts of forecasts.

Drawn with :mod:`iresflow.runs.plots` in the data's original units, with the dataset's axis
names. The test sequences shown are the first :data:`PLOT_TEST_SEQUENCES` of the test split.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from torch import Tensor

from iresflow.runs.forecast import Forecast
from iresflow.runs.load import LoadedRun, full_history
from iresflow.runs.plots import (
    PlotLabels,
    plot_fan,
    plot_learning_curves,
    plot_marginals,
    plot_traces,
)
from iresflow.runs.sample import Samples, sample_run
from iresflow.train.config import ConfigError
from iresflow.train.likelihood import batch_context, trimmed_batch

__all__ = ["plot_forecast", "plot_samples", "plotted_test_sequences", "write_plots"]

#: Sequences sampled for the figures of :func:`write_plots`.
PLOT_SAMPLES = 64
#: Test sequences shown in the figures at most (all of a smaller test split).
PLOT_TEST_SEQUENCES = 1000


def write_plots(run: LoadedRun, *, seed: int = 0) -> list[Path]:
    """Write the run's figures into ``plots/``.

    ``learning_curves.png`` (NLL and learning rate of every epoch of the run, from the ``last``
    checkpoint, whichever checkpoint ``run`` holds, with the best epoch marked), ``samples.png``
    (the :data:`PLOT_SAMPLES` sampled sequences, their lengths drawn from the training lengths,
    and the test sequences of :func:`plotted_test_sequences`, as per-feature traces) and
    ``marginals.png`` (per-feature histograms of the frames of those test sequences and of the
    sampled frames), all in the data's original units with the dataset's axis names
    (:meth:`~iresflow.runs.plots.PlotLabels.for_dataset`). A conditional run samples sequence
    ``i`` with the context (class or covariates) of the ``i``-th plotted test sequence, so the
    samples and the real sequences they are drawn next to share their conditions.

    Args:
        run: A loaded run.
        seed: Seed of the samples.

    Returns:
        The paths written.
    """
    real, mask = plotted_test_sequences(run)
    index = torch.arange(PLOT_SAMPLES) % len(real)
    context = batch_context(run.model, run.dataset.test, index, torch.device("cpu"))
    samples = sample_run(run, num=PLOT_SAMPLES, seed=seed, context=context)
    folder = run.paths.plots
    labels = PlotLabels.for_dataset(run.dataset.name)
    history, best_epoch = full_history(run)
    written = [] if not history else [
        plot_learning_curves(
            history, folder / "learning_curves.png", unit=run.dataset.unit, best_epoch=best_epoch
        )
    ]
    written.append(plot_traces(
        real, mask, samples.x, samples.mask, folder / "samples.png", labels=labels
    ))
    written.append(plot_marginals(
        real, mask, samples.x, samples.mask, folder / "marginals.png", labels=labels
    ))
    return written


def plotted_test_sequences(run: LoadedRun) -> tuple[Tensor, Tensor]:
    """The test sequences the figures show, in original units, on the CPU.

    The first :data:`PLOT_TEST_SEQUENCES` of the test split (all of a smaller one), so a split
    read from disk (:class:`~iresflow.data.store.StoredSplit`) is never loaded whole.

    Args:
        run: A loaded run.

    Returns:
        ``(x, mask)`` of shapes ``(b, n, D)`` and ``(b, n)``, ``n`` the longest of them.
    """
    test = run.dataset.test
    index = torch.arange(min(len(test), PLOT_TEST_SEQUENCES))
    x, mask = trimmed_batch(test, index, torch.device("cpu"))
    return run.dataset.to_raw(x, mask), mask


def plot_samples(run: LoadedRun, samples: Samples, path: str | Path) -> Path:
    """Per-feature traces of samples next to the test sequences of :func:`plotted_test_sequences`.

    Samples of one class (a label-conditional run) are drawn next to the test sequences of that
    class, when the plotted ones hold some.

    Args:
        run: A loaded run.
        samples: What :func:`~iresflow.runs.sample.sample_run` drew.
        path: The ``.png`` file.

    Returns:
        The path written.
    """
    real, mask = plotted_test_sequences(run)
    context = samples.context
    one_class = run.config.condition == "label" and context is not None
    if one_class and bool((context == context[0]).all()):
        same = run.dataset.test.labels[: len(real)] == context[0]
        real, mask = (real[same], mask[same]) if bool(same.any()) else (real, mask)
    return plot_traces(
        real, mask, samples.x, samples.mask, path, labels=PlotLabels.for_dataset(run.dataset.name)
    )


def plot_forecast(run: LoadedRun, forecast: Forecast, sequence: int, path: str | Path) -> Path:
    """The fan chart (:func:`~iresflow.runs.plots.plot_fan`) of one forecast sequence.

    Args:
        run: The run that forecast.
        forecast: What :func:`~iresflow.runs.forecast.forecast_run` drew.
        sequence: Which of its sequences, ``0 <= sequence < B`` (an index into
            ``forecast.index``).
        path: The ``.png`` file.

    Returns:
        The path written.

    Raises:
        ConfigError: ``sequence`` out of range.
    """
    count = forecast.samples.shape[1]
    if not 0 <= sequence < count:
        raise ConfigError(f"plot_sequence must be in [0, {count}) for this forecast of {count} "
                          f"sequences, got {sequence}")
    truth = None if forecast.truth is None else forecast.truth[sequence]
    truth_mask = None if forecast.truth_mask is None else forecast.truth_mask[sequence]
    start = int(forecast.start[sequence])
    labels = PlotLabels.for_dataset(run.dataset.name)
    return plot_fan(
        forecast.observed[sequence, :start], forecast.mask[sequence, :start],
        forecast.samples[:, sequence], start, path, truth=truth, truth_mask=truth_mask,
        labels=replace(labels, data=_source_title(labels.data, forecast, sequence)),
    )


def _source_title(data: str, forecast: Forecast, sequence: int) -> str:
    """Where a forecast sequence comes from, for titles: the run's data and the split of a
    held-out forecast, or the file whose series were continued, with the sequence's index.

    Example:
        >>> held = Forecast(torch.zeros(2, 1, 3, 1), torch.zeros(1, 5, 1),
        ...                 torch.ones(1, 5, dtype=torch.bool), torch.tensor([5]),
        ...                 torch.tensor([7]), torch.zeros(1, 3, 1), None, None, {}, "test")
        >>> _source_title("GunPoint_TRAIN.ts", held, 0)
        'GunPoint_TRAIN.ts, test split, sequence 7'
        >>> _source_title("GunPoint_TRAIN.ts", replace(held, truth=None, source="/d/new.csv"), 0)
        'new.csv, sequence 7'
    """
    index = int(forecast.index[sequence])
    if forecast.truth is None:
        return f"{Path(forecast.source).name}, sequence {index}"
    return f"{data}, {forecast.source} split, sequence {index}"
