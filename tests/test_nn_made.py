"""The masked MLP over a frame's features (docs/math.md#autoregressive-step)."""

from __future__ import annotations

import pytest
import torch

from iresflow.nn.made import MaskedFrameNet

F64 = torch.float64


@pytest.mark.parametrize("reverse", [False, True])
@pytest.mark.parametrize("features", [1, 3, 5])
def test_each_output_reads_the_context_and_the_features_before_it_only(device, features,
                                                                       reverse):
    # The autograd Jacobian with respect to the frame is zero wherever the order forbids a
    # dependence and nonzero elsewhere once the weights have moved from their start.
    torch.manual_seed(0)
    net = MaskedFrameNet(features, 4, hidden=16, reverse=reverse).to(device=device, dtype=F64)
    with torch.no_grad():
        net.output.weight.normal_()
    x = torch.randn(features, dtype=F64, device=device)
    h = torch.randn(4, dtype=F64, device=device)
    jac = torch.autograd.functional.jacobian(lambda v: net(v, h), x).view(2, features, features)
    place = torch.arange(features, device=device)
    place = place.flip(0) if reverse else place  # place[d]: feature d's place in the order
    allowed = place[None, :] < place[:, None]  # output d reads input e: e comes before d
    assert torch.equal(jac[:, ~allowed], torch.zeros_like(jac[:, ~allowed]))
    assert bool((jac[:, allowed].abs() > 0).all())
    context_jac = torch.autograd.functional.jacobian(lambda c: net(x, c), h)
    assert bool((context_jac.abs().sum(-1) > 0).all())  # every output reads the context


def test_starts_at_zero_and_given_equals_forward(device):
    net = MaskedFrameNet(3, 2, hidden=8).to(device=device, dtype=F64)
    x = torch.randn(4, 5, 3, dtype=F64, device=device)
    h = torch.randn(4, 5, 2, dtype=F64, device=device)
    assert torch.equal(net(x, h), torch.zeros(4, 5, 6, dtype=F64, device=device))
    with torch.no_grad():
        net.output.weight.normal_()
    assert torch.equal(net.given(h)(x), net(x, h))


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [({"features": 0}, ValueError), ({"context_features": 0}, ValueError),
     ({"hidden": 0}, ValueError), ({"outputs": 0}, ValueError), ({"features": 1.5}, TypeError)],
)
def test_bad_options_raise(kwargs, error):
    options = {"features": 3, "context_features": 2} | kwargs
    with pytest.raises(error):
        MaskedFrameNet(**options)
