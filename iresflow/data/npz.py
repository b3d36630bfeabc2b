"""Reader for user ``.npz`` archives of padded sequences, with labels ``y`` and covariates ``c``.

Every reader raises ``ValueError`` naming the file and the problem for malformed input; missing
frames are a boolean ``mask`` array (see :func:`read_npz`).
"""

from __future__ import annotations

import os
import zipfile

import numpy as np
import torch
from torch import Tensor

from iresflow.data.readers import empty_rows, existing_file

__all__ = ["read_npz", "read_npz_covariates", "read_npz_labels"]


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
    file = str(existing_file(path))
    x_np, lengths_np, mask_np = _read_arrays(file)
    x = torch.from_numpy(x_np.astype(np.float64))
    mask = _observed_mask(file, x.shape[0], x.shape[1], lengths_np, mask_np)
    if not bool(torch.isfinite(x[mask]).all()):
        raise ValueError(
            f"{file}: 'x' contains NaN or Inf values at observed frames (mark missing frames "
            "False in a boolean 'mask' array)"
        )
    return torch.where(mask.unsqueeze(-1), x, 0.0), mask


def _read_arrays(file: str) -> tuple[np.ndarray, np.ndarray | None, np.ndarray | None]:
    """``x`` (checked: real, ``(B, N, D)``, non-empty) and the optional ``lengths`` and ``mask``."""
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
    return x_np, lengths_np, mask_np


def _observed_mask(
    file: str, batch: int, length: int, lengths_np: np.ndarray | None, mask_np: np.ndarray | None
) -> Tensor:
    """The ``(B, N)`` mask of observed frames from ``lengths`` and ``mask`` (checked)."""
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
    empty = empty_rows(mask)
    if empty:
        raise ValueError(
            f"{file}: sequence(s) {empty} have no observed frame ('mask' and 'lengths' "
            "leave every sequence at least one)"
        )
    return mask


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
