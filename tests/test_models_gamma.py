"""Gamma variates from one generator (docs/math.md#gamma-sampling)."""

from __future__ import annotations

import math

import pytest
import torch
from scipy import stats

from iresflow.models.gamma import sample_gamma


@pytest.mark.parametrize("shape", [0.3, 0.7, 1.0, 2.5, 15.0])
def test_gamma_draws_follow_scipy(shape, device, dtype):
    # Kolmogorov-Smirnov at a fixed seed, shapes below 1 (the boost) and above; 15 is the shape
    # nu / 2 of the t bases at their initial nu = 30.
    concentration = torch.full((4000,), shape, device=device, dtype=dtype)
    draw = sample_gamma(concentration, torch.Generator(device).manual_seed(int(10 * shape)))
    assert draw.dtype == dtype and draw.shape == (4000,) and bool((draw > 0).all())
    assert stats.kstest(draw.cpu().double().numpy(), stats.gamma(shape).cdf).pvalue > 1e-3


def test_gamma_draws_mixed_shapes_of_any_shape(device):
    # Every entry has its own law: standardised by its own shape, all are Gamma(a) at once.
    shapes = torch.tensor([0.5, 3.0, 40.0], device=device, dtype=torch.float64)
    concentration = shapes.repeat(2000, 2, 1)  # (2000, 2, 3)
    draw = sample_gamma(concentration, torch.Generator(device).manual_seed(0))
    assert draw.shape == concentration.shape
    for k, shape in enumerate(shapes.tolist()):
        values = draw[..., k].flatten().cpu().numpy()
        assert stats.kstest(values, stats.gamma(shape).cdf).pvalue > 1e-3
        assert abs(values.mean() - shape) < 5 * math.sqrt(shape / values.size)


def test_gamma_draws_come_from_the_generator_only(device):
    concentration = torch.tensor([0.4, 2.0, 9.0], device=device, dtype=torch.float64)
    before = torch.random.get_rng_state()
    draw = sample_gamma(concentration, torch.Generator(device).manual_seed(5))
    assert torch.equal(torch.random.get_rng_state(), before)  # the global stream is untouched
    assert torch.equal(sample_gamma(concentration, torch.Generator(device).manual_seed(5)), draw)
    assert not torch.equal(sample_gamma(concentration, torch.Generator(device).manual_seed(6)),
                           draw)
    torch.manual_seed(1)
    first = sample_gamma(concentration)  # without a generator: torch's global one
    torch.manual_seed(1)
    assert torch.equal(sample_gamma(concentration), first)


@pytest.mark.parametrize(
    "concentration,generator,error,match",
    [
        ([1.0, 2.0], None, TypeError, "concentration"),
        (torch.tensor([1, 2]), None, TypeError, "concentration"),
        (torch.tensor([1.0, 0.0]), None, ValueError, "positive"),
        (torch.tensor([1.0, float("nan")]), None, ValueError, "positive"),
        (torch.tensor([1.0, float("inf")]), None, ValueError, "finite"),
        (torch.tensor([1.0]), 0, TypeError, "generator"),
    ],
)
def test_gamma_rejects_bad_arguments(concentration, generator, error, match):
    with pytest.raises(error, match=match):
        sample_gamma(concentration, generator)
