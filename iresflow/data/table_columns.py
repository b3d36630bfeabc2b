"""The columns of a table: a CSV file, a Parquet file or a pandas DataFrame, read alike.

:func:`read_columns` is the first step of :func:`~iresflow.data.tables.read_table`: it reads a
table into one array per column, so that the series are built from any source by the same code.
A CSV file is read with the standard library (one UTF-8 header line of column names, comma
separated, every cell a string); a Parquet file with pandas and pyarrow; a DataFrame's columns
keep their dtypes (integers, floats, datetimes; other columns hold Python objects).
"""

from __future__ import annotations

import csv
import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from iresflow.data.readers import existing_file

__all__ = [
    "MISSING_TEXT", "Columns", "is_data_frame", "missing", "number", "numbers", "read_columns",
]

#: Texts of a missing value (compared without case and surrounding blanks).
MISSING_TEXT = frozenset({"", "na", "nan", "null"})


@dataclass(frozen=True)
class Columns:
    """A table as one array per column.

    Attributes:
        name: The file, or ``"DataFrame"``, for messages.
        columns: One array of shape ``(rows,)`` per column, by name, in the table's order.
        lines: The line of every row of a CSV file (``None``: rows counted from 0).
    """

    name: str
    columns: dict[str, np.ndarray]
    lines: list[int] | None

    @property
    def rows(self) -> int:
        """Number of rows."""
        return len(next(iter(self.columns.values()))) if self.columns else 0

    def cell(self, name: str, row: int) -> Any:
        """The cell of column ``name`` in row ``row`` as a Python value, for messages."""
        value = self.columns[name][row]
        if isinstance(value, np.datetime64):
            return str(value)
        return value.item() if isinstance(value, np.generic) else value

    def where(self, row: int) -> str:
        """Where row ``row`` is, for messages: ``line 7`` of a CSV file, else ``row 5``."""
        return f"line {self.lines[row]}" if self.lines is not None else f"row {row}"


def is_data_frame(value: Any) -> bool:
    """Whether ``value`` is a pandas DataFrame (without importing pandas)."""
    pandas = sys.modules.get("pandas")
    return pandas is not None and isinstance(value, pandas.DataFrame)


def read_columns(source: str | os.PathLike | Any) -> Columns:
    """The columns of a ``.csv`` or ``.parquet`` file or of a pandas DataFrame.

    Raises:
        FileNotFoundError: the file does not exist.
        ImportError: a Parquet file without pandas and pyarrow.
        ValueError: naming the file: not UTF-8 text, no header, a row with another number of
            cells than the header, an empty or repeated column name, an unreadable Parquet file.
    """
    if is_data_frame(source):
        return Columns("DataFrame", _frame_columns(source, "DataFrame"), None)
    path = existing_file(source)
    if path.name.lower().endswith(".parquet"):
        return Columns(str(path), _frame_columns(_read_parquet(path), str(path)), None)
    try:
        return _read_csv(path)
    except (UnicodeDecodeError, csv.Error) as error:
        raise ValueError(f"{path}: not a readable CSV file ({error})") from None


def _read_csv(path: Path) -> Columns:
    with open(path, newline="", encoding="utf-8-sig") as handle:  # -sig: a spreadsheet's BOM
        reader = csv.reader(handle)
        header = next(reader, None)
        if header is None:
            raise ValueError(f"{path}: empty file (no header line of column names)")
        names = [name.strip() for name in header]
        _check_names(names, str(path))
        rows, lines = [], []
        for row in reader:
            if not row:  # a blank line
                continue
            if len(row) != len(names):
                raise ValueError(f"{path}: line {reader.line_num}: {len(row)} cells, the header "
                                 f"has {len(names)}")
            rows.append(row)
            lines.append(reader.line_num)
    cells = list(zip(*rows, strict=True)) if rows else [() for _ in names]
    columns = {name: np.array([c.strip() for c in column], dtype=object)
               for name, column in zip(names, cells, strict=True)}
    return Columns(str(path), columns, lines)


