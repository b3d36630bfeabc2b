"""Readers for sequence files: sktime ``.ts``, user ``.npz`` and a weekly ``.csv`` series.

Every reader raises ``ValueError`` naming the file and the problem for malformed input. Missing
values are explicit: ``?`` or ``NaN`` in a ``.ts`` file (read as NaN, see :func:`observed_frames`),
a boolean ``mask`` in an ``.npz`` file, empty values in the ``.csv`` series; Inf is always an
error. Parsed ``.ts`` and ``.csv`` files are cached in memory (keyed by path, modification time
and size); the public functions return fresh tensors.
"""

from __future__ import annotations

import datetime
import gzip
import os
import zipfile
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple, TextIO

import numpy as np
import torch
from torch import Tensor

__all__ = ["TsFile", "observed_frames", "pad_sequences", "read_npz", "read_ts", "read_weekly_csv"]


class TsFile(NamedTuple):
    """Contents of a ``.ts`` file.

    Attributes:
        series: One float64 tensor of shape ``(n_i, D)`` per case (frames by dimensions), NaN
            where the file has a missing value (``?`` or ``NaN``).
        labels: One class label per case, or ``None`` if the file declares no labels.
    """

    series: list[Tensor]
    labels: list[str] | None


def _cache_key(path: str | os.PathLike) -> tuple[str, int, int]:
    resolved = Path(path).expanduser().resolve()
    if not resolved.is_file():
        raise FileNotFoundError(f"no such file: {resolved}")
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
    empty = _empty_rows(observed)
    if empty:
        raise ValueError(
            f"sequence(s) {empty} have no frame without missing values (every sequence needs "
            "at least one observed frame)"
        )
    return torch.where(observed.unsqueeze(-1), x, 0.0), observed


def _empty_rows(mask: Tensor) -> list[int]:
    """Indices (at most 10) of the rows of a ``(B, N)`` mask without a ``True``."""
    return (~mask.any(dim=1)).nonzero().flatten()[:10].tolist()


def read_npz(path: str | os.PathLike) -> tuple[Tensor, Tensor]:
    """Read a user ``.npz`` file of padded sequences, possibly with missing frames.

    The archive holds ``x``, a real array of shape ``(B, N, D)``, and optionally

    * ``lengths``, an integer array of shape ``(B,)`` with ``1 <= lengths <= N``: frame ``n`` of
      sequence ``b`` is real iff ``n < lengths[b]`` (padding at the end);
    * ``mask``, a boolean array of shape ``(B, N)``, ``True`` for an observed frame: any pattern
      of missing frames (gaps), alone or together with ``lengths`` (then a frame counts iff both
      say so).

    Without either every frame is observed. Every sequence needs at least one observed frame,
    observed frames must be finite, and values at padded or missing frames are ignored (they may
    be NaN) and replaced by zeros. Other keys are ignored.

    Args:
        path: Path to the ``.npz`` file.

    Returns:
        ``x`` of shape ``(B, N, D)``, float64, zero at padded and missing frames, and the mask
        ``(B, N)``, bool, ``True`` for observed frames.

    Raises:
        FileNotFoundError: the file does not exist.
        ValueError: not an ``.npz`` archive, missing ``x``, ragged/object arrays, wrong rank or
            dtype, empty arrays, bad ``lengths`` or ``mask``, a sequence without an observed
            frame, NaN/Inf at observed frames.

    Example:
        >>> import tempfile, numpy as np
        >>> with tempfile.TemporaryDirectory() as d:
        ...     np.savez(f"{d}/a.npz", x=np.ones((2, 3, 1)), lengths=np.array([3, 1]))
        ...     x, mask = read_npz(f"{d}/a.npz")
        >>> x.sum().item(), mask.sum(dim=1).tolist()
        (4.0, [3, 1])
    """
    file = _cache_key(path)[0]
    try:
        archive = np.load(file, allow_pickle=False)
    except (zipfile.BadZipFile, OSError, EOFError, ValueError) as error:
        raise ValueError(f"{file}: not a readable .npz archive ({error})") from None
    if not isinstance(archive, np.lib.npyio.NpzFile):
        raise ValueError(f"{file}: holds a single array, not an .npz archive with key 'x'")
    with archive:
        if "x" not in archive.files:
            raise ValueError(f"{file}: missing array 'x' (found keys {sorted(archive.files)})")
        x_np = _load_member(archive, "x", file)
        lengths_np = _load_member(archive, "lengths", file) if "lengths" in archive.files else None
        mask_np = _load_member(archive, "mask", file) if "mask" in archive.files else None
    if x_np.dtype.kind not in "fiu":
        raise ValueError(f"{file}: 'x' must hold real numbers, got dtype {x_np.dtype}")
    if x_np.ndim != 3:
        raise ValueError(
            f"{file}: 'x' must have shape (B, N, D), got {x_np.shape} (add a trailing axis "
            "for univariate sequences)"
        )
    if 0 in x_np.shape:
        raise ValueError(f"{file}: 'x' is empty (shape {x_np.shape})")
    x = torch.from_numpy(x_np.astype(np.float64))
    batch, length = x.shape[:2]
    mask = torch.ones(batch, length, dtype=torch.bool)
    if lengths_np is not None:
        if lengths_np.dtype.kind not in "iu" or lengths_np.shape != (batch,):
            raise ValueError(
                f"{file}: 'lengths' must be an integer array of shape ({batch},), got dtype "
                f"{lengths_np.dtype} and shape {lengths_np.shape}"
            )
        lengths = torch.from_numpy(lengths_np.astype(np.int64))
        if bool(((lengths < 1) | (lengths > length)).any()):
            raise ValueError(
                f"{file}: 'lengths' must lie in [1, {length}], got range "
                f"[{int(lengths.min())}, {int(lengths.max())}]"
            )
        mask = torch.arange(length) < lengths.unsqueeze(1)
    if mask_np is not None:
        if mask_np.dtype != np.bool_ or mask_np.shape != (batch, length):
            raise ValueError(
                f"{file}: 'mask' must be a boolean array of shape ({batch}, {length}) (True = "
                f"observed frame), got dtype {mask_np.dtype} and shape {mask_np.shape}"
            )
        mask = mask & torch.from_numpy(mask_np)
    empty = _empty_rows(mask)
    if empty:
        raise ValueError(
            f"{file}: sequence(s) {empty} have no observed frame ('mask' and 'lengths' "
            "leave every sequence at least one)"
        )
    if not bool(torch.isfinite(x[mask]).all()):
        raise ValueError(
            f"{file}: 'x' contains NaN or Inf values at observed frames (mark missing frames "
            "False in a boolean 'mask' array)"
        )
    return torch.where(mask.unsqueeze(-1), x, 0.0), mask


