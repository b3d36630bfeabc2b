"""Tests of iresflow.data: loaders on the vendored files, preprocessing maps and their
log-Jacobians (autograd + slogdet oracle), NLL arithmetic, user files and bad-file errors."""

from __future__ import annotations

import gzip
import math
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
from oracles import jacobian_logdet
from scipy.special import logit
from scipy.stats import multivariate_normal, norm

import iresflow.data.datasets as datasets
from iresflow.data.datasets import (
    SequenceDataset,
    SequenceSplit,
    available_datasets,
    load_dataset,
)
from iresflow.data.preprocessing import (
    LogitTransform,
    Preprocessing,
    Standardization,
    interpolate_gaps,
    uniform_dequantize,
)

FILES = Path(datasets.__file__).parent / "files"
NAMED = ["japanese_vowels", "digits_rows", "co2_windows"]


def splits(ds: SequenceDataset) -> list[SequenceSplit]:
    return [ds.train, ds.val, ds.test]


def oracle_log_jacobian(preprocessing: Preprocessing, raw: torch.Tensor, mask: torch.Tensor):
    """Autograd Jacobian + slogdet of the preprocessing over each sequence's real frames."""
    return jacobian_logdet(lambda t, m: preprocessing.forward(t, m)[0], raw, mask)


def parse_ts_oracle(path: Path) -> list[np.ndarray]:
    """Plain independent parse of a labelled .ts.gz file: list of (n_i, D) arrays."""
    with gzip.open(path, "rt") as handle:
        lines = handle.read().splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip().lower() == "@data") + 1
    cases = []
    for line in lines[start:]:
        if line.strip():
            dims = line.strip().split(":")[:-1]
            cases.append(np.array([[float(v) for v in d.split(",")] for d in dims]).T)
    return cases


def co2_differences_oracle() -> np.ndarray:
    """Weekly differences of the CO2 series with gaps linearly interpolated (numpy)."""
    table = np.genfromtxt(FILES / "co2_weekly_mauna_loa.csv", delimiter=",", skip_header=1)
    values = table[:, 1]
    t = np.arange(len(values))
    known = ~np.isnan(values)
    return np.diff(np.interp(t, t[known], values[known]))


# --- registry and arguments -------------------------------------------------------------------


def test_available_datasets() -> None:
    assert available_datasets() == ["japanese_vowels", "digits_rows", "co2_windows",
                                    "repeated_motif", "nonlinear_seasonal", "npz", "ts",
                                    "table"]


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"name": "mnist"}, "available: .*japanese_vowels"),
        ({"name": "npz"}, "needs path="),
        ({"name": "ts"}, "needs path="),
        ({"name": "japanese_vowels", "path": "a.npz"}, "only used by"),
        ({"name": "a.npz", "path": "b.npz"}, "not both"),
        ({"name": "japanese_vowels", "val_fraction": 0.0}, "val_fraction"),
        ({"name": "japanese_vowels", "val_fraction": 1.0}, "val_fraction"),
        ({"name": "co2_windows", "val_fraction": 0.01}, "shorter than one window"),
        ({"name": "japanese_vowels", "val_fraction": 0.995}, "too few"),
    ],
)
def test_load_dataset_argument_errors(kwargs: dict, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        load_dataset(**kwargs)


def test_load_dataset_argument_types() -> None:
    with pytest.raises(TypeError, match="seed"):
        load_dataset("japanese_vowels", seed=1.5)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="name"):
        load_dataset(3)  # type: ignore[arg-type]


# --- the named datasets -----------------------------------------------------------------------


@pytest.mark.parametrize("name", NAMED)
def test_masks_padding_and_finiteness(name: str) -> None:
    ds = load_dataset(name)
    for split in splits(ds):
        assert split.x.dtype == torch.float32 and split.mask.dtype == torch.bool
        assert split.log_jacobian.dtype == torch.float64
        assert split.x.shape == (len(split), ds.max_len, ds.features)
        assert torch.isfinite(split.x).all() and torch.isfinite(split.log_jacobian).all()
        lengths = split.mask.sum(dim=1)
        assert torch.equal(split.mask, torch.arange(ds.max_len) < lengths[:, None])
        assert (split.x[~split.mask] == 0).all()


def test_japanese_vowels_shapes_and_splits() -> None:
    ds = load_dataset("japanese_vowels", val_fraction=0.1)
    assert (ds.name, ds.features, ds.max_len, ds.unit) == ("japanese_vowels", 12, 29, "nats/frame")
    assert (len(ds.train), len(ds.val), len(ds.test)) == (243, 27, 370)
    lengths = torch.cat([s.mask.sum(dim=1) for s in splits(ds)])
    assert len(lengths) == 640 and int(lengths.min()) == 7 and int(lengths.max()) == 29


@pytest.mark.parametrize("name", ["japanese_vowels", "co2_windows"])
def test_standardised_with_train_statistics(name: str) -> None:
    ds = load_dataset(name)
    frames = ds.train.x[ds.train.mask].double()
    torch.testing.assert_close(
        frames.mean(dim=0), torch.zeros(ds.features), atol=1e-6, rtol=0, check_dtype=False
    )
    torch.testing.assert_close(
        frames.std(dim=0, correction=0),
        torch.ones(ds.features),
        atol=1e-6,
        rtol=0,
        check_dtype=False,
    )
    val = ds.val.x[ds.val.mask].double()
    assert val.mean(dim=0).abs().max() > 1e-3  # the validation part was not used to fit


