"""Temporal linear flows (docs/math.md#temporal-linear, docs/math.md#feature-mixing) and their
composition with the convolution branch (docs/math.md#temporal-conv)."""

from __future__ import annotations

import math

import pytest
import torch
from nflows.distributions import StandardNormal
from nflows.flows import Flow
from nflows.transforms import CompositeTransform, InverseTransform
from oracles import jacobian, padded_batch, real_indices

from iresflow.nn.conv import TemporalConvBranch
from iresflow.transforms.base import SequenceCompositeTransform
from iresflow.transforms.residual import ResidualTransform
from iresflow.transforms.temporal import (
    MIN_INIT_RESIDUAL_VARIANCE,
    AutoregressiveLinear,
    FeatureMixing,
)

F64 = torch.float64


def _logabsdet(f, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
    """``log|det|`` of the autograd Jacobian of ``f`` restricted to the real frames (any sign)."""
    jac = jacobian(f, x, mask)
    batch, length, features = x.shape
    out = []
    for b in range(batch):
        idx = real_indices(mask, b, length, features).to(x.device)
        out.append(torch.linalg.slogdet(jac[b][idx][:, idx])[1])
    return torch.stack(out)


def _transform_map(transform):
    return lambda x, mask: transform(x, mask=mask)[0]


def _standard_normal_log_prob(z: torch.Tensor, mask: torch.Tensor | None) -> torch.Tensor:
    per_frame = -0.5 * z.square().sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)
    if mask is not None:
        per_frame = per_frame * mask
    return per_frame.sum(-1)


def _random_ar(features: int, order: int, device) -> AutoregressiveLinear:
    layer = AutoregressiveLinear(features, order).to(device=device, dtype=F64)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.4)
    return layer.eval()  # no data-dependent initialisation


def _random_mixing(features: int, device) -> FeatureMixing:
    gen = torch.Generator().manual_seed(3)
    layer = FeatureMixing(features, generator=gen).to(device=device, dtype=F64)
    with torch.no_grad():
        for p in layer.parameters():
            p.add_(0.3 * torch.randn_like(p))
    return layer


def _ar_process(batch: int, length: int, device) -> torch.Tensor:
    """Sequences of a 2-D Gaussian AR(2) process with correlated noise."""
    a1 = torch.tensor([[0.6, 0.2], [-0.1, 0.5]], dtype=F64, device=device)
    a2 = torch.tensor([[-0.2, 0.0], [0.1, -0.3]], dtype=F64, device=device)
    chol = torch.tensor([[0.5, 0.0], [0.3, 0.4]], dtype=F64, device=device)
    frames = [torch.zeros(batch, 2, dtype=F64, device=device)] * 2
    for _ in range(length):
        noise = torch.randn(batch, 2, dtype=F64, device=device) @ chol.T
        frames.append(frames[-1] @ a1.T + frames[-2] @ a2.T + 0.3 + noise)
    return torch.stack(frames[2:], dim=1)


def _history(x: torch.Tensor, mask: torch.Tensor | None, b: int, t: int, k: int):
    """Frame ``t - k`` of sequence ``b`` if it exists and is real, else ``None``."""
    s = t - k
    if s < 0 or (mask is not None and not mask[b, s]):
        return None
    return x[b, s]


# ---------------------------------------------------------------- AutoregressiveLinear


def test_ar_forward_matches_the_frame_by_frame_definition(device):
    layer = _random_ar(3, 2, device)
    x, mask = padded_batch(device)
    z, _ = layer(x, mask=mask)
    whitening = torch.tril(layer.lower, -1) + torch.diag(layer.log_diag.exp())
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if not mask[b, t]:
                assert torch.equal(z[b, t], x[b, t])
                continue
            prediction = layer.bias.clone()
            for k in (1, 2):
                past = _history(x, mask, b, t, k)
                if past is not None:
                    prediction = prediction + layer.lag_weights[k - 1] @ past
            torch.testing.assert_close(z[b, t], whitening @ (x[b, t] - prediction))


@pytest.mark.parametrize("use_mask", [False, True])
def test_ar_logdet_matches_the_jacobian_oracle(device, use_mask):
    layer = _random_ar(3, 2, device)
    x, mask = padded_batch(device)
    mask = mask if use_mask else None
    _, logdet = layer(x, mask=mask)
    torch.testing.assert_close(logdet, _logabsdet(_transform_map(layer), x, mask))


