"""LipschitzNorm scores and certificates (docs/math.md#lipschitznorm (F3, F5-F8); checks H18,
H19 (docs/math.md#checks))."""

from __future__ import annotations

import math

import pytest
import torch

from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.nn.attention import ContractiveLipschitzNormAttention, DotProductMultiheadAttention
from iresflow.nn.diagnostics import empirical_lipschitz, jacobian_norm
from iresflow.nn.lipschitz_norm import (
    LinearScoreAttention,
    _vector_norm,
    chi2_to_uniform,
    linear_score_bound,
    lipschitz_norm_scale,
    multihead_bound,
    softmax_norm_bound,
    transformer_head_bound,
)
from iresflow.nn.positional import LearnedPositionalEncoding, PositionalBranch
from iresflow.transforms.residual import ResidualTransform

MASK = [[True] * 6, [True, True, True, False, False, False], [True, False, True, True, False, True]]


def test_h19_chi2_identity(dtype, device):
    for m, n in ((1, 1), (3, 7), (6, 6)):
        probs = torch.softmax(3 * torch.randn(4, m, n, dtype=dtype, device=device), dim=-1)
        fro2 = torch.linalg.matrix_norm(probs, ord="fro") ** 2
        identity = (1 + chi2_to_uniform(probs)).sum(dim=-1) / n
        tol = 1e-12 if dtype == torch.float64 else 1e-5
        torch.testing.assert_close(identity, fro2, rtol=tol, atol=tol)
    uniform = torch.full((3, 5), 0.2, dtype=dtype, device=device)
    assert float(torch.linalg.matrix_norm(uniform)) == pytest.approx(math.sqrt(3 / 5))
    one_hot = torch.eye(5, dtype=dtype, device=device)[:3]
    torch.testing.assert_close(chi2_to_uniform(one_hot), torch.full_like(one_hot[:, 0], 4.0))


def bounded_scores(alpha, shape, dtype, device):
    """Scores in [-alpha, alpha]: uniform, random signs at +-alpha, and one shared hot column."""
    uniform = alpha * (2 * torch.rand(shape, dtype=dtype, device=device) - 1)
    signs = alpha * torch.randint(0, 2, shape, device=device).to(dtype).mul(2).sub(1)
    hot = torch.full(shape, -alpha, dtype=dtype, device=device)
    hot[..., 0] = alpha
    return torch.cat([uniform, signs, hot])


@pytest.mark.parametrize("alpha", [0.25, 1.0, 3.0])
@pytest.mark.parametrize("m,n", [(1, 4), (5, 5), (6, 3)])
def test_f3_softmax_norm_bound(alpha, m, n, dtype, device):
    probs = torch.softmax(bounded_scores(alpha, (20, m, n), dtype, device), dim=-1)
    spectral = torch.linalg.matrix_norm(probs, ord=2)
    s_max = float(softmax_norm_bound(alpha, n, m))
    assert float(spectral.max()) <= s_max * (1 + 1e-12)
    e = math.exp(2 * alpha)
    assert s_max == pytest.approx(math.sqrt(m * e / (e + n - 1)))
    assert s_max <= math.exp(alpha) * math.sqrt(m / n) + 1e-12
    lengths = torch.tensor([1, n, 10])
    torch.testing.assert_close(
        softmax_norm_bound(alpha, lengths),
        torch.stack([softmax_norm_bound(alpha, int(k)) for k in lengths]),
    )


@pytest.mark.parametrize("alpha", [0.5, 2.0])
def test_f8_neighbourhood_softmax_bound(alpha, dtype, device):
    m, n = 5, 7
    adjacency = torch.rand(30, m, n, device=device) < 0.4
    adjacency[:, torch.arange(m), torch.arange(m)] = True
    scores = bounded_scores(alpha, (10, m, n), dtype, device)
    probs = torch.softmax(scores.masked_fill(~adjacency, -math.inf), dim=-1)
    s_max = linear_score_bound(alpha, adjacency) - 4 * alpha
    spectral = torch.linalg.matrix_norm(probs, ord=2)
    assert bool((spectral <= s_max.to(dtype) * (1 + 1e-12)).all())
    full = linear_score_bound(alpha, torch.ones(m, n, dtype=torch.bool))
    assert float(full) == pytest.approx(float(softmax_norm_bound(alpha, n, m)) + 4 * alpha)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
