"""Neumann-gradient surrogate and its memory-efficient Function (docs/math.md#neumann-gradient,
checks H13, H14 (docs/math.md#checks))."""

from __future__ import annotations

import copy

import pytest
import torch
from oracles import (
    MixingBranch,
    ScaleBranch,
    SpectralNormBranch,
    TanhMLPBranch,
    finite_difference_grad,
    jacobian,
    jacobian_logdet,
)

from iresflow.logdet.neumann import NeumannLogDetFunction, neumann_logdet
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.nn.conv import TemporalConvBranch
from iresflow.nn.mlp import LipschitzMLP

F64 = torch.float64
BRANCHES = {
    "mlp": lambda device: TanhMLPBranch(2, 4, 0.6, positional=True, max_len=3, device=device),
    "mixing": lambda device: MixingBranch(2, 0.6, max_len=3, device=device),
    "spectral": lambda device: SpectralNormBranch(2, 0.6, device=device),
}


def _inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = 0.5 * torch.randn(3, 3, 2, dtype=F64, device=device)
    mask = torch.tensor(
        [[True, True, True], [True, True, False], [False, True, True]], device=device
    )
    return x, mask


def _upstream(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Non-uniform upstream gradients: per-sample log-det weights and a dense output weight."""
    gen = torch.Generator(device=device).manual_seed(123)
    out_weight = torch.randn(3, 3, 2, dtype=F64, device=device, generator=gen)
    return out_weight, torch.tensor([0.7, -1.3, 2.1], dtype=F64, device=device)


def _roulette_gradients(branch, x, mask, seed, **kwargs):
    out_weight, ld_weight = _upstream(x.device)
    gen = torch.Generator(device=x.device).manual_seed(seed)
    x = x.clone().requires_grad_()
    out, logdet = RouletteLogDet(generator=gen, **kwargs)(branch, x, mask)
    loss = (out * out_weight).sum() + (logdet * ld_weight).sum()
    params = [p for p in branch.parameters() if p.requires_grad]
    grads = torch.autograd.grad(loss, [x, *params], materialize_grads=True)
    return [out.detach(), logdet.detach(), *grads, *[b.clone() for b in branch.buffers()]]


@pytest.mark.parametrize("kind", sorted(BRANCHES))
@pytest.mark.parametrize("distribution", ["geometric", "poisson"])
@pytest.mark.parametrize("n_probes", [1, 3])
def test_memory_efficient_equals_plain(device, kind, distribution, n_probes):
    """H14: identical values, input/parameter gradients and buffer states for a fixed seed,
    under non-uniform per-sample upstream gradients and a padding mask."""
    torch.manual_seed(2)
    branch = BRANCHES[kind](device).train()
    x, mask = _inputs(device)
    kwargs = {"distribution": distribution, "n_probes": n_probes}
    results = []
    for memory_efficient in (True, False):
        module = copy.deepcopy(branch)
        results.append(
            _roulette_gradients(module, x, mask, 11, memory_efficient=memory_efficient, **kwargs)
        )
    for got, expected in zip(*results, strict=True):
        torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)
    assert results[0][2].abs().sum() > 0 and results[0][3].abs().sum() > 0


def test_memory_efficient_equals_plain_in_eval_mode_and_partial_grads(device):
    branch = BRANCHES["mixing"](device).eval()
    x, mask = _inputs(device)
    out_weight, ld_weight = _upstream(device)
    for trainable in (True, False):
        branch.requires_grad_(trainable)
        for x_grad in (True, not trainable):
            grads = []
            for memory_efficient in (True, False):
                gen = torch.Generator(device=device).manual_seed(5)
                estimator = RouletteLogDet(memory_efficient=memory_efficient, generator=gen)
                xi = x.clone().requires_grad_(x_grad)
                out, logdet = estimator(branch, xi, mask)
                loss = (out * out_weight).sum() + (logdet * ld_weight).sum()
                inputs = [xi] if x_grad else []
                inputs += [p for p in branch.parameters() if p.requires_grad]
                grads.append(torch.autograd.grad(loss, inputs))
            for got, expected in zip(*grads, strict=True):
                torch.testing.assert_close(got, expected, atol=1e-10, rtol=0)


def _function_setup(device):
    torch.manual_seed(4)
    branch = MixingBranch(2, 0.6, max_len=3, device=device)
    x, mask = _inputs(device)
    gen = torch.Generator(device=device).manual_seed(0)
    probes = torch.randint(0, 2, (2 * 3, 3, 2), generator=gen, device=device).to(F64) * 2 - 1
    probes = probes * mask.repeat(2, 1)[..., None]
    c = RouletteLogDet("geometric").weights(3, 2)  # K = 5 terms, weights 1, 1, 1, 2, 4, 8
    coeffs = [(-1) ** (k + 1) / k * c[k] for k in range(1, len(c))]
    neumann_coeffs = [(-1) ** k * c_k for k, c_k in enumerate(c)]
    return branch, x, mask, probes, coeffs, neumann_coeffs


def test_function_gradcheck_branch_output(device):
    """gradcheck of the Function's g(x) output w.r.t. x and all parameters (float64)."""
    branch, x, mask, probes, coeffs, neumann_coeffs = _function_setup(device)
    params = list(branch.parameters())

    def outputs(t, *p):
        return NeumannLogDetFunction.apply(
            branch, None, mask, coeffs, neumann_coeffs, t, probes, *p
        )[0]

    assert torch.autograd.gradcheck(outputs, (x.requires_grad_(), *params))


@pytest.mark.parametrize("kind", ["mlp", "conv"])
def test_function_gradcheck_fast_path(device, kind):
    """gradcheck of g(x) through the linearization path, w.r.t. x and the effective parameters."""
    _, x, mask, probes, coeffs, neumann_coeffs = _function_setup(device)
    if kind == "mlp":
        mlp = LipschitzMLP((2, 5, 4, 2), coeff=0.9)
    else:
        mlp = TemporalConvBranch(2, 4, 3, coeff=0.9, max_len=3)
    mlp = mlp.to(device=device, dtype=F64).eval()
    linearization = type(mlp.linearize())
    params = [p.detach().clone().requires_grad_() for p in mlp.linearize().params]

    def outputs(t, *p):
        lin = linearization(list(p[:3]), list(p[3:6]), list(p[6:]))
        return NeumannLogDetFunction.apply(
            mlp, lin, mask, coeffs, neumann_coeffs, t, probes, *p
        )[0]

    assert torch.autograd.gradcheck(outputs, (x.requires_grad_(), *params))


def test_function_matches_frozen_surrogate_oracle(device):
    r"""Value = weighted Hutchinson series; backward = finite differences of
    sum(g * G) + sum_b w_b mean_p u_pb^T J(x_b) v_pb with u frozen (dense Jacobian oracle)."""
    branch, x, mask, probes, coeffs, neumann_coeffs = _function_setup(device)
    out_weight, ld_weight = _upstream(device)
    params = list(branch.parameters())
    batch, size = x.shape[0], x[0].numel()
    v = probes.reshape(2, batch, size)

    def dense_jacobian() -> torch.Tensor:
        return jacobian(lambda t, m: branch(t, m), x, mask)  # (B, ND, ND)

    jac = dense_jacobian()
    w, u, series = v, neumann_coeffs[0] * v, torch.zeros(2, batch, dtype=F64, device=device)
    for k in range(1, len(neumann_coeffs)):
        w = torch.einsum("pbi,bij->pbj", w, jac)  # w_k^T = w_{k-1}^T J
        series = series + coeffs[k - 1] * (w * v).sum(-1)
        u = u + neumann_coeffs[k] * w

    def frozen_objective() -> torch.Tensor:
        surrogate = torch.einsum("pbi,bij,pbj->pb", u, dense_jacobian(), v).mean(0)
        return (branch(x, mask) * out_weight).sum() + (surrogate * ld_weight).sum()

    xg = x.clone().requires_grad_()
    out, logdet = NeumannLogDetFunction.apply(
        branch, None, mask, coeffs, neumann_coeffs, xg, probes, *params
    )
    torch.testing.assert_close(out, branch(x, mask), atol=1e-14, rtol=0)
    torch.testing.assert_close(logdet, series.mean(0), atol=1e-12, rtol=0)
    loss = (out * out_weight).sum() + (logdet * ld_weight).sum()
    grads = torch.autograd.grad(loss, [xg, *params])
    expected = finite_difference_grad(frozen_objective, [x, *params])
    for got, exp in zip(grads, expected, strict=True):
        torch.testing.assert_close(got, exp, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("memory_efficient", [True, False])
@pytest.mark.parametrize("training", [True, False])
def test_scaled_identity_gradient_closed_form(device, memory_efficient, training):
    r"""J = c I, Rademacher probes: d s_b / dc = d_b \sum_{k=0}^{K} (-c)^k c_k, d s / dx = 0."""
    c = -0.45
    branch = ScaleBranch(c, device=device).train(training)
    x, mask = _inputs(device)
    _, ld_weight = _upstream(device)
    dims = mask.sum(1).to(F64) * x.shape[-1]
    kwargs = {"distribution": "poisson", "memory_efficient": memory_efficient}
    for seed in range(4):
        gen = torch.Generator(device=device).manual_seed(seed)
        xg = x.clone().requires_grad_()
        _, logdet = RouletteLogDet(**kwargs, generator=gen)(branch, xg, mask)
        grad_x, grad_c = torch.autograd.grad(
            (logdet * ld_weight).sum(), [xg, branch.c], materialize_grads=True
        )
        twin = RouletteLogDet(**kwargs, generator=torch.Generator(device=device).manual_seed(seed))
        weights = twin.weights(twin.sample_count(), 2 if training else 20)
        neumann = sum((-c) ** k * c_k for k, c_k in enumerate(weights))
        torch.testing.assert_close(grad_c, (ld_weight * dims).sum() * neumann)
        assert grad_x.abs().max() == 0


def test_backprop_through_estimator_without_neumann(device):
    r"""neumann_gradient=False: the gradient is that of the estimate,
    d/dc \sum_k a_k d c^k = d \sum_k k a_k c^{k-1}."""
    c = 0.4
    branch = ScaleBranch(c, device=device)
    x, mask = _inputs(device)
    dims = mask.sum(1).to(F64) * x.shape[-1]
    gen = torch.Generator(device=device).manual_seed(9)
    estimator = RouletteLogDet(neumann_gradient=False, generator=gen)
    _, logdet = estimator(branch, x, mask)
    (grad_c,) = torch.autograd.grad(logdet.sum(), [branch.c])
    twin = RouletteLogDet(generator=torch.Generator(device=device).manual_seed(9))
    weights = twin.weights(twin.sample_count(), 2)
    slope = sum((-1) ** (k + 1) * weights[k] * c ** (k - 1) for k in range(1, len(weights)))
    torch.testing.assert_close(grad_c, dims.sum() * slope)


def test_no_graph_without_grad(device):
    branch = BRANCHES["mixing"](device)
    x, mask = _inputs(device)
    with torch.no_grad():
        out, logdet = RouletteLogDet()(branch, x.requires_grad_(), mask)
    assert not out.requires_grad and not logdet.requires_grad
    branch.requires_grad_(False)
    out, logdet = RouletteLogDet()(branch, x.detach(), mask)
    assert not out.requires_grad and not logdet.requires_grad
    with torch.no_grad():
        v = torch.ones(3, 3, 2, dtype=F64, device=device)
        out, logdet = neumann_logdet(branch, x, mask, v, [1.0], [1.0, -1.0], memory_efficient=False)
    assert not logdet.requires_grad


def _neumann_gradient_error(distribution, probe, calls, device):
    """Relative error of the mean Neumann gradient (x and parameters) vs autograd of slogdet."""
    torch.manual_seed(1)
    branch = MixingBranch(2, 0.5, max_len=3, device=device).train()
    x, mask = _inputs(device)
    x.requires_grad_()
    params = list(branch.parameters())
    exact = jacobian_logdet(lambda t, m: t + branch(t, m), x, mask, create_graph=True)
    weights = torch.tensor([0.7, -1.3, 2.1], dtype=F64, device=device)
    reference = torch.autograd.grad((exact * weights).sum(), [x, *params])
    reference = torch.cat([g.flatten() for g in reference])
    gen = torch.Generator(device=device).manual_seed(0)
    estimator = RouletteLogDet(distribution, n_probes=16, probe=probe, generator=gen)
    total = torch.zeros_like(reference)
    for _ in range(calls):
        _, logdet = estimator(branch, x, mask)
        grads = torch.autograd.grad((logdet * weights).sum(), [x, *params], materialize_grads=True)
        total += torch.cat([g.flatten() for g in grads])
    return ((total / calls - reference).norm() / reference.norm()).item()


@pytest.mark.parametrize(
    ("distribution", "probe"), [("geometric", "rademacher"), ("poisson", "gaussian")]
)
def test_neumann_gradient_is_unbiased(device, distribution, probe):
    """H13 (fast): mean surrogate gradient within 10% of the exact log-det gradient."""
    assert _neumann_gradient_error(distribution, probe, 150, device) < 0.1


@pytest.mark.slow
@pytest.mark.parametrize("distribution", ["geometric", "poisson"])
@pytest.mark.parametrize("probe", ["rademacher", "gaussian"])
def test_neumann_gradient_is_unbiased_many_draws(device, distribution, probe):
    """H13: with 4000 calls the mean surrogate gradient is within 3% of the exact gradient."""
    assert _neumann_gradient_error(distribution, probe, 4000, device) < 0.03
