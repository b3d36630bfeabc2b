"""Synthetic long-range datasets: exact densities against brute-force oracles, the generators
against their densities, determinism, and the dataset and command-line plumbing."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from torch.distributions import MultivariateNormal, Normal

from iresflow.cli import main
from iresflow.data.datasets import load_dataset
from iresflow.data.synthetic import (
    SPLIT_SIZES,
    NonlinearSeasonal,
    RepeatedMotif,
    load_synthetic,
    synthetic_family,
    synthetic_names,
)
from iresflow.runs.load import load_run

# --- oracles -------------------------------------------------------------------------------------


def motif_covariance(family: RepeatedMotif, period: int, n: int) -> torch.Tensor:
    """Dense covariance ``(n, n)`` of one feature given the period: s_m^2 R R^T + s^2 I."""
    repeat = (torch.arange(n).unsqueeze(1) % period == torch.arange(period)).to(torch.float64)
    return family.motif_scale**2 * repeat @ repeat.T + family.noise_scale**2 * torch.eye(
        n, dtype=torch.float64)


def motif_oracle(family: RepeatedMotif, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Per-period log-likelihoods ``(B, K)`` by dense Gaussians over the observed frames."""
    table = torch.empty(x.shape[0], len(family.periods), dtype=torch.float64)
    for b in range(x.shape[0]):
        observed = mask[b].nonzero().squeeze(1)
        for k, period in enumerate(family.periods):
            cov = motif_covariance(family, period, x.shape[1])[observed][:, observed]
            normal = MultivariateNormal(torch.zeros(len(observed), dtype=torch.float64), cov)
            table[b, k] = normal.log_prob(x[b, observed].T).sum()  # features independent
    return table


def seasonal_oracle(family: NonlinearSeasonal, x: torch.Tensor, lengths: list[int]) -> list[float]:
    """Chain rule, frame by frame and feature by feature, in plain Python over time."""
    out = []
    for b, length in enumerate(lengths):
        total = 0.0
        for t in range(length):
            for d in range(family.features):
                if t < family.period:
                    mean, scale = 0.0, family.initial_scale
                else:
                    back = x[b, t - family.period]
                    source = -back[-1] if d == 0 else back[d - 1]
                    mean = (family.amplitude * math.tanh(family.gain * float(source))
                            + family.carry * float(x[b, t - 1, d]))
                    scale = family.noise_scale
                normal = Normal(torch.tensor(mean, dtype=torch.float64),
                                torch.tensor(scale, dtype=torch.float64))
                total += float(normal.log_prob(x[b, t, d].double()))
        out.append(total)
    return out


# --- exact densities ------------------------------------------------------------------------------


def test_repeated_motif_density_matches_dense_gaussians() -> None:
    family = RepeatedMotif(length=20, min_period=3, max_period=7, motif_scale=0.8,
                           noise_scale=0.3)
    generator = torch.Generator().manual_seed(1)
    x, _ = family.sample(3, generator)
    x = torch.cat([x, 1.5 * torch.randn(2, 20, 2, generator=generator, dtype=torch.float64)])
    mask = torch.ones(5, 20, dtype=torch.bool)
    mask[1, 13:] = False  # a shorter sequence
    mask[2, [0, 4, 5, 11, 19]] = False  # gaps
    mask[4, 1::2] = False
    x = torch.where(mask.unsqueeze(-1), x, 0.0)
    expected = motif_oracle(family, x, mask)
    torch.testing.assert_close(family.period_log_likelihoods(x, mask), expected)
    mixture = torch.logsumexp(expected, 1) - math.log(5)
    torch.testing.assert_close(family.log_prob(x, mask), mixture)
    # Values at padded frames are ignored; a shorter tensor equals its padded version.
    noisy = torch.where(mask.unsqueeze(-1), x, 7.0)
    torch.testing.assert_close(family.log_prob(noisy, mask), mixture)
    torch.testing.assert_close(family.log_prob(x[1:2, :13]), mixture[1:2])


def test_nonlinear_seasonal_density_matches_the_chain_rule_loop() -> None:
    family = NonlinearSeasonal(length=14, features=2, period=5, amplitude=1.3, gain=1.7,
                               carry=-0.4, noise_scale=0.35, initial_scale=0.9)
    generator = torch.Generator().manual_seed(2)
    x = torch.cat([family.sample(2, generator),
                   torch.randn(2, 14, 2, generator=generator, dtype=torch.float64)])
    lengths = [14, 9, 3, 14]
    mask = torch.arange(14) < torch.tensor(lengths).unsqueeze(1)
    x = torch.where(mask.unsqueeze(-1), x, 0.0)
    expected = torch.tensor(seasonal_oracle(family, x, lengths), dtype=torch.float64)
    torch.testing.assert_close(family.log_prob(x, mask), expected)
    torch.testing.assert_close(family.log_prob(x[:, :9], mask[:, :9])[1], expected[1])
    one_feature = NonlinearSeasonal(length=12, features=1, period=4)
    y = one_feature.sample(2, generator)
    torch.testing.assert_close(one_feature.log_prob(y),
                               torch.tensor(seasonal_oracle(one_feature, y, [12, 12]),
                                            dtype=torch.float64))