def test_f6_scores_bounded_and_scale_invariant(alpha, dtype, device):
    q, k, v = (s * torch.randn(3, 2, 6, 4, dtype=dtype, device=device) for s in (0.1, 5.0, 30.0))
    mask = torch.tensor(MASK, device=device)[:, None, :]
    scale = lipschitz_norm_scale(q, k, v, alpha, mask)
    assert scale.shape == (3, 2, 1, 1)
    scores = scale * q @ k.transpose(-1, -2)
    real = mask[..., None, :] & mask[..., :, None]
    assert float(scores.abs()[real.expand_as(scores)].max()) <= alpha * (1 + 1e-12)
    rescaled = lipschitz_norm_scale(7 * q, 7 * k, 7 * v, alpha, mask) * (7 * q @ (7 * k).mT)
    torch.testing.assert_close(rescaled, scores)
    # Padded tokens do not enter the normaliser.
    noisy = [torch.where(mask[..., None], t, 100 * torch.randn_like(t)) for t in (q, k, v)]
    torch.testing.assert_close(lipschitz_norm_scale(*noisy, alpha, mask), scale)
    # Explicit u, v, w for one (batch, head) without padding.
    u = torch.linalg.matrix_norm(q[0, 0])
    kk, vv = k[0, 0].norm(dim=-1).max(), v[0, 0].norm(dim=-1).max()
    expected = alpha / max(u * kk, u * vv, kk * vv)
    assert float(scale[0, 0]) == pytest.approx(float(expected), rel=1e-12)
    zero = torch.zeros(1, 3, 2, dtype=dtype, device=device)
    assert float(lipschitz_norm_scale(zero, zero, zero, alpha)) == 0.0


@pytest.mark.parametrize("masked", [False, True])
def test_h18_homogeneity(masked, dtype, device):
    mask = torch.tensor(MASK, device=device) if masked else None
    x = torch.randn(3, 6, 4, dtype=dtype, device=device)
    dp = DotProductMultiheadAttention(4, 2, "transformer", alpha=1.5)
    dp = dp.to(dtype=dtype, device=device)
    branch = ContractiveLipschitzNormAttention(4, 2).to(dtype=dtype, device=device)
    linear = LinearScoreAttention(4, 3, alpha=0.7).to(dtype=dtype, device=device)
    adjacency = mask[:, None, :].expand(3, 3, 6) if masked else None  # every query sees real tokens
    for s in (0.01, 3.0, 100.0):
        tol = {"rtol": 1e-10, "atol": 1e-12 * s}
        torch.testing.assert_close(dp(s * x, mask), s * dp(x, mask), **tol)
        torch.testing.assert_close(branch(s * x, mask), s * branch(x, mask), **tol)
        torch.testing.assert_close(linear(s * x, adjacency), s * linear(x, adjacency), **tol)


def ln_bound(dp: DotProductMultiheadAttention, n: int) -> torch.Tensor:
    heads = transformer_head_bound(dp.alpha, n, dp.w_query, dp.w_key, dp.w_value, dp.heads)
    return multihead_bound(heads, dp.w_out).detach()


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("heads,scale", [(1, 1.0), (2, 3.0), (2, 0.3)])
def test_h18_transformer_certificate(alpha, heads, scale, dtype, device):
    dp = DotProductMultiheadAttention(4, heads, "transformer", alpha)
    dp = dp.requires_grad_(False).to(dtype=dtype, device=device)
    for w in dp.parameters():
        w.copy_(scale * torch.randn_like(w))
    x = torch.randn(4, 6, 4, dtype=dtype, device=device) * torch.tensor(
        [0.1, 1.0, 5.0, 50.0], dtype=dtype, device=device
    ).reshape(4, 1, 1)
    bound = float(ln_bound(dp, 6))
    assert float(jacobian_norm(dp, x, "2").max()) <= bound
    found = empirical_lipschitz(dp, x, "2", steps=15, lr=0.2)
    assert 0 < float(found.value) <= bound


@pytest.mark.slow
@pytest.mark.parametrize("alpha", [0.25, 1.0, 4.0])
def test_h18_transformer_certificate_strong_search(alpha, dtype, device):
    generator = torch.Generator(device=device).manual_seed(3)
    for heads in (1, 2):
        dp = DotProductMultiheadAttention(4, heads, "transformer", alpha)
        dp = dp.requires_grad_(False).to(dtype=dtype, device=device)
        x = 3 * torch.randn(16, 6, 4, generator=generator, dtype=dtype, device=device)
        found = empirical_lipschitz(dp, x, "2", steps=200, lr=0.1, generator=generator)
        assert float(found.value) <= float(ln_bound(dp, 6))