def read_npz_labels(path: str | os.PathLike) -> list[str] | None:
    """The class labels ``y`` of an ``.npz`` archive (see :func:`read_npz`), if it has them.

    Args:
        path: The archive.

    Returns:
        One label per sequence, as strings (``None`` without a ``y`` array).

    Raises:
        ValueError: ``y`` is not a 1-D integer array.

    Example:
        >>> import tempfile, numpy as np
        >>> with tempfile.TemporaryDirectory() as d:
        ...     np.savez(f"{d}/a.npz", x=np.ones((2, 3, 1)), y=np.array([4, 1]))
        ...     read_npz_labels(f"{d}/a.npz")
        ['4', '1']
    """
    file = os.fspath(path)
    with np.load(file, allow_pickle=False) as archive:
        if "y" not in archive.files:
            return None
        y = _load_member(archive, "y", file)
    if y.ndim != 1 or not np.issubdtype(y.dtype, np.integer):
        raise ValueError(f"{file}: 'y' must be a 1-D integer array of class labels, got dtype "
                         f"{y.dtype} and shape {y.shape}")
    return [str(int(v)) for v in y]


def read_npz_covariates(path: str | os.PathLike) -> Tensor | None:
    """The per-sequence covariates ``c`` of an ``.npz`` archive (see :func:`read_npz`), if any.

    Args:
        path: The archive.

    Returns:
        ``c`` as a float64 tensor ``(B, C)`` (``None`` without a ``c`` array).

    Raises:
        ValueError: ``c`` is not a finite real array of shape ``(B, C)``.

    Example:
        >>> import tempfile, numpy as np
        >>> with tempfile.TemporaryDirectory() as d:
        ...     np.savez(f"{d}/a.npz", x=np.ones((2, 3, 1)), c=np.ones((2, 4)))
        ...     read_npz_covariates(f"{d}/a.npz").shape
        torch.Size([2, 4])
    """
    file = os.fspath(path)
    with np.load(file, allow_pickle=False) as archive:
        if "c" not in archive.files:
            return None
        c = _load_member(archive, "c", file)
    real = np.issubdtype(c.dtype, np.floating) or np.issubdtype(c.dtype, np.integer)
    if c.ndim != 2 or not real:
        raise ValueError(f"{file}: 'c' must be a real array of shape (B, C), got dtype {c.dtype} "
                         f"and shape {c.shape}")
    covariates = torch.from_numpy(c.astype(np.float64))
    if not bool(torch.isfinite(covariates).all()):
        raise ValueError(f"{file}: 'c' contains NaN or Inf values")
    return covariates


def _load_member(archive: np.lib.npyio.NpzFile, key: str, file: str) -> np.ndarray:
    try:
        return archive[key]
    except ValueError as error:
        if "allow_pickle" in str(error):
            raise ValueError(
                f"{file}: '{key}' is an object (ragged) array; store x as a padded float array "
                "of shape (B, N, D) together with an integer 'lengths' array"
            ) from None
        raise ValueError(f"{file}: cannot read '{key}' ({error})") from None


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
