r"""Time series in long-format tables: CSV and Parquet files and pandas DataFrames.

A long-format table holds one row per time step of a series: a column naming the series, a
column of times and one column of values per feature. :func:`read_table` turns it into padded
sequences and the mask of their observed frames, the form every user file takes
(:func:`~iresflow.data.readers.read_ts`, :func:`~iresflow.data.npz.read_npz`); how the table
is read is a :class:`TableLayout`. Each series is laid on a regular time grid, whose step is the
most common difference between consecutive times: a time step without a row and a row with a
missing value become missing frames. The series are in the order of their first row and may be
cut into windows. Details and a worked example: ``docs/datasets.md#tables``.

CSV files are read with the standard library; Parquet files need pandas and pyarrow
(``pip install iresflow[tables]``).
"""

from __future__ import annotations

import dataclasses
import datetime
import os
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from torch import Tensor

from iresflow._settings import ConfigError, SettingsRecord, check_minimum, setting
from iresflow.data.readers import observed_frames, pad_sequences
from iresflow.data.table_columns import (
    Columns,
    is_data_frame,
    missing,
    number,
    numbers,
    read_columns,
)

__all__ = ["TABLE_SETTINGS", "TABLE_SUFFIXES", "TableLayout", "read_table"]

#: Endings of a table file: CSV (standard library) or Parquet (pandas and pyarrow).
TABLE_SUFFIXES = (".csv", ".parquet")

#: Tolerance, in steps, of a float time off its grid point (binary rounding of e.g. 0.1 steps).
GRID_TOLERANCE = 1e-6


@dataclass(frozen=True)
class TableLayout(SettingsRecord):
    """How a long-format table holds its series, and how they are cut into sequences.

    The same settings are those of a training run on a table file
    (:class:`~iresflow.train.config.TrainConfig`, ``--id-column`` and so on).

    Raises:
        ConfigError: a window or stride below 1, a stride without a window, no value column,
            or one column named twice.

    Example:
        >>> TableLayout(id_column="station", time_column="date", window=24).stride is None
        True
        >>> TableLayout(stride=2)
        Traceback (most recent call last):
        ...
        iresflow._settings.ConfigError: stride = 2 needs a window
    """

    id_column: str | None = setting(
        None, "table data: the column naming the series of each row", unset="one series"
    )
    time_column: str | None = setting(
        None, "table data: the column of times (numbers or ISO dates), on a regular grid whose "
        "missing steps become missing frames", unset="the order of the rows"
    )
    value_columns: tuple[str, ...] | None = setting(
        None, "table data: the columns of values, one feature each",
        unset="every other numeric column",
    )
    window: int | None = setting(
        None, "table data: cut every series into windows of this many frames",
        unset="each series is one sequence",
    )
    stride: int | None = setting(
        None, "table data: frames from the start of one window to the start of the next",
        unset="the window",
    )
    window_split: str = setting(
        "blocks", "table data: how windows that overlap (a stride shorter than the window) are "
        "split: blocks in table order, leaving out the windows that overlap the next block, so "
        "no frame lies in two splits (docs/datasets.md#validation-split); or random, as other "
        "sequences, where a validation window can share frames with training ones",
        ("blocks", "random"),
    )

    def check(self) -> None:
        check_minimum(self, ("window", "stride"), 1)
        if self.stride is not None and self.window is None:
            raise ConfigError(f"stride = {self.stride} needs a window")
        if self.value_columns == ():
            raise ConfigError("value_columns must name at least one column (none: every other "
                              "numeric column)")
        names = [self.id_column, self.time_column, *(self.value_columns or ())]
        names = [name for name in names if name is not None]
        if "" in names:
            raise ConfigError("a column name must not be empty")
        twice = next((name for k, name in enumerate(names) if name in names[:k]), None)
        if twice is not None:
            raise ConfigError(
                f"column {twice!r} is named twice (the id, time and value columns are distinct)"
            )

    def given(self) -> list[str]:
        """The settings that differ from their defaults and change how a table is read, in
        order (``window_split`` does nothing without a window; older runs record ``random``).

        Example:
            >>> TableLayout(window=4, window_split="random").given(), TableLayout().given()
            (['window', 'window_split'], [])
        """
        default = TableLayout()
        changed = [f.name for f in dataclasses.fields(self)
                   if getattr(self, f.name) != getattr(default, f.name)]
        return changed if self.window is not None else [n for n in changed if n != "window_split"]

    @property
    def overlap(self) -> int:
        """How many of the next windows of a series share a frame with a window (those left out
        between two blocks of the split): ``(window - 1) // stride``, 0 without overlap.

        Example:
            >>> TableLayout(window=12, stride=3).overlap, TableLayout(window=12).overlap
            (3, 0)
        """
        return 0 if self.window is None or self.stride is None else (self.window - 1) // self.stride