def test_transformer_head_bound_matches_per_head_oracle(dtype, device):
    d, heads, dh, alpha, n = 6, 3, 2, 0.8, 9
    w = [torch.randn(d, d, dtype=dtype, device=device) for _ in range(3)]
    e = math.exp(2 * alpha)
    s_max = math.sqrt(n * e / (e + n - 1))
    factor = math.sqrt(32 * alpha**2 + (s_max + 2 * alpha) ** 2)
    expected = torch.stack(
        [
            factor
            * torch.linalg.matrix_norm(torch.cat([m[:, h * dh : (h + 1) * dh] for m in w], 1), 2)
            for h in range(heads)
        ]
    )
    rtol = 1e-12 if dtype == torch.float64 else 1e-5
    bound = transformer_head_bound(alpha, n, *w, heads)
    torch.testing.assert_close(bound, expected, rtol=rtol, atol=0)
    per_seq = transformer_head_bound(alpha, torch.tensor([2, n]), *w, heads)
    assert per_seq.shape == (2, heads)
    torch.testing.assert_close(per_seq[1], expected, rtol=rtol, atol=0)
    w_out = torch.randn(d, d, dtype=dtype, device=device)
    combined = multihead_bound(expected, w_out)
    manual = torch.linalg.matrix_norm(w_out, 2) * expected.square().sum().sqrt()
    torch.testing.assert_close(combined, manual, rtol=rtol, atol=0)


@pytest.mark.parametrize("alpha", [0.5, 1.0, 2.0])
@pytest.mark.parametrize("with_adjacency", [False, True])
def test_h18_linear_score_attention(alpha, with_adjacency, dtype, device):
    m, n = 3, 6
    attn = LinearScoreAttention(3, m, alpha).requires_grad_(False).to(dtype=dtype, device=device)
    adjacency = None
    full = torch.ones(m, n, dtype=torch.bool, device=device)
    if with_adjacency:  # a path graph over the tokens, query i sees tokens i, i+1, i+2
        adjacency = torch.zeros(m, n, dtype=torch.bool, device=device)
        for i in range(m):
            adjacency[i, i : i + 3] = True
    x = torch.randn(4, n, 3, dtype=dtype, device=device) * torch.tensor(
        [0.1, 1.0, 5.0, 50.0], dtype=dtype, device=device
    ).reshape(4, 1, 1)
    scores = attn.scores(x, adjacency)
    visible = full if adjacency is None else adjacency
    assert float(scores.abs()[visible.expand_as(scores)].max()) <= alpha * (1 + 1e-12)
    bound = float(linear_score_bound(alpha, visible))

    def f(z):
        return attn(z, adjacency)

    assert float(jacobian_norm(f, x, "2").max()) <= bound
    found = empirical_lipschitz(f, x, "2", steps=15, lr=0.2)
    assert 0 < float(found.value) <= bound
    if with_adjacency:  # token 5 is nobody's neighbour: no influence
        moved = x.clone()
        moved[:, 5] = 1e3
        torch.testing.assert_close(f(moved), f(x), atol=0, rtol=0)
        batched = adjacency.expand(4, m, n)
        torch.testing.assert_close(attn(x, batched), f(x), atol=0, rtol=0)


def test_linear_score_attention_oracle(dtype, device):
    attn = LinearScoreAttention(2, 2, alpha=1.0).requires_grad_(False)
    attn = attn.to(dtype=dtype, device=device)
    x = torch.randn(1, 4, 2, dtype=dtype, device=device)
    q = attn.query
    v = x[0].norm(dim=-1).max()
    g = q @ x[0].T / (q.norm() * v)
    expected = torch.softmax(g, dim=-1) @ x[0]
    torch.testing.assert_close(attn(x)[0], expected)


def test_bad_arguments():
    x = torch.randn(2, 4, 3)
    attn = LinearScoreAttention(3, 2)
    with pytest.raises(TypeError):
        attn(x, torch.ones(2, 4))
    with pytest.raises(ValueError, match="shape"):
        attn(x, torch.ones(2, 5, dtype=torch.bool))
    with pytest.raises(ValueError, match="empty"):
        attn(x, torch.tensor([[True] * 4, [False] * 4]))
    with pytest.raises(ValueError, match="batch"):
        attn(x, torch.ones(3, 2, 4, dtype=torch.bool))
    with pytest.raises(ValueError, match="features"):
        attn(torch.randn(2, 4, 5))
    with pytest.raises(ValueError):
        LinearScoreAttention(3, 0)
    with pytest.raises(ValueError, match="alpha"):
        LinearScoreAttention(3, 2, alpha=-1.0)
    with pytest.raises(ValueError, match="alpha"):
        lipschitz_norm_scale(x, x, x, alpha=math.inf)
    with pytest.raises(ValueError):
        lipschitz_norm_scale(torch.ones(3), x, x)
    with pytest.raises(ValueError, match="seq_len"):
        softmax_norm_bound(1.0, 0)
    with pytest.raises(ValueError, match="heads"):
        transformer_head_bound(1.0, 4, torch.eye(4), torch.eye(4), torch.eye(4), 3)
    with pytest.raises(ValueError, match="w_key"):
        transformer_head_bound(1.0, 4, torch.eye(4), torch.eye(3), torch.eye(4), 2)
    with pytest.raises(ValueError):
        chi2_to_uniform(torch.ones(3))


