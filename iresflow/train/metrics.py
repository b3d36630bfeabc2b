"""Writing the metrics of a run: JSONL and CSV tables, TensorBoard events, progress lines, and
per-sequence score tables."""

from __future__ import annotations

import csv
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from iresflow.train.config import ConfigError
from iresflow.train.paths import RunPaths

__all__ = ["SCORE_SUFFIXES", "epoch_summary", "tensorboard_writer", "write_metrics", "write_scores"]

#: File endings :func:`write_scores` writes.
SCORE_SUFFIXES = (".csv", ".npz")


def write_metrics(paths: RunPaths, history: list[dict[str, float]]) -> None:
    """Rewrite ``metrics.jsonl`` and ``metrics.csv`` from the history (one row per epoch).

    Example:
        >>> import tempfile, pathlib
        >>> paths = RunPaths(pathlib.Path(tempfile.mkdtemp()))
        >>> write_metrics(paths, [{"epoch": 1, "val_nll": 2.5}])
        >>> paths.metrics_csv.read_text().splitlines()
        ['epoch,val_nll', '1,2.5']
    """
    with paths.metrics_jsonl.open("w", encoding="utf-8") as file:
        for row in history:
            file.write(json.dumps(row) + "\n")
    with paths.metrics_csv.open("w", encoding="utf-8", newline="") as file:
        if history:
            writer = csv.DictWriter(file, fieldnames=list(history[0]))
            writer.writeheader()
            writer.writerows(history)


def tensorboard_writer(paths: RunPaths, epoch: int) -> Any:
    """A TensorBoard ``SummaryWriter`` into ``paths.tensorboard`` that continues after ``epoch``.

    Events of later epochs left by an interrupted run are purged.

    Raises:
        ConfigError: the tensorboard package is not installed.
    """
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:
        raise ConfigError("tensorboard = true needs the tensorboard package") from None
    return SummaryWriter(log_dir=str(paths.tensorboard), purge_step=epoch + 1)


def epoch_summary(row: dict[str, float], best_epoch: int) -> str:
    """The one-line progress report of an epoch's metrics.

    Args:
        row: The epoch's metrics (``epoch``, ``train_nll``, ``val_nll``, ``lr``,
            ``train_seconds``; ``val_nll_stderr`` and the inverse check where present).
        best_epoch: The epoch of the lowest validation NLL so far (training runs until it
            stops improving, so the report names it instead of the cap ``epochs``).

    Example:
        >>> row = {"epoch": 1, "train_nll": 2.0, "val_nll": 1.5, "lr": 1e-3,
        ...        "inverse_iterations": 7, "inverse_residual": 1e-9,
        ...        "reconstruction_error": 1e-8, "train_seconds": 0.5}
        >>> epoch_summary(row, 1)
        'epoch 1 (best 1)  train 2.0000  val 1.5000  lr 1.00e-03  inverse 7 it, residual 1.0e-09, error 1.0e-08  (0.5 s)'
    """  # noqa: E501
    text = (f"epoch {row['epoch']} (best {best_epoch})  train {row['train_nll']:.4f}  "
            f"val {row['val_nll']:.4f}")
    if "val_nll_stderr" in row:
        text += f" ± {row['val_nll_stderr']:.4f}"
    text += f"  lr {row['lr']:.2e}"
    if "inverse_iterations" in row:  # a flow's inverse check
        text += (
            f"  inverse {row['inverse_iterations']:.0f} it, residual "
            f"{row['inverse_residual']:.1e}, error {row['reconstruction_error']:.1e}"
        )
    return f"{text}  ({row['train_seconds']:.1f} s)"


def write_scores(path: str | os.PathLike, columns: dict[str, Any]) -> Path:
    """Write a table of per-sequence scores as ``.csv`` (a header row, one row per sequence) or
    ``.npz`` (one array per column), chosen by the suffix of ``path``.

    Args:
        path: Destination ending in ``.csv`` or ``.npz``; missing folders are created.
        columns: Column name to values, each a sequence (tensor, array or list) of length ``B``.

    Returns:
        ``path`` as a :class:`~pathlib.Path`.

    Raises:
        ValueError: another suffix, or columns of different lengths.

    Example:
        >>> import tempfile, pathlib, torch
        >>> path = pathlib.Path(tempfile.mkdtemp()) / "s.csv"
        >>> columns = {"index": torch.arange(2), "log_prob": torch.tensor([-1.5, 2.0])}
        >>> _ = write_scores(path, columns)
        >>> path.read_text().splitlines()
        ['index,log_prob', '0,-1.5', '1,2.0']
    """
    path = Path(path)
    if path.suffix not in SCORE_SUFFIXES:
        raise ValueError(f"scores must name a .csv or .npz file, got {str(path)!r}")
    arrays = {name: np.asarray(values) for name, values in columns.items()}
    lengths = {len(values) for values in arrays.values()}
    if len(lengths) > 1:
        raise ValueError(f"score columns must have one length, got {sorted(lengths)}")
    path.parent.mkdir(parents=True, exist_ok=True)
    if path.suffix == ".npz":
        np.savez(path, **arrays)
        return path
    with path.open("w", encoding="utf-8", newline="") as file:
        writer = csv.writer(file)
        writer.writerow(arrays)
        writer.writerows(zip(*(values.tolist() for values in arrays.values()), strict=True))
    return path