#: Names of the :class:`TableLayout` settings, in order.
TABLE_SETTINGS = tuple(f.name for f in dataclasses.fields(TableLayout))


def read_table(
    source: str | os.PathLike | Any, layout: TableLayout | None = None
) -> tuple[Tensor, Tensor]:
    """Read the series of a long-format table as padded sequences with missing frames.

    * **Series:** the rows of each value of ``id_column`` (one series without it), in the
      order of their first rows.
    * **Time:** ``time_column`` holds numbers, or ISO dates or datetimes
      (``2024-03-01``, ``2024-03-01T12:30:00+01:00``); without it the rows follow each other in
      the table's order. The rows of a series are sorted by time. The *step* is the most common
      difference between consecutive times of a series, over all series (the smallest of equally
      common ones); dates that all fall on the same day of the month, or all on the last day,
      are counted in months (monthly, quarterly, yearly data). A series then has a frame at
      every step from its first time to its last: time steps without a row are missing frames.
    * **Values:** ``value_columns`` (default: every other column of numbers), as float64. An
      empty cell, ``NA``, ``NaN`` or ``null`` is a missing value, and a frame with a missing
      value is missing (its other values are dropped too, as in ``.ts`` files).
    * **Windows:** with ``window`` W and ``stride`` S (default W), a series of L frames
      becomes the windows starting at frames 0, S, 2S, ... that end by frame L (the frames
      after the last window are not used); a series shorter than W stays one shorter sequence.
      A window without an observed frame (inside a gap) is left out.

    Args:
        source: A ``.csv`` or ``.parquet`` file, or a pandas DataFrame (its named index
            levels count as columns).
        layout: The columns and windows (default: :class:`TableLayout()`).

    Returns:
        ``x`` of shape ``(B, N, D)``, float64, zero at padded and missing frames, and the mask
        ``(B, N)``, ``True`` for observed frames; ``D`` is the number of value columns.

    Raises:
        FileNotFoundError: the file does not exist.
        ImportError: a Parquet file without pandas and pyarrow installed.
        ValueError: naming the file (or ``DataFrame``), the row or line and the column: an
            unknown column, no rows, duplicate times in a series, a time off the grid, a
            missing or unreadable time, a value that is not a number, Inf, a series without
            an observed frame.

    Example:
        >>> import tempfile
        >>> with tempfile.TemporaryDirectory() as folder:
        ...     path = f"{folder}/series.csv"
        ...     _ = open(path, "w").write("id,day,v\\na,1,0.5\\na,2,1.0\\na,4,2.0\\nb,1,3.0\\n")
        ...     x, mask = read_table(path, TableLayout(id_column="id", time_column="day"))
        >>> x[..., 0].tolist()
        [[0.5, 1.0, 0.0, 2.0], [3.0, 0.0, 0.0, 0.0]]
        >>> mask.tolist()
        [[True, True, False, True], [True, False, False, False]]
    """
    if layout is None:
        layout = TableLayout()
    if not isinstance(layout, TableLayout):
        raise TypeError(f"layout must be a TableLayout, got {type(layout).__name__}")
    if not (isinstance(source, str | os.PathLike) or is_data_frame(source)):
        raise TypeError(f"source must be a path or a pandas DataFrame, got "
                        f"{type(source).__name__}")
    if not is_data_frame(source) and not str(source).lower().endswith(TABLE_SUFFIXES):
        raise ValueError(f"{source}: a table file ends in .csv or .parquet")
    table = read_columns(source)
    try:
        return _sequences(table, layout)
    except ValueError as error:
        raise ValueError(f"{table.name}: {error}") from None


