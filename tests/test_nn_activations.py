"""Tests of LipSwish (docs/math.md#lipswish, check H15 (docs/math.md#checks))."""

from __future__ import annotations

import math

import pytest
import torch
from scipy.optimize import minimize_scalar
from torch.autograd import gradcheck

from iresflow.nn.activations import LipSwish


def swish_slope_extrema() -> tuple[float, float]:
    """Oracle: extrema of d/dt [t sigmoid(t)] = s + t s (1 - s), found by scipy on [-10, 10]."""

    def slope(t: float) -> float:
        s = 1.0 / (1.0 + math.exp(-t))
        return s + t * s * (1.0 - s)

    top = minimize_scalar(
        lambda t: -slope(t), bounds=(0.0, 10.0), method="bounded", options={"xatol": 1e-10}
    )
    low = minimize_scalar(slope, bounds=(-10.0, 0.0), method="bounded", options={"xatol": 1e-10})
    return slope(low.x), slope(top.x)


def with_beta(beta: float, dtype: torch.dtype, device: torch.device) -> LipSwish:
    act = LipSwish().to(device=device, dtype=dtype)
    with torch.no_grad():  # softplus^{-1}(beta)
        act.beta_raw.fill_(math.log(math.expm1(beta)))
    return act


def test_initial_beta(device, dtype):
    act = LipSwish().to(device=device, dtype=dtype)
    assert act.beta_raw.item() == 0.5
    torch.testing.assert_close(act.beta, torch.nn.functional.softplus(act.beta_raw))


@pytest.mark.parametrize("beta", [0.05, 0.5, 1.0, 4.0, 30.0])
def test_max_derivative_h15(device, beta):
    dtype = torch.float64
    act = with_beta(beta, dtype, device)
    # The slope is h'(beta z) / 1.1, so a grid in t = beta z resolves every beta equally well.
    t = torch.linspace(-20.0, 20.0, 400_001, device=device, dtype=dtype)
    z = (t / beta).requires_grad_(True)
    (slope,) = torch.autograd.grad(act(z).sum(), z)
    low, top = swish_slope_extrema()
    assert slope.max() <= 1.0
    assert slope.min() >= -1.0
    torch.testing.assert_close(slope.max().item(), top / 1.1, rtol=0, atol=1e-9)
    torch.testing.assert_close(slope.min().item(), low / 1.1, rtol=0, atol=1e-9)
    assert abs(top / 1.1 - 0.99985) < 1e-5  # docs/math.md#lipswish


def test_matches_silu_formula(device, dtype):
    act = with_beta(2.5, dtype, device)
    z = torch.randn(3, 4, 5, device=device, dtype=dtype) * 3
    beta = act.beta.detach()
    expected = torch.nn.functional.silu(beta * z) / (1.1 * beta)
    torch.testing.assert_close(act(z), expected)
    assert act(z).dtype == dtype and act(z).shape == z.shape


def test_without_a_graph_it_is_the_same_map(device):
    act = with_beta(0.7, torch.float64, device)
    z = torch.randn(4, 6, device=device, dtype=torch.float64) * 5
    kept = z.clone()
    with torch.no_grad():
        fast = act(z)
    torch.testing.assert_close(fast, act(z).detach(), rtol=1e-14, atol=1e-15)
    assert torch.equal(z, kept)  # the input is not overwritten


def test_lipschitz_on_random_pairs(device):
    act = with_beta(3.0, torch.float64, device)
    a = torch.randn(10_000, device=device, dtype=torch.float64) * 4
    b = a + torch.randn_like(a) * 0.5
    assert bool(((act(a) - act(b)).abs() <= (a - b).abs()).all())


def test_gradcheck_input_and_beta(device):
    act = LipSwish().to(device=device, dtype=torch.float64)
    z = torch.randn(7, device=device, dtype=torch.float64, requires_grad=True)
    beta_raw = act.beta_raw.detach().clone().requires_grad_(True)

    def f(z, beta_raw):
        return torch.func.functional_call(act, {"beta_raw": beta_raw}, (z,))

    assert gradcheck(f, (z, beta_raw))


def test_beta_gets_gradient(device, dtype):
    act = LipSwish().to(device=device, dtype=dtype)
    act(torch.randn(10, device=device, dtype=dtype)).pow(2).sum().backward()
    assert act.beta_raw.grad is not None and act.beta_raw.grad != 0
