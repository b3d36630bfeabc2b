"""Checkpoints: atomic writes and code-free loading.

A checkpoint is a dict of tensors, numbers, strings, lists and dicts written with
:func:`torch.save`. :func:`save_checkpoint` writes it to a temporary file in the target folder and
moves it into place with :func:`os.replace`, so an interrupted or failed write never damages the
previous checkpoint. :func:`load_checkpoint` reads it with ``torch.load(..., weights_only=True)``,
which refuses any pickled object other than plain data: opening a checkpoint never runs code.

A training checkpoint (:meth:`iresflow.train.epoch.TrainingSession.state`, written by
:mod:`iresflow.train.loop`) holds the keys ``format`` (3), ``config`` (the
:class:`~iresflow.train.config.TrainConfig` as a flat dict: every setting of the run, the model's
included; the data complete the model settings, :func:`~iresflow.train.factories.build_model`;
format 2 also stored those completed settings as ``model_config``), ``model``,
``ema`` (the ``state_dict`` of the :class:`torch.optim.swa_utils.AveragedModel` of the weights,
or ``None``; format 1 stored the averages by parameter name), ``optimizer``, ``scheduler``,
``warmup`` (the state of the learning-rate warm-up, or ``None``; absent before warm-up existed),
``rng`` (every random state as a tensor: torch's global CPU generator, the CUDA generator of the
training device, the minibatch-order and the log-determinant generators; iresflow draws no
numbers from Python's ``random`` or NumPy), ``epoch``, ``best_epoch``, ``best_metric``,
``bad_epochs`` and ``history`` (the metrics of every epoch).
"""

from __future__ import annotations

import os
import pickle
import re
import tempfile
import warnings
import zipfile
from pathlib import Path
from typing import Any

import torch

__all__ = ["CheckpointError", "load_checkpoint", "save_checkpoint"]


class CheckpointError(RuntimeError):
    """A checkpoint is missing, unreadable, or holds something other than plain data."""


def save_checkpoint(state: dict[str, Any], path: str | Path) -> None:
    """Write ``state`` to ``path`` atomically.

    The data go to a temporary file next to ``path``, are flushed to disk and then renamed over
    ``path`` in one step; if anything fails, the temporary file is removed and an existing file at
    ``path`` is left untouched.

    Raises:
        CheckpointError: the write failed (full disk, unwritable folder), with the reason.

    Args:
        state: Plain data (tensors, numbers, strings, ``None``, lists, tuples, dicts).
        path: Destination file; its folder must exist.

    Example:
        >>> import tempfile, pathlib
        >>> folder = pathlib.Path(tempfile.mkdtemp())
        >>> save_checkpoint({"epoch": 3, "w": torch.ones(2)}, folder / "last.pt")
        >>> load_checkpoint(folder / "last.pt")["epoch"]
        3
    """
    path = Path(path)
    try:
        handle, temp_name = tempfile.mkstemp(
            prefix=f".{path.name}.", suffix=".tmp", dir=path.parent
        )
    except OSError as error:
        raise _write_error(path, error) from None
    try:
        with os.fdopen(handle, "wb") as file:
            torch.save(state, file)
            file.flush()
            os.fsync(file.fileno())
        os.replace(temp_name, path)
    except BaseException as error:
        Path(temp_name).unlink(missing_ok=True)
        if isinstance(error, OSError) or isinstance(error.__cause__, OSError):
            raise _write_error(path, error) from None
        raise


def _write_error(path: Path, error: BaseException) -> CheckpointError:
    """One-line message for a failed write (full disk, unwritable folder)."""
    cause = error if isinstance(error, OSError) else error.__cause__
    reason = cause.strerror if isinstance(cause, OSError) and cause.strerror else str(error)
    return CheckpointError(
        f"cannot write checkpoint {path}: {reason}; any previous checkpoint there is unchanged"
    )


def load_checkpoint(path: str | Path, map_location: str | torch.device = "cpu") -> dict[str, Any]:
    """Read a checkpoint without executing any code.

    Args:
        path: A file written by :func:`save_checkpoint`.
        map_location: Device for the loaded tensors.

    Returns:
        The stored dict.

    Raises:
        CheckpointError: the file is missing, is not a checkpoint (truncated, corrupt), or
            contains anything but plain data, e.g. a pickled object that would run code.
    """
    path = Path(path)
    if not path.is_file():
        raise CheckpointError(f"checkpoint not found: {path}")
    if not zipfile.is_zipfile(path):  # torch.save always writes a zip archive
        raise CheckpointError(f"cannot read checkpoint {path}: not a torch archive (corrupt?)")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # protocol notes on foreign pickles; we refuse them
            state = torch.load(path, map_location=map_location, weights_only=True)
    except pickle.UnpicklingError as error:
        found = re.search(r"unsupported GLOBAL (\S+)", str(error))
        detail = f" (it references {found.group(1)})" if found else ""
        raise CheckpointError(
            f"refusing checkpoint {path}: it holds objects other than plain data and may run "
            f"code when opened{detail}; it was not loaded"
        ) from None
    except Exception as error:  # torch.load raises many types for truncated or foreign bytes
        reason = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise CheckpointError(f"cannot read checkpoint {path}: {reason}") from None
    if not isinstance(state, dict):
        raise CheckpointError(
            f"refusing checkpoint {path}: expected a dict, got {type(state).__name__}"
        )
    return state