def _sequences(table: Columns, layout: TableLayout) -> tuple[Tensor, Tensor]:
    """The padded sequences of a table (:func:`read_table` after reading the columns)."""
    names = list(table.columns)
    for name in (layout.id_column, layout.time_column, *(layout.value_columns or ())):
        if name is not None and name not in table.columns:
            raise ValueError(f"no column {name!r} (the columns: {', '.join(names)})")
    if table.rows == 0:
        raise ValueError("no rows (an empty table)")
    values = _values(table, layout)  # (rows, D)
    series, labels = _series_codes(table, layout.id_column)
    positions = _positions(table, layout, series, labels)
    by_series = np.split(np.argsort(series, kind="stable"), np.cumsum(np.bincount(series))[:-1])
    sequences = []
    for label, rows in zip(labels, by_series, strict=True):
        frames = np.full((int(positions[rows].max()) + 1, values.shape[1]), np.nan)
        frames[positions[rows]] = values[rows]
        observed = ~np.isnan(frames).any(axis=1)
        if not observed.any():
            raise ValueError(f"{label} has no frame without a missing value")
        sequences += _windows(torch.from_numpy(frames), torch.from_numpy(observed), layout)
    if not sequences:
        raise ValueError(f"no window of {layout.window} frames (stride {layout.stride}) holds "
                         "an observed frame")
    x, mask = pad_sequences(sequences)
    return observed_frames(x, mask)


def _values(table: Columns, layout: TableLayout) -> np.ndarray:
    """The values ``(rows, D)``, float64, NaN at missing values: of ``value_columns``, or of
    every column of numbers but the id and time columns.

    Raises:
        ValueError: a named column with a cell that is not a number, an unnamed one that holds
            numbers and text (it may be a column of numbers with a typing mistake), Inf, or no
            column of numbers.
    """
    named = layout.value_columns is not None
    names = layout.value_columns or [name for name in table.columns
                                      if name not in (layout.id_column, layout.time_column)]
    chosen = []
    for name in names:
        values, text = numbers(table.columns[name])
        all_missing = bool(np.isnan(values).all())
        if text.any():
            row = int(np.flatnonzero(text)[0])
            if named:
                raise ValueError(f"{table.where(row)}: column {name!r}: "
                                 f"{table.cell(name, row)!r} is not a number")
            if not all_missing:
                raise ValueError(
                    f"{table.where(row)}: column {name!r} holds numbers and text "
                    f"({table.cell(name, row)!r}); name the value columns (value_columns) to "
                    "choose"
                )
        if text.any() or all_missing and not named:  # text, or a column of empty cells
            continue
        infinite = np.flatnonzero(np.isinf(values))
        if infinite.size:
            raise ValueError(f"{table.where(int(infinite[0]))}: column {name!r}: Inf values are "
                             "not allowed (leave a value empty to mark it missing)")
        chosen.append(values)
    if not chosen:
        raise ValueError(f"no column of numbers besides the id and time columns (the columns: "
                         f"{', '.join(table.columns)})")
    return np.stack(chosen, axis=1)


