"""Attention: L2-MHA (docs/math.md#l2-attention, #l2-bounds; checks H1,
H3-H6 (docs/math.md#checks)), DP-MHA (#dot-product-attention), contractive branches
(#contractive-attention, #lipschitznorm)."""

from __future__ import annotations

import math

import pytest
import torch
from torch.func import functional_call, jacrev, vmap

from iresflow.nn.attention import (
    ContractiveL2MultiheadAttention,
    ContractiveLipschitzNormAttention,
    DotProductMultiheadAttention,
    L2MultiheadAttention,
    lipschitz_bound,
)
from iresflow.nn.diagnostics import empirical_lipschitz, jacobian_norm
from tests.oracles import l2_attention_direct


def make(cls, *args, dtype, device, **kwargs):
    return cls(*args, **kwargs).to(dtype=dtype, device=device)


MASK = [[True] * 6, [True, True, True, False, False, False], [True, False, True, True, False, True]]


@pytest.mark.parametrize("dim,heads", [(4, 1), (4, 2), (6, 3), (1, 1)])
@pytest.mark.parametrize("masked", [False, True])
def test_h1_efficient_equals_direct(dim, heads, masked, dtype, device):
    attn = make(L2MultiheadAttention, dim, heads, dtype=dtype, device=device)
    x = 3 * torch.randn(3, 6, dim, dtype=dtype, device=device)
    mask = torch.tensor(MASK, device=device) if masked else None
    expected = l2_attention_direct(attn, x, mask)
    tol = 1e-10 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(attn(x, mask), expected, atol=tol, rtol=0)
    with torch.no_grad():  # fused scaled_dot_product_attention path
        torch.testing.assert_close(attn(x, mask), expected, atol=tol, rtol=0)


@pytest.mark.parametrize("dim,heads", [(4, 2), (1, 1), (4, 1)])
@pytest.mark.parametrize("scale", [0.5, 2.0, 5.0])
def test_h3_jacobian_within_bounds(dim, heads, scale, dtype, device):
    attn = make(L2MultiheadAttention, dim, heads, dtype=dtype, device=device)
    with torch.no_grad():
        for w in attn.parameters():
            w.copy_(scale * torch.randn_like(w))
    n = 5
    x = torch.randn(4, n, dim, dtype=dtype, device=device) * torch.tensor(
        [0.1, 1.0, 3.0, 10.0], dtype=dtype, device=device
    ).reshape(4, 1, 1)
    for p in ("inf", "2"):
        bound = lipschitz_bound(attn, n, p).detach()
        at_random = jacobian_norm(attn, x, p)
        found = empirical_lipschitz(attn, x, p, steps=15, lr=0.1 / scale)
        assert bool((at_random <= bound).all())
        assert float(found.value) <= float(bound)
        assert float(found.value) >= float(at_random.detach().max()) * (1 - 1e-9)


@pytest.mark.slow
@pytest.mark.parametrize("dim,heads", [(1, 1), (2, 2), (4, 2)])
def test_h3_jacobian_within_bounds_strong_search(dim, heads, dtype, device):
    generator = torch.Generator(device=device).manual_seed(1)
    for scale in (0.3, 1.0, 3.0, 6.0):
        attn = make(L2MultiheadAttention, dim, heads, dtype=dtype, device=device)
        with torch.no_grad():
            for w in attn.parameters():
                w.copy_(scale * torch.randn(w.shape, generator=generator, dtype=dtype))
        n = 8
        c = 10 * torch.rand(16, 1, 1, generator=generator, dtype=dtype)
        x = c * (2 * torch.rand(16, n, dim, generator=generator, dtype=dtype) - 1)
        for p in ("inf", "2"):
            found = empirical_lipschitz(attn, x, p, steps=200, lr=0.1, generator=generator)
            assert float(found.value) <= float(lipschitz_bound(attn, n, p))


@pytest.mark.parametrize("norm", ["inf", "2"])
@pytest.mark.parametrize("length", ["actual", "max"])
@pytest.mark.parametrize("masked", [False, True])
def test_h4_contractive_branch(norm, length, masked, dtype, device):
    branch = make(
        ContractiveL2MultiheadAttention,
        4,
        2,
        coeff=0.7,
        norm=norm,
        length=length,
        dtype=dtype,
        device=device,
    )
    with torch.no_grad():
        for w in branch.parameters():
            w.mul_(4)
    mask = torch.tensor(MASK, device=device) if masked else None
    x = 5 * torch.randn(3, 6, 4, dtype=dtype, device=device)

    def f(z):
        return branch(z, mask)

    found = empirical_lipschitz(f, x, norm, steps=15, lr=0.3)
    assert float(found.value) <= 0.7 * (1 + 1e-12)
    assert float(found.value) > 0
    assert float(branch.lipschitz_constant(6)) == pytest.approx(0.7)


