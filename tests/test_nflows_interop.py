"""The model's transform inside nflows' own Flow, CompositeTransform and InverseTransform."""

from __future__ import annotations

import pytest
import torch
from nflows.distributions import StandardNormal
from nflows.flows import Flow
from nflows.transforms import CompositeTransform, InverseTransform

from iresflow.models.residual_flow import ResidualSequenceFlow


@pytest.mark.parametrize("attention", ["l2", "lipschitznorm"])
def test_flow_trains_and_samples_on_fixed_length_data(device, dtype, attention):
    n, d = 3, 2
    model = ResidualSequenceFlow(features=d, n_blocks=1, hidden=8, max_len=n,
                                    attention=attention, logdet="exact", base="normal")
    model = model.to(device=device, dtype=dtype)
    flow = Flow(model.transform, StandardNormal([n, d])).to(device=device, dtype=dtype)
    # Correlated, non-standard data: consecutive tokens share a component.
    base = torch.randn(64, n + 1, d, device=device, dtype=dtype)
    data = 2.0 * (base[:, 1:] + 0.8 * base[:, :-1]) + 1.0

    def exact_nll() -> float:
        flow.eval()
        with torch.no_grad():
            value = -flow.log_prob(data).mean().item()
        flow.train()
        return value

    model.transform.initialize(data[:32])  # data-dependent ActNorm initialisation
    before = exact_nll()
    torch.testing.assert_close(flow.log_prob(data[:4]).detach(),
                               model.log_prob(data[:4]).detach())
    optimiser = torch.optim.Adam(flow.parameters(), lr=1e-2)
    for _ in range(15):
        optimiser.zero_grad()
        flow.log_prob(data).mean().neg().backward()
        optimiser.step()
    after = exact_nll()
    assert after < before - 0.05

    flow.eval()
    # nflows' StandardNormal draws its noise in the default dtype.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        samples = flow.sample(7)
    finally:
        torch.set_default_dtype(previous)
    assert samples.shape == (7, n, d) and bool(torch.isfinite(samples).all())
    noise = flow.transform_to_noise(samples)
    assert noise.shape == (7, n, d)


def test_inverse_then_forward_is_identity_with_zero_logdet(device, dtype):
    model = ResidualSequenceFlow(features=2, n_blocks=2, hidden=8, max_len=4, logdet="exact")
    model = model.to(device=device, dtype=dtype)
    x = torch.randn(5, 4, 2, device=device, dtype=dtype) * 2 + 1
    model.transform.initialize(x)  # initialise the ActNorms
    transform = model.eval().transform
    y, logdet = CompositeTransform([InverseTransform(transform), transform])(x)
    tol = 1e-8 if dtype == torch.float64 else 1e-4
    torch.testing.assert_close(y, x, atol=tol, rtol=tol)
    torch.testing.assert_close(logdet, torch.zeros_like(logdet), atol=tol, rtol=0)
    # The other order as well: forward, then inverse.
    y, logdet = CompositeTransform([transform, InverseTransform(transform)])(x)
    torch.testing.assert_close(y, x, atol=tol, rtol=tol)
    torch.testing.assert_close(logdet, torch.zeros_like(logdet), atol=tol, rtol=0)