def test_ar_inverse_round_trip_and_padding(device):
    layer = _random_ar(3, 3, device)
    x, mask = padded_batch(device)
    z, logdet = layer(x, mask=mask)
    x_back, logdet_inv = layer.inverse(z, mask=mask)
    torch.testing.assert_close(x_back, x, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(logdet_inv, -logdet)
    assert torch.equal(z[~mask], x[~mask])
    # Padded values change neither a real output nor the log-determinant.
    other = torch.where(mask[..., None], x, 50 * torch.randn_like(x))
    z_other, logdet_other = layer(other, mask=mask)
    assert torch.equal(z_other[mask], z[mask]) and torch.equal(logdet_other, logdet)
    # ... nor, in the inverse, a real input's preimage.
    z_noise = torch.where(mask[..., None], z, 50 * torch.randn_like(z))
    assert torch.equal(layer.inverse(z_noise, mask=mask)[0][mask], x_back[mask])


def test_ar_vectors_are_sequences_of_length_one(device):
    layer = _random_ar(3, 2, device)
    x = torch.randn(4, 3, dtype=F64, device=device)
    z, logdet = layer(x)
    z_seq, logdet_seq = layer(x.unsqueeze(1))
    torch.testing.assert_close(z, z_seq.squeeze(1))
    torch.testing.assert_close(logdet, logdet_seq)
    torch.testing.assert_close(layer.inverse(z)[0], x)


def test_ar_initialisation_is_the_fitted_gaussian_autoregression(device):
    """Layer + standard normal base == the closed-form AR(2) Gaussian fitted by least squares."""
    p = 2
    x = _ar_process(6, 9, device)
    mask = torch.ones(6, 9, dtype=torch.bool, device=device)
    mask[1, 6:] = False
    mask[2, 3] = False  # a gap: frames 4 and 5 of sequence 2 have an incomplete history
    mask[3, 0] = False
    layer = AutoregressiveLinear(2, p).to(device=device, dtype=F64).train()
    z, logdet = layer(x, mask=mask)
    assert bool(layer.initialized)
    flow_log_prob = _standard_normal_log_prob(z, mask) + logdet

    # Independent fit: normal equations on the full-history frames, built frame by frame.
    rows, targets = [], []
    for b in range(6):
        for t in range(9):
            past = [_history(x, mask, b, t, k) for k in range(1, p + 1)]
            if mask[b, t] and all(f is not None for f in past):
                rows.append(torch.cat([*past, torch.ones(1, dtype=F64, device=device)]))
                targets.append(x[b, t])
    design, response = torch.stack(rows), torch.stack(targets)
    coef = torch.linalg.solve(design.T @ design, design.T @ response)
    residuals = response - design @ coef
    covariance = residuals.T @ residuals / len(rows)
    lags = [coef[2 * (k - 1) : 2 * k].T for k in range(1, p + 1)]
    expected = torch.zeros(6, dtype=F64, device=device)
    for b in range(6):
        for t in range(9):
            if not mask[b, t]:
                continue
            mean = coef[-1].clone()
            for k in range(1, p + 1):
                past = _history(x, mask, b, t, k)
                if past is not None:
                    mean = mean + lags[k - 1] @ past
            normal = torch.distributions.MultivariateNormal(mean, covariance)
            expected[b] += normal.log_prob(x[b, t])
    torch.testing.assert_close(flow_log_prob, expected, rtol=1e-10, atol=1e-10)


def test_ar_initialisation_maximises_the_conditional_likelihood(device):
    """At the initialisation the likelihood of the full-history frames is stationary."""
    x = _ar_process(5, 8, device)
    mask = torch.ones(5, 8, dtype=torch.bool, device=device)
    mask[0, 5:] = False
    layer = AutoregressiveLinear(2, 1).to(device=device, dtype=F64)
    layer.initialize(x, mask)
    full = mask.clone()
    full[:, 0] = False  # order 1: the first frame has no history
    z, _ = layer(x, mask=mask)
    log_lik = _standard_normal_log_prob(z, full).sum() + full.sum() * layer.log_diag.sum()
    grads = torch.autograd.grad(log_lik, list(layer.parameters()))
    for name, grad in zip([n for n, _ in layer.named_parameters()], grads, strict=True):
        if name == "lower":
            grad = torch.tril(grad, -1)  # only the strictly lower part is used
        torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-9, rtol=0, msg=name)
    # ... and not trivially: the likelihood is not stationary at a perturbed point.
    with torch.no_grad():
        layer.bias.add_(0.1)
    z, _ = layer(x, mask=mask)
    log_lik = _standard_normal_log_prob(z, full).sum()
    assert torch.autograd.grad(log_lik, layer.bias)[0].abs().max() > 1e-3


