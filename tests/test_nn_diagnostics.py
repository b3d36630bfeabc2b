"""Empirical Lipschitz lower bounds (docs/math.md#conventions and #experiments (E1))."""

from __future__ import annotations

import math

import pytest
import torch

from iresflow.nn.attention import ContractiveL2MultiheadAttention, L2MultiheadAttention
from iresflow.nn.diagnostics import attention_weights, empirical_lipschitz, jacobian_norm
from iresflow.nn.positional import PositionalBranch, SinusoidalPositionalEncoding


def test_jacobian_norm_matches_autograd(dtype, device):
    attn = L2MultiheadAttention(4, 2).requires_grad_(False).to(dtype=dtype, device=device)
    mask = torch.tensor([[True] * 5, [True, True, False, False, True]], device=device)
    x = 2 * torch.randn(2, 5, 4, dtype=dtype, device=device)

    def f(z):
        return attn(z, mask)

    blocks = []
    for i in range(2):
        jac = torch.autograd.functional.jacobian(
            lambda z, i=i: attn(z, mask[i : i + 1])[0], x[i : i + 1]
        )
        blocks.append(jac.reshape(20, 20))
    dense = torch.stack(blocks)
    expected_inf = torch.linalg.matrix_norm(dense, math.inf)
    torch.testing.assert_close(jacobian_norm(f, x, "inf"), expected_inf)
    torch.testing.assert_close(jacobian_norm(f, x, "2"), torch.linalg.matrix_norm(dense, 2))


def test_position_wise_linear_map_is_exact(dtype, device):
    # Section 0: X -> X W has lip_inf = ||W^T||_inf (max abs column sum of W), lip_2 = ||W||_2.
    w = torch.tensor([[1.0, -2.0, 0.5], [0.5, 1.0, -1.0]], dtype=dtype, device=device)
    x = torch.randn(3, 4, 2, dtype=dtype, device=device)

    def f(z):
        return z @ w

    inf = empirical_lipschitz(f, x, "inf", steps=3)
    assert float(inf.value) == pytest.approx(3.0, rel=1e-12)
    two = empirical_lipschitz(f, x, "2", steps=0, power_iterations=50)
    assert float(two.value) == pytest.approx(float(torch.linalg.matrix_norm(w, 2)), rel=1e-10)


def test_ascent_finds_the_maximum(dtype, device):
    # lip(tanh(X) W) = ||W|| is attained at X = 0 only; start away from it.
    w = torch.tensor([[2.0, 1.0], [0.0, 2.0]], dtype=dtype, device=device)
    x = torch.full((2, 3, 2), 1.5, dtype=dtype, device=device)

    def f(z):
        return torch.tanh(z) @ w

    start = jacobian_norm(f, x, "inf").max()
    inf = empirical_lipschitz(f, x, "inf", steps=60, lr=0.1)
    lip_inf = float(torch.linalg.matrix_norm(w.T, math.inf))  # = 3, max abs column sum
    assert float(start) < 1.0 and float(inf.value) == pytest.approx(lip_inf, rel=1e-3)
    two = empirical_lipschitz(f, x, "2", steps=60, lr=0.1)
    assert float(two.value) == pytest.approx(float(torch.linalg.matrix_norm(w, 2)), rel=1e-3)


def test_estimates_are_lower_bounds_at_returned_inputs(dtype, device):
    attn = L2MultiheadAttention(2, 1).requires_grad_(False).to(dtype=dtype, device=device)
    x = 3 * torch.randn(3, 4, 2, dtype=dtype, device=device)
    inf = empirical_lipschitz(attn, x, "inf", steps=10)
    torch.testing.assert_close(jacobian_norm(attn, inf.inputs, "inf"), inf.per_sample)
    assert float(inf.value) == float(inf.per_sample.max())
    assert bool((inf.per_sample >= jacobian_norm(attn, x, "inf") * (1 - 1e-12)).all())
    two = empirical_lipschitz(attn, x, "2", steps=10)
    assert bool((two.per_sample <= jacobian_norm(attn, two.inputs, "2") * (1 + 1e-12)).all())
    assert inf.inputs.shape == x.shape and two.per_sample.shape == (3,)
    assert all(p.grad is None for p in attn.parameters())


def test_generator_reproducible(dtype, device):
    attn = L2MultiheadAttention(2, 1).requires_grad_(False).to(dtype=dtype, device=device)
    x = torch.randn(2, 4, 2, dtype=dtype, device=device)
    runs = [
        empirical_lipschitz(
            attn, x, "2", steps=3, generator=torch.Generator(device=device).manual_seed(5)
        ).per_sample
        for _ in range(2)
    ]
    torch.testing.assert_close(runs[0], runs[1], atol=0, rtol=0)


def test_bad_arguments():
    x = torch.randn(2, 3, 2)
    with pytest.raises(ValueError, match="p must"):
        empirical_lipschitz(torch.tanh, x, "1")
    with pytest.raises(ValueError, match="steps"):
        empirical_lipschitz(torch.tanh, x, "inf", steps=-1)
    with pytest.raises(ValueError, match="lr"):
        empirical_lipschitz(torch.tanh, x, "inf", lr=0.0)
    with pytest.raises(ValueError, match="power_iterations"):
        empirical_lipschitz(torch.tanh, x, "2", power_iterations=0)
    with pytest.raises(ValueError, match="batch"):
        jacobian_norm(lambda z: z.sum(0, keepdim=True), x, "inf")
    with pytest.raises(ValueError, match="NaN"):
        jacobian_norm(torch.tanh, torch.full((2, 3), math.nan), "inf")


def test_attention_weights_reproduce_the_attention_output() -> None:
    # Per head, P^h X A_h W^{V,h} concatenated and mapped by W^O is the module's output, with a
    # relative bias and a mask with a gap (docs/math.md#l2-attention, #relative-bias).
    torch.manual_seed(0)
    attn = L2MultiheadAttention(dim=4, heads=2, max_offset=3).double()
    with torch.no_grad():
        attn.relative_bias.normal_()
    x = torch.randn(2, 6, 4, dtype=torch.float64)
    mask = torch.tensor([[True] * 6, [True, False, True, True, True, False]])
    weights = attention_weights(attn, x, mask)
    assert weights.shape == (2, 2, 6, 6)
    assert torch.all(weights[1, :, :, 1] == 0) and torch.all(weights[1, :, 5] == 0)
    real_rows = weights.sum(-1)[mask[:, None, :].expand(2, 2, 6)]
    torch.testing.assert_close(real_rows, torch.ones_like(real_rows))
    heads = []
    for h in range(2):
        wq, wv = attn.w_query[:, 2 * h : 2 * h + 2], attn.w_value[:, 2 * h : 2 * h + 2]
        heads.append(weights[:, h] @ x @ (wq @ wq.T / math.sqrt(2)) @ wv)
    expected = (torch.cat(heads, -1) @ attn.w_out) * mask[..., None]
    torch.testing.assert_close(expected, attn(x, mask), rtol=1e-10, atol=1e-12)


def test_attention_weights_see_the_positional_table() -> None:
    torch.manual_seed(1)
    inner = ContractiveL2MultiheadAttention(dim=2, heads=1).double()
    encoding = SinusoidalPositionalEncoding(2)
    x = torch.randn(1, 5, 2, dtype=torch.float64)
    torch.testing.assert_close(
        attention_weights(PositionalBranch(inner, encoding), x),
        attention_weights(inner.attention, x + encoding(x)))
    with pytest.raises(TypeError, match="attention must be an L2 attention module"):
        attention_weights(torch.nn.Linear(2, 2), x)