def test_bad_inputs_are_refused() -> None:
    motif, seasonal = RepeatedMotif(), NonlinearSeasonal()
    with pytest.raises(ValueError, match="at most 64 frames"):
        motif.log_prob(torch.zeros(1, 65, 2))
    with pytest.raises(ValueError):
        motif.log_prob(torch.zeros(1, 8, 3))
    gaps = torch.ones(1, 96, dtype=torch.bool)
    gaps[0, 10] = False
    with pytest.raises(ValueError, match="prefix"):
        seasonal.log_prob(torch.zeros(1, 96, 2), gaps)
    with pytest.raises(ValueError, match="unknown synthetic dataset"):
        synthetic_family("motif")


# --- generators against their densities --------------------------------------------------------


def test_repeated_motif_samples_follow_the_components_and_a_uniform_period() -> None:
    family = RepeatedMotif()
    num = 1700
    x, periods = family.sample(num, torch.Generator().manual_seed(3))
    table = family.period_log_likelihoods(x)
    # Given its period, -2 log N(x; 0, Sigma_P) - log det(2 pi Sigma_P) ~ chi^2 with N D dof:
    # a z-test of the mean log-likelihood against its expectation (dense slogdet oracle).
    n, d = family.length, family.features
    expected = {p: -0.5 * d * (n * math.log(2 * math.pi) + n
                               + float(torch.linalg.slogdet(motif_covariance(family, p, n))[1]))
                for p in family.periods}
    own = table.gather(1, (periods - family.min_period).unsqueeze(1)).squeeze(1)
    centred = own - torch.tensor([expected[int(p)] for p in periods], dtype=torch.float64)
    z = float(centred.sum()) / math.sqrt(num * n * d / 2)
    assert abs(z) < 4.5, z
    # The periods are uniform on min..max: the posterior mass (about one-hot, on the true
    # period) summed over the samples passes a chi-square test against num / K per period.
    posterior = torch.softmax(table, 1)
    assert float(posterior.gather(1, (periods - family.min_period).unsqueeze(1)).mean()) > 0.99
    k = len(family.periods)
    chi2 = float(((posterior.sum(0) - num / k).square() / (num / k)).sum())
    assert chi2 < 50.0, chi2  # 16 dof: P(chi2 > 50) < 1e-4
    assert int(periods.min()) == family.min_period and int(periods.max()) == family.max_period


def test_nonlinear_seasonal_samples_have_standard_normal_innovations() -> None:
    family = NonlinearSeasonal()
    num = 1000
    x = family.sample(num, torch.Generator().manual_seed(4))
    n, d, p = family.length, family.features, family.period
    # log p = sum of log N(innovation): E = -sum_t D (log scale_t + log(2 pi)/2 + 1/2),
    # Var = N D / 2 for every sequence.
    log_scales = p * math.log(family.initial_scale) + (n - p) * math.log(family.noise_scale)
    expected = -d * (log_scales + n * (0.5 * math.log(2 * math.pi) + 0.5))
    z = float((family.log_prob(x) - expected).sum()) / math.sqrt(num * n * d / 2)
    assert abs(z) < 4.5, z


# --- datasets ----------------------------------------------------------------------------------


@pytest.mark.parametrize("name", synthetic_names())
def test_dataset_is_deterministic_with_a_fixed_test_split(name: str) -> None:
    first, again, other = (load_dataset(name, seed=s) for s in (0, 0, 1))
    family = synthetic_family(name)
    assert (len(first.train), len(first.val), len(first.test)) == SPLIT_SIZES
    assert first.test.x.shape == (SPLIT_SIZES[2], family.length, family.features)
    assert first.unit == "nats/frame" and bool(first.test.mask.all())
    assert not bool(first.train.log_jacobian.any())
    for split in ("train", "val", "test"):
        assert torch.equal(getattr(first, split).x, getattr(again, split).x)
    assert torch.equal(first.test.x, other.test.x)
    assert not torch.equal(first.train.x, other.train.x)
    train_and_val = torch.cat([first.train.x, first.val.x, other.train.x]).flatten(1)
    assert not bool((torch.cdist(train_and_val, first.test.x.flatten(1)) < 1e-3).any())
    # The floor is the NLL of the exact density, in the unit of ds.nll.
    log_prob = family.log_prob(first.test.x, first.test.mask)
    frames = SPLIT_SIZES[2] * family.length
    assert first.nll(log_prob, first.test) == pytest.approx(-float(log_prob.sum()) / frames)
    torch.testing.assert_close(first.to_raw(first.test.x, first.test.mask), first.test.x)


def test_load_synthetic_refuses_other_settings() -> None:
    with pytest.raises(ValueError, match="fixed split sizes"):
        load_dataset("repeated_motif", val_fraction=0.2)
    with pytest.raises(ValueError, match="seed must be >= 0"):
        load_synthetic("nonlinear_seasonal", seed=-1)
    with pytest.raises(ValueError, match="only used by"):
        load_dataset("repeated_motif", path="x.npz")


def test_train_command_on_repeated_motif(tmp_path: Path) -> None:
    out = tmp_path / "run"
    flags = ["--n-blocks", "1", "--hidden", "8", "--max-train", "12", "--max-eval", "6",
             "--batch-size", "6", "--epochs", "1", "--eval-method", "exact", "--quiet",
             "--device", "cpu"]
    assert main(["train", "--data", "repeated_motif", "--out", str(out)] + flags) == 0
    run = load_run(out, device="cpu")
    assert run.dataset.name == "repeated_motif" and run.dataset.features == 2
    assert len(run.dataset.train) == 12
