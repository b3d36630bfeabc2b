"""Linearization fast path of the log-det engines (docs/math.md#neumann-gradient, checks H13,
H14 (docs/math.md#checks)).

The fast path (:meth:`iresflow.nn.base.LipschitzBranch.linearize`, used by the memory-efficient
Neumann Function and by graph-free estimates) must give the values, gradients and buffer states
of the autograd path. The oracle is the same branch with the hook switched off (``linearize``
returning ``None``), which runs the engine's autograd code: the memory-efficient double backward
or the plain path that keeps the surrogate's graph.
"""

from __future__ import annotations

import pytest
import torch
from oracles import ScaleBranch

from iresflow.logdet.roulette import RouletteLogDet
from iresflow.nn.conditional import ConditionalBranch
from iresflow.nn.conv import TemporalConvBranch
from iresflow.nn.mlp import LipschitzMLP

F64 = torch.float64


class AutogradMLP(LipschitzMLP):
    """``LipschitzMLP`` without its linearization: the engines fall back to autograd."""

    def linearize(self, shift=None):
        return None


class AutogradConv(TemporalConvBranch):
    """``TemporalConvBranch`` without its linearization."""

    def linearize(self, shift=None):
        return None


def _build(kind: str, fast: bool):
    """Branch kinds: ``"2"``/``"inf"`` (MLP norms), ``"conv"`` (kernel 3: radius 2),
    ``"causal-conv"`` (kernel 2, causal) and their variants dilated by 2 (radius 4)."""
    cls = TemporalConvBranch if fast else AutogradConv
    dilation = 2 if kind.startswith("dilated-") else 1
    if kind.removeprefix("dilated-") == "conv":
        return cls(3, 5, 3, coeff=0.9, max_len=4, dilation=dilation)
    if kind.removeprefix("dilated-") == "causal-conv":
        return cls(3, 5, 2, coeff=0.9, max_len=4, causal=True, dilation=dilation)
    return (LipschitzMLP if fast else AutogradMLP)((3, 8, 6, 3), coeff=0.9, norm=kind)


def _pair(norm: str, device: torch.device, training: bool) -> tuple[torch.nn.Module, ...]:
    fast = _build(norm, True).to(device=device, dtype=F64)
    with torch.no_grad():  # weights beyond the bound, so the rescaling is active
        for p in fast.parameters():
            p.mul_(3.0)
    slow = _build(norm, False).to(device=device, dtype=F64)
    slow.load_state_dict(fast.state_dict())
    return fast.train(training), slow.train(training)