def _series_codes(table: Columns, id_column: str | None) -> tuple[np.ndarray, list[str]]:
    """The series of every row (an index, in order of first rows) and the series' names for
    messages (``series 'a'``)."""
    if id_column is None:
        return np.zeros(table.rows, dtype=np.int64), ["the series"]
    index: dict[Any, int] = {}
    codes = np.empty(table.rows, dtype=np.int64)
    for row, key in enumerate(table.columns[id_column].tolist()):
        if missing(key) or key == "":
            raise ValueError(f"{table.where(row)}: column {id_column!r}: missing series id")
        codes[row] = index.setdefault(key, len(index))
    return codes, [f"series {key!r}" for key in index]


def _positions(table: Columns, layout: TableLayout, series: np.ndarray,
               labels: list[str]) -> np.ndarray:
    """Every row's frame within its series: its rank in the table's order without a time column,
    else its number of steps after the series' first time.

    Raises:
        ValueError: a missing or unreadable time, a time off the grid, or two rows of a series
            at the same time.
    """
    if layout.time_column is None:
        order = np.argsort(series, kind="stable")
        positions = np.empty(table.rows, dtype=np.int64)
        positions[order] = np.arange(table.rows) - _first_rows(series[order])
        return positions
    ticks, unit = _ticks(table, layout.time_column)
    order = np.lexsort((ticks, series))  # by series, then by time
    same = series[order][1:] == series[order][:-1]  # consecutive rows of one series
    offsets = ticks[order] - ticks[order][_first_rows(series[order])]
    gaps = np.diff(offsets)[same]
    step = _most_common(gaps[gaps > 0]) if (gaps > 0).any() else 1
    if unit == "float":
        steps = np.rint(offsets / step)
        off_grid = np.abs(offsets / step - steps) > GRID_TOLERANCE
    else:
        steps, remainder = np.divmod(offsets, step)
        off_grid = remainder != 0
    if off_grid.any():
        row = int(order[np.flatnonzero(off_grid)[0]])
        raise ValueError(
            f"{table.where(row)}: time {table.cell(layout.time_column, row)!r} of "
            f"{labels[series[row]]} is not a whole number of steps of {_describe(step, unit)} "
            "after the series' first time (the step is the most common difference between "
            "consecutive times of a series); irregular times are not supported"
        )
    repeated = np.flatnonzero((np.diff(steps) == 0) & same)
    if repeated.size:
        earlier, row = sorted(order[repeated[0] : repeated[0] + 2])
        raise ValueError(
            f"{table.where(row)}: {labels[series[row]]} has two rows at time "
            f"{table.cell(layout.time_column, row)!r} (also {table.where(earlier)})"
        )
    positions = np.empty(table.rows, dtype=np.int64)
    positions[order] = steps
    return positions


def _first_rows(codes: np.ndarray) -> np.ndarray:
    """For sorted codes ``0, ..., G-1`` (each present), the index of the first row of each
    row's code."""
    starts = np.r_[0, np.flatnonzero(np.diff(codes)) + 1]
    return starts[codes]


def _ticks(table: Columns, name: str) -> tuple[np.ndarray, str]:
    """Times as numbers and their unit: ``"int"`` or ``"float"`` as given, dates in months
    or nanoseconds (:func:`_calendar_ticks`).

    Raises:
        ValueError: a missing or unreadable time, or numbers and dates in one column.
    """
    column = table.columns[name]
    if column.dtype.kind in "iu":
        return column.astype(np.int64), "int"
    if column.dtype.kind in "fM":
        parsed = list(column)
    else:
        parsed = [_time(cell) for cell in column]
    bad = next((k for k, value in enumerate(parsed) if value is None or missing(value)), None)
    if bad is None:
        kinds = [isinstance(value, int | float | np.number) for value in parsed]
        bad = next((k for k, numeric in enumerate(kinds) if numeric != kinds[0]), None)
    if bad is not None:
        raise ValueError(
            f"{table.where(bad)}: column {name!r}: {table.cell(name, bad)!r} is not a time "
            "(every row needs a number or an ISO date or datetime, all of one kind)"
        )
    if column.dtype.kind == "M":
        return _calendar_ticks(column.astype("datetime64[ns]"))
    if kinds[0]:
        times = np.array(parsed)  # int64, or float64 when one time is not whole
        if np.isinf(times).any():
            row = int(np.flatnonzero(np.isinf(times))[0])
            raise ValueError(f"{table.where(row)}: column {name!r}: an infinite time")
        return times, "int" if times.dtype.kind == "i" else "float"
    return _calendar_ticks(_datetimes(parsed, table, name))