def test_ar_initialisation_floors_the_residual_covariance(device):
    x = _ar_process(4, 10, device)
    x = torch.cat([x, x[..., :1]], dim=-1)  # a third feature equal to the first: singular
    layer = AutoregressiveLinear(3, 1).to(device=device, dtype=F64).train()
    z, logdet = layer(x)
    assert torch.isfinite(z).all() and torch.isfinite(logdet).all()
    whitening = layer.whitening_matrix()
    covariance = torch.linalg.inv(whitening.T @ whitening)
    smallest = float(torch.linalg.eigvalsh(covariance.detach())[0])
    assert smallest == pytest.approx(MIN_INIT_RESIDUAL_VARIANCE, rel=1e-6)


def test_ar_initialisation_without_enough_full_history_frames_is_the_identity(device):
    for x in (
        torch.randn(2, 4, 2, dtype=F64, device=device),  # 2 x 2 full-history frames < 7
        torch.randn(20, 2, dtype=F64, device=device),  # vectors have no history
    ):
        layer = AutoregressiveLinear(2, 2).to(device=device, dtype=F64).train()
        with torch.no_grad():
            layer.lag_weights.fill_(0.3)
        with pytest.warns(UserWarning, match="needs at least"):
            z, logabsdet = layer(x)
        assert bool(layer.initialized)
        assert torch.equal(z, x) and torch.equal(logabsdet, torch.zeros_like(logabsdet))


def test_ar_initialises_once_and_only_in_training_forward(device):
    x = _ar_process(4, 8, device)
    layer = AutoregressiveLinear(2, 1).to(device=device, dtype=F64)
    layer.eval()(x)
    layer.train().inverse(x)
    assert not bool(layer.initialized) and torch.count_nonzero(layer.lag_weights) == 0
    layer(x)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    layer(3 * x + 1)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, state[key]), key
    loaded = AutoregressiveLinear(2, 1).to(device=device, dtype=F64).train()
    loaded.load_state_dict(state)
    assert torch.equal(loaded(x + 5)[0], layer(x + 5)[0])  # not re-initialised


def test_ar_gradients_reach_every_parameter(device):
    layer = _random_ar(3, 2, device)
    x, mask = padded_batch(device)
    z, logdet = layer(x, mask=mask)
    (z.square().sum() + logdet.sum()).backward()
    for name, p in layer.named_parameters():
        grad = torch.tril(p.grad, -1) if name == "lower" else p.grad
        assert grad.abs().sum() > 0, name


# ---------------------------------------------------------------- FeatureMixing


def test_mixing_starts_as_a_rotation(device):
    layer = FeatureMixing(4, generator=torch.Generator().manual_seed(0)).to(device, F64)
    w = layer.weight()
    # Drawn in the default dtype (float32), then converted.
    torch.testing.assert_close(w @ w.T, torch.eye(4, dtype=F64, device=device), atol=1e-6, rtol=0)
    again = FeatureMixing(4, generator=torch.Generator().manual_seed(0)).to(device, F64)
    assert torch.equal(again.weight(), w)


@pytest.mark.parametrize("use_mask", [False, True])
def test_mixing_logdet_matches_the_jacobian_oracle(device, use_mask):
    layer = _random_mixing(3, device)
    x, mask = padded_batch(device)
    mask = mask if use_mask else None
    y, logdet = layer(x, mask=mask)
    torch.testing.assert_close(logdet, _logabsdet(_transform_map(layer), x, mask))
    torch.testing.assert_close(layer.log_abs_diag.sum(), torch.linalg.slogdet(layer.weight())[1])