def test_japanese_vowels_raw_matches_files() -> None:
    ds = load_dataset("japanese_vowels")
    test_cases = parse_ts_oracle(FILES / "JapaneseVowels_TEST.ts.gz")
    raw = ds.to_raw(ds.test.x.double(), ds.test.mask)
    for b in (0, 1, 200, 369):
        n = test_cases[b].shape[0]
        assert int(ds.test.mask[b].sum()) == n
        np.testing.assert_allclose(raw[b, :n].numpy(), test_cases[b], rtol=1e-5, atol=1e-5)
    train_cases = parse_ts_oracle(FILES / "JapaneseVowels_TRAIN.ts.gz")
    assert len(train_cases) == len(ds.train) + len(ds.val) == 270
    pooled = np.concatenate(train_cases)
    raw_train = ds.to_raw(ds.train.x.double(), ds.train.mask)[ds.train.mask]
    raw_val = ds.to_raw(ds.val.x.double(), ds.val.mask)[ds.val.mask]
    both = torch.cat([raw_train, raw_val]).numpy()
    np.testing.assert_allclose(np.sort(both, axis=0), np.sort(pooled, axis=0), atol=1e-5)


def test_japanese_vowels_nll_in_original_units_matches_raw_gaussian() -> None:
    """A Gaussian over frames scored in model space + log_jacobian equals scipy on raw frames."""
    ds = load_dataset("japanese_vowels")
    frames = ds.train.x[ds.train.mask].double()
    gaussian = torch.distributions.MultivariateNormal(
        frames.mean(dim=0), torch.cov(frames.T, correction=0)
    )
    log_prob = (gaussian.log_prob(ds.test.x.double()) * ds.test.mask).sum(dim=1)
    ours = ds.nll(log_prob, ds.test)
    raw_train = ds.to_raw(ds.train.x.double(), ds.train.mask)[ds.train.mask].numpy()
    peer = multivariate_normal(raw_train.mean(axis=0), np.cov(raw_train.T, bias=True))
    raw_test = np.concatenate(parse_ts_oracle(FILES / "JapaneseVowels_TEST.ts.gz"))
    assert ours == pytest.approx(float(-peer.logpdf(raw_test).mean()), rel=1e-5)


def test_digits_rows_shapes_and_raw_values() -> None:
    from sklearn.datasets import load_digits

    images = torch.from_numpy(load_digits().images).double()
    ds = load_dataset("digits_rows")
    assert (ds.features, ds.max_len, ds.unit) == (8, 8, "bits/dim")
    assert (len(ds.train), len(ds.val), len(ds.test)) == (1437, 180, 180)
    raw = torch.cat([ds.to_raw(s.x.double(), s.mask) for s in splits(ds)])
    assert raw.min() > -1e-5 and raw.max() < 17 + 1e-5
    # Every dequantised image lies within its pixel bins [k, k + 1) of exactly one digit image.
    distance = torch.cdist((raw - 0.5).reshape(-1, 64), images.reshape(-1, 64), p=float("inf"))
    best, match = distance.min(dim=1)
    assert best.max() < 0.5 + 1e-5
    as_rows = sorted(map(tuple, images[match].reshape(-1, 64).int().tolist()))
    assert as_rows == sorted(map(tuple, images.reshape(-1, 64).int().tolist()))
    # The dequantisation offsets are uniform on [0, 1): mean 1/2, variance 1/12 (z-tests).
    offsets = (raw - images[match]).flatten()
    z_mean = (offsets.mean() - 0.5) / math.sqrt(1 / 12 / offsets.numel())
    assert abs(float(z_mean)) < 5
    assert float(offsets.var()) == pytest.approx(1 / 12, rel=0.02)


def test_digits_rows_logit_map_against_scipy() -> None:
    ds = load_dataset("digits_rows")
    raw = ds.to_raw(ds.test.x.double(), ds.test.mask)
    expected = logit(datasets.DIGITS_ALPHA + (1 - 2 * datasets.DIGITS_ALPHA) * raw.numpy() / 17)
    np.testing.assert_allclose(ds.test.x.numpy(), expected, atol=1e-5)


def test_co2_windows_chronological_without_crossing() -> None:
    ds = load_dataset("co2_windows")
    assert (ds.features, ds.max_len, ds.unit) == (1, 52, "nats/frame")
    diffs = torch.from_numpy(co2_differences_oracle())
    candidates = diffs.unfold(0, 52, 1)  # every possible window start
    starts = []
    residuals = []
    for split in splits(ds):
        windows = ds.to_raw(split.x.double(), split.mask)[..., 0]
        distance, start = torch.cdist(windows, candidates, p=float("inf")).min(dim=1)
        # Differences of two U[-0.05, 0.05) dequantisation offsets lie in (-0.1, 0.1).
        assert distance.max() < 0.1 + 1e-5
        assert torch.equal(start.diff(), torch.full_like(start.diff(), datasets.CO2_STRIDE))
        starts.append(start)
        residuals.append((windows - candidates[start])[:, : datasets.CO2_STRIDE].flatten())
    for earlier, later in zip(starts, starts[1:], strict=False):
        assert int(earlier[-1]) + 52 <= int(later[0])  # windows never cross a split boundary
    assert int(starts[-1][-1]) + 52 > len(diffs) - datasets.CO2_STRIDE - 52
    total = sum(len(s) for s in splits(ds))
    assert len(ds.test) / total == pytest.approx(0.15, abs=0.02)
    noise = torch.cat(residuals)
    assert float(noise.std()) == pytest.approx(math.sqrt(2 * 0.1**2 / 12), rel=0.1)


