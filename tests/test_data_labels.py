"""Class labels of datasets: the Japanese Vowels speakers, ``.ts`` labels and ``.npz`` ``y``."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from iresflow.data.datasets import class_indices, load_dataset
from iresflow.data.splits import SequenceSplit
from tests.test_data import match_rows, write_ts

pytestmark = pytest.mark.filterwarnings("ignore:.*split has only")

# UCI: 30 training utterances per speaker; test utterances in these blocks per speaker.
TEST_BLOCKS = [31, 35, 88, 44, 29, 24, 40, 50, 29]


def test_japanese_vowels_speakers() -> None:
    ds = load_dataset("japanese_vowels")
    assert ds.classes == tuple(str(k) for k in range(1, 10))
    assert torch.equal(ds.test.labels, torch.repeat_interleave(
        torch.arange(9), torch.tensor(TEST_BLOCKS)))
    train = torch.cat([ds.train.labels, ds.val.labels])
    assert torch.equal(train.bincount(), torch.full((9,), 30))
    subset = ds.test.subset(torch.tensor([0, 31, 369]))
    assert subset.labels.tolist() == [0, 1, 8]


def test_split_rejects_bad_labels() -> None:
    x, mask, lj = torch.zeros(2, 3, 1), torch.ones(2, 3, dtype=torch.bool), torch.zeros(2)
    with pytest.raises(TypeError, match="labels"):
        SequenceSplit(x, mask, lj, torch.zeros(2))
    with pytest.raises(ValueError, match="labels"):
        SequenceSplit(x, mask, lj, torch.zeros(3, dtype=torch.int64))
    with pytest.raises(ValueError, match="labels"):
        SequenceSplit(x, mask, lj, torch.tensor([0, -1]))


def test_class_indices_order() -> None:
    labels, classes = class_indices(["b", "a", "b"])
    assert classes == ("a", "b") and labels.tolist() == [1, 0, 1]


def _recover(ds, original):
    """Labels of the splits in the order of the original rows."""
    raw = torch.cat([ds.to_raw(s.x.double(), s.mask) for s in (ds.train, ds.val, ds.test)])
    labels = torch.cat([s.labels for s in (ds.train, ds.val, ds.test)])
    index = match_rows(raw, original)
    out = torch.empty_like(labels)
    out[index] = labels
    return out


def test_ts_labels_follow_their_sequences(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    cases = [torch.randn(4, 2, generator=gen, dtype=torch.float64).numpy() for _ in range(12)]
    names = ["a" if i % 3 else "b" for i in range(12)]
    write_ts(tmp_path / "mine.ts", cases, names)
    ds = load_dataset(str(tmp_path / "mine.ts"))
    original = torch.from_numpy(np.stack(cases))
    assert ds.classes == ("a", "b")
    assert _recover(ds, original).tolist() == [0 if n == "a" else 1 for n in names]


def test_npz_labels_follow_their_sequences(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((12, 4, 2))
    y = np.array([7, 3, 3, 7, 10, 3, 7, 7, 10, 3, 3, 7])
    np.savez(tmp_path / "mine.npz", x=x, y=y)
    ds = load_dataset(str(tmp_path / "mine.npz"))
    assert ds.classes == ("3", "7", "10")
    expected = [("3", "7", "10").index(str(v)) for v in y]
    assert _recover(ds, torch.from_numpy(x)).tolist() == expected
    np.savez(tmp_path / "bad.npz", x=x, y=y.astype(float))
    with pytest.raises(ValueError, match="'y'"):
        load_dataset(str(tmp_path / "bad.npz"))


def test_unlabelled_data_has_no_labels(tmp_path: Path) -> None:
    np.savez(tmp_path / "plain.npz", x=np.zeros((10, 3, 1)) + np.arange(10)[:, None, None])
    ds = load_dataset(str(tmp_path / "plain.npz"))
    assert ds.classes is None and ds.train.labels is None


def test_npz_covariates_follow_their_sequences(tmp_path: Path) -> None:
    rng = np.random.default_rng(1)
    x = rng.standard_normal((12, 4, 2))
    c = rng.standard_normal((12, 3))
    np.savez(tmp_path / "mine.npz", x=x, c=c)
    ds = load_dataset(str(tmp_path / "mine.npz"))
    raw = torch.cat([ds.to_raw(s.x.double(), s.mask) for s in (ds.train, ds.val, ds.test)])
    got = torch.cat([s.covariates for s in (ds.train, ds.val, ds.test)])
    index = match_rows(raw, torch.from_numpy(x))
    assert torch.allclose(got.double(), torch.from_numpy(c)[index], atol=1e-6)
    assert ds.train.subset(torch.tensor([0])).covariates.shape == (1, 3)
    np.savez(tmp_path / "bad.npz", x=x, c=np.full((12, 3), np.nan))
    with pytest.raises(ValueError, match="'c'"):
        load_dataset(str(tmp_path / "bad.npz"))
