"""Readers for sequence files: sktime ``.ts`` and a weekly ``.csv`` series.

Every reader raises ``ValueError`` naming the file and the problem for malformed input. Missing
values are explicit: ``?`` or ``NaN`` in a ``.ts`` file (read as NaN, see :func:`observed_frames`),
empty values in the ``.csv`` series; Inf is always an error. User ``.npz`` archives are read by
:mod:`iresflow.data.npz`. Parsed ``.ts`` and ``.csv`` files are cached in memory (keyed by path,
modification time and size); the public functions return fresh tensors.
"""

from __future__ import annotations

import datetime
import gzip
import os
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, TextIO

import torch
from torch import Tensor

__all__ = [
    "TsFile",
    "empty_rows",
    "existing_file",
    "observed_frames",
    "pad_sequences",
    "pad_to",
    "read_ts",
    "read_weekly_csv",
]


class TsFile(NamedTuple):
    """Contents of a ``.ts`` file.

    Attributes:
        series: One float64 tensor of shape ``(n_i, D)`` per case (frames by dimensions), NaN
            where the file has a missing value (``?`` or ``NaN``).
        labels: One class label per case, or ``None`` if the file declares no labels.
    """

    series: list[Tensor]
    labels: list[str] | None


def existing_file(path: str | os.PathLike) -> Path:
    """The absolute path of an existing file.

    Raises:
        FileNotFoundError: ``path`` is not a file.
    """
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise FileNotFoundError(f"no such file: {resolved}")
    return resolved


def _cache_key(path: str | os.PathLike) -> tuple[str, int, int]:
    resolved = existing_file(path)
    stat = resolved.stat()
    return str(resolved), stat.st_mtime_ns, stat.st_size


def _open_text(path: str) -> TextIO:
    if path.endswith(".gz"):
        return gzip.open(path, "rt", encoding="utf-8")
    return open(path, encoding="utf-8")


def _parse_values(text: str, path: str, where: str) -> list[float]:
    try:
        # '?' is the sktime/UEA missing value; float() reads "NaN" itself.
        values = [float("nan") if v.strip() == "?" else float(v) for v in text.split(",")]
    except ValueError:
        raise ValueError(
            f"{path}: {where}: could not parse {text[:40]!r} as comma-separated numbers "
            "(missing values are '?' or NaN; timestamps are not supported)"
        ) from None
    return values


