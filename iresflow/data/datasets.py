r"""Offline sequence datasets and user-file loaders.

:func:`load_dataset` returns a :class:`~iresflow.data.splits.SequenceDataset`: train/validation/
test splits of padded sequences in model space with the log-Jacobian of the preprocessing, so
that negative log-likelihoods are reported in the original units of the data. See
``docs/datasets.md`` for every dataset's source, licence, preprocessing and unit.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable
from functools import lru_cache, partial
from pathlib import Path
from typing import Any

import torch
from torch import Tensor

from iresflow.data.npz import read_npz_covariates
from iresflow.data.partition import blocked_split, default_val_fraction, random_split, split_sizes
from iresflow.data.preprocessing import (
    LogitTransform,
    Preprocessing,
    Standardization,
    interpolate_gaps,
    uniform_dequantize,
)
from iresflow.data.quantization import DEQUANTIZE_CHOICES, dequantize_features
from iresflow.data.readers import (
    pad_sequences,
    pad_to,
    read_ts,
    read_weekly_csv,
)
from iresflow.data.splits import SequenceDataset, SequenceSplit
from iresflow.data.store import SequenceStore, StoredSplit, is_store
from iresflow.data.synthetic import load_synthetic, synthetic_names
from iresflow.data.table_columns import is_data_frame
from iresflow.data.tables import TableLayout
from iresflow.data.user_files import (
    USER_FILE_SUFFIXES,
    USER_SOURCES,
    check_table_arguments,
    read_user_file,
    read_user_labels,
    source_name,
    user_file_kind,
)

__all__ = ["SequenceDataset", "SequenceSplit", "available_datasets", "class_indices",
           "default_val_fraction", "load_dataset"]

_FILES = Path(__file__).resolve().parent / "files"

#: Squeeze of the logit for ``digits_rows`` (RealNVP's value for 8-bit images).
DIGITS_ALPHA = 0.05
#: Number of pixel levels of the scikit-learn digits (values 0..16).
DIGITS_LEVELS = 17
#: Fraction of the digits and of user data held out for the test split (user data given without
#: a test file).
TEST_FRACTION = 0.1
#: A split of user data with fewer sequences than this triggers a ``UserWarning``: its NLL is a
#: noisy estimate (and a training split this small is easily overfitted).
MIN_SPLIT_SEQUENCES = 30
#: Window length (weeks of differences), stride and test fraction of ``co2_windows``.
CO2_WINDOW = 52
CO2_STRIDE = 4
CO2_TEST_FRACTION = 0.15
#: Recording resolution of the CO2 series, in ppm.
CO2_RESOLUTION = 0.1


def _val_fraction(val_fraction: float | None, total: int) -> float:
    """``val_fraction``, or :func:`default_val_fraction` of ``total`` sequences if ``None``."""
    return default_val_fraction(total) if val_fraction is None else val_fraction


def _dataset(
    name: str,
    unit: str,
    parts: tuple[tuple[Tensor, Tensor], ...],
    preprocessing: Preprocessing,
    labels: tuple[Tensor, ...] | None = None,
    classes: tuple[str, ...] | None = None,
    covariates: tuple[Tensor, ...] | None = None,
    val_fraction: float | None = None,
) -> SequenceDataset:
    splits = []
    for k, (raw, mask) in enumerate(parts):
        x, log_jacobian = preprocessing.forward(raw, mask)
        split_labels = None if labels is None else labels[k]
        split_covariates = None if covariates is None else covariates[k].to(torch.float32)
        splits.append(SequenceSplit(x.to(torch.float32), mask, log_jacobian, split_labels,
                                    split_covariates))
    train, val, test = splits
    return SequenceDataset(
        name=name,
        features=train.x.shape[2],
        max_len=train.x.shape[1],
        unit=unit,
        train=train,
        val=val,
        test=test,
        preprocessing=preprocessing,
        classes=classes,
        val_fraction=val_fraction,
    )


def _standardised(
    name: str,
    raw: Tensor,
    mask: Tensor,
    indices: tuple[Tensor, Tensor, Tensor],
    labels: tuple[Tensor, tuple[str, ...]] | None = None,
    covariates: Tensor | None = None,
    val_fraction: float | None = None,
) -> SequenceDataset:
    parts = tuple((raw[i], mask[i]) for i in indices)
    split_labels = None if labels is None else tuple(labels[0][i] for i in indices)
    split_covariates = None if covariates is None else tuple(covariates[i] for i in indices)
    return _dataset(name, "nats/frame", parts, Standardization.fit(*parts[0]), split_labels,
                    None if labels is None else labels[1], split_covariates, val_fraction)


def class_indices(names: list[str]) -> tuple[Tensor, tuple[str, ...]]:
    """Class indices of string labels, the classes in natural order (numerically if all are
    integers, else alphabetically).

    Args:
        names: One label per sequence.

    Returns:
        ``(labels, classes)``: int64 indices ``(B,)`` into ``classes``.

    Example:
        >>> class_indices(["10", "2", "2"])
        (tensor([1, 0, 0]), ('2', '10'))
    """
    unique = set(names)
    numeric = all(n.lstrip("-").isdigit() for n in unique)
    classes = tuple(sorted(unique, key=int if numeric else str))
    position = {c: i for i, c in enumerate(classes)}
    return torch.tensor([position[n] for n in names], dtype=torch.int64), classes


def _load_japanese_vowels(seed: int, val_fraction: float | None) -> SequenceDataset:
    train_file = read_ts(_FILES / "JapaneseVowels_TRAIN.ts.gz")
    test_file = read_ts(_FILES / "JapaneseVowels_TEST.ts.gz")
    train_cases, test_cases = train_file.series, test_file.series
    raw, mask = pad_sequences(train_cases + test_cases)
    speakers = class_indices(train_file.labels + test_file.labels)  # the speakers 1-9
    generator = torch.Generator().manual_seed(seed)
    n_official = len(train_cases)
    val_fraction = _val_fraction(val_fraction, n_official)
    train, val, _ = random_split(n_official, val_fraction, 0.0, generator)
    test = torch.arange(n_official, raw.shape[0])
    return _standardised("japanese_vowels", raw, mask, (train, val, test), speakers,
                         val_fraction=val_fraction)


@lru_cache(maxsize=1)
def _digit_images() -> Tensor:
    try:
        from sklearn.datasets import load_digits
    except ImportError as error:
        raise ImportError(
            "the 'digits_rows' dataset needs scikit-learn (pip install scikit-learn)"
        ) from error
    return torch.from_numpy(load_digits().images).to(torch.float64)


def _load_digits_rows(seed: int, val_fraction: float | None) -> SequenceDataset:
    images = _digit_images()  # (1797, 8, 8): 8 rows of 8 pixels, integers 0..16
    generator = torch.Generator().manual_seed(seed)
    raw = uniform_dequantize(images, 1.0, centred=False, generator=generator)
    mask = torch.ones(raw.shape[:2], dtype=torch.bool)
    val_fraction = _val_fraction(val_fraction, raw.shape[0])
    indices = random_split(raw.shape[0], val_fraction, TEST_FRACTION, generator)
    parts = tuple((raw[i], mask[i]) for i in indices)
    return _dataset("digits_rows", "bits/dim", parts, LogitTransform(DIGITS_LEVELS, DIGITS_ALPHA),
                    val_fraction=val_fraction)


def _load_co2_windows(seed: int, val_fraction: float | None) -> SequenceDataset:
    _, co2 = read_weekly_csv(_FILES / "co2_weekly_mauna_loa.csv")
    generator = torch.Generator().manual_seed(seed)
    filled = interpolate_gaps(co2)
    noisy = uniform_dequantize(filled, CO2_RESOLUTION, centred=True, generator=generator)
    diffs = noisy.diff()  # (T - 1,) weekly differences in ppm
    val_fraction = _val_fraction(val_fraction, diffs.shape[0])
    n_train, n_val, _ = split_sizes(diffs.shape[0], val_fraction, CO2_TEST_FRACTION)
    segments = diffs[:n_train], diffs[n_train : n_train + n_val], diffs[n_train + n_val :]
    parts: list[tuple[Tensor, Tensor]] = []
    for segment in segments:
        if segment.shape[0] < CO2_WINDOW:
            raise ValueError(
                f"val_fraction={val_fraction} leaves a chronological segment of "
                f"{segment.shape[0]} weeks, shorter than one window of {CO2_WINDOW}"
            )
        windows = segment.unfold(0, CO2_WINDOW, CO2_STRIDE).unsqueeze(-1)  # (B, N, 1)
        parts.append((windows, torch.ones(windows.shape[:2], dtype=torch.bool)))
    standardization = Standardization.fit(*parts[0])
    return _dataset("co2_windows", "nats/frame", tuple(parts), standardization,
                    val_fraction=val_fraction)


def _warn_small_splits(name: str, indices: tuple[Tensor, Tensor, Tensor]) -> None:
    """``UserWarning`` for every split with fewer than :data:`MIN_SPLIT_SEQUENCES` sequences."""
    for label, index in zip(("train", "val", "test"), indices, strict=True):
        if len(index) < MIN_SPLIT_SEQUENCES:
            warnings.warn(
                f"{name}: the {label} split has only {len(index)} sequences (fewer than "
                f"{MIN_SPLIT_SEQUENCES}); its NLL is a noisy estimate",
                UserWarning,
                stacklevel=4,  # the caller of load_dataset
            )


def _load_user(
    kind: str, path: str | os.PathLike | Any | None, test_path: str | os.PathLike | Any | None,
    seed: int, val_fraction: float | None, table: TableLayout | None, dequantize: str,
) -> SequenceDataset:
    layout = table or TableLayout()
    if path is None:
        raise ValueError(f"load_dataset({kind!r}) needs path= pointing to {USER_SOURCES[kind]}")
    file, test_file = (value if value is None or is_data_frame(value)
                       else Path(value).expanduser() for value in (path, test_path))
    raw, mask = read_user_file(kind, file, layout)
    names = read_user_labels(kind, file)
    covariates = read_npz_covariates(file) if kind == "npz" else None
    test = None if test_file is None else read_user_file(kind, test_file, layout)
    if test_file is not None and names is not None:
        test_names = read_user_labels(kind, test_file)
        names = None if test_names is None else names + test_names
    if test_file is not None and covariates is not None:
        test_covariates = read_npz_covariates(test_file)
        covariates = (None if test_covariates is None
                      else torch.cat([covariates, test_covariates]))
    generator = torch.Generator().manual_seed(seed)
    gap = layout.overlap if kind == "table" and layout.window_split == "blocks" else 0

    def split(total: int, val_fraction: float, test_fraction: float) -> tuple[Tensor, ...]:
        if gap > 0:  # overlapping windows: blocks in time order, no frame shared between splits
            return blocked_split(total, val_fraction, test_fraction, gap)
        return random_split(total, val_fraction, test_fraction, generator)

    try:
        if test is None:
            val_fraction = _val_fraction(val_fraction, raw.shape[0])
            indices = split(raw.shape[0], val_fraction, TEST_FRACTION)
        else:
            test_raw, test_mask = test
            if test_raw.shape[2] != raw.shape[2]:
                raise ValueError(
                    f"the test file {source_name(test_file)} has {test_raw.shape[2]} features "
                    f"per frame, the training file {raw.shape[2]}"
                )
            length = max(raw.shape[1], test_raw.shape[1])
            parts = (pad_to(raw, mask, length), pad_to(test_raw, test_mask, length))
            n_train_file = raw.shape[0]
            val_fraction = _val_fraction(val_fraction, n_train_file)
            raw, mask = (torch.cat(pair) for pair in zip(*parts, strict=True))
            train, val, _ = split(n_train_file, val_fraction, 0.0)
            indices = (train, val, torch.arange(n_train_file, raw.shape[0]))
        name = file.name if isinstance(file, Path) else "DataFrame"
        if dequantize == "auto":  # the grids of the training file's values
            fit_rows = raw.shape[0] if test is None else n_train_file
            copies = layout.overlap + 1 if kind == "table" else 1  # windows holding a frame
            raw = dequantize_features(raw, mask, fit_rows, generator, name, copies)
        _warn_small_splits(name, indices)
        labels = None if names is None else class_indices(names)
        return _standardised(name, raw, mask, indices, labels, covariates, val_fraction)
    except ValueError as error:
        raise ValueError(f"{source_name(file)}: {error}") from None


def _load_store(
    folder: Path, seed: int, val_fraction: float | None, memory_cap: int
) -> SequenceDataset:
    store = SequenceStore(folder, memory_cap=memory_cap)
    generator = torch.Generator().manual_seed(seed)
    val_fraction = _val_fraction(val_fraction, len(store))
    try:
        indices = random_split(len(store), val_fraction, TEST_FRACTION, generator)
    except ValueError as error:
        raise ValueError(f"{folder}: {error}") from None
    _warn_small_splits(folder.name, indices)
    # One streaming pass over the training frames (in chunks) fits the standardisation.
    standardization = Standardization.fit_chunks(store.frame_chunks(indices[0]))
    train, val, test = (StoredSplit(store, index, standardization) for index in indices)
    return SequenceDataset(
        name=folder.name,
        features=store.features,
        max_len=store.max_len,
        unit="nats/frame",
        train=train,
        val=val,
        test=test,
        preprocessing=standardization,
        val_fraction=val_fraction,
    )


_LOADERS: dict[str, Callable[[int, float | None], SequenceDataset]] = {
    "japanese_vowels": _load_japanese_vowels,
    "digits_rows": _load_digits_rows,
    "co2_windows": _load_co2_windows,
    **{name: partial(load_synthetic, name) for name in synthetic_names()},
}
_USER_KINDS = tuple(USER_SOURCES)


def available_datasets() -> list[str]:
    """Names accepted by :func:`load_dataset` (besides a path ending in one of
    :data:`USER_FILE_SUFFIXES`).

    Returns:
        ``["japanese_vowels", "digits_rows", "co2_windows", "repeated_motif",
        "nonlinear_seasonal", "npz", "ts", "table"]``.

    Example:
        >>> "japanese_vowels" in available_datasets()
        True
    """
    return [*_LOADERS, *_USER_KINDS]


def load_dataset(
    name: str,
    *,
    seed: int = 0,
    path: str | os.PathLike | Any | None = None,
    val_fraction: float | None = None,
    test_path: str | os.PathLike | Any | None = None,
    memory_cap: int = 0,
    table: TableLayout | None = None,
    dequantize: str = "auto",
) -> SequenceDataset:
    """Load a dataset by name, user sequences from a file or a DataFrame, or a store folder.

    Every loader is offline and deterministic given ``seed`` (random splits, dequantisation):
    * ``japanese_vowels``: official 270/370 train/test split; ``val_fraction`` of the official
      training cases are held out for validation; standardised; nats/frame.
    * ``digits_rows``: 8x8 digits as 8 rows of 8 pixels, dequantised, logit; random split with
      ``val_fraction`` validation and 10% test; bits/dim.
    * ``co2_windows``: windows of 52 weekly CO2 differences, chronological split with
      ``val_fraction`` validation and the last 15% test; standardised; nats/frame.
    * ``repeated_motif``, ``nonlinear_seasonal``: synthetic, with an exact log-density
      (:mod:`iresflow.data.synthetic`); fixed 1000/200/500 splits; not preprocessed; nats/frame.
    * ``npz`` / ``ts``: user file at ``path`` (or as ``name``). Without ``test_path``, a random
      split: ``val_fraction`` validation, 10% test, the rest training. With ``test_path`` (e.g.
      the UEA pair ``*_TRAIN.ts`` / ``*_TEST.ts``) the test file is the test split and
      ``val_fraction`` of the training file is held out for validation. Standardised with the
      training split's observed frames; nats/frame. Missing frames (a boolean ``mask`` in
      ``.npz``, ``?``/``NaN`` in ``.ts``) are unobserved. A ``UserWarning`` names every split
      with fewer than :data:`MIN_SPLIT_SEQUENCES` sequences.
    * ``table``: a long-format table at ``path`` (or a file as ``name``), read as ``table``
      says (:func:`~iresflow.data.tables.read_table`), then split like an ``npz`` file.
    * a sequence-store folder (:mod:`iresflow.data.store`) as ``name``: data larger than memory,
      read from disk (:class:`~iresflow.data.store.StoredSplit`), split like a user file without
      a test file, standardised in one streaming pass; nats/frame.

    Args:
        name: One of :func:`available_datasets`, or a path ending in :data:`USER_FILE_SUFFIXES`.
        seed: Seed of the torch generator for splits and dequantisation.
        path: The user file for ``"npz"``, ``"ts"`` and ``"table"`` (also a DataFrame).
        val_fraction: Fraction in ``(0, 1)`` for validation; ``None``: :func:`default_val_fraction`.
        test_path: Optional test file of a user dataset, in the format of the training file.
        memory_cap: For a store, megabytes its memory map may keep resident (0: no cap; see
            :class:`~iresflow.data.store.SequenceStore`).
        table: For table data, its columns and windows (default: ``TableLayout()``).
        dequantize: For user data, ``"auto"`` (dequantise the features on a grid,
            :func:`~iresflow.data.quantization.dequantize_features`) or ``"off"``.

    Returns:
        The dataset.

    Raises:
        ValueError: unknown name, missing or superfluous ``path``/``test_path``, bad values, or
            a malformed user file (naming the file and the problem).

    Example:
        >>> ds = load_dataset("japanese_vowels", seed=0)
        >>> len(ds.train) + len(ds.val) + len(ds.test), ds.test.x.shape
        (640, torch.Size([370, 29, 12]))
    """
    _check_load_arguments(name, seed, val_fraction, path, test_path, memory_cap, table, dequantize)
    if is_store(name):
        if path is not None or test_path is not None:
            raise ValueError(f"a store folder takes no path or test_path ({name!r})")
        return _load_store(Path(name).expanduser(), seed, val_fraction, memory_cap)
    kind = user_file_kind(name)
    if kind is not None:
        if path is not None:
            raise ValueError(f"give the file either as name or as path, not both ({name!r})")
        name, path = kind, name
    if name in _USER_KINDS:
        return _load_user(name, path, test_path, seed, val_fraction, table, dequantize)
    for label, value in (("path", path), ("test_path", test_path)):
        if value is not None:
            raise ValueError(f"{label} is only used by user files, not {name!r}")
    if name not in _LOADERS:
        raise ValueError(
            f"unknown dataset {name!r}; available: {available_datasets()} (or a path ending "
            f"in {', '.join(USER_FILE_SUFFIXES)}, or a sequence-store folder)"
        )
    return _LOADERS[name](seed, val_fraction)


def _check_load_arguments(
    name: object,
    seed: object,
    val_fraction: object,
    path: object,
    test_path: object,
    memory_cap: object,
    table: object,
    dequantize: object,
) -> None:
    """Types and ranges of :func:`load_dataset`'s arguments (``TypeError``/``ValueError``)."""
    if not isinstance(name, str):
        raise TypeError(f"name must be a str, got {type(name).__name__}")
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int, got {type(seed).__name__}")
    if val_fraction is not None:
        if isinstance(val_fraction, bool) or not isinstance(val_fraction, int | float):
            raise TypeError(
                f"val_fraction must be a float or None, got {type(val_fraction).__name__}"
            )
        if not 0.0 < val_fraction < 1.0:
            raise ValueError(f"val_fraction must lie in (0, 1), got {val_fraction}")
    for label, value in (("path", path), ("test_path", test_path)):
        if value is not None and not isinstance(value, str | os.PathLike) and not is_data_frame(
            value
        ):
            raise TypeError(f"{label} must be a str, os.PathLike or a pandas DataFrame, got "
                            f"{type(value).__name__}")
    if table is not None and not isinstance(table, TableLayout):
        raise TypeError(f"table must be a TableLayout or None, got {type(table).__name__}")
    check_table_arguments(name, path, test_path, table)
    if isinstance(memory_cap, bool) or not isinstance(memory_cap, int) or memory_cap < 0:
        raise ValueError(f"memory_cap must be an int >= 0 (megabytes), got {memory_cap!r}")
    if dequantize not in DEQUANTIZE_CHOICES:
        raise ValueError(f"dequantize must be one of {DEQUANTIZE_CHOICES}, got {dequantize!r}")
