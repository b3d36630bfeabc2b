"""The length limit of a certificate is enforced on every path (docs/math.md#temporal-conv).

A temporal convolution branch is certified on sequences of length ``N <= max_len`` only: the
bound of its whole operator is that of the circular embedding of period ``max_len + k - 1``
(docs/math.md#temporal-conv), and a longer sequence can have a Jacobian of norm above the
certificate. Every entry point rejects such sequences with a ``ValueError`` naming ``max_len``
and ``N``, from the sequence's shape alone; branches without a limit are not affected.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from nflows.distributions import StandardNormal
from nflows.flows import Flow

from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.logdet.series import SeriesLogDet
from iresflow.models.flow import SequenceFlow
from iresflow.nn.attention import ContractiveL2MultiheadAttention
from iresflow.nn.conditional import ConditionalBranch
from iresflow.nn.conv import SpectralConv1d, TemporalConvBranch
from iresflow.nn.diagnostics import jacobian_norm
from iresflow.nn.mlp import LipschitzMLP
from iresflow.nn.positional import PositionalBranch, SinusoidalPositionalEncoding
from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.composite import SequenceCompositeTransform
from iresflow.transforms.residual import ResidualTransform

F64 = torch.float64
MAX_LEN = 4
TOO_LONG = rf"N={MAX_LEN + 1} exceeds max_len={MAX_LEN}"
ESTIMATORS = [ExactLogDet(), SeriesLogDet(n_terms=3), RouletteLogDet()]


def _conv(device) -> TemporalConvBranch:
    return TemporalConvBranch(2, 6, kernel_size=3, coeff=0.9, max_len=MAX_LEN).to(device, F64)


def _long(device, batch: int = 3) -> torch.Tensor:
    return torch.randn(batch, MAX_LEN + 1, 2, device=device, dtype=F64)


def _unchecked(branch: TemporalConvBranch):
    """The branch's map without the length check (an oracle), from its effective taps."""
    with torch.no_grad():
        taps = [(layer.weight_normalized(), layer.bias, layer.kernel_size // 2)
                if isinstance(layer, SpectralConv1d) else layer for layer in branch.net]

    def g(x: torch.Tensor) -> torch.Tensor:
        h = x.transpose(1, 2)
        for layer in taps:
            h = F.conv1d(h, *layer[:2], padding=layer[2]) if isinstance(layer, tuple) else layer(h)
        return h.transpose(1, 2)

    return g


def test_beyond_max_len_the_certificate_fails():
    """Why the limit exists: taps whose frequency response peaks between the frequencies of the
    circular embedding for max_len = 2 (period 6) have a Jacobian of 2-norm above the
    certificate on a sequence of 64 frames, and agree with the branch up to max_len."""
    branch = TemporalConvBranch(1, 1, kernel_size=5, coeff=0.9, max_len=2).double().eval()
    with torch.no_grad():
        for layer in branch.net[::2]:
            layer.weight.copy_(torch.tensor([1.0, 0.0, -1.0, 0.0, 1.0]).view(1, 1, -1)
                               if layer.kernel_size == 5 else torch.ones(1, 1, 1))
            layer.bias.fill_(10.0)  # LipSwish in its linear regime
    x, unchecked = torch.zeros(1, 64, 1, dtype=F64), _unchecked(branch)
    with torch.no_grad():
        assert torch.allclose(unchecked(x[:, :2]), branch(x[:, :2]), atol=1e-12)
        assert float(branch.lipschitz_constant()) <= 0.9 + 1e-12
        assert float(jacobian_norm(unchecked, x, "2")) > 1.0
    with pytest.raises(ValueError, match="max_len=2"):
        branch.linearize().at(x)


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
@pytest.mark.parametrize("grad", [True, False], ids=["grad", "no-grad"])
def test_estimators_reject_long_sequences(device, estimator, grad):
    branch = _conv(device).train(grad)
    with torch.set_grad_enabled(grad), pytest.raises(ValueError, match=TOO_LONG):
        estimator(branch, _long(device))


def test_linearization_rejects_long_sequences(device):
    lin = _conv(device).linearize()
    with pytest.raises(ValueError, match=TOO_LONG):
        lin.at(_long(device))
    assert lin.at(_long(device)[:, :MAX_LEN]).output.shape == (3, MAX_LEN, 2)


@pytest.mark.parametrize("logdet", ["exact", "series", "roulette"])
def test_residual_transform_and_chain_reject_long_sequences(device, logdet):
    block = ResidualTransform(_conv(device), logdet=logdet)
    chain = SequenceCompositeTransform([ActNorm(2), block]).to(device, F64).eval()
    x, mask = _long(device), torch.ones(3, MAX_LEN + 1, dtype=torch.bool, device=device)
    for call in (block, block.inverse, chain, chain.inverse):
        for m in (None, mask):
            with pytest.raises(ValueError, match=TOO_LONG):
                call(x, mask=m)
            with pytest.raises(ValueError, match=TOO_LONG):
                call(x, mask=m, logdet=False)


def test_conditional_branch_keeps_the_limit(device):
    branch = ConditionalBranch(_conv(device), context_features=2).to(device, F64)
    block = ResidualTransform(branch, logdet="roulette")
    context = torch.randn(3, 2, device=device, dtype=F64)
    assert branch.max_len == MAX_LEN
    for call in (block, block.inverse):
        with pytest.raises(ValueError, match=TOO_LONG):
            call(_long(device), context)


@pytest.mark.parametrize("logdet", ["exact", "roulette"])
def test_flows_reject_long_sequences(device, logdet):
    """nflows' Flow around the chain (float32, its base's dtype), and a SequenceFlow without a
    max_len of its own."""
    chain = SequenceCompositeTransform([ResidualTransform(_conv(device), logdet=logdet)])
    flow = Flow(chain.float(), StandardNormal([MAX_LEN + 1, 2])).to(device).eval()
    with pytest.raises(ValueError, match=TOO_LONG):
        flow.log_prob(_long(device).float())
    with pytest.raises(ValueError, match=TOO_LONG):
        flow.sample(2)
    model = SequenceFlow(chain, features=2).to(device, F64).eval()
    with pytest.raises(ValueError, match=TOO_LONG):
        model.log_prob(_long(device), method=logdet)
    with pytest.raises(ValueError, match=TOO_LONG):
        model.sample(2, seq_len=MAX_LEN + 1)
    assert model.log_prob(_long(device)[:, :MAX_LEN], method=logdet).shape == (3,)


@pytest.mark.parametrize("kind", ["mlp", "attention"])
def test_branches_without_a_limit_take_any_length(device, kind):
    if kind == "mlp":
        branch = LipschitzMLP((2, 8, 2), coeff=0.9)
    else:
        branch = PositionalBranch(ContractiveL2MultiheadAttention(2, 1, coeff=0.9),
                                  SinusoidalPositionalEncoding(2))
    branch = branch.to(device, F64)
    assert branch.max_len is None
    x = torch.randn(2, 100, 2, device=device, dtype=F64)
    if kind == "mlp":
        assert torch.allclose(branch.linearize().at(x).output, branch(x))
    for estimator in ESTIMATORS[1:]:
        assert estimator(branch, x)[1].shape == (2,)
    block = ResidualTransform(branch, logdet="roulette").eval()
    y, _ = block(x)
    assert torch.allclose(block.inverse(y)[0], x, atol=1e-8)