def test_mixing_inverse_round_trip_and_padding(device):
    layer = _random_mixing(3, device)
    x, mask = padded_batch(device)
    y, logdet = layer(x, mask=mask)
    assert torch.equal(y[~mask], x[~mask])
    x_back, logdet_inv = layer.inverse(y, mask=mask)
    torch.testing.assert_close(x_back, x, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(logdet_inv, -logdet)
    vectors = x[:, 0]
    torch.testing.assert_close(layer.inverse(layer(vectors)[0])[0], vectors)
    torch.testing.assert_close(layer(vectors)[0], vectors @ layer.weight().T)


def test_mixing_gradients_reach_every_parameter(device):
    layer = _random_mixing(3, device)
    x, mask = padded_batch(device)
    y, logdet = layer(x, mask=mask)
    (y.square().sum() + logdet.sum()).backward()
    for name, p in layer.named_parameters():
        if name == "lower":
            assert torch.tril(p.grad, -1).abs().sum() > 0
        elif name == "upper":
            assert torch.triu(p.grad, 1).abs().sum() > 0
        else:
            assert p.grad.abs().sum() > 0, name


# ---------------------------------------------------------------- compositions


def _chain(device) -> list:
    conv = TemporalConvBranch(3, 4, 3, 0.9, max_len=4).to(device=device, dtype=F64)
    with torch.no_grad():
        for p in conv.parameters():
            p.mul_(3.0)
    return [
        _random_ar(3, 2, device),
        _random_mixing(3, device),
        ResidualTransform(conv, logdet="exact").eval(),
    ]


def test_masked_chain_log_prob_matches_the_jacobian_oracle(device):
    chain = SequenceCompositeTransform(_chain(device))
    x, mask = padded_batch(device)
    z, logdet = chain(x, mask=mask)
    torch.testing.assert_close(logdet, _logabsdet(_transform_map(chain), x, mask))
    x_back, logdet_inv = chain.inverse(z, mask=mask)
    torch.testing.assert_close(x_back, x, atol=1e-9, rtol=0)
    torch.testing.assert_close(logdet_inv, -logdet)
    other = torch.where(mask[..., None], x, torch.randn_like(x))
    z_other, logdet_other = chain(other, mask=mask)
    torch.testing.assert_close(logdet_other, logdet, rtol=1e-12, atol=1e-12)
    assert torch.equal(z_other[mask], z[mask]) and torch.equal(z_other[~mask], other[~mask])


def test_nflows_flow_with_fixed_length_data(device):
    transform = CompositeTransform(_chain(device))
    flow = Flow(transform, StandardNormal([4, 3])).to(device)
    x = torch.randn(2, 4, 3, dtype=F64, device=device)
    z, _ = transform(x)
    expected = _standard_normal_log_prob(z, None) + _logabsdet(
        lambda v, m: transform(v)[0], x
    )
    torch.testing.assert_close(flow.log_prob(x), expected)
    y, logdet = CompositeTransform([InverseTransform(transform), transform])(z)
    torch.testing.assert_close(y, z, atol=1e-9, rtol=0)
    torch.testing.assert_close(logdet, torch.zeros_like(logdet), atol=1e-9, rtol=0)


def test_bad_inputs_raise(device):
    ar = AutoregressiveLinear(3, 1).to(device=device, dtype=F64)
    mixing = FeatureMixing(3).to(device=device, dtype=F64)
    x = torch.randn(2, 4, 3, dtype=F64, device=device)
    for layer in (ar, mixing):
        with pytest.raises(ValueError, match="3 features"):
            layer(torch.randn(2, 4, 2, dtype=F64, device=device))
        with pytest.raises(TypeError, match="bool"):
            layer.inverse(x, mask=torch.ones(2, 4, device=device))
        with pytest.raises(TypeError, match="dtype"):
            layer(x.float())
        with pytest.raises(ValueError, match="NaN"):
            layer.inverse(torch.full_like(x, float("nan")))
    with pytest.raises(ValueError, match="order must be positive"):
        AutoregressiveLinear(3, 0)
    with pytest.raises(TypeError, match="features must be an int"):
        FeatureMixing(3.0)  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="generator"):
        FeatureMixing(3, generator=0)  # type: ignore[arg-type]
