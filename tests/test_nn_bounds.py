"""Bounds of L2 attention: Kim's Theorem 3.2, its head-by-head infinity-norm form, and the
Lambert-W function phi^{-1} (docs/math.md#l2-bounds, #l2-bounds-heads; checks H2, H5, H7, H21
(docs/math.md#checks))."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy.special import lambertw
from torch.func import vmap

from iresflow.nn.attention import L2MultiheadAttention, lipschitz_bound
from iresflow.nn.bounds import l2_attention_bound, phi, phi_inv
from tests.oracles import heads_inf_bound, kim_inf_bound

# docs/math.md#l2-bounds, reference values of phi^{-1}(N - 1).
TABLE = {
    2: 0.278465,
    10: 1.101003,
    64: 2.307130,
    100: 2.628650,
    128: 2.810739,
    256: 3.336378,
    512: 3.880425,
    1000: 4.420502,
    1024: 4.439870,
}


@pytest.mark.parametrize("n,expected", TABLE.items())
def test_h2_phi_inv_table(n, expected):
    assert phi_inv(n - 1) == pytest.approx(expected, abs=5e-7)
    assert 4 * phi_inv(n - 1) + 1 == pytest.approx(4 * expected + 1, abs=2e-6)
    tensor = phi_inv(torch.tensor(float(n - 1), dtype=torch.float64))
    assert float(tensor) == pytest.approx(expected, abs=5e-7)


def test_h2_phi_inverts_phi():
    for y in np.logspace(-8, 10, 60):
        assert phi(phi_inv(float(y))) == pytest.approx(y, rel=1e-9)
    y = torch.logspace(-8, 10, 60, dtype=torch.float64)
    torch.testing.assert_close(phi(phi_inv(y)), y, rtol=1e-9, atol=0)
    assert phi_inv(0) == 0.0


def test_phi_inv_tensor_matches_scipy(device):
    y = torch.cat(
        [
            torch.arange(0, 5000, dtype=torch.float64),
            torch.logspace(-12, 12, 500, dtype=torch.float64),
        ]
    ).to(device)
    expected = torch.from_numpy(lambertw(y.cpu().numpy() / np.e).real).to(device)
    torch.testing.assert_close(phi_inv(y), expected, rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(vmap(phi_inv)(y), expected, rtol=1e-12, atol=1e-15)
    lengths = torch.tensor([1, 2, 10, 1000], device=device)  # integer tensors are accepted
    torch.testing.assert_close(
        phi_inv(lengths - 1).double(), expected[lengths - 1], rtol=1e-6, atol=1e-7
    )


def test_phi_inv_gradient():
    y = torch.tensor([1e-3, 0.3, 9.0, 511.0], dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(phi_inv, (y,))
    assert torch.autograd.gradgradcheck(phi_inv, (y,))
    (grad,) = torch.autograd.grad(phi_inv(y).sum(), y, create_graph=True)
    x = phi_inv(y.detach())
    torch.testing.assert_close(grad, 1 / ((x + 1) * torch.exp(x + 1)), rtol=1e-12, atol=0)
    # W_0'' = -W^2 (W + 2) / (z^2 (1 + W)^3) at z = y / e, times the chain factor 1 / e^2.
    (second,) = torch.autograd.grad(grad.sum(), y)
    z = y.detach() / math.e
    expected = -(x**2) * (x + 2) / (z**2 * (1 + x) ** 3) / math.e**2
    torch.testing.assert_close(second, expected, rtol=1e-10, atol=0)


@pytest.mark.parametrize("y", [-1.0, math.nan, math.inf, torch.tensor([1.0, -0.5])])
def test_phi_inv_rejects_bad_values(y):
    with pytest.raises(ValueError):
        phi_inv(y)


def test_phi_inv_rejects_bad_types():
    with pytest.raises(TypeError):
        phi_inv("3")


def heads_oracle(attn: L2MultiheadAttention):
    """Per-head weight blocks W^{Q,h}, W^{V,h} (D x d_h), sliced one at a time."""
    dh = attn.dim // attn.heads
    return [
        (attn.w_query[:, h * dh : (h + 1) * dh], attn.w_value[:, h * dh : (h + 1) * dh])
        for h in range(attn.heads)
    ]


@pytest.mark.parametrize("dim,heads", [(4, 2), (6, 3), (4, 1), (3, 3)])
def test_bound_matches_glossary(dim, heads, dtype, device):
    attn = L2MultiheadAttention(dim, heads).requires_grad_(False).to(dtype=dtype, device=device)
    for w in attn.parameters():
        w.normal_()
    blocks = heads_oracle(attn)
    dh = dim // heads
    n = 17
    phi_n = float(lambertw((n - 1) / np.e).real)
    mn = torch.linalg.matrix_norm
    expected_inf = heads_inf_bound(attn, [phi_n] * heads)
    assert expected_inf <= kim_inf_bound(attn, phi_n) * (1 + 1e-12)  # H21: never above Kim's
    heads_2 = sum(float(mn(q, 2)) ** 4 * float(mn(v, 2)) ** 2 for q, v in blocks)
    expected_2 = math.sqrt(n / dh) * (4 * phi_n + 1) * math.sqrt(heads_2) * float(mn(attn.w_out, 2))
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    assert float(lipschitz_bound(attn, n, "inf")) == pytest.approx(expected_inf, rel=rtol)
    assert float(lipschitz_bound(attn, n, math.inf)) == pytest.approx(expected_inf, rel=rtol)
    assert float(lipschitz_bound(attn, n, "2")) == pytest.approx(expected_2, rel=rtol)
    assert float(lipschitz_bound(attn, n, 2)) == pytest.approx(expected_2, rel=rtol)
    bound = lipschitz_bound(attn, n)
    assert bound.dtype == dtype and bound.device.type == torch.device(device).type


def test_position_wise_norms_follow_section_0(dtype, device):
    # One hand-made head (d_h = D = 2, N = 10): the head-by-head bound of
    # docs/math.md#l2-bounds-heads by hand, and Kim's product of glossary norms above it.
    attn = L2MultiheadAttention(2, 1).requires_grad_(False).to(dtype=dtype, device=device)
    attn.w_query.copy_(torch.tensor([[1.0, -2.0], [0.5, 0.0]]))  # rows 3, 0.5; cols 1.5, 2
    attn.w_value.copy_(torch.tensor([[1.0, 0.0], [3.0, 1.0]]))  # cols 4, 1
    attn.w_out.copy_(torch.tensor([[0.0, 2.0], [1.0, -1.0]]))  # cols 1, 3
    n = 10
    # G = W^{Q T} W^V W^O = [[0.5, 4.5], [0, -4]], W^Q G = [[0.5, 12.5], [0.25, 2.25]]; the
    # column sums of |G| are 0.5, 8.5, of |W^Q G| 0.75, 14.75; ||W^{Q T}||_inf = 2.
    columns = [x / math.sqrt(2) + 4 * TABLE[10] * 2 * g for x, g in ((0.75, 0.5), (14.75, 8.5))]
    assert float(lipschitz_bound(attn, n)) == pytest.approx(max(columns), rel=1e-6)
    kim = (4 * TABLE[10] + 1 / math.sqrt(2)) * 3 * (3 * 2) * 4
    assert max(columns) < kim / 4


def test_h7_piecewise_affine_in_lambert_w(dtype, device):
    # B_inf is a maximum over output columns of functions affine in W = phi^{-1}(N - 1): convex
    # and increasing in W, and affine once one column dominates (large N).
    attn = L2MultiheadAttention(4, 2).requires_grad_(False).to(dtype=dtype, device=device)
    ns = [2, 3, 10, 100, 1000, 10**5]
    w = np.array([lambertw((n - 1) / np.e).real for n in ns])
    bounds = np.array([float(lipschitz_bound(attn, n)) for n in ns])
    slopes = np.diff(bounds) / np.diff(w)
    rtol = 1e-10 if dtype == torch.float64 else 1e-4
    assert np.all(slopes > 0) and np.all(np.diff(slopes) >= -rtol * slopes[1:])
    big = [2**k for k in range(10, 21)]
    w_big = np.array([lambertw((n - 1) / np.e).real for n in big])
    bounds_big = np.array([float(lipschitz_bound(attn, n)) for n in big])
    slope, intercept = np.polyfit(w_big, bounds_big, 1)
    np.testing.assert_allclose(slope * w_big + intercept, bounds_big, rtol=rtol)
    # Approximately linear in log N for large N: the increment per doubling tends to
    # slope * log 2 from below (dW/dlog z = W / (1 + W) -> 1).
    steps = np.diff(bounds_big) / (slope * math.log(2))
    assert np.all(np.diff(steps) > 0) and 0.75 < steps[0] < steps[-1] < 1


def test_h5_bound_degree_two_in_query_weights(dtype, device):
    attn = L2MultiheadAttention(4, 2).requires_grad_(False).to(dtype=dtype, device=device)
    for p in ("inf", "2"):
        base = l2_attention_bound(attn.w_query, attn.w_value, attn.w_out, 2, 8, p)
        scaled = l2_attention_bound(3 * attn.w_query, attn.w_value, attn.w_out, 2, 8, p)
        assert float(scaled / base) == pytest.approx(9.0, rel=1e-6)


def test_tensor_lengths_match_int_lengths(dtype, device):
    attn = L2MultiheadAttention(4, 2).requires_grad_(False).to(dtype=dtype, device=device)
    lengths = torch.tensor([1, 5, 64, 1000], device=device)
    for p in ("inf", "2"):
        per_seq = lipschitz_bound(attn, lengths, p)
        assert per_seq.shape == (4,)
        expected = torch.stack([lipschitz_bound(attn, int(n), p) for n in lengths])
        rtol = 1e-12 if dtype == torch.float64 else 1e-6
        torch.testing.assert_close(per_seq, expected, rtol=rtol, atol=0)
        assert bool((per_seq.diff() > 0).all())  # phi^{-1} is increasing: "max" length is valid


def test_bound_is_differentiable_in_weights():
    attn = L2MultiheadAttention(4, 2).double()
    params = tuple(p.detach().requires_grad_() for p in attn.parameters())
    for p in ("inf", "2"):
        assert torch.autograd.gradcheck(
            lambda q, v, o, p=p: l2_attention_bound(q, v, o, 2, torch.tensor([3, 9]), p), params
        )


@pytest.mark.parametrize(
    "kwargs,error",
    [
        ({"seq_len": 0}, ValueError),
        ({"seq_len": 2.5}, TypeError),
        ({"seq_len": torch.tensor([3, 0])}, ValueError),
        ({"p": 1}, ValueError),
        ({"p": "fro"}, ValueError),
    ],
)
def test_bad_bound_arguments(kwargs, error):
    attn = L2MultiheadAttention(4, 2)
    args = {"seq_len": 4, "p": "inf"} | kwargs
    with pytest.raises(error):
        lipschitz_bound(attn, **args)


def test_bad_weights():
    w = torch.eye(4)
    with pytest.raises(ValueError, match="square"):
        l2_attention_bound(torch.ones(4, 3), w, w, 2, 4)
    with pytest.raises(ValueError, match="divisible"):
        l2_attention_bound(w, w, w, 3, 4)
    with pytest.raises(TypeError):
        lipschitz_bound(torch.nn.Linear(4, 4), 4)  # type: ignore[arg-type]