def test_co2_nll_in_original_units_matches_raw_gaussian() -> None:
    ds = load_dataset("co2_windows")
    frames = ds.train.x[ds.train.mask].double()
    mean, std = frames.mean(), frames.std(correction=0)
    log_prob = torch.distributions.Normal(mean, std).log_prob(ds.test.x.double()).sum(dim=(1, 2))
    raw_train = ds.to_raw(ds.train.x.double(), ds.train.mask).numpy()
    raw_test = ds.to_raw(ds.test.x.double(), ds.test.mask).numpy()
    peer = -norm(raw_train.mean(), raw_train.std()).logpdf(raw_test).mean()
    assert ds.nll(log_prob, ds.test) == pytest.approx(float(peer), rel=1e-5)


@pytest.mark.parametrize("name", NAMED)
def test_log_jacobian_against_autograd(name: str) -> None:
    ds = load_dataset(name)
    for split in (ds.train, ds.test):
        index = torch.tensor([0, len(split) - 1])
        raw = ds.to_raw(split.x[index].double(), split.mask[index])
        oracle = oracle_log_jacobian(ds.preprocessing, raw, split.mask[index])
        # Stored values come from the exact raw data; `raw` here is rebuilt from float32 x.
        torch.testing.assert_close(split.log_jacobian[index], oracle, rtol=1e-6, atol=1e-4)


@pytest.mark.parametrize("name", NAMED)
def test_to_raw_inverts_preprocessing(name: str) -> None:
    ds = load_dataset(name)
    x = ds.val.x.double()
    raw = ds.to_raw(x, ds.val.mask)
    assert raw.dtype == torch.float64 and (raw[~ds.val.mask] == 0).all()
    again, log_jacobian = ds.preprocessing.forward(raw, ds.val.mask)
    torch.testing.assert_close(again, x, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(log_jacobian, ds.val.log_jacobian, atol=1e-4, rtol=1e-6)


@pytest.mark.parametrize("name", NAMED)
def test_determinism_under_seed(name: str) -> None:
    first, again, other = (
        load_dataset(name, seed=3),
        load_dataset(name, seed=3),
        load_dataset(name, seed=4),
    )
    for a, b in zip(splits(first), splits(again), strict=True):
        assert torch.equal(a.x, b.x) and torch.equal(a.mask, b.mask)
        assert torch.equal(a.log_jacobian, b.log_jacobian)
    # japanese_vowels changes its validation hold-out, the others their dequantisation noise.
    assert not torch.equal(first.val.x, other.val.x)


def test_sample_lengths_follow_train_distribution() -> None:
    ds = load_dataset("japanese_vowels")
    train_lengths = ds.train.mask.sum(dim=1).double()
    draws = ds.sample_lengths(4000, torch.Generator().manual_seed(0))
    assert draws.shape == (4000,) and draws.dtype == torch.int64
    assert set(draws.tolist()) <= set(train_lengths.long().tolist())
    z = (draws.double().mean() - train_lengths.mean()) / (train_lengths.std() / math.sqrt(4000))
    assert abs(float(z)) < 5
    again = ds.sample_lengths(4000, torch.Generator().manual_seed(0))
    assert torch.equal(draws, again)
    with pytest.raises(ValueError, match="num"):
        ds.sample_lengths(0)


def test_digits_need_scikit_learn(monkeypatch: pytest.MonkeyPatch) -> None:
    datasets._digit_images.cache_clear()
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)
    try:
        with pytest.raises(ImportError, match="scikit-learn"):
            load_dataset("digits_rows")
    finally:
        datasets._digit_images.cache_clear()


# --- NLL arithmetic on toy numbers --------------------------------------------------------------


def toy_dataset(unit: str) -> SequenceDataset:
    x = torch.zeros(2, 3, 2)
    x[0, :2] = 1.0
    x[1, 0] = -1.0
    mask = torch.tensor([[True, True, False], [True, False, False]])
    split = SequenceSplit(x, mask, torch.tensor([0.5, -1.0], dtype=torch.float64))
    return SequenceDataset("toy", 2, 3, unit, split, split, split)


def test_nll_and_stderr_nats_per_frame() -> None:
    ds = toy_dataset("nats/frame")
    assert ds.units(ds.test.mask).tolist() == [2, 1]
    # -((-2 + 0.5) + (-3 - 1)) / (2 + 1) frames
    assert ds.nll(torch.tensor([-2.0, -3.0], dtype=torch.float64), ds.test) == pytest.approx(
        5.5 / 3, rel=1e-12
    )
    # sqrt(0.3^2 + 0.4^2) / 3
    se = torch.tensor([0.3, 0.4], dtype=torch.float64)
    assert ds.nll_stderr(se, ds.test) == pytest.approx(0.5 / 3, rel=1e-12)


def test_nll_and_stderr_bits_per_dim() -> None:
    ds = toy_dataset("bits/dim")
    assert ds.units(ds.test.mask).tolist() == [4, 2]
    expected = 5.5 / 6 / math.log(2)
    assert ds.nll(torch.tensor([-2.0, -3.0], dtype=torch.float64), ds.test) == pytest.approx(
        expected, rel=1e-12
    )
    expected_se = 0.5 / 6 / math.log(2)
    se = torch.tensor([0.3, 0.4], dtype=torch.float64)
    assert ds.nll_stderr(se, ds.test) == pytest.approx(expected_se, rel=1e-12)


def test_nll_input_errors() -> None:
    ds = toy_dataset("nats/frame")
    with pytest.raises(ValueError, match=r"shape \(B,\)"):
        ds.nll(torch.zeros(3), ds.test)
    with pytest.raises(ValueError, match="NaN"):
        ds.nll(torch.tensor([0.0, float("nan")]), ds.test)
    with pytest.raises(ValueError, match="non-negative"):
        ds.nll_stderr(torch.tensor([0.1, -0.1]), ds.test)
    with pytest.raises(TypeError, match="floating"):
        ds.nll(torch.zeros(2, dtype=torch.long), ds.test)