@lru_cache(maxsize=16)
def _parse_ts(
    path: str, _mtime_ns: int, _size: int
) -> tuple[tuple[Tensor, ...], tuple[str, ...] | None]:
    header: dict[str, str] = {}
    cases: list[Tensor] = []
    labels: list[str] = []
    in_data = has_label = False
    with _open_text(path) as handle:
        for line_no, line in enumerate(handle, start=1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            if not in_data:
                if not line.startswith("@"):
                    raise ValueError(f"{path}: line {line_no}: data before the @data line")
                key, _, value = line[1:].partition(" ")
                key = key.lower()
                if key == "data":
                    in_data = True
                    if header.get("timestamps", "false").lower() == "true":
                        raise ValueError(f"{path}: timestamped .ts files are not supported")
                    has_label = any(
                        header.get(k, "false").lower().startswith("true")
                        for k in ("classlabel", "targetlabel")
                    )
                else:
                    header[key] = value.strip()
                continue
            fields = line.split(":")
            if has_label:
                if len(fields) < 2:
                    raise ValueError(f"{path}: line {line_no}: missing the ':label' field")
                labels.append(fields[-1].strip())
                fields = fields[:-1]
            dims = [_parse_values(f, path, f"line {line_no}") for f in fields]
            if len({len(d) for d in dims}) != 1:
                raise ValueError(
                    f"{path}: line {line_no}: dimensions of one case have different lengths "
                    f"{[len(d) for d in dims]}"
                )
            case = torch.tensor(dims, dtype=torch.float64).T.contiguous()
            if bool(torch.isinf(case).any()):
                raise ValueError(f"{path}: line {line_no}: Inf values")
            if bool(torch.isnan(case).any(dim=1).all()):
                raise ValueError(
                    f"{path}: line {line_no}: every frame of the case has a missing value"
                )
            if cases and case.shape[1] != cases[0].shape[1]:
                raise ValueError(
                    f"{path}: line {line_no}: {case.shape[1]} dimensions, earlier cases have "
                    f"{cases[0].shape[1]}"
                )
            cases.append(case)
    if not in_data:
        raise ValueError(f"{path}: no @data line; not a .ts file")
    if not cases:
        raise ValueError(f"{path}: no cases after @data (empty file)")
    declared = header.get("dimensions")
    if declared is not None and declared.isdigit() and int(declared) != cases[0].shape[1]:
        raise ValueError(
            f"{path}: header declares {declared} dimensions, cases have {cases[0].shape[1]}"
        )
    return tuple(cases), (tuple(labels) if labels else None)


def read_ts(path: str | os.PathLike) -> TsFile:
    """Read a multivariate, possibly unequal-length ``.ts`` file (sktime format).

    The format: comment lines start with ``#``; header lines start with ``@`` (``@dimensions``,
    ``@classLabel``, ...) and end with ``@data``; then one line per case, its dimensions separated
    by ``:``, each a comma-separated series, followed by ``:label`` when the header declares
    ``@classLabel true`` (or ``@targetLabel true``). A ``.gz`` suffix is decompressed. Missing
    values, ``?`` or ``NaN``, are returned as NaN (:func:`observed_frames` turns them into a
    mask); every case needs at least one frame without a missing value.

    Args:
        path: Path to a ``.ts`` or ``.ts.gz`` file.

    Returns:
        A :class:`TsFile` with one ``(n_i, D)`` float64 tensor per case and the labels.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: malformed file (naming the file and line), Inf values, or a case with a
            missing value in every frame.

    Example:
        >>> from pathlib import Path
        >>> import iresflow.data.readers as readers
        >>> files = Path(readers.__file__).parent / "files"
        >>> ts = read_ts(files / "JapaneseVowels_TEST.ts.gz")
        >>> len(ts.series), ts.series[0].shape[1], ts.labels[0]
        (370, 12, '1')
    """
    cases, labels = _parse_ts(*_cache_key(path))
    return TsFile([c.clone() for c in cases], list(labels) if labels is not None else None)


def pad_sequences(series: list[Tensor]) -> tuple[Tensor, Tensor]:
    """Stack unequal-length sequences into a zero-padded batch.

    Args:
        series: Non-empty list of tensors of shape ``(n_i, D)`` with a common ``D``, ``n_i >= 1``.

    Returns:
        ``x`` of shape ``(B, N, D)`` with ``N = max n_i`` (zeros at padding, dtype of the inputs)
        and the boolean mask ``(B, N)``, ``True`` for real frames.

    Example:
        >>> x, mask = pad_sequences([torch.ones(2, 3), torch.ones(1, 3)])
        >>> x.shape, mask.tolist()
        (torch.Size([2, 2, 3]), [[True, True], [True, False]])
    """
    if not series:
        raise ValueError("series must contain at least one sequence")
    if any(s.dim() != 2 or s.shape[1] != series[0].shape[1] or s.shape[0] < 1 for s in series):
        raise ValueError("every sequence must have shape (n_i, D) with n_i >= 1 and a common D")
    lengths = torch.tensor([s.shape[0] for s in series])
    x = torch.zeros(len(series), int(lengths.max()), series[0].shape[1], dtype=series[0].dtype)
    for b, s in enumerate(series):
        x[b, : s.shape[0]] = s
    mask = torch.arange(x.shape[1]) < lengths.unsqueeze(1)
    return x, mask


def pad_to(x: Tensor, mask: Tensor, length: int) -> tuple[Tensor, Tensor]:
    """Pad sequences with unobserved frames at the end.

    Args:
        x: Sequences ``(B, N, D)``.
        mask: Their mask ``(B, N)``, ``True`` for observed frames.
        length: The new length ``>= N``.

    Returns:
        ``x`` ``(B, length, D)``, zero at the new frames, and its mask ``(B, length)``.

    Example:
        >>> x, mask = pad_to(torch.ones(1, 2, 1), torch.ones(1, 2, dtype=torch.bool), 3)
        >>> x.flatten().tolist(), mask.tolist()
        ([1.0, 1.0, 0.0], [[True, True, False]])
    """
    if length < x.shape[1]:
        raise ValueError(f"length must be >= the current length {x.shape[1]}, got {length}")
    extra = length - x.shape[1]
    padded = torch.cat([x, x.new_zeros(x.shape[0], extra, x.shape[2])], dim=1)
    return padded, torch.cat([mask, mask.new_zeros(mask.shape[0], extra)], dim=1)


def observed_frames(x: Tensor, mask: Tensor) -> tuple[Tensor, Tensor]:
    """Mark frames with a missing (NaN) value as unobserved and zero them.

    A frame is missing when *any* of its ``D`` values is NaN: the model's mask is per frame, so a
    partly observed frame cannot be kept, and its observed values are dropped with it. Missing
    frames are then treated like padding (conventions: ``docs/math.md#masks``).

    Args:
        x: Padded sequences, shape ``(B, N, D)``, NaN at missing values.
        mask: Boolean ``(B, N)``, ``True`` for real (not padded) frames.

    Returns:
        ``x`` with zeros at every unobserved frame and the mask ``(B, N)`` of the frames that are
        real and complete.

    Raises:
        ValueError: a sequence without any complete real frame.

    Example:
        >>> nan = float("nan")
        >>> x = torch.tensor([[[1.0, 2.0], [nan, 3.0], [4.0, 5.0]]])
        >>> x, mask = observed_frames(x, torch.ones(1, 3, dtype=torch.bool))
        >>> mask.tolist(), x[0, 1].tolist()
        ([[True, False, True]], [0.0, 0.0])
    """
    observed = mask & ~torch.isnan(x).any(dim=-1)
    empty = empty_rows(observed)
    if empty:
        raise ValueError(
            f"sequence(s) {empty} have no frame without missing values (every sequence needs "
            "at least one observed frame)"
        )
    return torch.where(observed.unsqueeze(-1), x, 0.0), observed


def empty_rows(mask: Tensor) -> list[int]:
    """Indices (at most 10) of the rows of a ``(B, N)`` mask without a ``True``."""
    return (~mask.any(dim=1)).nonzero().flatten()[:10].tolist()


@lru_cache(maxsize=4)
def _parse_weekly_csv(path: str, _mtime_ns: int, _size: int) -> tuple[tuple[str, ...], Tensor]:
    with open(path, encoding="utf-8") as handle:
        lines = [line.strip() for line in handle if line.strip()]
    if not lines or lines[0].replace(" ", "").lower() != "date,co2":
        raise ValueError(f"{path}: expected the header 'date,co2'")
    dates: list[str] = []
    values: list[float] = []
    previous: datetime.date | None = None
    for line_no, line in enumerate(lines[1:], start=2):
        date_text, _, value_text = line.partition(",")
        try:
            date = datetime.datetime.strptime(date_text, "%Y%m%d").date()
            value = float(value_text) if value_text.strip() else float("nan")
        except ValueError:
            raise ValueError(f"{path}: line {line_no}: cannot parse {line!r}") from None
        if previous is not None and (date - previous).days != 7:
            raise ValueError(f"{path}: line {line_no}: dates are not on a weekly grid")
        previous = date
        dates.append(date_text)
        values.append(value)
    if not dates:
        raise ValueError(f"{path}: no data rows")
    return tuple(dates), torch.tensor(values, dtype=torch.float64)


def read_weekly_csv(path: str | os.PathLike) -> tuple[list[str], Tensor]:
    """Read a weekly ``date,co2`` series; empty values are gaps.

    Args:
        path: CSV with header ``date,co2``, dates as ``YYYYMMDD`` exactly 7 days apart.

    Returns:
        The dates (strings) and the values, shape ``(T,)``, float64, NaN at gaps.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: wrong header, unparsable row, or dates off the weekly grid.

    Example:
        >>> from pathlib import Path
        >>> import iresflow.data.readers as readers
        >>> dates, co2 = read_weekly_csv(Path(readers.__file__).parent / "files" /
        ...                              "co2_weekly_mauna_loa.csv")
        >>> dates[0], co2[0].item(), len(dates)
        ('19580329', 316.1, 2284)
    """
    dates, values = _parse_weekly_csv(*_cache_key(path))
    return list(dates), values.clone()