@pytest.mark.parametrize("masked", [False, True])
def test_contractive_bound_uses_real_lengths(masked, dtype, device):
    branch = make(ContractiveL2MultiheadAttention, 4, 2, dtype=dtype, device=device)
    x = torch.randn(3, 6, 4, dtype=dtype, device=device)
    mask = (
        torch.tensor(MASK, device=device)
        if masked
        else torch.ones(3, 6, dtype=torch.bool, device=device)
    )
    out = branch(x, mask if masked else None)
    for i in range(3):  # the real tokens of a padded sequence see the bound of their own length
        real = x[i : i + 1, mask[i]]
        expected = 0.9 * branch.attention(real) / branch.raw_bound(real.shape[1])
        torch.testing.assert_close(out[i, mask[i]], expected[0], atol=1e-12, rtol=0)
    max_branch = make(
        ContractiveL2MultiheadAttention, 4, 2, length="max", dtype=dtype, device=device
    )
    max_branch.load_state_dict(branch.state_dict())
    padded = 0.9 * branch.attention(x, mask) / branch.raw_bound(6)
    torch.testing.assert_close(max_branch(x, mask), padded, atol=1e-12, rtol=0)


def test_h5_degree_two_in_query_weights(dtype, device):
    attn = make(L2MultiheadAttention, 4, 2, dtype=dtype, device=device)
    scaled = make(L2MultiheadAttention, 4, 2, dtype=dtype, device=device)
    s = 3.0
    scaled.load_state_dict({**attn.state_dict(), "w_query": s * attn.w_query.detach()})
    x = torch.randn(4, 5, 4, dtype=dtype, device=device)
    for p in ("inf", "2"):
        # F(X; sW) = s F(sX; W), so ||J(X; sW)|| = s^2 ||J(sX; W)|| pointwise.
        torch.testing.assert_close(
            jacobian_norm(scaled, x, p), s**2 * jacobian_norm(attn, s * x, p), rtol=1e-10, atol=0
        )
        ratio = (lipschitz_bound(scaled, 5, p) / lipschitz_bound(attn, 5, p)).detach()
        assert float(ratio) == pytest.approx(s**2, rel=1e-12)
    # Empirical maxima from matched starts (X0 / s with learning rate lr / s) scale by s^2.
    lip_w = empirical_lipschitz(attn, x, "inf", steps=10, lr=0.1)
    lip_sw = empirical_lipschitz(scaled, x / s, "inf", steps=10, lr=0.1 / s)
    assert float(lip_sw.value / lip_w.value) == pytest.approx(s**2, rel=1e-3)


def dp_j00_closed_form(attn: DotProductMultiheadAttention, x: torch.Tensor) -> torch.Tensor:
    """d F_0 / d x_0 at x_0 = 0 (docs/math.md#dot-product-attention): sum_h W^{O,h T} W^{V,h T}
    (Sigma A_h^T + I / N)."""
    n, d = x.shape
    dh = d // attn.heads
    centred = x - x.mean(0)
    sigma = centred.T @ centred / n
    j = torch.zeros(d, d, dtype=x.dtype, device=x.device)
    for h in range(attn.heads):
        cols = slice(h * dh, (h + 1) * dh)
        a = attn.w_query[:, cols] @ attn.w_key[:, cols].T / math.sqrt(dh)
        head = sigma @ a.T + torch.eye(d, dtype=x.dtype, device=x.device) / n
        j = j + attn.w_out[cols].T @ attn.w_value[:, cols].T @ head
    return j


def test_h6_dot_product_not_lipschitz(dtype, device):
    dp = make(DotProductMultiheadAttention, 4, 2, dtype=dtype, device=device)
    l2 = make(L2MultiheadAttention, 4, 2, dtype=dtype, device=device)
    with torch.no_grad():
        for w in (*dp.parameters(), *l2.parameters()):
            w.normal_()
    base = 2 * torch.rand(1, 8, 4, dtype=dtype, device=device) - 1
    base[:, 0] = 0
    ratios = []
    for s in (1.0, 4.0, 16.0):
        x = s * base
        jac = torch.autograd.functional.jacobian(lambda z: dp(z)[0, 0], x)[:, 0, 0]
        torch.testing.assert_close(jac, dp_j00_closed_form(dp, x[0]), atol=1e-10, rtol=1e-10)
        ratios.append(float(torch.linalg.matrix_norm(jac, ord=math.inf)) / s**2)
        assert bool(jacobian_norm(l2, x, "inf")[0] <= lipschitz_bound(l2, 8, "inf"))
    # ||J_00|| / s^2 settles (quadratic growth, unbounded Jacobian) once Sigma A^T dominates I / N.
    assert ratios[2] == pytest.approx(ratios[1], rel=0.05)
    assert ratios[1] == pytest.approx(ratios[0], rel=0.3)