def test_to_raw_without_preprocessing_and_validation() -> None:
    ds = toy_dataset("nats/frame")
    x = torch.ones(2, 3, 2)
    raw = ds.to_raw(x, ds.test.mask)
    assert torch.equal(raw, torch.where(ds.test.mask[..., None], x, 0.0))
    with pytest.raises(ValueError, match="features"):
        ds.to_raw(torch.ones(2, 3, 5), ds.test.mask)


def test_split_and_dataset_validation() -> None:
    mask = torch.tensor([[True, False]])
    with pytest.raises(ValueError, match="zero at padded"):
        SequenceSplit(torch.ones(1, 2, 1), mask, torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="log_jacobian"):
        SequenceSplit(torch.zeros(1, 2, 1), mask, torch.zeros(2, dtype=torch.float64))
    split = SequenceSplit(torch.zeros(1, 2, 1), mask, torch.zeros(1, dtype=torch.float64))
    with pytest.raises(ValueError, match="unit"):
        SequenceDataset("toy", 1, 2, "nats", split, split, split)
    with pytest.raises(ValueError, match="shape"):
        SequenceDataset("toy", 3, 2, "nats/frame", split, split, split)


# --- preprocessing maps -----------------------------------------------------------------------


def test_standardization_round_trip_and_log_jacobian() -> None:
    raw = torch.randn(4, 5, 3, dtype=torch.float64) * torch.tensor([0.5, 2.0, 3.0]) + 1.0
    mask = torch.arange(5) < torch.tensor([5, 3, 1, 4])[:, None]
    raw = torch.where(mask[..., None], raw, 0.0)
    stand = Standardization.fit(raw, mask)
    x, log_jacobian = stand.forward(raw, mask)
    torch.testing.assert_close(stand.inverse(x, mask), raw, atol=1e-12, rtol=0)
    oracle = oracle_log_jacobian(stand, raw, mask)
    torch.testing.assert_close(log_jacobian, oracle, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match="constant"):
        Standardization.fit(torch.ones(2, 3, 1, dtype=torch.float64), torch.ones(2, 3).bool())


def test_logit_transform_round_trip_log_jacobian_and_range() -> None:
    transform = LogitTransform(levels=17, alpha=0.05)
    raw = torch.rand(3, 4, 2, dtype=torch.float64) * 17
    mask = torch.arange(4) < torch.tensor([4, 2, 1])[:, None]
    raw = torch.where(mask[..., None], raw, 0.0)
    x, log_jacobian = transform.forward(raw, mask)
    torch.testing.assert_close(transform.inverse(x, mask), raw, atol=1e-12, rtol=0)
    oracle = oracle_log_jacobian(transform, raw, mask)
    torch.testing.assert_close(log_jacobian, oracle, atol=1e-10, rtol=0)
    with pytest.raises(ValueError, match=r"\[0, 17\]"):
        transform.forward(raw + 20.0, mask)
    with pytest.raises(ValueError, match="alpha"):
        LogitTransform(levels=17, alpha=0.5)


def test_interpolate_gaps_against_numpy() -> None:
    values = torch.tensor([1.0, float("nan"), 4.0, float("nan"), float("nan"), -2.0, 3.0])
    t = np.arange(7)
    known = ~np.isnan(values.numpy())
    expected = np.interp(t, t[known], values.numpy()[known])
    np.testing.assert_allclose(interpolate_gaps(values).numpy(), expected, rtol=1e-6)
    with pytest.raises(ValueError, match="first and last"):
        interpolate_gaps(torch.tensor([float("nan"), 1.0]))


def test_uniform_dequantize_moments() -> None:
    values = torch.zeros(20000, dtype=torch.float64)
    gen = torch.Generator().manual_seed(0)
    centred = uniform_dequantize(values, 0.1, centred=True, generator=gen)
    assert centred.min() >= -0.05 and centred.max() < 0.05
    assert abs(float(centred.mean()) / math.sqrt(0.01 / 12 / 20000)) < 5
    assert float(centred.var()) == pytest.approx(0.01 / 12, rel=0.05)
    shifted = uniform_dequantize(values + 3, 1.0, centred=False, generator=gen)
    assert shifted.min() >= 3 and shifted.max() < 4


# --- user files -------------------------------------------------------------------------------


def match_rows(raw: torch.Tensor, original: torch.Tensor) -> torch.Tensor:
    """Index of the original sequence closest to each raw sequence (max-abs distance)."""
    distance = torch.cdist(raw.flatten(1), original.flatten(1), p=float("inf"))
    best, index = distance.min(dim=1)
    assert best.max() < 1e-5
    return index


def test_npz_round_trip(tmp_path: Path) -> None:
    x = torch.randn(20, 6, 3, dtype=torch.float64) * 2 + 5
    lengths = torch.randint(1, 7, (20,))
    path = tmp_path / "mine.npz"
    np.savez(path, x=x.numpy(), lengths=lengths.numpy(), labels=np.arange(20))
    ds = load_dataset("npz", path=path, seed=1)
    assert (ds.name, ds.features, ds.max_len, ds.unit) == ("mine.npz", 3, 6, "nats/frame")
    assert (len(ds.train), len(ds.val), len(ds.test)) == (13, 5, 2)  # default: a quarter
    same = load_dataset(str(path), seed=1)
    assert torch.equal(ds.test.x, same.test.x)
    mask = torch.arange(6) < lengths[:, None]
    padded = torch.where(mask[..., None], x, 0.0)
    raw = torch.cat([ds.to_raw(s.x.double(), s.mask) for s in splits(ds)])
    index = match_rows(raw, padded)
    assert sorted(index.tolist()) == list(range(20))
    assert torch.equal(torch.cat([s.mask for s in splits(ds)]), mask[index])
    frames = ds.train.x[ds.train.mask].double()
    torch.testing.assert_close(
        frames.mean(dim=0), torch.zeros(3, dtype=torch.float64), atol=1e-6, rtol=0
    )


