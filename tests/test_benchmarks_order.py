"""Checks of the order benchmark (benchmarks/order.py): shuffles, autocorrelations, metrics."""

from __future__ import annotations

import itertools
import json
import math

import numpy as np
import pytest
import torch

from benchmarks import cli
from benchmarks.order import lag1_autocorrelation, order_metrics, shuffle_frames
from iresflow.data.datasets import SequenceDataset, SequenceSplit
from iresflow.models.reference import AutoregressiveGaussian
from iresflow.models.residual_flow import ResidualSequenceFlow

MASK = torch.tensor([[True, True, True, True], [True, False, False, False],
                     [False, True, True, False], [True, True, False, True]])


def _ar1(num: int, length: int, phi: float, seed: int) -> torch.Tensor:
    """Scalar stationary AR(1) sequences x_t = phi x_{t-1} + sqrt(1 - phi^2) e_t."""
    generator = torch.Generator().manual_seed(seed)
    eps = torch.randn(num, length, 1, generator=generator, dtype=torch.float64)
    x = eps.clone()
    for t in range(1, length):
        x[:, t] = phi * x[:, t - 1] + math.sqrt(1 - phi**2) * eps[:, t]
    return x


def _dataset(x: torch.Tensor, mask: torch.Tensor | None = None) -> SequenceDataset:
    mask = torch.ones(x.shape[:2], dtype=torch.bool) if mask is None else mask
    x = torch.where(mask[..., None], x, 0.0)
    parts = [SequenceSplit(x[i::3], mask[i::3], torch.zeros(len(x[i::3]), dtype=torch.float64))
             for i in range(3)]
    return SequenceDataset("synthetic", x.shape[2], x.shape[1], "nats/frame", *parts)


def test_shuffle_permutes_real_frames_and_keeps_padding() -> None:
    x = torch.randn(4, 4, 2, dtype=torch.float64)
    out = shuffle_frames(x, MASK, torch.Generator().manual_seed(0))
    assert torch.equal(out[~MASK], x[~MASK])
    for b in range(4):
        key = lambda rows: sorted(map(tuple, rows.tolist()))  # noqa: E731
        assert key(out[b][MASK[b]]) == key(x[b][MASK[b]])
    again = shuffle_frames(x, MASK, torch.Generator().manual_seed(0))
    assert torch.equal(out, again)
    with pytest.raises(ValueError, match="mask"):
        shuffle_frames(x, None)  # type: ignore[arg-type]


def test_shuffle_is_uniform_over_permutations() -> None:
    draws = 6000
    x = torch.arange(3.0).reshape(1, 3, 1).expand(draws, 3, 1)
    out = shuffle_frames(x, torch.ones(draws, 3, dtype=torch.bool),
                         torch.Generator().manual_seed(1))[..., 0]
    counts = {p: 0 for p in itertools.permutations(range(3))}
    for row in out.long().tolist():
        counts[tuple(row)] += 1
    expected, sd = draws / 6, math.sqrt(draws * (1 / 6) * (5 / 6))
    assert all(abs(c - expected) < 4.5 * sd for c in counts.values())  # binomial z-tests


def test_lag1_autocorrelation_matches_numpy_over_adjacent_real_pairs() -> None:
    x = torch.randn(4, 4, 2, dtype=torch.float64).cumsum(1)
    pairs = [(x[b, t], x[b, t + 1]) for b in range(4) for t in range(3)
             if MASK[b, t] and MASK[b, t + 1]]
    a = np.array([p.numpy() for p, _ in pairs])
    c = np.array([q.numpy() for _, q in pairs])
    expected = [np.corrcoef(a[:, d], c[:, d])[0, 1] for d in range(2)]
    np.testing.assert_allclose(lag1_autocorrelation(x, MASK).numpy(), expected, rtol=1e-12)
    with pytest.raises(ValueError, match="two pairs"):
        lag1_autocorrelation(x, torch.eye(4, dtype=torch.bool))


def test_lag1_autocorrelation_recovers_phi_and_zero() -> None:
    n = 20000 * 3  # pairs; the standard error of a correlation near phi is (1 - phi^2)/sqrt(n)
    phi = 0.6
    r = float(lag1_autocorrelation(_ar1(20000, 4, phi, seed=2))[0])
    assert abs(r - phi) < 4 * (1 - phi**2) / math.sqrt(n)
    r0 = float(lag1_autocorrelation(_ar1(20000, 4, 0.0, seed=3))[0])
    assert abs(r0) < 4 / math.sqrt(n)