def test_dot_product_matches_torch_multihead_attention(dtype, device):
    dp = make(DotProductMultiheadAttention, 4, 2, dtype=dtype, device=device)
    ref = torch.nn.MultiheadAttention(4, 2, bias=False, batch_first=True)
    ref = ref.to(dtype=dtype, device=device)
    with torch.no_grad():
        ref.in_proj_weight.copy_(torch.cat([dp.w_query.T, dp.w_key.T, dp.w_value.T]))
        ref.out_proj.weight.copy_(dp.w_out.T)
    x = torch.randn(3, 6, 4, dtype=dtype, device=device)
    mask = torch.tensor(MASK, device=device)
    expected = ref(x, x, x, key_padding_mask=~mask, need_weights=False)[0] * mask[..., None]
    tol = 1e-12 if dtype == torch.float64 else 1e-5
    torch.testing.assert_close(dp(x, mask), expected, atol=tol, rtol=0)
    with torch.no_grad():
        torch.testing.assert_close(dp(x, mask), expected, atol=tol, rtol=0)


ALL_BRANCHES = [
    lambda: L2MultiheadAttention(4, 2),
    lambda: ContractiveL2MultiheadAttention(4, 2),
    lambda: ContractiveL2MultiheadAttention(4, 2, norm="2", length="max"),
    lambda: DotProductMultiheadAttention(4, 2),
    lambda: DotProductMultiheadAttention(4, 2, lipschitz_norm="transformer", alpha=0.5),
    lambda: ContractiveLipschitzNormAttention(4, 2, coeff=0.5, alpha=2.0),
]