def _time(cell: Any) -> Any:
    """A time cell as a number, a date or a datetime (``None``: not a time)."""
    if isinstance(cell, datetime.date | np.datetime64):  # pandas Timestamps are datetimes
        return cell
    if not isinstance(cell, str):
        return number(cell)
    text = cell.strip()
    for parse in (int, float, datetime.date.fromisoformat, _iso_datetime, _year_month):
        try:
            return parse(text)
        except ValueError:
            continue
    return None


def _iso_datetime(text: str) -> datetime.datetime:
    """``datetime.fromisoformat``, reading a trailing ``Z`` (UTC) on Python 3.10 too."""
    return datetime.datetime.fromisoformat(text[:-1] + "+00:00" if text.endswith("Z") else text)


def _year_month(text: str) -> datetime.date:
    """A month written ``YYYY-MM``, as its first day."""
    return datetime.datetime.strptime(text, "%Y-%m").date()


def _datetimes(parsed: list[Any], table: Columns, name: str) -> np.ndarray:
    """Dates and datetimes as ``datetime64[ns]``, aware ones in UTC (they do not mix with naive
    ones)."""
    aware = [getattr(value, "tzinfo", None) is not None for value in parsed]
    if any(aware) and not all(aware):
        row = aware.index(not aware[0])
        raise ValueError(f"{table.where(row)}: column {name!r}: times with and without a time "
                         "zone do not mix")
    if aware[0]:
        parsed = [value.astimezone(datetime.timezone.utc).replace(tzinfo=None)
                  for value in parsed]
    return np.array(parsed, dtype="datetime64[ns]")


def _calendar_ticks(stamps: np.ndarray) -> tuple[np.ndarray, str]:
    """Months since 1970 when every time lies at the same point of its month, counted from the
    month's start or from its end (monthly, quarterly, yearly data); else nanoseconds."""
    months = stamps.astype("datetime64[M]")
    since_start = stamps - months.astype(stamps.dtype)
    until_end = (months + 1).astype(stamps.dtype) - stamps
    if (since_start == since_start[0]).all() or (until_end == until_end[0]).all():
        return months.astype(np.int64), "month"
    return stamps.astype(np.int64), "ns"


def _most_common(gaps: np.ndarray) -> Any:
    """The most common of positive differences, the smallest of equally common ones; float
    differences are compared to 12 significant digits."""
    keys = gaps if gaps.dtype.kind == "i" else np.array([float(f"{g:.12g}") for g in gaps])
    values, counts = np.unique(keys, return_counts=True)
    return values[np.argmax(counts)].item()


def _describe(step: Any, unit: str) -> str:
    """A step in words: ``3``, ``0.1``, ``2 months``, ``7 days, 0:00:00``."""
    if unit == "month":
        return f"{step} month" + ("s" if step != 1 else "")
    if unit == "ns":
        return str(datetime.timedelta(microseconds=step / 1000))
    return f"{step:g}"


def _windows(frames: Tensor, observed: Tensor, layout: TableLayout) -> list[Tensor]:
    """The sequences of a series ``(L, D)``: the whole series, or its windows that hold an
    observed frame."""
    window = layout.window
    if window is None or frames.shape[0] <= window:
        return [frames]
    stride = window if layout.stride is None else layout.stride
    starts = range(0, frames.shape[0] - window + 1, stride)
    return [frames[s : s + window] for s in starts if bool(observed[s : s + window].any())]
