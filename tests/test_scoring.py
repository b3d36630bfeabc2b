"""Forecast scores from draws: the sorted CRPS against its pairwise sum and the Gaussian closed
form, the energy score against its pairwise sum, interval coverage, and the refusals."""

from __future__ import annotations

import math

import pytest
import torch

from iresflow.runs.scoring import crps, energy_score, forecast_scores, interval_coverage


def _pairwise_crps(samples: torch.Tensor, truth: torch.Tensor) -> torch.Tensor:
    count = samples.shape[0]
    spread = (samples[:, None] - samples[None]).abs().sum((0, 1)) / (count * (count - 1))
    return (samples - truth).abs().mean(0) - spread / 2


def _gaussian_crps(mean: float, std: float, y: float) -> float:
    z = (y - mean) / std
    cdf = 0.5 * (1 + math.erf(z / math.sqrt(2)))
    pdf = math.exp(-z * z / 2) / math.sqrt(2 * math.pi)
    return std * (z * (2 * cdf - 1) + 2 * pdf - 1 / math.sqrt(math.pi))


def test_sorted_crps_equals_the_pairwise_sum_in_float64() -> None:
    generator = torch.Generator().manual_seed(0)
    samples = torch.randn(37, 4, 3, generator=generator, dtype=torch.float64)
    truth = torch.randn(4, 3, generator=generator, dtype=torch.float64)
    assert torch.allclose(crps(samples, truth), _pairwise_crps(samples, truth), atol=1e-12)


def test_crps_of_gaussian_draws_matches_the_closed_form() -> None:
    generator = torch.Generator().manual_seed(1)
    mean, std, count, trials = 0.3, 1.7, 400, 200
    truth = torch.tensor([-1.0, 0.3, 2.5], dtype=torch.float64)
    draws = mean + std * torch.randn(trials, count, 3, generator=generator, dtype=torch.float64)
    estimates = torch.stack([crps(draw, truth) for draw in draws])  # (trials, 3)
    exact = torch.tensor([_gaussian_crps(mean, std, float(y)) for y in truth],
                         dtype=torch.float64)
    z = (estimates.mean(0) - exact) / (estimates.std(0) / math.sqrt(trials))
    assert bool((z.abs() < 4.0).all()), z  # unbiased: no drift with the number of draws


def test_crps_of_a_point_forecast_is_the_absolute_error() -> None:
    draws = torch.full((5, 2), 1.5, dtype=torch.float64)
    assert crps(draws, torch.tensor([0.5, 3.0], dtype=torch.float64)).tolist() == [1.0, 1.5]


def test_energy_score_equals_its_pairwise_sum_and_the_crps_in_one_dimension() -> None:
    generator = torch.Generator().manual_seed(2)
    samples = torch.randn(23, 5, 4, generator=generator, dtype=torch.float64)
    truth = torch.randn(5, 4, generator=generator, dtype=torch.float64)
    count = samples.shape[0]
    error = (samples - truth).norm(dim=-1).mean(0)
    pairs = torch.stack([(samples[i] - samples[j]).norm(dim=-1)
                         for i in range(count) for j in range(count) if i != j]).mean(0)
    assert torch.allclose(energy_score(samples, truth), error - pairs / 2, atol=1e-12)
    one = samples[..., :1]
    assert torch.allclose(energy_score(one, truth[:, :1]), crps(one, truth[:, :1])[:, 0],
                          atol=1e-12)


def test_interval_coverage_of_calibrated_draws_is_nominal() -> None:
    generator = torch.Generator().manual_seed(3)
    draws = torch.randn(2000, 4000, generator=generator, dtype=torch.float64)
    truth = torch.randn(4000, generator=generator, dtype=torch.float64)
    for level in (0.5, 0.9):
        covered = interval_coverage(draws, truth, level).double().mean()
        spread = math.sqrt(level * (1 - level) / 4000)
        assert abs(float(covered) - level) < 4 * spread + 2e-3, (level, covered)


def test_forecast_scores_skip_frames_that_are_not_real() -> None:
    generator = torch.Generator().manual_seed(4)
    samples = torch.randn(50, 2, 3, 2, generator=generator, dtype=torch.float64)
    truth = torch.randn(2, 3, 2, generator=generator, dtype=torch.float64)
    mask = torch.tensor([[True, True, True], [True, False, False]])
    scores = forecast_scores(samples, truth, mask)
    per_value = crps(samples, truth)[mask]
    assert scores["crps"] == pytest.approx(per_value.mean(0).tolist(), abs=1e-12)
    assert scores["frames"] == 4 and scores["sequences"] == 2
    full = energy_score(samples[:, :1].flatten(2), truth[:1].flatten(1))
    assert scores["energy"] == pytest.approx(float(full), abs=1e-12)  # the complete one only
    assert set(scores["coverage"]) == {"50", "90"}
    truth_changed = truth.clone()
    truth_changed[1, 1:] = 1e6  # not real: not scored
    assert forecast_scores(samples, truth_changed, mask)["crps"] == scores["crps"]


@pytest.mark.parametrize(("call", "message"), [
    (lambda: crps(torch.zeros(1, 3), torch.zeros(3)), "at least 2 draws"),
    (lambda: crps(torch.zeros(4, 3), torch.zeros(2)),
     r"samples must have shape \(S, \*truth.shape\) = \(S, 2\)"),
    (lambda: crps(torch.zeros(4, 3, dtype=torch.int64), torch.zeros(3)), "floating-point"),
    (lambda: interval_coverage(torch.zeros(4, 3), torch.zeros(3), 1.0), "level must lie"),
    (lambda: energy_score(torch.zeros(4, 3), torch.zeros(3)), r"truth must have shape \(B, M\)"),
    (lambda: forecast_scores(torch.zeros(4, 1, 2, 1), torch.zeros(1, 2, 1),
                             torch.zeros(1, 2, dtype=torch.bool)), "no real frame"),
])
def test_bad_forecast_inputs_are_refused(call, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        call()