def test_npz_without_lengths(tmp_path: Path) -> None:
    path = tmp_path / "full.npz"
    np.savez(path, x=np.random.default_rng(0).standard_normal((10, 4, 2)).astype(np.float32))
    ds = load_dataset(str(path))
    assert all(bool(s.mask.all()) for s in splits(ds))
    assert len(ds.train) + len(ds.val) + len(ds.test) == 10


def write_ts(path: Path, cases: list[np.ndarray], labels: list[str] | None) -> None:
    lines = [
        "# a comment",
        "@problemName toy",
        f"@dimensions {cases[0].shape[1]}",
        f"@classLabel {'true a b' if labels else 'false'}",
        "@data",
    ]
    for i, case in enumerate(cases):
        dims = [",".join(repr(float(v)) for v in case[:, d]) for d in range(case.shape[1])]
        lines.append(":".join(dims) + (f":{labels[i]}" if labels else ""))
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize("labelled", [True, False])
def test_ts_round_trip(tmp_path: Path, labelled: bool) -> None:
    gen = torch.Generator().manual_seed(0)
    lengths = torch.randint(2, 9, (12,), generator=gen)
    cases = [torch.randn(int(n), 2, generator=gen, dtype=torch.float64).numpy() for n in lengths]
    path = tmp_path / "mine.ts"
    write_ts(path, cases, ["a" if i % 2 else "b" for i in range(12)] if labelled else None)
    ds = load_dataset(str(path))
    assert (ds.features, ds.max_len, ds.name) == (2, int(lengths.max()), "mine.ts")
    original = torch.zeros(12, ds.max_len, 2, dtype=torch.float64)
    for b, case in enumerate(cases):
        original[b, : len(case)] = torch.from_numpy(case)
    raw = torch.cat([ds.to_raw(s.x.double(), s.mask) for s in splits(ds)])
    index = match_rows(raw, original)
    assert sorted(index.tolist()) == list(range(12))
    assert torch.equal(torch.cat([s.mask.sum(dim=1) for s in splits(ds)]), lengths[index])


def object_array() -> np.ndarray:
    ragged = np.empty(2, dtype=object)
    ragged[0], ragged[1] = np.zeros((3, 2)), np.zeros((2, 2))
    return ragged


BAD_NPZ = {
    "nan": ({"x": np.full((5, 3, 2), np.nan)}, "NaN or Inf"),
    "inf": ({"x": np.where(np.eye(3)[None, :, :2] > 0, np.inf, 1.0).repeat(5, 0)}, "NaN or Inf"),
    "rank": ({"x": np.zeros((5, 3))}, r"shape \(B, N, D\)"),
    "ragged": ({"x": object_array()}, "ragged"),
    "lengths_zero": ({"x": np.ones((5, 3, 2)), "lengths": np.array([3, 0, 1, 2, 3])}, r"\[1, 3\]"),
    "lengths_long": ({"x": np.ones((5, 3, 2)), "lengths": np.array([3, 4, 1, 2, 3])}, r"\[1, 3\]"),
    "lengths_shape": ({"x": np.ones((5, 3, 2)), "lengths": np.array([3, 3])}, "lengths"),
    "lengths_float": ({"x": np.ones((5, 3, 2)), "lengths": np.ones(5)}, "integer"),
    "empty": ({"x": np.zeros((0, 3, 2))}, "empty"),
    "missing_x": ({"y": np.zeros((5, 3, 2))}, "missing array 'x'"),
    "strings": ({"x": np.array([[["a"]]])}, "real numbers"),
    "too_few": ({"x": np.random.default_rng(0).standard_normal((2, 3, 2))}, "too few"),
    "constant": ({"x": np.ones((10, 3, 2))}, "constant"),
}


@pytest.mark.parametrize("case", list(BAD_NPZ))
def test_bad_npz_raises(tmp_path: Path, case: str) -> None:
    arrays, message = BAD_NPZ[case]
    path = tmp_path / f"bad_{case}.npz"
    np.savez(path, **arrays)
    with pytest.raises(ValueError, match=message) as error:
        load_dataset("npz", path=path)
    assert path.name in str(error.value)