# --- zero tokens: finite first and second derivatives (audit defect 8) ---------------------------


def zero_token_batch(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 batch ``(3, 5, 2)`` with padded zero tokens (sequence 0) and a zero real token."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(3, 5, 2, generator=gen, dtype=torch.float64).to(device)
    mask = torch.ones(3, 5, dtype=torch.bool, device=device)
    mask[0, :2] = False
    x[~mask] = 0.0
    x[1, 3] = 0.0  # a real token that is exactly zero
    return x, mask


@pytest.mark.parametrize("logdet", ["roulette", "exact"])
@pytest.mark.parametrize("masked", [True, False])
def test_zero_tokens_give_finite_training_gradients(device, logdet, masked):
    # A zero positional table: the attention sees the zero tokens of x unchanged.
    branch = PositionalBranch(
        ContractiveLipschitzNormAttention(dim=2, heads=1),
        LearnedPositionalEncoding(2, max_len=5, init_std=0.0),
    )
    block = ResidualTransform(branch, logdet=logdet).to(device=device, dtype=torch.float64)
    block.train()
    x, mask = zero_token_batch(device)
    _, logabsdet = block(x, mask=mask if masked else None)
    logabsdet.sum().backward()
    grads = {name: p.grad for name, p in block.named_parameters()}
    assert all(g is not None and bool(torch.isfinite(g).all()) for g in grads.values()), grads
    assert any(bool(g.abs().sum() > 0) for g in grads.values())


def test_zero_tokens_give_finite_model_gradients(device):
    model = ResidualSequenceFlow(
        features=1, n_blocks=1, hidden=8, max_len=6, attention="lipschitznorm"
    )
    model = model.to(device=device, dtype=torch.float64).train()
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 1, generator=gen, dtype=torch.float64).to(device)
    mask = torch.ones(3, 5, dtype=torch.bool, device=device)
    mask[0, :2] = False
    x[~mask] = 0.0
    x[2, 0] = 0.0  # real and zero; the sinusoidal table is 0 at position 0 for D = 1
    model.log_prob(x, mask).sum().backward()
    for name, p in model.named_parameters():
        assert p.grad is not None and bool(torch.isfinite(p.grad).all()), name


def test_lipschitz_norm_attention_second_derivatives_at_zero_tokens(device):
    # x is fixed with zero tokens, so q = k = v = 0 there for every weight: the map is smooth in
    # the weights, and gradgradcheck compares the double backward with finite differences.
    attn = DotProductMultiheadAttention(2, 1, lipschitz_norm="transformer")
    attn = attn.to(device=device, dtype=torch.float64)
    x, mask = zero_token_batch(device)
    names = [name for name, _ in attn.named_parameters()]
    weights = tuple(p.detach().clone().requires_grad_(True) for p in attn.parameters())

    def f(*params: torch.Tensor) -> torch.Tensor:
        return torch.func.functional_call(attn, dict(zip(names, params, strict=True)), (x, mask))

    assert torch.autograd.gradcheck(f, weights)
    assert torch.autograd.gradgradcheck(f, weights)


def test_norm_helper_matches_vector_norm_away_from_zero(device):
    t = torch.randn(4, 6, 3, dtype=torch.float64, device=device)
    t[0, 2] = 0.0
    torch.testing.assert_close(_vector_norm(t), torch.linalg.vector_norm(t, dim=-1), rtol=0, atol=0)
    tiny = torch.full((2, 3), 1e-200, dtype=torch.float64, device=device)
    torch.testing.assert_close(_vector_norm(tiny), torch.linalg.vector_norm(tiny, dim=-1))
    (grad,) = torch.autograd.grad(_vector_norm(t.requires_grad_(True)).sum(), t, create_graph=True)
    (second,) = torch.autograd.grad(grad.square().sum(), t)
    assert bool(torch.isfinite(second).all()) and bool((grad[0, 2] == 0).all())
