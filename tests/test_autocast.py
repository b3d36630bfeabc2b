"""Mixed precision and dtype following (issue 7, "Device handling").

Under ``torch.autocast("cpu", dtype=torch.bfloat16)`` the branches run their matrix products in
bfloat16, but every log-determinant (``slogdet``, sums of series terms, ActNorm's sum of
log-scales, the base log-density and the sums over steps) must accumulate in at least float32:
the returned log-densities and log-determinants are float32, finite, close to the float32 values
without autocast, and differentiable. A float64 model with float64 inputs stays float64 (also
under autocast), so every tensor created inside (probes, masks, base log-density) follows the
input's dtype.

Tolerance: bfloat16 keeps 8 significant bits (unit roundoff :math:`u = 2^{-8} \\approx 3.9
\\times 10^{-3}`). The branch evaluations (and so the Jacobian entries and vector-Jacobian
products) carry relative errors of a few :math:`u`; to first order a log-det changes by
:math:`\\operatorname{tr}((I + J)^{-1}\\,\\delta J)`, at most about :math:`u` per real coordinate
for a contractive branch (:math:`\\|J\\| < 1`). We compare with ``rtol = 5e-2`` (about 13
:math:`u`) on the log-det sums plus ``atol = u N D`` (one roundoff per coordinate). Measured
deviations are about ten times smaller; a log-det returned in bfloat16 fails the dtype checks.
"""

from __future__ import annotations

import pytest
import torch

from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.logdet.series import SeriesLogDet
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.nn.mlp import LipschitzMLP
from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.residual import ResidualTransform

B, N, D = 2, 3, 4
RTOL = 5e-2
ATOL = 2.0**-8 * N * D
BF16 = torch.bfloat16


def inputs(device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(B, N, D, device=device, dtype=dtype)
    mask = torch.tensor([[True] * N, [True] * (N - 1) + [False]], device=device)
    return x, mask


def autocast(device: torch.device) -> torch.autocast:
    return torch.autocast(device.type, dtype=BF16)


def assert_grads_finite(module: torch.nn.Module) -> None:
    grads = [p.grad for p in module.parameters() if p.requires_grad]
    assert grads and all(g is not None for g in grads)
    assert all(bool(torch.isfinite(g).all()) for g in grads)
    assert any(bool((g != 0).any()) for g in grads)


def estimator(name: str):
    """A fresh estimator; the stochastic ones draw from a generator seeded identically each time."""
    if name == "exact":
        return ExactLogDet()
    gen = torch.Generator().manual_seed(3)
    if name == "series":
        return SeriesLogDet(n_terms=8, n_probes=2, generator=gen)
    if name == "roulette-graph":  # Neumann gradient through the kept graph
        return RouletteLogDet(n_probes=2, memory_efficient=False, generator=gen)
    if name == "roulette-plain":  # backpropagation through the whole estimator
        return RouletteLogDet(n_probes=2, neumann_gradient=False, generator=gen)
    return RouletteLogDet(n_probes=2, generator=gen)


def make_model(device: torch.device, dtype: torch.dtype) -> ResidualSequenceFlow:
    model = ResidualSequenceFlow(features=4, n_blocks=1, hidden=8, max_len=512)
    model = model.to(device=device, dtype=dtype)
    x, mask = inputs(device, dtype)
    with torch.no_grad():
        model.log_prob(x, mask, method="exact")  # data-dependent ActNorm initialisation
    return model


def model_log_prob(model, x, mask, method: str) -> torch.Tensor:
    torch.manual_seed(5)  # the roulette counts and probes come from the global generator
    return model.log_prob(x, mask, method=method)


@pytest.mark.parametrize("method", ["exact", "roulette"])
def test_model_log_prob_under_bf16_autocast(device, method):
    model = make_model(device, torch.float32)
    x, mask = inputs(device, torch.float32)
    reference = model_log_prob(model, x, mask, method).detach()
    with autocast(device):
        value = model_log_prob(model, x, mask, method)
    assert value.dtype == torch.float32 and value.shape == (B,)
    assert bool(torch.isfinite(value).all())
    torch.testing.assert_close(value.detach(), reference, rtol=RTOL, atol=ATOL)
    (-value.mean()).backward()
    assert_grads_finite(model)


@pytest.mark.parametrize(
    "name", ["exact", "series", "roulette", "roulette-graph", "roulette-plain"]
)
def test_residual_transform_under_bf16_autocast(device, name):
    branch = LipschitzMLP((D, 8, D), coeff=0.9).to(device=device, dtype=torch.float32)
    block = ResidualTransform(branch, logdet="exact")
    x, mask = inputs(device, torch.float32)
    y_ref, ref = block(x, mask=mask, logdet=estimator(name))
    with autocast(device):
        y, logdet = block(x, mask=mask, logdet=estimator(name))
    assert logdet.dtype == torch.float32 and y.dtype == torch.float32
    assert bool(torch.isfinite(logdet).all())
    torch.testing.assert_close(logdet.detach(), ref.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(y.detach(), y_ref.detach(), rtol=RTOL, atol=RTOL)
    (logdet.sum() + y.square().sum()).backward()
    assert_grads_finite(block)


def test_actnorm_under_bf16_autocast(device):
    actnorm = ActNorm(D).to(device=device, dtype=torch.float32)
    x, mask = inputs(device, torch.float32)
    actnorm.initialize(x, mask)  # data-dependent initialisation
    with torch.no_grad():
        actnorm.log_scale.add_(0.3)
    y_ref, ref = actnorm(x, mask=mask)
    with autocast(device):
        y, logdet = actnorm(x, mask=mask)
    assert logdet.dtype == torch.float32 and y.dtype == torch.float32
    torch.testing.assert_close(logdet.detach(), ref.detach(), rtol=RTOL, atol=ATOL)
    torch.testing.assert_close(y.detach(), y_ref.detach(), rtol=RTOL, atol=RTOL)
    (logdet.sum() + y.square().sum()).backward()
    assert_grads_finite(actnorm)


@pytest.mark.parametrize("method", ["exact", "roulette"])
@pytest.mark.parametrize("use_autocast", [False, True])
def test_model_float64_stays_float64(device, method, use_autocast):
    model = make_model(device, torch.float64)
    x, mask = inputs(device, torch.float64)
    reference = model_log_prob(model, x, mask, method).detach()
    with torch.autocast(device.type, dtype=BF16, enabled=use_autocast):
        value = model_log_prob(model, x, mask, method)
    assert value.dtype == torch.float64 and value.device.type == device.type
    # float64 branches are outside autocast's reach: the values agree to float64 round-off.
    torch.testing.assert_close(value.detach(), reference, rtol=1e-10, atol=1e-10)
    (-value.mean()).backward()
    assert all(p.grad is None or p.grad.dtype == torch.float64 for p in model.parameters())
    assert_grads_finite(model)


@pytest.mark.parametrize("name", ["exact", "series", "roulette"])
def test_residual_transform_float64_stays_float64(device, name):
    branch = LipschitzMLP((D, 8, D), coeff=0.9).to(device=device, dtype=torch.float64)
    block = ResidualTransform(branch, logdet="exact")
    x, mask = inputs(device, torch.float64)
    with autocast(device):
        y, logdet = block(x, mask=mask, logdet=estimator(name))
    assert y.dtype == torch.float64 and logdet.dtype == torch.float64
    assert y.device.type == device.type and logdet.device.type == device.type
    _, reference = block(x, mask=mask, logdet=estimator(name))
    torch.testing.assert_close(logdet, reference, rtol=1e-10, atol=1e-10)