def _read_parquet(path: Path) -> Any:
    try:
        import pandas
        import pyarrow
    except ImportError as error:
        raise ImportError(
            f"reading the Parquet file {path} needs pandas and pyarrow "
            "(pip install iresflow[tables])"
        ) from error
    try:
        return pandas.read_parquet(path, engine="pyarrow")
    except (OSError, ValueError, pyarrow.ArrowException) as error:
        raise ValueError(f"{path}: not a readable Parquet file ({error})") from None


def _frame_columns(frame: Any, name: str) -> dict[str, np.ndarray]:
    """A DataFrame's columns (named index levels first) as arrays: integers without missing
    values as int64, other numbers as float64 (NaN at missing values), datetimes as
    ``datetime64[ns]`` (in UTC), anything else as Python objects."""
    import pandas

    if any(level is not None for level in frame.index.names):
        frame = frame.reset_index()
    names = [str(column) for column in frame.columns]
    _check_names(names, name)
    columns = {}
    for label, series in zip(names, (frame.iloc[:, k] for k in range(frame.shape[1])),
                             strict=True):
        dtype = series.dtype
        if pandas.api.types.is_bool_dtype(dtype):
            array = series.to_numpy(dtype=object)
        elif pandas.api.types.is_integer_dtype(dtype) and not series.hasnans:
            array = series.to_numpy(dtype=np.int64)
        elif pandas.api.types.is_numeric_dtype(dtype):
            array = series.to_numpy(dtype=np.float64, na_value=np.nan)
        elif pandas.api.types.is_datetime64_any_dtype(dtype):
            if getattr(dtype, "tz", None) is not None:
                series = series.dt.tz_convert("UTC").dt.tz_localize(None)
            array = series.to_numpy(dtype="datetime64[ns]")
        else:
            array = series.to_numpy(dtype=object)
        columns[label] = array
    return columns


def _check_names(names: list[str], source: str) -> None:
    """Column names must be non-empty and distinct."""
    for k, name in enumerate(names):
        if not name:
            raise ValueError(f"{source}: column {k + 1} has no name")
        if name in names[:k]:
            raise ValueError(f"{source}: two columns are named {name!r}")


def missing(value: Any) -> bool:
    """Whether a cell is a missing value of Python, numpy or pandas: ``None``, NaN, NaT, NA."""
    if value is None or type(value).__name__ in ("NAType", "NaTType"):
        return True
    if isinstance(value, np.datetime64):
        return bool(np.isnat(value))
    return isinstance(value, float | np.floating) and math.isnan(value)


def number(cell: Any) -> float | None:
    """A cell as a number: NaN for a missing value (:func:`missing`, or a text of
    :data:`MISSING_TEXT`), ``None`` if it is not a number (text, a date, a boolean).

    Example:
        >>> number(" 1.5 "), number("NA"), number("1.5x"), number(2)
        (1.5, nan, None, 2.0)
    """
    if missing(cell):
        return math.nan
    if isinstance(cell, bool | np.bool_):
        return None
    if isinstance(cell, int | float | np.integer | np.floating):
        return float(cell)
    if not isinstance(cell, str):
        return None
    text = cell.strip()
    if text.lower() in MISSING_TEXT:
        return math.nan
    try:
        return float(text)
    except ValueError:
        return None


def numbers(column: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """A column as float64 numbers (:func:`number` of every cell).

    Returns:
        The values ``(rows,)``, NaN at missing values and at cells that are not numbers, and
        the boolean mask ``(rows,)`` of the cells that are not numbers.
    """
    if column.dtype.kind in "iuf":
        return column.astype(np.float64), np.zeros(column.shape, dtype=bool)
    if all(type(cell) is str for cell in column):
        try:  # the common case of a CSV column: float() of every text, in C
            return column.astype(np.float64), np.zeros(column.shape, dtype=bool)
        except ValueError:
            pass  # missing values or text: cell by cell
    parsed = [number(cell) for cell in column]
    text = np.array([value is None for value in parsed], dtype=bool)
    return np.array([math.nan if value is None else value for value in parsed]), text