def test_nan_in_padding_is_ignored(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((10, 3, 2))
    x[0, 2] = np.nan
    path = tmp_path / "padded_nan.npz"
    np.savez(path, x=x, lengths=np.array([2] + [3] * 9))
    ds = load_dataset(str(path))
    assert all(bool(torch.isfinite(s.x).all()) for s in splits(ds))


def test_not_an_npz_raises(tmp_path: Path) -> None:
    path = tmp_path / "text.npz"
    path.write_text("not an archive")
    with pytest.raises(ValueError, match="text.npz"):
        load_dataset(str(path))
    with pytest.raises(FileNotFoundError):
        load_dataset(str(tmp_path / "absent.npz"))


BAD_TS = {
    "inf": ("@dimensions 1\n@classLabel false\n@data\n1,2,inf\n1,2\n", "Inf values"),
    "all_missing": ("@dimensions 2\n@classLabel false\n@data\n1,?:NaN,2\n", "every frame"),
    "not_a_number": ("@dimensions 1\n@classLabel false\n@data\n1,a,3\n", "could not parse"),
    "unequal_dims": ("@classLabel false\n@data\n1,2,3:1,2\n", "different lengths"),
    "dims_change": ("@classLabel false\n@data\n1,2:3,4\n1,2\n", "dimensions"),
    "header_dims": ("@dimensions 3\n@classLabel false\n@data\n1,2:3,4\n", "declares 3"),
    "no_data": ("@dimensions 1\n", "no @data"),
    "empty": ("@dimensions 1\n@classLabel false\n@data\n", "no cases"),
    "timestamps": ("@timeStamps true\n@data\n(0,1),(1,2)\n", "timestamped"),
}


@pytest.mark.parametrize("case", list(BAD_TS))
def test_bad_ts_raises(tmp_path: Path, case: str) -> None:
    text, message = BAD_TS[case]
    path = tmp_path / f"bad_{case}.ts"
    path.write_text(text)
    with pytest.raises(ValueError, match=message) as error:
        load_dataset("ts", path=path)
    assert path.name in str(error.value)


# --- explicit test files, small-split warnings ----------------------------------------------------


def random_cases(gen: torch.Generator, count: int, max_len: int, dims: int) -> list[np.ndarray]:
    lengths = torch.randint(2, max_len + 1, (count,), generator=gen)
    return [
        (3 * torch.randn(int(n), dims, generator=gen, dtype=torch.float64) + 1).numpy()
        for n in lengths
    ]


def padded(cases: list[np.ndarray], length: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Independent padding oracle: zeros after each case, mask of its frames without NaN."""
    x = torch.zeros(len(cases), length, cases[0].shape[1], dtype=torch.float64)
    mask = torch.zeros(len(cases), length, dtype=torch.bool)
    for b, case in enumerate(cases):
        observed = ~np.isnan(case).any(axis=1)
        x[b, : len(case)] = torch.from_numpy(np.where(observed[:, None], case, 0.0))
        mask[b, : len(case)] = torch.from_numpy(observed)
    return x, mask


def fitted_oracle(raw: torch.Tensor, mask: torch.Tensor) -> tuple[np.ndarray, np.ndarray]:
    """Mean and divide-by-n standard deviation over the observed frames, with numpy."""
    frames = raw.numpy()[mask.numpy()]
    return frames.mean(axis=0), frames.std(axis=0, ddof=0)


def test_ts_with_explicit_test_file(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(0)
    train_cases, test_cases = random_cases(gen, 40, 6, 2), random_cases(gen, 31, 9, 2)
    write_ts(tmp_path / "toy_TRAIN.ts", train_cases, ["a"] * 40)
    write_ts(tmp_path / "toy_TEST.ts", test_cases, ["b"] * 31)
    with pytest.warns(UserWarning, match="val split has only 10 sequences") as record:
        ds = load_dataset(str(tmp_path / "toy_TRAIN.ts"), test_path=tmp_path / "toy_TEST.ts")
    assert [str(w.message) for w in record if "split" in str(w.message)] == [
        "toy_TRAIN.ts: the val split has only 10 sequences (fewer than 30); its NLL is a noisy "
        "estimate"
    ]
    assert (len(ds.train), len(ds.val), len(ds.test), ds.val_fraction) == (30, 10, 31, 0.25)
    length = max(len(c) for c in train_cases + test_cases)
    assert ds.max_len == length
    # the test split is the whole test file, in file order
    test_raw, test_mask = padded(test_cases, length)
    torch.testing.assert_close(ds.to_raw(ds.test.x.double(), ds.test.mask), test_raw, atol=1e-5,
                               rtol=1e-6)
    assert torch.equal(ds.test.mask, test_mask)
    # train + val are exactly the training file; the statistics are those of the train split
    train_raw, train_mask = padded(train_cases, length)
    raw = torch.cat([ds.to_raw(s.x.double(), s.mask) for s in (ds.train, ds.val)])
    assert sorted(match_rows(raw, train_raw).tolist()) == list(range(40))
    train_rows = match_rows(ds.to_raw(ds.train.x.double(), ds.train.mask), train_raw)
    mean, std = fitted_oracle(train_raw[train_rows], train_mask[train_rows])
    np.testing.assert_allclose(ds.preprocessing.mean.numpy(), mean, rtol=1e-12)
    np.testing.assert_allclose(ds.preprocessing.std.numpy(), std, rtol=1e-12)
    # the split of the training file depends on the seed only
    again = load_dataset("ts", path=tmp_path / "toy_TRAIN.ts", test_path=tmp_path / "toy_TEST.ts")
    assert torch.equal(again.val.x, ds.val.x)


def test_npz_with_explicit_test_file_of_another_length(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(1)
    x_train = torch.randn(50, 4, 3, generator=gen, dtype=torch.float64)
    x_test = torch.randn(30, 7, 3, generator=gen, dtype=torch.float64) + 2
    lengths = torch.randint(1, 8, (30,), generator=gen)
    np.savez(tmp_path / "a.npz", x=x_train.numpy())
    np.savez(tmp_path / "b.npz", x=x_test.numpy(), lengths=lengths.numpy())
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # 40 / 10 / 30: only val is small
        with pytest.raises(UserWarning, match="val split has only 10"):
            load_dataset("npz", path=tmp_path / "a.npz", test_path=tmp_path / "b.npz")
    with pytest.warns(UserWarning):
        ds = load_dataset("npz", path=tmp_path / "a.npz", test_path=tmp_path / "b.npz")
    assert (len(ds.train), len(ds.val), len(ds.test), ds.max_len) == (40, 10, 30, 7)
    assert not ds.train.mask[:, 4:].any() and not ds.val.mask[:, 4:].any()
    assert torch.equal(ds.test.mask.sum(dim=1), lengths)
    expected = torch.where((torch.arange(7) < lengths[:, None])[..., None], x_test, 0.0)
    torch.testing.assert_close(ds.to_raw(ds.test.x.double(), ds.test.mask), expected, atol=1e-5,
                               rtol=1e-6)


def test_no_warning_for_large_splits(tmp_path: Path) -> None:
    path = tmp_path / "large.npz"
    np.savez(path, x=np.random.default_rng(0).standard_normal((400, 3, 1)))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ds = load_dataset(str(path))
    assert (len(ds.train), len(ds.val), len(ds.test), ds.val_fraction) == (320, 40, 40, 0.1)


def test_default_val_fraction_holds_ten_sequences_of_small_data() -> None:
    """A tenth from 100 sequences on; below, 10 validation sequences, at most a quarter."""
    for total in (1, 2, 20, 36, 40, 41, 50, 67, 99, 100, 101, 270, 1797):
        fraction = datasets.default_val_fraction(total)
        n_val = round(fraction * total)  # the loaders' rounding
        if total >= 100:
            assert fraction == 0.1
        elif total >= 40:
            assert n_val == 10, total
        else:
            assert fraction == 0.25
    with pytest.raises(ValueError, match="total"):
        datasets.default_val_fraction(0)


def test_explicit_val_fraction_is_authoritative_and_recorded(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal
    np.savez(tmp_path / "train.npz", x=x((40, 5, 2)))
    np.savez(tmp_path / "test.npz", x=x((8, 5, 2)))
    files = {"name": str(tmp_path / "train.npz"), "test_path": tmp_path / "test.npz"}
    with pytest.warns(UserWarning):
        automatic = load_dataset(**files)
        explicit = load_dataset(**files, val_fraction=0.1)
        same = load_dataset(**files, val_fraction=automatic.val_fraction)
    assert (len(automatic.train), len(automatic.val), automatic.val_fraction) == (30, 10, 0.25)
    assert (len(explicit.train), len(explicit.val), explicit.val_fraction) == (36, 4, 0.1)
    assert torch.equal(same.val.x, automatic.val.x)  # the recorded fraction rebuilds the split
    for name in NAMED:  # the shipped datasets keep their tenth
        assert load_dataset(name).val_fraction == 0.1


def test_small_splits_warn_without_test_file(tmp_path: Path) -> None:
    path = tmp_path / "small.npz"
    np.savez(path, x=np.random.default_rng(0).standard_normal((20, 3, 2)))
    with pytest.warns(UserWarning) as record:
        load_dataset(str(path))
    messages = sorted(str(w.message) for w in record)
    assert [m.split(": ")[1].split(" (")[0] for m in messages] == [
        "the test split has only 2 sequences",
        "the train split has only 13 sequences",
        "the val split has only 5 sequences",
    ]


def test_test_path_errors(tmp_path: Path) -> None:
    np.savez(tmp_path / "a.npz", x=np.random.default_rng(0).standard_normal((10, 3, 2)))
    np.savez(tmp_path / "b.npz", x=np.random.default_rng(1).standard_normal((10, 3, 1)))
    with pytest.raises(ValueError, match="test_path is only used"):
        load_dataset("japanese_vowels", test_path=tmp_path / "b.npz")
    with pytest.raises(ValueError, match=r"b\.npz has 1 features per frame, the training file 2"):
        load_dataset(str(tmp_path / "a.npz"), test_path=tmp_path / "b.npz")
    with pytest.raises(FileNotFoundError):
        load_dataset(str(tmp_path / "a.npz"), test_path=tmp_path / "absent.npz")
    with pytest.raises(TypeError, match="test_path"):
        load_dataset(str(tmp_path / "a.npz"), test_path=3)  # type: ignore[arg-type]


# --- missing frames ---------------------------------------------------------------------------


def test_npz_mask_with_gaps(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(2)
    x = 2 * torch.randn(40, 6, 2, generator=gen, dtype=torch.float64) - 1
    lengths = torch.randint(3, 7, (40,), generator=gen)
    gaps = torch.rand(40, 6, generator=gen) < 0.3
    gaps[:, 0] = False  # every sequence keeps an observed frame
    x_file = x.clone()
    x_file[gaps] = float("nan")  # values at missing frames are ignored
    path = tmp_path / "gaps.npz"
    np.savez(path, x=x_file.numpy(), lengths=lengths.numpy(), mask=(~gaps).numpy())
    with pytest.warns(UserWarning):
        ds = load_dataset(str(path), seed=3)
    observed = (torch.arange(6) < lengths[:, None]) & ~gaps
    original = torch.where(observed[..., None], x, 0.0)
    raws = [ds.to_raw(s.x.double(), s.mask) for s in splits(ds)]
    rows = [match_rows(raw, original) for raw in raws]
    assert sorted(torch.cat(rows).tolist()) == list(range(40))
    for split, index in zip(splits(ds), rows, strict=True):
        assert torch.equal(split.mask, observed[index])
        assert (split.x[~split.mask] == 0).all()
        # log|det| counts the observed frames only: -n_obs sum_d log sigma_d
        expected = -observed[index].sum(1).double() * torch.from_numpy(
            np.log(fitted_oracle(original[rows[0]], observed[rows[0]])[1])
        ).sum()
        torch.testing.assert_close(split.log_jacobian, expected, rtol=1e-12, atol=1e-12)
    mean, std = fitted_oracle(original[rows[0]], observed[rows[0]])
    np.testing.assert_allclose(ds.preprocessing.mean.numpy(), mean, rtol=1e-12)
    np.testing.assert_allclose(ds.preprocessing.std.numpy(), std, rtol=1e-12)
    assert torch.equal(ds.units(ds.test.mask), observed[rows[2]].sum(1))


def test_npz_mask_alone_and_sample_lengths_span_the_gaps(tmp_path: Path) -> None:
    x = np.random.default_rng(0).standard_normal((10, 5, 1))
    mask = np.ones((10, 5), dtype=bool)
    mask[:, 1] = False  # a gap inside every sequence
    mask[:, 4] = False  # and a missing last frame
    path = tmp_path / "mask_only.npz"
    np.savez(path, x=x, mask=mask)
    with pytest.warns(UserWarning):
        ds = load_dataset(str(path))
    assert all(torch.equal(s.mask, torch.from_numpy(mask[: len(s)])) for s in splits(ds))
    lengths = ds.sample_lengths(50, torch.Generator().manual_seed(0))
    assert lengths.tolist() == [4] * 50  # one past the last observed frame, not 3 frames


BAD_MASKS = {
    "dtype": ({"mask": np.ones((5, 3), dtype=np.int64)}, "boolean array of shape"),
    "shape": ({"mask": np.ones((5, 2), dtype=bool)}, r"shape \(5, 3\)"),
    "empty_row": ({"mask": np.eye(5, 3, dtype=bool)}, r"sequence\(s\) \[3, 4\] have no observed"),
    "lengths_and_mask": (
        {"mask": np.eye(5, 3, k=1, dtype=bool), "lengths": np.array([1, 3, 3, 3, 3])},
        r"sequence\(s\) \[0, 2, 3, 4\] have no observed",
    ),
    "nan_observed": ({"mask": np.ones((5, 3), dtype=bool), "nan": True}, "boolean 'mask'"),
}


@pytest.mark.parametrize("case", list(BAD_MASKS))
def test_bad_npz_mask_raises(tmp_path: Path, case: str) -> None:
    arrays, message = BAD_MASKS[case]
    x = np.random.default_rng(0).standard_normal((5, 3, 2))
    if arrays.pop("nan", False):
        x[1, 1, 0] = np.nan
    path = tmp_path / f"bad_{case}.npz"
    np.savez(path, x=x, **arrays)
    with pytest.raises(ValueError, match=message) as error:
        load_dataset(str(path))
    assert path.name in str(error.value)


def test_ts_missing_values_mark_frames_missing(tmp_path: Path) -> None:
    gen = torch.Generator().manual_seed(4)
    cases = random_cases(gen, 12, 7, 3)
    for b, case in enumerate(cases):  # one missing value in some frames, a whole frame in others
        if b % 3 == 0:
            case[len(case) // 2, b % case.shape[1]] = np.nan
        if b % 4 == 1:
            case[-1, :] = np.nan
    path = tmp_path / "missing.ts"
    write_ts(path, cases, None)
    text = path.read_text().replace("nan", "?", 5)  # '?' and 'NaN' both mean missing
    path.write_text(text.replace("nan", "NaN"))
    assert "?" in text and "NaN" in path.read_text()
    with pytest.warns(UserWarning):
        ds = load_dataset(str(path))
    original, observed = padded(cases, ds.max_len)
    assert int((~observed).sum()) > int((observed.sum(1) == 0).sum())  # gaps exist
    raws = [ds.to_raw(s.x.double(), s.mask) for s in splits(ds)]
    rows = torch.cat([match_rows(raw, original) for raw in raws])
    assert sorted(rows.tolist()) == list(range(12))
    # a frame with any missing value is missing as a whole (its other values are dropped)
    assert torch.equal(torch.cat([s.mask for s in splits(ds)]), observed[rows])
    assert all(bool((s.x[~s.mask] == 0).all()) for s in splits(ds))


def test_gap_density_keeps_time_positions() -> None:
    # The density of a sequence with a gap is that of its observed frames at their own time
    # positions: the values at the gap never matter, the exact log-density equals the
    # dense-Jacobian oracle over the observed frames, and it differs from the density of the
    # same frames moved together.
    from iresflow.models.residual_flow import ResidualSequenceFlow

    torch.manual_seed(0)
    # After the keyword-settings change of the model constructor: features=2 as a keyword.
    model = ResidualSequenceFlow(features=2, n_blocks=1, hidden=8, max_len=6,
                                    base="normal").double()
    model.train().log_prob(torch.randn(8, 4, 2, dtype=torch.float64) + 0.3, method="exact")
    model.eval()
    x = torch.randn(2, 4, 2, dtype=torch.float64)
    mask = torch.tensor([[True, False, True, True], [True, True, True, False]])
    x = torch.where(mask[..., None], x, 0.0)
    log_prob = model.log_prob(x, mask, method="exact")
    z = model.transform_to_noise(x, mask)
    base = (-0.5 * z.square().sum(-1) - math.log(2 * math.pi)) * mask
    oracle = base.sum(-1) + jacobian_logdet(model.transform_to_noise, x, mask)
    torch.testing.assert_close(log_prob, oracle, rtol=1e-10, atol=1e-10)
    filled = x.clone()
    filled[~mask] = 7.0
    torch.testing.assert_close(model.log_prob(filled, mask, method="exact"), log_prob, rtol=0,
                               atol=0)
    compact = torch.stack([x[0, [0, 2, 3]], x[1, :3]])
    shifted = model.log_prob(compact, torch.ones(2, 3, dtype=torch.bool), method="exact")
    assert abs(float(shifted[0] - log_prob[0])) > 1e-6  # positions matter
    torch.testing.assert_close(shifted[1], log_prob[1])  # a trailing gap is plain padding


def test_pad_to_adds_unobserved_frames_and_refuses_to_shorten() -> None:
    from iresflow.data.readers import pad_to

    x, mask = torch.randn(2, 3, 4, dtype=torch.float64), torch.tensor([[1, 1, 0], [1, 1, 1]]).bool()
    padded, padded_mask = pad_to(x, mask, 5)
    assert torch.equal(padded[:, :3], x) and not padded[:, 3:].any()
    assert padded_mask.tolist() == [[True, True, False, False, False], [True] * 3 + [False] * 2]
    with pytest.raises(ValueError, match="length must be >= the current length 3"):
        pad_to(x, mask, 2)