def test_order_metrics_of_the_ar_gaussian() -> None:
    ds = _dataset(_ar1(600, 6, 0.8, seed=4))
    ar1 = AutoregressiveGaussian(1, 6).fit(ds.train.x, ds.train.mask, order=1)
    metrics = order_metrics(ar1, ds, generator=torch.Generator().manual_seed(0))
    assert metrics["test_nll"] == pytest.approx(ds.nll(ar1.log_prob(ds.test.x), ds.test))
    # expected gain (5/6) * 0.5 * (E(x'_t - 0.8 x'_{t-1})^2 / 0.36 - 1) = 0.34 nats/frame, with
    # E = 1.64 - 1.6 * 0.616 for shuffled frames (mean correlation 0.616 of two distinct frames)
    assert metrics["order_gain"] > 0.2
    assert abs(metrics["autocorr_samples"][0] - 0.8) < 0.05
    assert abs(metrics["autocorr_data"][0] - 0.8) < 0.05
    assert abs(metrics["autocorr_noise"][0]) < 0.05  # innovations are white
    ar0 = AutoregressiveGaussian(1, 6).fit(ds.train.x, ds.train.mask, order=0)
    metrics = order_metrics(ar0, ds, generator=torch.Generator().manual_seed(0))
    assert metrics["order_gain"] == pytest.approx(0.0, abs=1e-12)  # i.i.d. frames
    assert abs(metrics["autocorr_samples"][0]) < 0.05


def test_order_metrics_of_the_iresflow_model_with_variable_lengths() -> None:
    mask = torch.arange(5) < torch.randint(2, 6, (30,))[:, None]
    ds = _dataset(torch.randn(30, 5, 2, dtype=torch.float64), mask)
    frames = ResidualSequenceFlow(features=2, n_blocks=1, hidden=8, max_len=5,
                                     layers=("mlp",), ar_order=0).double().eval()
    metrics = order_metrics(frames, ds, method="exact", batch_size=4,
                            generator=torch.Generator().manual_seed(0))
    exact = frames.log_prob(ds.test.x, ds.test.mask, method="exact").detach()
    assert metrics["test_nll"] == pytest.approx(ds.nll(exact, ds.test), rel=1e-10)
    assert metrics["order_gain"] == pytest.approx(0.0, abs=1e-10)  # frame-wise: no order
    attention = ResidualSequenceFlow(features=2, n_blocks=1, hidden=8, max_len=5
                                        ).double().eval()
    with torch.no_grad():  # leave the identity start of ActNorm/attention outputs
        for p in attention.parameters():
            p.add_(0.5 * torch.randn_like(p))
    metrics = order_metrics(attention, ds, method="exact", batch_size=4,
                            generator=torch.Generator().manual_seed(0))
    assert metrics["order_gain"] != pytest.approx(0.0, abs=1e-6)  # positions matter
    assert len(metrics["autocorr_noise"]) == 2 and metrics["unit"] == "nats/frame"


def _order(*argv: str) -> list[dict]:
    args = cli.parse(["order", *argv])
    return args.benchmark(args)


def test_order_command_writes_the_table(tmp_path, capsys) -> None:
    (report,) = _order("--no-flow", "--datasets", "co2_windows", "--out", str(tmp_path / "o.json"))
    (entry,) = json.loads((tmp_path / "o.json").read_text())["records"]
    assert entry["ar1_gaussian"] == report["ar1_gaussian"] and entry["dataset"] == "co2_windows"
    assert entry["ar1_gaussian"]["order_gain"] > 0  # the weekly CO2 differences are correlated
    assert "AR(1) Gaussian" in capsys.readouterr().out


@pytest.mark.slow
def test_order_command_trains_and_scores_a_flow(tmp_path) -> None:
    (report,) = _order("--quick", "--datasets", "co2_windows", "--out", str(tmp_path / "o.json"))
    flow = report["iresflow"]
    assert math.isfinite(flow["order_gain"]) and (tmp_path / "runs" / "co2_windows").is_dir()