@pytest.mark.parametrize("factory", ALL_BRANCHES)
def test_masks_padding_has_no_influence(factory, dtype, device):
    module = factory().to(dtype=dtype, device=device)
    mask = torch.tensor(MASK, device=device)
    x = torch.randn(3, 6, 4, dtype=dtype, device=device)
    noise = torch.where(mask[..., None], 0.0, 100 * torch.randn_like(x))
    for grad_mode in (True, False):
        with torch.set_grad_enabled(grad_mode):
            out, out_noisy = module(x, mask), module(x + noise, mask)
            assert bool((out[~mask] == 0).all())
            torch.testing.assert_close(out_noisy, out, atol=1e-12, rtol=0)
    if getattr(module, "length", "actual") == "max":
        return  # its bound uses the padded length by design
    # Each real sequence behaves as its unpadded self.
    for i in range(3):
        real = module(x[i : i + 1, mask[i]])
        torch.testing.assert_close(module(x, mask)[i, mask[i]], real[0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("factory", ALL_BRANCHES)
def test_vmap_jacrev_matches_autograd(factory, dtype, device):
    module = factory().to(dtype=dtype, device=device)
    x = torch.randn(3, 6, 4, dtype=dtype, device=device)
    mask = torch.tensor(MASK, device=device)
    for m in (None, mask):
        if m is None:
            jac = vmap(jacrev(lambda xi: module(xi[None])[0]))(x)
        else:
            jac = vmap(jacrev(lambda xi, mi: module(xi[None], mi[None])[0]))(x, m)
        for i in range(3):
            mi = None if m is None else m[i : i + 1]
            ref = torch.autograd.functional.jacobian(
                lambda z, mi=mi: module(z, mi)[0], x[i : i + 1]
            )
            torch.testing.assert_close(jac[i], ref[:, :, 0], atol=1e-12, rtol=0)


@pytest.mark.parametrize("factory", ALL_BRANCHES)
def test_gradients_and_double_backward(factory, device):
    module = factory().to(dtype=torch.float64, device=device)
    params = {k: v.detach().requires_grad_() for k, v in module.named_parameters()}
    x = torch.randn(2, 3, 4, dtype=torch.float64, device=device, requires_grad=True)
    mask = torch.tensor([[True, True, False], [True] * 3], device=device)

    def f(x, *values):
        return functional_call(module, dict(zip(params, values, strict=True)), (x, mask))

    assert torch.autograd.gradcheck(f, (x, *params.values()))
    assert torch.autograd.gradgradcheck(f, (x, *params.values()))
    out = module(x, mask)
    out.square().sum().backward()
    assert all(p.grad is not None and bool(p.grad.abs().sum() > 0) for p in module.parameters())


def test_contractive_lipschitz_norm_branch(dtype, device):
    branch = make(ContractiveLipschitzNormAttention, 4, 2, coeff=0.8, dtype=dtype, device=device)
    mask = torch.tensor(MASK, device=device)
    x = 3 * torch.randn(3, 6, 4, dtype=dtype, device=device)
    found = empirical_lipschitz(lambda z: branch(z, mask), x, "2", steps=15, lr=0.3)
    assert float(found.value) <= 0.8 * (1 + 1e-12)
    assert branch.norm == "2" and not branch.position_wise
    assert float(branch.lipschitz_constant()) == pytest.approx(0.8)
    lengths = torch.tensor([6, 3, 4], device=device)
    per_sequence = branch.raw_bound(lengths).detach()
    assert per_sequence.shape == (3,)
    assert float(per_sequence[1]) == pytest.approx(float(branch.raw_bound(3).detach()))


def test_state_dict_round_trip(dtype, device):
    branch = make(ContractiveL2MultiheadAttention, 4, 2, dtype=dtype, device=device)
    other = make(ContractiveL2MultiheadAttention, 4, 2, dtype=dtype, device=device)
    other.load_state_dict(branch.state_dict())
    x = torch.randn(2, 5, 4, dtype=dtype, device=device)
    torch.testing.assert_close(other(x), branch(x), atol=0, rtol=0)


def test_branch_attributes():
    branch = ContractiveL2MultiheadAttention(4, 2, coeff=0.5)
    assert branch.norm == "inf" and not branch.position_wise
    assert ContractiveL2MultiheadAttention(4, 2, norm="2").norm == "2"
    assert branch.lipschitz_constant(100).dtype == branch.attention.w_query.dtype
    names = set(dict(L2MultiheadAttention(4, 2).named_parameters()))
    assert names == {"w_query", "w_value", "w_out"}  # tied W^K = W^Q, no biases


@pytest.mark.parametrize(
    "build,error",
    [
        (lambda: L2MultiheadAttention(5, 2), ValueError),
        (lambda: L2MultiheadAttention(0, 1), ValueError),
        (lambda: ContractiveL2MultiheadAttention(4, 2, coeff=1.0), ValueError),
        (lambda: ContractiveL2MultiheadAttention(4, 2, coeff=0.0), ValueError),
        (lambda: ContractiveL2MultiheadAttention(4, 2, norm="1"), ValueError),
        (lambda: ContractiveL2MultiheadAttention(4, 2, length="min"), ValueError),
        (lambda: DotProductMultiheadAttention(4, 2, lipschitz_norm="graph"), ValueError),
        (lambda: DotProductMultiheadAttention(4, 2, alpha=0.0), ValueError),
        (lambda: ContractiveLipschitzNormAttention(4, 3), ValueError),
        (lambda: ContractiveLipschitzNormAttention(4, 2, coeff=-0.1), ValueError),
    ],
)
def test_bad_construction(build, error):
    with pytest.raises(error):
        build()


F64 = {"dtype": torch.float64}
NO_REAL = torch.tensor([[True, True, True], [False, False, False]])


@pytest.mark.parametrize(
    "x,mask,error,match",
    [
        (torch.zeros(2, 3, 5, **F64), None, ValueError, "features"),
        (torch.zeros(2, 4, **F64), None, ValueError, "shape"),
        (torch.full((2, 3, 4), math.nan, **F64), None, ValueError, "NaN"),
        (torch.zeros(2, 3, 4, dtype=torch.int64), None, TypeError, "floating"),
        (torch.zeros(2, 3, 4, dtype=torch.float32), None, TypeError, "dtype"),
        (torch.zeros(2, 3, 4, **F64), torch.ones(2, 3), TypeError, "bool"),
        (torch.zeros(2, 3, 4, **F64), torch.ones(2, 4, dtype=torch.bool), ValueError, "shape"),
        (torch.zeros(2, 3, 4, **F64), NO_REAL, ValueError, "no real"),
    ],
)
def test_bad_inputs(x, mask, error, match):
    for module in (ContractiveL2MultiheadAttention(4, 2), DotProductMultiheadAttention(4, 2)):
        with pytest.raises(error, match=match):
            module.double()(x, mask)
