"""ResidualTransform (docs/math.md#change-of-variables, docs/math.md#fixed-point-inverse)."""

from __future__ import annotations

import io
import math

import nflows.transforms as nft
import pytest
import torch
from nflows.distributions import StandardNormal
from nflows.flows import Flow
from oracles import MixingBranch, TanhMLPBranch, jacobian_logdet

from iresflow.inverse.fixed_point import InversionError, InversionWarning, fixed_point_inverse
from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.nn.attention import ContractiveL2MultiheadAttention
from iresflow.nn.conditional import ConditionalBranch
from iresflow.nn.linear import SpectralLinear
from iresflow.nn.mlp import LipschitzMLP
from iresflow.transforms.residual import ResidualTransform

F64 = torch.float64
BRANCHES = ["mlp", "attention", "tanh", "mixing"]
D = 4  # features (2 attention heads of width 2)
SOLVERS = ["plain", "anderson"]


def make_branch(kind: str, device: torch.device, lipschitz: float = 0.9, features: int = D):
    """A branch with certificate ``lipschitz`` (attained or nearly so, except for attention)."""
    if kind == "mlp":
        mlp = LipschitzMLP((features, 16, features), coeff=math.sqrt(lipschitz))
        with torch.no_grad():
            for layer in mlp.modules():
                if isinstance(layer, SpectralLinear):
                    layer.weight.mul_(10.0)  # the normalisation binds: each layer has norm coeff
        return mlp.to(device=device, dtype=F64).eval()
    if kind == "attention":
        attention = ContractiveL2MultiheadAttention(features, heads=2, coeff=lipschitz)
        return attention.to(device=device, dtype=F64)
    if kind == "tanh":
        return TanhMLPBranch(features, 8, lipschitz, dtype=F64, device=device)
    if kind == "mixing":
        return MixingBranch(features, lipschitz, dtype=F64, device=device)
    raise ValueError(kind)


