"""User files of every kind: which kind a file's ending names, and its sequences and labels.

A user's data come as an ``.npz`` archive (:mod:`iresflow.data.npz`), a ``.ts`` file
(:func:`~iresflow.data.readers.read_ts`) or a long-format table
(:func:`~iresflow.data.tables.read_table`); :func:`~iresflow.data.datasets.load_dataset` splits
and standardises them alike.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from torch import Tensor

from iresflow.data.npz import read_npz, read_npz_labels
from iresflow.data.readers import observed_frames, pad_sequences, read_ts
from iresflow.data.table_columns import is_data_frame
from iresflow.data.tables import TABLE_SUFFIXES, TableLayout, read_table

__all__ = ["USER_FILE_SUFFIXES", "USER_SOURCES", "check_table_arguments", "read_user_file",
           "read_user_labels", "source_name", "user_file_kind"]

#: The kind of user data each ending of a file names.
_FILE_KINDS = {".npz": "npz", ".ts": "ts", ".ts.gz": "ts", **dict.fromkeys(TABLE_SUFFIXES, "table")}
#: Endings of a user file given as the ``name`` of :func:`~iresflow.data.datasets.load_dataset`
#: (the ``data`` and ``test_data`` of a run).
USER_FILE_SUFFIXES = tuple(_FILE_KINDS)
#: What the ``path`` of each kind of user data is.
USER_SOURCES = {"npz": "an .npz file", "ts": "a .ts file",
                "table": "a .csv or .parquet file or a pandas DataFrame"}


def user_file_kind(name: str) -> str | None:
    """The kind of user data (``"npz"``, ``"ts"``, ``"table"``) a file name's ending names.

    Example:
        >>> user_file_kind("Toy_TRAIN.ts.gz"), user_file_kind("sales.CSV"), user_file_kind("x")
        ('ts', 'table', None)
    """
    lowered = name.lower()
    return next((kind for end, kind in _FILE_KINDS.items() if lowered.endswith(end)), None)


def source_name(source: Path | Any) -> str:
    """A user file's path, or ``"DataFrame"``, for messages."""
    return "DataFrame" if is_data_frame(source) else str(source)


def read_user_file(kind: str, file: Path | Any, layout: TableLayout) -> tuple[Tensor, Tensor]:
    """Padded raw sequences ``(B, N, D)`` and the mask of observed frames of user data."""
    if kind == "npz":
        return read_npz(file)
    if kind == "table":
        return read_table(file, layout)
    raw, mask = pad_sequences(read_ts(file).series)
    try:
        return observed_frames(raw, mask)
    except ValueError as error:
        raise ValueError(f"{file}: {error}") from None


def read_user_labels(kind: str, file: Path | Any) -> list[str] | None:
    """Class labels of a user file: ``y`` of an ``.npz``, the ``:label`` fields of a ``.ts``
    (a table has none)."""
    if kind == "table":
        return None
    return read_npz_labels(file) if kind == "npz" else read_ts(file).labels


def check_table_arguments(name: str, path: object, test_path: object, table: object) -> None:
    """Table settings and DataFrames are for table data only (``ValueError``)."""
    if name == "table" or user_file_kind(name) == "table":
        return
    if isinstance(table, TableLayout) and table.given():
        raise ValueError(f"table is only used by table data (.csv, .parquet, a pandas DataFrame), "
                         f"not {name!r}")
    if any(is_data_frame(value) for value in (path, test_path)):
        raise ValueError(f"a DataFrame is table data (load_dataset('table', path=frame)), not "
                         f"{name!r}")
