r"""Sequence stores: datasets larger than memory, read from disk through memory maps.

A *store* is a folder with two NumPy files:

* ``values.npy``: the frames of all sequences one after another, shape ``(T, D)``, float32 or
  float64, without padding;
* ``lengths.npy``: the number of frames of every sequence, shape ``(B,)``, integers ``>= 1``
  summing to ``T``.

Sequence :math:`b` is ``values[o_b : o_b + lengths[b]]`` with :math:`o_b` the sum of the lengths
before it. A store is written by :func:`write_store` (or by ``numpy.save`` of the two arrays) and
read by :class:`SequenceStore`, which maps ``values.npy`` into memory with ``numpy.load(...,
mmap_mode="r")`` and copies out only the sequences of a batch. The pages of a memory map that
have been read stay resident until the map is closed, and one page fault can map far more than
was read (the kernel maps the cached pages around it, a whole large folio or huge page on recent
Linux). With ``memory_cap`` megabytes the store counts the aligned blocks of the largest such
mapping (2 MiB with 4 KiB pages) its reads touched since the map was opened, and re-opens the
map before a read would take that past the cap: the memory the data occupy in the process stays
below the cap, whatever folio size the kernel maps per fault, up to the few pages its
fault-around window (64 KiB by default) may map across a block edge, and except while a single
sequence longer than the cap is read (the operating system's file cache is not part of it).
The cap is rounded down to whole blocks; a cap below one block re-opens the map for every
sequence.

:class:`StoredSplit` is a split of a store in model space (standardised on the fly); it offers
what training and evaluation use of a :class:`~iresflow.data.datasets.SequenceSplit` (batches,
subsets, frame counts, log-Jacobians) without holding the frames in memory. See
``docs/scaling.md``.
"""

from __future__ import annotations

import mmap
import os
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from iresflow.data.preprocessing import Standardization

__all__ = ["STORE_FILES", "SequenceStore", "StoredSplit", "is_store", "write_store"]