def padding_mask(lengths: list[int], n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def round_trip(block: ResidualTransform, x: torch.Tensor, mask: torch.Tensor):
    """``y = block(x)`` and its inverse, checked: converged, padded frames untouched, the real
    ones ``x`` to 1e-9. Returns ``(y, x_rec, stats)``."""
    y, _ = block(x, mask=mask)
    x_rec, _ = block.inverse(y, mask=mask)
    stats = block.last_inverse_stats
    assert stats is not None and bool(stats.converged.all())
    assert torch.equal(x_rec[~mask], y[~mask])
    assert float((x_rec - x)[mask].abs().max()) < 1e-9
    return y, x_rec, stats


def vec_norm(t: torch.Tensor, norm: str) -> torch.Tensor:
    flat = t.reshape(t.shape[0], -1)
    return flat.abs().amax(1) if norm == "inf" else torch.linalg.vector_norm(flat, dim=1)


@pytest.mark.parametrize("kind", BRANCHES)
@pytest.mark.parametrize("masked", [False, True])
def test_exact_logdet_matches_jacobian_oracle(device, kind, masked):
    branch = make_branch(kind, device)
    block = ResidualTransform(branch, logdet="exact")
    x = torch.randn(3, 5, D, device=device, dtype=F64)
    mask = padding_mask([5, 2, 4], 5, device) if masked else None
    y, logabsdet = block(x, mask=mask)
    assert y.shape == x.shape and logabsdet.shape == (3,)
    assert torch.allclose(y, x + branch(x, mask), atol=1e-13, rtol=0)
    expected = jacobian_logdet(lambda t, m: t + branch(t, m), x, mask)
    assert torch.allclose(logabsdet, expected, atol=1e-8, rtol=0)


@pytest.mark.parametrize("kind", ["mlp", "tanh"])
def test_vector_inputs_are_sequences_of_length_one(device, kind):
    branch = make_branch(kind, device)
    block = ResidualTransform(branch, logdet="exact")
    x = torch.randn(4, D, device=device, dtype=F64)
    y, logabsdet = block(x)
    assert y.shape == (4, D)
    expected = jacobian_logdet(lambda t, m: t + branch(t, m), x[:, None, :])
    assert torch.allclose(logabsdet, expected, atol=1e-8, rtol=0)
    x_rec, inverse_logabsdet = block.inverse(y)
    assert x_rec.shape == (4, D)
    assert torch.allclose(x_rec, x, atol=1e-9, rtol=0)
    assert torch.allclose(inverse_logabsdet, -logabsdet, atol=1e-10, rtol=0)


@pytest.mark.parametrize("kind", BRANCHES)
def test_per_call_logdet_override(device, kind):
    branch = make_branch(kind, device)
    block = ResidualTransform(branch, logdet="roulette")
    x = torch.randn(2, 4, D, device=device, dtype=F64)
    _, logabsdet = block(x, logdet=ExactLogDet())
    _, by_name = block(x, logdet="exact")
    expected = jacobian_logdet(lambda t, m: t + branch(t, m), x)
    assert torch.allclose(logabsdet, expected, atol=1e-8, rtol=0)
    assert torch.allclose(by_name, expected, atol=1e-8, rtol=0)
    assert isinstance(block.logdet, RouletteLogDet)


@pytest.mark.parametrize("kind", BRANCHES)
@pytest.mark.parametrize("solver", SOLVERS)
@pytest.mark.parametrize("lipschitz", [0.5, 0.97])
def test_inverse_round_trip_within_banach_bound(device, kind, solver, lipschitz):
    branch = make_branch(kind, device, lipschitz)
    certificate = float(branch.lipschitz_constant(6).detach())
    assert certificate == pytest.approx(lipschitz, rel=1e-6)
    block = ResidualTransform(branch, logdet="exact", inverse_solver=solver)
    x = torch.randn(4, 6, D, device=device, dtype=F64)
    mask = padding_mask([6, 3, 1, 5], 6, device)
    y, _ = block(x, mask=mask)
    x_rec, _ = block.inverse(y, mask=mask)
    assert float((x_rec - x).abs().max()) < 1e-9  # H9
    stats = block.last_inverse_stats
    assert stats is not None and bool(stats.converged.all())
    assert stats.iterations.shape == (4,)
    error = vec_norm(x_rec - x, branch.norm)
    # a posteriori bound, valid for any returned point: ||x - x*|| <= ||T(x) - x|| / (1 - L)
    step = vec_norm(y - branch(x_rec, mask) - x_rec, branch.norm)
    assert bool((error <= step / (1 - certificate) + 1e-12).all())
    if solver == "plain":
        # a priori (Banach): ||x_k - x*|| <= L^k / (1 - L) ||x_1 - x_0||, x_0 = y
        k = stats.iterations.to(F64)
        bound = certificate**k / (1 - certificate) * vec_norm(branch(y, mask), branch.norm)
        assert bool((error <= bound + 1e-12).all())


@pytest.mark.parametrize("solver", SOLVERS)
def test_position_wise_inverse_on_one_feature_solves_frame_by_frame(device, solver):
    branch = make_branch("mlp", device, 0.97, features=1)
    certificate = float(branch.lipschitz_constant(9).detach())
    block = ResidualTransform(branch, logdet="exact", inverse_solver=solver)
    x = torch.randn(4, 9, 1, device=device, dtype=F64)
    mask = padding_mask([9, 3, 1, 6], 9, device)
    y, x_rec, stats = round_trip(block, x, mask)
    error = vec_norm(x_rec - x, branch.norm)
    step = vec_norm(y - branch(x_rec, mask) - x_rec, branch.norm)
    assert bool((error <= step / (1 - certificate) + 1e-12).all())
    # the same equations solved as whole sequences: the same solution, in no fewer evaluations
    whole, whole_stats = fixed_point_inverse(branch, torch.where(mask[..., None], y, 0.0),
                                             args=(mask,), solver=solver)
    assert torch.allclose(x_rec[mask], whole[mask], atol=1e-9, rtol=0)
    assert stats.evaluations <= whole_stats.evaluations


def test_position_wise_inverse_on_one_feature_with_a_context(device):
    """A conditional per-frame branch on one feature: its moving frames are evaluated alone with
    their sequence's context, and the inverse is the forward's."""
    branch = ConditionalBranch(make_branch("mlp", device, 0.97, features=1), context_features=2)
    branch = branch.to(device=device, dtype=F64)
    for p in branch.parameters():  # a shift that differs between the sequences
        torch.nn.init.normal_(p, std=0.5)
    block = ResidualTransform(branch, logdet="exact", inverse_solver="anderson")
    x = torch.randn(3, 7, 1, device=device, dtype=F64)
    mask = padding_mask([7, 4, 6], 7, device)
    context = torch.randn(3, 2, device=device, dtype=F64)
    y, _ = block(x, context=context, mask=mask)
    lengths: list[int] = []
    hook = branch.register_forward_hook(lambda module, args, out: lengths.append(args[0].shape[1]))
    x_rec, _ = block.inverse(y, context=context, mask=mask)
    hook.remove()
    assert bool(block.last_inverse_stats.converged.all()) and 1 in lengths
    assert float((x_rec - x)[mask].abs().max()) < 1e-9


@pytest.mark.parametrize("kind", BRANCHES)
def test_inverse_logdet_is_minus_forward_logdet(device, kind):
    block = ResidualTransform(make_branch(kind, device), logdet="exact")
    x = torch.randn(3, 4, D, device=device, dtype=F64)
    mask = padding_mask([4, 1, 3], 4, device)
    y, logabsdet = block(x, mask=mask)
    _, inverse_logabsdet = block.inverse(y, mask=mask)
    assert torch.allclose(inverse_logabsdet, -logabsdet, atol=1e-9, rtol=0)


@pytest.mark.parametrize("kind", BRANCHES)
def test_appending_padding_changes_nothing(device, kind):
    block = ResidualTransform(make_branch(kind, device), logdet="exact")
    x = torch.randn(3, 4, D, device=device, dtype=F64)
    lengths = [4, 2, 3]
    mask = padding_mask(lengths, 4, device)
    y, logabsdet = block(x, mask=mask)
    x_long = torch.cat([x, 100 * torch.randn(3, 2, D, device=device, dtype=F64)], dim=1)
    mask_long = padding_mask(lengths, 6, device)
    y_long, logabsdet_long = block(x_long, mask=mask_long)
    assert torch.allclose(y_long[:, :4][mask], y[mask], atol=1e-13, rtol=0)
    assert torch.equal(y_long[~mask_long], x_long[~mask_long])  # padding passes unchanged
    assert torch.allclose(logabsdet_long, logabsdet, atol=1e-10, rtol=0)
    for b, n in enumerate(lengths):  # each sequence alone, without padding
        y_b, logabsdet_b = block(x[b : b + 1, :n])
        assert torch.allclose(y_b[0], y[b, :n], atol=1e-13, rtol=0)
        assert torch.allclose(logabsdet_b[0], logabsdet[b], atol=1e-10, rtol=0)
    x_rec, _ = block.inverse(y_long, mask=mask_long)
    assert torch.equal(x_rec[~mask_long], x_long[~mask_long])
    assert torch.allclose(x_rec[mask_long], x_long[mask_long], atol=1e-9, rtol=0)


@pytest.mark.parametrize("kind", BRANCHES)
@pytest.mark.parametrize("logdet", ["roulette", "exact"])
def test_gradients_reach_all_parameters(device, kind, logdet):
    branch = make_branch(kind, device).train()
    block = ResidualTransform(branch, logdet=logdet)
    x = torch.randn(3, 4, D, device=device, dtype=F64, requires_grad=True)
    y, logabsdet = block(x, mask=padding_mask([4, 2, 3], 4, device))
    (0.5 * y.pow(2).sum() - logabsdet.sum()).backward()
    assert x.grad is not None and bool(torch.isfinite(x.grad).all())
    for name, p in block.named_parameters():
        assert p.grad is not None, name
        assert bool(torch.isfinite(p.grad).all()) and bool((p.grad != 0).any()), name


def test_exact_logdet_gradient_matches_oracle(device):
    branch = make_branch("tanh", device)
    block = ResidualTransform(branch, logdet="exact")
    x = torch.randn(2, 3, D, device=device, dtype=F64)
    mask = padding_mask([3, 2], 3, device)
    params = [p for name, p in branch.named_parameters() if name != "b2"]  # b2: no effect on J
    ours = torch.autograd.grad(block(x, mask=mask)[1].sum(), params)
    oracle = jacobian_logdet(lambda t, m: t + branch(t, m), x, mask, create_graph=True)
    expected = torch.autograd.grad(oracle.sum(), params)
    for a, b in zip(ours, expected, strict=True):
        assert torch.allclose(a, b, atol=1e-9, rtol=0)


def test_inverse_is_detached_and_stats_are_kept(device):
    block = ResidualTransform(make_branch("tanh", device), logdet="exact")
    assert block.last_inverse_stats is None
    y = torch.randn(3, 2, D, device=device, dtype=F64, requires_grad=True)
    x, logabsdet = block.inverse(y)
    assert not x.requires_grad and not logabsdet.requires_grad
    stats = block.last_inverse_stats
    assert stats.residual.shape == (3,) and stats.evaluations == int(stats.iterations.max())


def test_inverse_failure_raises_or_warns(device):
    branch = make_branch("tanh", device, 0.97)
    y = torch.randn(3, 2, D, device=device, dtype=F64)
    with pytest.raises(InversionError):
        ResidualTransform(branch, inverse_max_iter=2).inverse(y)
    block = ResidualTransform(branch, logdet="exact", inverse_max_iter=2, on_failure="warn")
    with pytest.warns(InversionWarning):
        block.inverse(y)
    assert not bool(block.last_inverse_stats.converged.any())


def test_lipschitz_constant_is_the_branch_certificate(device):
    branch = make_branch("mixing", device, 0.8)
    block = ResidualTransform(branch)
    assert float(block.lipschitz_constant(4)) == pytest.approx(0.8)


def test_state_dict_round_trip(device):
    block = ResidualTransform(make_branch("mlp", device), logdet="exact")
    buffer = io.BytesIO()
    torch.save(block.state_dict(), buffer)
    other = ResidualTransform(make_branch("mlp", device), logdet="exact")
    buffer.seek(0)
    other.load_state_dict(torch.load(buffer))
    x = torch.randn(2, 3, D, device=device, dtype=F64)
    for a, b in zip(block(x), other(x), strict=True):
        assert torch.allclose(a, b, atol=1e-14, rtol=0)


def test_nflows_composite_inverse_transform_and_flow(device):
    blocks = [ResidualTransform(make_branch("mlp", device), logdet="exact") for _ in range(2)]
    swaps = nft.Permutation(torch.tensor([1, 0, 3, 2]))  # even: the oracle needs det > 0
    chain = nft.CompositeTransform([blocks[0], swaps, blocks[1]])
    x = torch.randn(5, D, device=device, dtype=F64)
    z, logabsdet = chain(x)
    x_rec, inverse_logabsdet = chain.inverse(z)
    assert torch.allclose(x_rec, x, atol=1e-9, rtol=0)
    assert torch.allclose(inverse_logabsdet, -logabsdet, atol=1e-9, rtol=0)
    expected = jacobian_logdet(lambda t, m: chain(t.squeeze(1))[0].unsqueeze(1), x[:, None, :])
    assert torch.allclose(logabsdet, expected, atol=1e-8, rtol=0)

    inverted = nft.InverseTransform(blocks[0])
    u, u_logabsdet = inverted(x)
    back, back_logabsdet = inverted.inverse(u)
    assert torch.allclose(back, x, atol=1e-9, rtol=0)
    assert torch.allclose(u_logabsdet, -back_logabsdet, atol=1e-9, rtol=0)

    flow = Flow(chain, StandardNormal([D])).to(dtype=F64)
    normal = -0.5 * z.pow(2).sum(1) - D / 2 * math.log(2 * math.pi)
    assert torch.allclose(flow.log_prob(x), normal + logabsdet, atol=1e-10, rtol=0)


@pytest.mark.parametrize(
    ("call", "error"),
    [
        (lambda block, x: block(x, torch.ones(2)), ValueError),  # context
        (lambda block, x: block(x[..., :2]), ValueError),  # feature size
        (lambda block, x: block(x.masked_fill(x > 1, float("nan"))), ValueError),
        (lambda block, x: block(x.long()), TypeError),
        (lambda block, x: block(x[0, 0]), ValueError),  # rank 1
        (lambda block, x: block(x, mask=torch.ones(2, 3, dtype=torch.bool)), ValueError),
        (lambda block, x: block(x, mask=torch.ones(2, 4)), TypeError),
        (lambda block, x: block(x[:, 0], mask=torch.ones(2, 1, dtype=torch.bool)), ValueError),
        (lambda block, x: block.inverse(x, torch.ones(2)), ValueError),
        (lambda block, x: block.inverse(x[..., :1]), ValueError),
        (lambda block, x: block(x, logdet="magic"), ValueError),
    ],
)
def test_bad_inputs_raise(device, call, error):
    block = ResidualTransform(make_branch("mlp", device))
    x = torch.randn(2, 4, D, device=device, dtype=F64)
    with pytest.raises(error):
        call(block, x)


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        ({"inverse_solver": "newton"}, ValueError),
        ({"inverse_tol": 0.0}, ValueError),
        ({"inverse_max_iter": 0}, ValueError),
        ({"on_failure": "ignore"}, ValueError),
        ({"logdet": "magic"}, ValueError),
    ],
)
def test_bad_options_raise(device, kwargs, error):
    with pytest.raises(error):
        ResidualTransform(make_branch("tanh", device), **kwargs)


def test_branch_must_be_contractive(device):
    with pytest.raises(ValueError, match="contractive"):
        ResidualTransform(TanhMLPBranch(3, 4, 1.2, dtype=F64, device=device))
    with pytest.raises(TypeError, match="LipschitzBranch"):
        ResidualTransform(torch.nn.Linear(3, 3))