def _inputs(device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(3, 4, 3, dtype=F64, device=device)
    mask = torch.tensor(
        [[True, True, True, True], [True, True, False, False], [False, True, True, True]],
        device=device,
    )
    return x, mask


def _run(branch, x, mask, seed, extra=(), **kwargs):
    """Values, gradients of a loss with non-uniform upstream weights (w.r.t. ``x``, the
    branch's parameters and ``extra``), and buffers afterwards."""
    gen = torch.Generator(device=x.device).manual_seed(seed)
    out_weight = torch.randn(x.shape, dtype=F64, device=x.device, generator=gen)
    ld_weight = torch.tensor([0.7, -1.3, 2.1], dtype=F64, device=x.device)
    x = x.clone().requires_grad_()
    estimator = RouletteLogDet(probe="gaussian", generator=gen, **kwargs)
    out, logdet = estimator(branch, x, mask)
    loss = (out * out_weight).sum() + (logdet * ld_weight).sum()
    grads = torch.autograd.grad(loss, [x, *branch.parameters(), *extra])
    return [out.detach(), logdet.detach(), *grads, *[b.clone() for b in branch.buffers()]]


@pytest.mark.parametrize(
    "norm", ["2", "inf", "conv", "causal-conv", "dilated-conv", "dilated-causal-conv"]
)
@pytest.mark.parametrize("reference_memory_efficient", [True, False])
@pytest.mark.parametrize("n_probes", [1, 3])
@pytest.mark.parametrize("masked", [False, True])
def test_fast_path_equals_autograd(device, norm, reference_memory_efficient, n_probes, masked):
    """Identical log-det, output, x/parameter gradients and buffer states (training mode)."""
    fast, slow = _pair(norm, device, training=True)
    x, mask = _inputs(device)
    mask = mask if masked else None
    kwargs = {"n_probes": n_probes, "n_exact_terms": 4}
    ours = _run(fast, x, mask, 5, memory_efficient=True, **kwargs)
    reference = _run(slow, x, mask, 5, memory_efficient=reference_memory_efficient, **kwargs)
    assert len(ours) == len(reference)
    for a, b in zip(ours, reference, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    assert ours[1].abs().min() > 1e-3  # a non-trivial estimate
    if masked:
        assert (ours[0][~mask] == 0).all() and (ours[2][~mask] == 0).all()


@pytest.mark.parametrize("kind", ["2", "conv", "causal-conv", "dilated-causal-conv"])
@pytest.mark.parametrize("reference_memory_efficient", [True, False])
@pytest.mark.parametrize("masked", [False, True])
def test_conditional_fast_path_equals_autograd(device, kind, reference_memory_efficient, masked):
    """A conditional branch bound to a context (docs/math.md#conditional-branches): the shift
    enters the linearization, and the gradients reach the context network and the context."""
    fast, slow = _pair(kind, device, training=True)
    x, mask = _inputs(device)
    mask = mask if masked else None
    results = []
    for branch, memory_efficient in ((fast, True), (slow, reference_memory_efficient)):
        torch.manual_seed(0)
        conditional = ConditionalBranch(branch, context_features=2, context_hidden=4)
        conditional = conditional.to(device=device, dtype=F64)
        with torch.no_grad():
            for p in conditional.context_net.parameters():
                p.copy_(torch.randn_like(p))
        leaf = torch.linspace(-1.0, 1.0, 6, dtype=F64, device=device).view(3, 2).requires_grad_()
        bound = conditional.bind(torch.tanh(3 * leaf))
        assert (bound.linearize() is not None) == (branch is fast)
        extra = [*conditional.context_net.parameters(), leaf]
        results.append(_run(bound, x, mask, 5, memory_efficient=memory_efficient, n_probes=2,
                            n_exact_terms=4, extra=extra))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
    first = 3 + len(list(bound.parameters()))  # value, log-det, x, then the parameters
    assert all(g.abs().sum() > 0 for g in results[0][first : first + len(extra)])


@pytest.mark.parametrize("kind", ["2", "conv"])
@pytest.mark.parametrize("reference_memory_efficient", [True, False])
def test_fast_path_twice_before_backward(device, kind, reference_memory_efficient):
    """Two forwards, then the backward of the first: the recomputation sees the first's weights."""
    fast, slow = _pair(kind, device, training=True)
    x, _ = _inputs(device)
    results = []
    for branch, memory_efficient in ((fast, True), (slow, reference_memory_efficient)):
        estimator = RouletteLogDet(
            generator=torch.Generator(device=device).manual_seed(2),
            memory_efficient=memory_efficient,
        )
        xg = x.clone().requires_grad_()
        _, logdet = estimator(branch, xg)
        estimator(branch, x)  # advances the power iteration once more
        grads = torch.autograd.grad(
            logdet.sum(), [xg, *branch.parameters()], allow_unused=True, materialize_grads=True
        )
        results.append([*grads, *[b.clone() for b in branch.buffers()]])
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("norm", ["2", "inf", "conv"])
def test_fast_path_without_graph(device, norm):
    """Evaluation without a graph (Hutchinson chain through ``linearize``) equals autograd."""
    fast, slow = _pair(norm, device, training=False)
    x, mask = _inputs(device)
    values = []
    for branch in (fast, slow):
        gen = torch.Generator(device=device).manual_seed(7)
        with torch.no_grad():
            values.append(RouletteLogDet(n_probes=2, generator=gen)(branch, x, mask))
    for a, b in zip(*values, strict=True):
        assert not a.requires_grad
        torch.testing.assert_close(a, b, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kind", ["2", "conv"])
def test_fast_path_frozen_parameters(device, kind):
    """Only x requires grad: the fast backward still gives the autograd input gradient."""
    fast, slow = _pair(kind, device, training=True)
    for branch in (fast, slow):
        branch.requires_grad_(False)
    x, mask = _inputs(device)
    grads = []
    for branch in (fast, slow):
        xg = x.clone().requires_grad_()
        _, logdet = RouletteLogDet(generator=torch.Generator(device=device).manual_seed(1))(
            branch, xg, mask
        )
        grads.append(torch.autograd.grad(logdet.sum(), xg)[0])
    torch.testing.assert_close(grads[0], grads[1], rtol=0, atol=1e-12)
    assert grads[0].abs().max() > 0


@pytest.mark.parametrize("kind", ["2", "conv", "causal-conv"])
def test_linearization_products(device, kind):
    """``output``/``vjp`` (also of ``at``) against the forward and ``torch.func.vjp``, masked."""
    branch = _pair(kind, device, training=False)[0]
    x, mask = _inputs(device)
    w = torch.randn(x.shape, dtype=F64, device=device)
    lin = branch.linearize()
    for z in (x, 2 * x):
        point = lin.at(z, mask)
        out, pullback = torch.func.vjp(lambda y: branch(y, mask), z)
        torch.testing.assert_close(point.output, out, rtol=0, atol=1e-14)
        torch.testing.assert_close(point.vjp(w), pullback(w)[0], rtol=0, atol=1e-14)


def test_branch_without_hook_uses_autograd(device):
    """A branch without ``linearize`` keeps working: d/dw log(1 + w) = 1 / (1 + w)."""
    branch = ScaleBranch(0.4, device=device)
    assert branch.linearize() is None
    x = torch.zeros(2, 3, 1, dtype=F64, device=device)
    estimator = RouletteLogDet(n_exact_terms=60, generator=torch.Generator().manual_seed(0))
    _, logdet = estimator(branch, x)
    (grad,) = torch.autograd.grad(logdet.sum(), [next(branch.parameters())])
    expected = 2 * 3 / (1 + 0.4)  # two sequences of three tokens
    torch.testing.assert_close(
        grad, torch.tensor(expected, dtype=F64, device=device), atol=1e-6, rtol=0
    )


@pytest.mark.parametrize("kind", ["2", "inf", "conv", "causal-conv", "dilated-causal-conv"])
@pytest.mark.parametrize("shifted", [False, True])
def test_solve_map_equals_the_branch(device, kind, shifted):
    """What a fixed-point solve evaluates (``solve_map``): the linearization's value with every
    LipSwish folded into the layers around it equals the branch and ``at(x).output``, masked,
    with a shift, and on a sub-batch of rows (the solver's running samples)."""
    branch = _pair(kind, device, training=False)[0]
    assert branch.solves_linearized
    slopes = [float(m.beta) for m in branch.modules() if hasattr(m, "beta_raw")]
    assert slopes and all(abs(b - 1) > 0.5 for b in slopes)  # folding the slopes matters
    x, mask = _inputs(device)
    shift = (torch.randn(3, branch.shift_features, dtype=F64, device=device) if shifted
             else None)
    lin = branch.linearize(shift)
    for z, m in ((x, mask), (2 * x, None)):
        expected = branch(z, m, shift=shift)
        torch.testing.assert_close(lin.evaluate(z, m), expected, rtol=0, atol=1e-12)
        torch.testing.assert_close(lin.at(z, m).output, expected, rtol=0, atol=1e-12)
    if not shifted:
        rows = torch.tensor([0, 2], device=device)
        solve = branch.solve_map()
        torch.testing.assert_close(solve(x[rows], mask[rows]), branch(x[rows], mask[rows]),
                                   rtol=0, atol=1e-12)


def test_solve_map_of_a_branch_without_it_is_the_branch(device):
    """A branch that does not declare ``solves_linearized`` is evaluated itself."""
    branch = ScaleBranch(0.4, device=device)
    assert branch.solve_map() is branch