#: The files of a store folder: the concatenated frames and the sequence lengths.
STORE_FILES = ("values.npy", "lengths.npy")
_MEGABYTE = 2**20
#: The most a page fault of a memory map can make resident: a page-table page's worth of pages
#: (a huge page, the largest folio of the page cache; 2 MiB with 4 KiB pages).
_FAULT_BLOCK = mmap.PAGESIZE * (mmap.PAGESIZE // 8)


def is_store(path: str | os.PathLike) -> bool:
    """Whether ``path`` is a folder holding :data:`STORE_FILES`.

    Example:
        >>> is_store("no/such/folder")
        False
    """
    folder = Path(path).expanduser()
    return folder.is_dir() and all((folder / name).is_file() for name in STORE_FILES)


def write_store(
    path: str | os.PathLike,
    lengths: Tensor,
    frames: Iterable[Tensor],
    *,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Write a store folder from chunks of frames, without holding them all in memory.

    ``values.npy`` is created at its full size first and filled chunk by chunk through a
    writable memory map, so any amount of data can be written from a generator.

    Args:
        path: The folder to create (it may exist; the two files are replaced).
        lengths: Frames of every sequence, shape ``(B,)``, integer, each ``>= 1``.
        frames: Chunks of shape ``(t, D)`` whose concatenation, in order, is the frames of all
            sequences (e.g. one chunk per sequence, or a few sequences per chunk).
        dtype: ``torch.float32`` or ``torch.float64``, the dtype stored.

    Raises:
        TypeError: ``lengths`` not an integer tensor, a chunk not a floating-point tensor, or
            another ``dtype``.
        ValueError: a length ``< 1``, chunks of the wrong shape, non-finite values, or chunks
            that do not add up to ``lengths.sum()`` frames.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp()) / "store"
        >>> write_store(folder, torch.tensor([2, 1]), [torch.ones(2, 3), torch.zeros(1, 3)])
        >>> store = SequenceStore(folder)
        >>> len(store), store.features, store.max_len
        (2, 3, 2)
    """
    if not isinstance(lengths, Tensor) or lengths.dtype not in (torch.int32, torch.int64):
        raise TypeError("lengths must be an int32 or int64 torch.Tensor of shape (B,)")
    if lengths.dim() != 1 or len(lengths) == 0 or bool((lengths < 1).any()):
        raise ValueError(
            f"lengths must have shape (B,), B >= 1, with every length >= 1, got shape "
            f"{tuple(lengths.shape)}"
        )
    if dtype not in (torch.float32, torch.float64):
        raise TypeError(f"dtype must be torch.float32 or torch.float64, got {dtype}")
    folder = Path(path).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    total = int(lengths.sum())
    values: np.memmap | None = None
    written = 0
    for chunk in frames:
        if not isinstance(chunk, Tensor) or not chunk.is_floating_point() or chunk.dim() != 2:
            raise TypeError("every chunk of frames must be a floating-point tensor (t, D)")
        if values is None:
            values = np.lib.format.open_memmap(
                folder / STORE_FILES[0], mode="w+", dtype=str(dtype).removeprefix("torch."),
                shape=(total, chunk.shape[1]),
            )
        if chunk.shape[1] != values.shape[1]:
            raise ValueError(
                f"every chunk must have D = {values.shape[1]} columns, got {chunk.shape[1]}"
            )
        if written + chunk.shape[0] > total:
            raise ValueError(f"the chunks hold more than lengths.sum() = {total} frames")
        if not bool(torch.isfinite(chunk).all()):
            raise ValueError("frames must be finite (a store holds observed frames only)")
        values[written : written + chunk.shape[0]] = chunk.detach().cpu().numpy()
        written += chunk.shape[0]
    if values is None or written != total:
        raise ValueError(f"the chunks hold {written} frames, lengths.sum() is {total}")
    values.flush()
    del values
    np.save(folder / STORE_FILES[1], lengths.cpu().numpy().astype(np.int64))


class SequenceStore:
    """A store folder opened for reading (:func:`write_store` describes the format).

    Only the lengths (8 bytes per sequence) are read into memory; the frames are read batch by
    batch from a memory map of ``values.npy``.

    Args:
        path: The store folder.
        memory_cap: Megabytes the memory map may keep resident: it is re-opened before its reads
            could map more (0: no cap, the pages stay until the store is closed).

    Attributes:
        path: The folder.
        lengths: Frames of every sequence, ``(B,)``, int64.
        offsets: Index of the first frame of every sequence in ``values.npy``, ``(B,)``.
        features: ``D``.
        max_len: The longest sequence.

    Raises:
        ValueError: not a store folder, malformed arrays, or a negative ``memory_cap``.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> write_store(folder, torch.tensor([1, 2]), [torch.arange(6.0).reshape(3, 2)])
        >>> x, mask = SequenceStore(folder).read(torch.tensor([1, 0]))
        >>> x[:, :, 0].tolist(), mask.tolist()
        ([[2.0, 4.0], [0.0, 0.0]], [[True, True], [True, False]])
    """

    def __init__(self, path: str | os.PathLike, *, memory_cap: int = 0) -> None:
        self.path = Path(path).expanduser()
        if not is_store(self.path):
            raise ValueError(
                f"{self.path} is not a sequence store (a folder with {' and '.join(STORE_FILES)})"
            )
        if isinstance(memory_cap, bool) or not isinstance(memory_cap, int) or memory_cap < 0:
            raise ValueError(f"memory_cap must be an int >= 0 (megabytes), got {memory_cap!r}")
        self._cap = memory_cap * _MEGABYTE
        lengths = np.load(self.path / STORE_FILES[1], allow_pickle=False)
        values = self._open()
        if lengths.ndim != 1 or lengths.dtype.kind not in "iu" or len(lengths) == 0:
            raise ValueError(f"{self.path}: lengths.npy must be a non-empty integer array (B,)")
        if values.ndim != 2 or values.dtype not in (np.float32, np.float64):
            raise ValueError(
                f"{self.path}: values.npy must be a float32 or float64 array (T, D), got "
                f"dtype {values.dtype} and shape {values.shape}"
            )
        if int(lengths.min()) < 1 or int(lengths.sum()) != values.shape[0]:
            raise ValueError(
                f"{self.path}: lengths must be >= 1 and sum to the {values.shape[0]} frames of "
                f"values.npy, got sum {int(lengths.sum())}"
            )
        self.lengths = torch.from_numpy(lengths.astype(np.int64))
        self.offsets = torch.cumsum(self.lengths, 0) - self.lengths
        self.features = int(values.shape[1])
        self.max_len = int(self.lengths.max())
        self._bytes_per_frame = values.dtype.itemsize * self.features

    def __len__(self) -> int:
        return len(self.lengths)

    def _open(self) -> np.memmap:
        self._values = np.load(self.path / STORE_FILES[0], mmap_mode="r", allow_pickle=False)
        self._blocks: set[int] = set()
        return self._values

    def _frames(self, start: int, stop: int) -> np.ndarray:
        """A copy of frames ``start:stop`` (float64); re-opens the map past the cap."""
        # One page fault can map a whole huge page or large folio of the page cache around the
        # address: count every block of that size the frames touch since the map was opened.
        first = (self._values.offset + start * self._bytes_per_frame) // _FAULT_BLOCK
        last = (self._values.offset + stop * self._bytes_per_frame - 1) // _FAULT_BLOCK
        touched = range(first, last + 1)
        if self._cap and len(self._blocks.union(touched)) * _FAULT_BLOCK > self._cap:
            self._open()  # the old map, and the pages it kept resident, are released
        self._blocks.update(touched)
        return np.array(self._values[start:stop], dtype=np.float64)

    def read(self, index: Tensor) -> tuple[Tensor, Tensor]:
        """Raw sequences ``index``, padded with zeros to the longest of them.

        Args:
            index: Sequence indices, shape ``(b,)``, integer.

        Returns:
            ``x`` of shape ``(b, n, D)``, float64, and the mask ``(b, n)``, bool (a prefix of
            each row), ``n`` the longest length taken.

        Raises:
            ValueError: an index outside ``[0, B)`` or an empty ``index``.
        """
        index = self._check_index(index)
        lengths = self.lengths[index]
        longest = int(lengths.max())
        x = np.zeros((len(index), longest, self.features), dtype=np.float64)
        for row, (start, length) in enumerate(
            zip(self.offsets[index].tolist(), lengths.tolist(), strict=True)
        ):
            x[row, :length] = self._frames(start, start + length)
        mask = torch.arange(longest) < lengths.unsqueeze(1)
        return torch.from_numpy(x), mask

    def frame_chunks(self, index: Tensor, max_frames: int = 2**16) -> Iterator[Tensor]:
        """The frames of the sequences ``index``, in chunks of at most ``max_frames`` frames.

        Args:
            index: Sequence indices, shape ``(b,)``, integer.
            max_frames: Largest chunk (a longer sequence is one chunk of its own).

        Yields:
            Chunks of shape ``(t, D)``, float64.
        """
        index = self._check_index(index)
        pending: list[np.ndarray] = []
        size = 0
        for start, length in zip(
            self.offsets[index].tolist(), self.lengths[index].tolist(), strict=True
        ):
            if pending and size + length > max_frames:
                yield torch.from_numpy(np.concatenate(pending))
                pending, size = [], 0
            pending.append(self._frames(start, start + length))
            size += length
        if pending:
            yield torch.from_numpy(np.concatenate(pending))

    def _check_index(self, index: Tensor) -> Tensor:
        if not isinstance(index, Tensor) or index.dtype not in (torch.int32, torch.int64):
            raise TypeError("index must be an integer torch.Tensor of shape (b,)")
        index = index.cpu().long()
        if index.dim() != 1 or len(index) == 0:
            raise ValueError(f"index must have shape (b,), b >= 1, got {tuple(index.shape)}")
        if bool(((index < 0) | (index >= len(self))).any()):
            raise ValueError(f"index must lie in [0, {len(self)})")
        return index


class StoredSplit:
    """A split of a :class:`SequenceStore` in model space: the standardised sequences ``index``.

    Frames are read and standardised batch by batch; in memory are only the indices, the lengths
    and the log-Jacobians (a few bytes per sequence).

    Args:
        store: The store.
        index: Store indices of the split's sequences, shape ``(B,)``.
        standardization: The map from raw to model space.

    Attributes:
        store: The store.
        index: The store indices ``(B,)``, int64.
        standardization: The map from raw to model space.
        frames: Real frames of every sequence, ``(B,)``, int64.
        log_jacobian: Per-sequence log-Jacobian of the standardisation, ``(B,)``, float64.

    Example:
        >>> import tempfile
        >>> folder = Path(tempfile.mkdtemp())
        >>> write_store(folder, torch.tensor([1, 2]), [torch.tensor([[1.0], [3.0], [5.0]])])
        >>> store = SequenceStore(folder)
        >>> scale = Standardization(torch.tensor([3.0], dtype=torch.float64),
        ...                         torch.tensor([2.0], dtype=torch.float64))
        >>> split = StoredSplit(store, torch.tensor([1]), scale)
        >>> x, mask = split.batch(torch.tensor([0]), torch.device("cpu"))
        >>> x.flatten().tolist(), split.log_jacobian.tolist()
        ([0.0, 1.0], [-1.3862943611198906])
    """

    def __init__(
        self, store: SequenceStore, index: Tensor, standardization: Standardization
    ) -> None:
        self.store = store
        self.index = store._check_index(index)
        self.standardization = standardization
        self.frames = store.lengths[self.index]
        self.log_jacobian = standardization.log_jacobian(self.frames)

    def __len__(self) -> int:
        return len(self.index)

    def batch(self, index: Tensor, device: torch.device) -> tuple[Tensor, Tensor]:
        """Sequences ``index`` of the split in model space, trimmed to the longest, on ``device``.

        Args:
            index: Positions in the split, shape ``(b,)``.
            device: Where the batch goes.

        Returns:
            ``(x, mask)``: ``(b, n, D)`` float32, zero at padding, and ``(b, n)`` bool.
        """
        raw, mask = self.store.read(self.index[index])
        x, _ = self.standardization.forward(raw, mask)
        return x.to(device=device, dtype=torch.float32), mask.to(device)

    def batch_mask(self, index: Tensor) -> Tensor:
        """The padding mask of :meth:`batch` without reading any frame, ``(b, n)``."""
        lengths = self.frames[index]
        return torch.arange(int(lengths.max())) < lengths.unsqueeze(1)

    def subset(self, index: Tensor) -> StoredSplit:
        """The sequences ``index`` (positions or a boolean mask over the split) as a split."""
        return StoredSplit(self.store, self.index[index], self.standardization)

    @property
    def mask(self) -> Tensor:
        """The padding mask of the whole split, ``(B, n)`` with ``n`` its longest sequence: built
        on every access."""
        return self.batch_mask(torch.arange(len(self)))

    @property
    def x(self) -> Tensor:
        """The whole split in model space, ``(B, max_len, D)``: read on every access, so only
        for splits that fit in memory (figures of a few test sequences)."""
        return self.batch(torch.arange(len(self)), torch.device("cpu"))[0]
