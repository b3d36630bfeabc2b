"""Cross-check ResidualTransform against normflows' ``Residual(LipschitzMLP)`` with equal weights.

normflows' net is ``Swish -> InducedNormLinear -> Swish -> InducedNormLinear`` with the spectral
normalisation applied through stored power-iteration vectors. We copy its *effective* weights
(``compute_weight(update=False)``, exactly what its forward uses) into our
:class:`~iresflow.nn.linear.SpectralLinear` layers, whose bound ``coeff`` is then not binding, and
its Swish slope into our :class:`~iresflow.nn.activations.LipSwish`. normflows' ``Residual``
(``reverse=True``) maps noise to data in ``forward``; its ``inverse`` is the residual map
:math:`x \\mapsto x + g(x)` with :math:`+\\log\\det(I + J_g)`, i.e. our ``forward``.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from iresflow.nn.activations import LipSwish
from iresflow.nn.base import LipschitzBranch
from iresflow.nn.linear import SpectralLinear
from iresflow.nn.mlp import LipschitzMLP
from iresflow.transforms.residual import ResidualTransform

nf = pytest.importorskip("normflows")

F64 = torch.float64


class SwishFirstMLP(LipschitzBranch):
    """normflows' layout from our components: ``LipSwish`` followed by a ``LipschitzMLP``."""

    position_wise = True
    norm = "2"

    def __init__(self, dims: list[int]) -> None:
        super().__init__()
        self.act = LipSwish()
        self.mlp = LipschitzMLP(dims, coeff=0.999)
        self.features = dims[0]

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return self.mlp(self.act(x), mask)

    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        return self.mlp.lipschitz_constant()


def normflows_pair(dims: list[int], lipschitz_const: float, **residual_kwargs):
    """A float64 normflows ``Residual`` and our block with identical effective weights."""
    net = nf.nets.LipschitzMLP(dims, lipschitz_const=lipschitz_const, init_zeros=False)
    theirs = nf.flows.Residual(net.double(), reverse=True, **residual_kwargs)
    branch = SwishFirstMLP(dims).double().eval()
    their_linears = [m for m in net.modules() if isinstance(m, nf.nets.lipschitz.InducedNormLinear)]
    their_swishes = [m for m in net.modules() if isinstance(m, nf.nets.lipschitz.Swish)]
    our_linears = [m for m in branch.modules() if isinstance(m, SpectralLinear)]
    our_swishes = [m for m in branch.modules() if isinstance(m, LipSwish)]
    assert len(their_linears) == len(our_linears) and len(their_swishes) == len(our_swishes)
    with torch.no_grad():
        for layer in their_linears:
            # scaling keeps the power-iteration vectors exact, so normflows' normalisation binds:
            # every effective weight has spectral norm lipschitz_const
            layer.weight.mul_(10.0)
        for theirs_lin, ours_lin in zip(their_linears, our_linears, strict=True):
            ours_lin.weight.copy_(theirs_lin.compute_weight(update=False))
            ours_lin.bias.copy_(theirs_lin.bias)
        for theirs_act, ours_act in zip(their_swishes, our_swishes, strict=True):
            ours_act.beta_raw.copy_(theirs_act.beta.reshape(()))
    # the copied weights satisfy the bound, so our normalisation leaves them unchanged
    for layer in our_linears:
        assert torch.equal(layer.weight_normalized(), layer.weight)
    return theirs, ResidualTransform(branch, logdet="exact")


def tight_normflows_inverse(theirs, z: Tensor) -> Tensor:
    """normflows' own fixed-point loop with its (squared) tolerance pushed to |step| < 1e-11."""
    with torch.no_grad():
        return theirs.iresblock._inverse_fixed_point(z, atol=1e-22, rtol=0.0)


def test_brute_force_two_dimensional():
    # normflows computes the 2 x 2 determinant in closed form (brute_force=True)
    theirs, ours = normflows_pair([2, 32, 2], 0.97, brute_force=True)
    x = torch.randn(64, 2, dtype=F64)
    y_theirs, logdet_theirs = theirs.inverse(x)
    y_ours, logdet_ours = ours(x)
    assert torch.allclose(y_ours, y_theirs.detach(), atol=1e-12, rtol=0)
    assert torch.allclose(logdet_ours, logdet_theirs.detach(), atol=1e-12, rtol=0)

    x_theirs = tight_normflows_inverse(theirs, y_ours)
    x_ours, inverse_logdet_ours = ours.inverse(y_ours)
    assert torch.allclose(x_ours, x_theirs, atol=1e-8, rtol=0)
    assert torch.allclose(x_ours, x, atol=1e-9, rtol=0)
    # normflows' noise -> data direction returns -log det(I + J_g) at the inverse
    _, logdet_at_x = theirs.iresblock._logdetgrad(x_theirs)
    assert torch.allclose(inverse_logdet_ours, -logdet_at_x.view(-1).detach(), atol=1e-10, rtol=0)


def test_exact_trace_series_four_dimensional():
    # exact traces with a long truncated series (training mode: all weights 1); at
    # lip(g) <= 0.9^2 the truncation error after 150 terms is below 1e-12
    theirs, ours = normflows_pair([4, 16, 4], 0.9, exact_trace=True, n_power_series=150)
    theirs.train()
    x = torch.randn(16, 4, dtype=F64)
    y_theirs, logdet_theirs = theirs.inverse(x)
    y_ours, logdet_ours = ours(x)
    assert torch.allclose(y_ours, y_theirs.detach(), atol=1e-12, rtol=0)
    assert torch.allclose(logdet_ours, logdet_theirs.detach(), atol=1e-12, rtol=0)
    x_ours, _ = ours.inverse(y_ours)
    assert torch.allclose(x_ours, tight_normflows_inverse(theirs, y_ours), atol=1e-8, rtol=0)


def test_normflows_default_inverse_tolerance_is_loose():
    # normflows stops when (x - x_prev)^2 < 1e-5 (1 + |y|): steps of ~3e-3, not 1e-5
    theirs, ours = normflows_pair([2, 32, 2], 0.97, brute_force=True)
    x = 3 * torch.randn(64, 2, dtype=F64)
    y, _ = ours(x)
    with torch.no_grad():
        x_theirs, _ = theirs.forward(y)
    x_ours, _ = ours.inverse(y)
    assert float((x_ours - x).abs().max()) < 1e-9
    assert float((x_theirs.detach() - x).abs().max()) > 1e-8
