"""Temporal linear flows (docs/math.md#temporal-linear, docs/math.md#feature-mixing) and their
composition with the convolution branch (docs/math.md#temporal-conv)."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import scipy.linalg
import torch
from nflows.distributions import StandardNormal
from nflows.flows import Flow
from nflows.transforms import CompositeTransform, InverseTransform
from oracles import jacobian, padded_batch, real_indices
from scipy.stats import multivariate_normal

from iresflow.nn.conv import TemporalConvBranch
from iresflow.transforms.ar_fit import MIN_INIT_RESIDUAL_VARIANCE, RELATIVE_RESIDUAL_VARIANCE_FLOOR
from iresflow.transforms.composite import SequenceCompositeTransform
from iresflow.transforms.mixing import FeatureMixing
from iresflow.transforms.residual import ResidualTransform
from iresflow.transforms.temporal import AutoregressiveLinear

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


def _gap_batch(device) -> tuple[torch.Tensor, torch.Tensor]:
    """Three float64 sequences ``(3, 7, 3)`` with end padding and gaps in the middle."""
    x = torch.randn(3, 7, 3, dtype=F64, device=device)
    mask = torch.tensor(
        [
            [True] * 7,
            [True, True, False, True, True, True, False],
            [False, True, False, True, True, True, True],
        ],
        device=device,
    )
    return x, mask


def _past(mask: torch.Tensor | None, b: int, t: int, order: int) -> int:
    """``h(t)``: real frames immediately before frame ``t`` of sequence ``b``, at most ``order``."""
    h = 0
    while h < order and t - h - 1 >= 0 and (mask is None or bool(mask[b, t - h - 1])):
        h += 1
    return h


def _sub_model(layer: AutoregressiveLinear, h: int) -> tuple[list, torch.Tensor, torch.Tensor]:
    """Lags ``[A_{h,1}, ..., A_{h,h}]``, bias and whitening matrix of sub-model ``h``."""
    whitening = torch.tril(layer.lower[h], -1) + torch.diag(layer.log_diag[h].exp())
    return [layer.lag_weights[h, k - 1] for k in range(1, h + 1)], layer.bias[h], whitening


# ---------------------------------------------------------------- AutoregressiveLinear


@pytest.mark.parametrize("use_mask", [False, True])
def test_ar_forward_matches_the_frame_by_frame_definition(device, use_mask):
    layer = _random_ar(3, 2, device)
    x, mask = _gap_batch(device)
    mask = mask if use_mask else None
    z, logdet = layer(x, mask=mask)
    expected_logdet = torch.zeros(3, dtype=F64, device=device)
    for b in range(x.shape[0]):
        for t in range(x.shape[1]):
            if mask is not None and not mask[b, t]:
                assert torch.equal(z[b, t], x[b, t])
                continue
            h = _past(mask, b, t, 2)
            lags, bias, whitening = _sub_model(layer, h)
            prediction = bias + sum((a @ x[b, t - k] for k, a in enumerate(lags, 1)), 0.0)
            torch.testing.assert_close(z[b, t], whitening @ (x[b, t] - prediction))
            expected_logdet[b] += torch.linalg.slogdet(whitening)[1]
    torch.testing.assert_close(logdet, expected_logdet)


@pytest.mark.parametrize("batch", [padded_batch, _gap_batch])
@pytest.mark.parametrize("use_mask", [False, True])
def test_ar_logdet_matches_the_jacobian_oracle(device, use_mask, batch):
    layer = _random_ar(3, 2, device)
    x, mask = batch(device)
    mask = mask if use_mask else None
    _, logdet = layer(x, mask=mask)
    torch.testing.assert_close(logdet, _logabsdet(_transform_map(layer), x, mask))


@pytest.mark.parametrize("order", [1, 3])
def test_ar_inverse_round_trip_and_padding(device, order):
    layer = _random_ar(3, order, device)
    x, mask = _gap_batch(device)
    z, logdet = layer(x, mask=mask)
    x_back, logdet_inv = layer.inverse(z, mask=mask)
    torch.testing.assert_close(x_back, x, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(logdet_inv, -logdet)
    assert torch.equal(z[~mask], x[~mask])
    # Padded values change neither a real output nor the log-determinant ...
    other = torch.where(mask[..., None], x, 50 * torch.randn_like(x))
    z_other, logdet_other = layer(other, mask=mask)
    assert torch.equal(z_other[mask], z[mask]) and torch.equal(logdet_other, logdet)
    # ... nor, in the inverse, a real input's preimage.
    z_noise = torch.where(mask[..., None], z, 50 * torch.randn_like(z))
    assert torch.equal(layer.inverse(z_noise, mask=mask)[0][mask], x_back[mask])
    # Frames before a gap are no history: changing them leaves the frames after it alone.
    moved = x.clone()
    moved[1, :2] += 10.0  # sequence 1 has a gap at frame 2
    assert torch.equal(layer(moved, mask=mask)[0][1, 3:], z[1, 3:])


@pytest.mark.parametrize("order", [1, 3])
@pytest.mark.parametrize("conditional", [False, True])
@pytest.mark.parametrize("length", [2, 9])
def test_ar_inverse_without_padding_equals_the_masked_one(device, order, conditional, length):
    """Without a mask or a graph the frames from ``p`` on are recovered by the full model
    alone, one product per frame; it equals the frame-by-frame recovery that a mask (all real)
    or a graph takes."""
    layer = _conditional_ar(device, order) if conditional else _random_ar(3, order, device)
    context = torch.randn(4, 2, dtype=F64, device=device) if conditional else None
    x = torch.randn(4, length, 3, dtype=F64, device=device)
    z, logdet = layer(x, context)
    with torch.no_grad():
        x_back, logdet_inv = layer.inverse(z, context)
    everywhere = torch.ones(4, length, dtype=torch.bool, device=device)
    x_masked, logdet_masked = layer.inverse(z, context, mask=everywhere)
    torch.testing.assert_close(x_back, x_masked, atol=1e-12, rtol=0)
    torch.testing.assert_close(x_back, layer.inverse(z, context)[0], atol=1e-12, rtol=0)
    torch.testing.assert_close(x_back, x, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(logdet_inv, logdet_masked)
    torch.testing.assert_close(logdet_inv, -logdet)
    # with a graph the recovery is differentiable
    small = z[:2, :, :2].clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda v: layer.inverse(torch.cat([v, z[:2, :, 2:]], -1), context[:2] if conditional
                                else None)[0], (small,))


@pytest.mark.parametrize("first", [1, 5])
def test_ar_pinned_inverse_after_a_known_prefix_equals_the_frame_by_frame_one(device, first):
    """A forecast's pinned inverse: the known frames are a prefix of sequences without padding,
    so without a graph the new frames from ``p`` on are recovered by the full model alone; it
    equals the frame-by-frame recovery that a graph takes, and keeps the known frames."""
    layer = _random_ar(3, 3, device)
    x = torch.randn(4, 9, 3, dtype=F64, device=device)
    z, _ = layer(x)
    known = (torch.arange(9, device=device) < first).expand(4, -1)
    state, real = torch.where(known[..., None], x, 0.0), torch.ones_like(known)
    with torch.no_grad():
        steady = layer.inverse_pinned(z, state, known, None, real)
    general = layer.inverse_pinned(z, state, known, None, real)  # with a graph: frame by frame
    torch.testing.assert_close(steady, general, atol=1e-12, rtol=0)
    torch.testing.assert_close(steady, x, atol=1e-12, rtol=1e-12)


def _conditional_ar(device, order: int = 2) -> AutoregressiveLinear:
    torch.manual_seed(5)
    layer = AutoregressiveLinear(3, order, context_features=2, context_hidden=8)
    layer = layer.to(device=device, dtype=F64)
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(std=0.4)
    return layer.eval()


def test_conditional_ar_logdet_and_inverse_with_context(device):
    layer = _conditional_ar(device)
    x, mask = _gap_batch(device)
    context = torch.randn(3, 2, dtype=F64, device=device)
    z, logdet = layer(x, context, mask=mask)
    for b in range(3):
        f = lambda t, m, b=b: layer(t, context[b : b + 1], mask=m)[0]  # noqa: E731
        expected = _logabsdet(f, x[b : b + 1], mask[b : b + 1])
        torch.testing.assert_close(logdet[b : b + 1], expected)
    x_back, logdet_inv = layer.inverse(z, context, mask=mask)
    torch.testing.assert_close(x_back, x, atol=1e-12, rtol=1e-12)
    torch.testing.assert_close(logdet_inv, -logdet)
    assert torch.equal(z[~mask], x[~mask])
    # The context matters, and only for its own sequence.
    other = context.clone()
    other[1] += 1.0
    z_other, logdet_other = layer(x, other, mask=mask)
    assert not torch.allclose(z_other[1], z[1]) and not torch.allclose(logdet_other[1], logdet[1])
    assert torch.equal(z_other[[0, 2]], z[[0, 2]]) and torch.equal(logdet_other[[0, 2]],
                                                                   logdet[[0, 2]])


def test_conditional_ar_is_the_unconditional_layer_until_the_context_net_moves(device):
    layer = _conditional_ar(device, order=1)
    plain = AutoregressiveLinear(3, 1).to(device=device, dtype=F64).eval()
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if "context" not in k},
                          strict=False)
    with torch.no_grad():
        layer.context_net[-1].weight.zero_()
        layer.context_net[-1].bias.zero_()
    x, mask = _gap_batch(device)
    context = torch.randn(3, 2, dtype=F64, device=device)
    for got, expected in zip(layer(x, context, mask=mask), plain(x, mask=mask), strict=True):
        torch.testing.assert_close(got, expected)
    with pytest.raises(ValueError, match="context"):
        layer(x, mask=mask)
    with pytest.raises(ValueError, match="context"):
        layer(x, torch.randn(2, 2, dtype=F64, device=device), mask=mask)


def test_conditional_ar_can_hold_one_autoregression_per_class(device):
    # One-hot contexts with the deltas of class k in column k: every sequence is whitened by
    # its class's own AR(1) model.
    layer = AutoregressiveLinear(2, 1, context_features=2, context_hidden=4).to(device, F64)
    lag = torch.tensor([[[0.5, 0.0], [0.0, -0.5]], [[0.0, 0.3], [0.2, 0.0]]], dtype=F64)
    bias = torch.tensor([[1.0, -1.0], [0.0, 2.0]], dtype=F64)
    net = layer.context_net
    with torch.no_grad():
        for p in layer.parameters():
            p.zero_()
        # Hidden unit k is SiLU(10) for class k and SiLU(0) = 0 otherwise.
        net[0].weight.copy_(torch.eye(4, 2, dtype=F64) * 10)
        deltas = torch.zeros(12, 2, dtype=F64)  # lags (4), bias (2), log-diagonal (2), lower (4)
        deltas[:4] = lag.reshape(2, 4).T
        deltas[4:6] = bias.T
        net[2].weight[:, :2].copy_(deltas / torch.nn.functional.silu(torch.tensor(10.0)))
    layer.eval()
    x = torch.randn(2, 5, 2, dtype=F64, device=device)
    z, _ = layer(x, torch.eye(2, dtype=F64, device=device))
    for k in range(2):
        expected = x[k, 1:] - x[k, :-1] @ lag[k].T.to(device) - bias[k].to(device)
        torch.testing.assert_close(z[k, 1:], expected)
        torch.testing.assert_close(z[k, 0], x[k, 0] - bias[k].to(device))


def test_ar_vectors_are_sequences_of_length_one(device):
    layer = _random_ar(3, 2, device)
    x = torch.randn(4, 3, dtype=F64, device=device)
    z, logdet = layer(x)
    z_seq, logdet_seq = layer(x.unsqueeze(1))
    torch.testing.assert_close(z, z_seq.squeeze(1))
    torch.testing.assert_close(logdet, logdet_seq)
    _, bias, whitening = _sub_model(layer, 0)
    torch.testing.assert_close(z, (x - bias) @ whitening.T)
    torch.testing.assert_close(layer.inverse(z)[0], x)


def _init_mask(batch: int, length: int, device) -> torch.Tensor:
    mask = torch.ones(batch, length, dtype=torch.bool, device=device)
    mask[1, 6:] = False
    mask[2, 3] = False  # a gap: frame 4 of sequence 2 starts a new history
    mask[3, 0] = False
    return mask


def _fitted_log_prob(x: torch.Tensor, mask: torch.Tensor, order: int) -> torch.Tensor:
    """Log-density ``(B,)`` of the per-history-length conditional Gaussians, fitted here.

    Sub-model ``j`` is fitted by the normal equations on the real frames with ``h(t) = j``, or on
    those with ``h(t) >= j`` (first ``j`` lags) when there are fewer than ``(j + 1) D + 1``.
    """
    batch, length, d = x.shape
    history = [[_past(mask, b, t, order) for t in range(length)] for b in range(batch)]
    fits = []
    for j in range(order + 1):
        for pooled in (False, True):
            frames = [
                (b, t)
                for b in range(batch)
                for t in range(length)
                if mask[b, t] and (history[b][t] >= j if pooled else history[b][t] == j)
            ]
            if len(frames) >= (j + 1) * d + 1:
                break
        design = torch.stack(
            [torch.cat([*(x[b, t - k] for k in range(1, j + 1)), x.new_ones(1)]) for b, t in frames]
        )
        response = torch.stack([x[b, t] for b, t in frames])
        coef = torch.linalg.solve(design.T @ design, design.T @ response)
        residuals = response - design @ coef
        fits.append((coef, residuals.T @ residuals / len(frames)))
    log_prob = torch.zeros(batch, dtype=F64, device=x.device)
    for b in range(batch):
        for t in range(length):
            if mask[b, t]:
                h = history[b][t]
                coef, covariance = fits[h]
                mean = coef[-1] + sum((coef[(k - 1) * d : k * d].T @ x[b, t - k]
                                       for k in range(1, h + 1)), 0.0)
                normal = torch.distributions.MultivariateNormal(mean, covariance)
                log_prob[b] += normal.log_prob(x[b, t])
    return log_prob


@pytest.mark.parametrize("shape", [(12, 9), (2, 30)])  # per-h fits; pooled fits for h < p
def test_ar_initialisation_is_the_fitted_gaussian_autoregression(device, shape):
    """Layer + standard normal base == the per-history-length Gaussian conditionals."""
    p = 2
    x = _ar_process(*shape, device)
    mask = _init_mask(*shape, device) if shape[0] > 3 else torch.ones(shape, dtype=torch.bool)
    mask = mask.to(device)
    layer = AutoregressiveLinear(2, p).to(device=device, dtype=F64).train()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # every sub-model is fitted
        layer.initialize(x, mask)
    z, logdet = layer(x, mask=mask)
    assert bool(layer.initialized)
    flow_log_prob = _standard_normal_log_prob(z, mask) + logdet
    expected = _fitted_log_prob(x, mask, p)
    torch.testing.assert_close(flow_log_prob, expected, rtol=1e-10, atol=1e-10)


def test_ar_initialisation_maximises_the_likelihood(device):
    """With every sub-model fitted on the frames it maps, the likelihood is stationary."""
    x = _ar_process(12, 9, device)
    mask = _init_mask(12, 9, device)
    layer = AutoregressiveLinear(2, 2).to(device=device, dtype=F64)
    layer.initialize(x, mask)

    def log_lik() -> torch.Tensor:
        z, logdet = layer(x, mask=mask)
        return (_standard_normal_log_prob(z, mask) + logdet).sum()

    grads = torch.autograd.grad(log_lik(), list(layer.parameters()))
    for name, grad in zip([n for n, _ in layer.named_parameters()], grads, strict=True):
        torch.testing.assert_close(grad, torch.zeros_like(grad), atol=1e-9, rtol=0, msg=name)
    # ... and not trivially: the likelihood is not stationary at a perturbed point.
    with torch.no_grad():
        layer.bias.add_(0.1)
    for grad in torch.autograd.grad(log_lik(), layer.bias)[0]:
        assert grad.abs().max() > 1e-3


def test_ar_initialisation_floors_the_residual_covariance(device):
    x = _ar_process(12, 10, device)
    x = torch.cat([x, x[..., :1]], dim=-1)  # a third feature equal to the first: singular
    layer = AutoregressiveLinear(3, 1).to(device=device, dtype=F64).train()
    layer.initialize(x)
    z, logdet = layer(x)
    assert torch.isfinite(z).all() and torch.isfinite(logdet).all()
    whitening = layer.whitening_matrix()
    covariance = torch.linalg.inv(whitening.mT @ whitening)
    smallest = torch.linalg.eigvalsh(covariance.detach())[:, 0]
    torch.testing.assert_close(
        smallest, torch.full_like(smallest, MIN_INIT_RESIDUAL_VARIANCE), rtol=1e-6, atol=0
    )


def _residual_covariances(x: torch.Tensor, order: int, j: int) -> tuple[np.ndarray, np.ndarray]:
    """Sub-model ``j``'s residual covariance on the frames with exactly ``j`` predecessors and
    the pooled one on those with at least ``j`` (first ``j`` lags), by numpy's least squares."""
    x = x.detach().cpu().numpy()
    covariances = []
    pooled = range(j, x.shape[1])
    for starts in ((j,) if j < order else pooled, pooled):
        frames = [(b, t) for b in range(x.shape[0]) for t in starts]
        design = np.stack([np.concatenate([*(x[b, t - k] for k in range(1, j + 1)), [1.0]])
                           for b, t in frames])
        response = np.stack([x[b, t] for b, t in frames])
        residuals = response - design @ np.linalg.lstsq(design, response, rcond=None)[0]
        covariances.append(residuals.T @ residuals / len(frames))
    return covariances[0], covariances[-1]


def _covariances(layer: AutoregressiveLinear) -> torch.Tensor:
    """``(p + 1, D, D)``: every sub-model's :math:`\\Sigma_j = (L_j^\\top L_j)^{-1}`."""
    whitening = layer.whitening_matrix().detach()
    return torch.linalg.inv(whitening.mT @ whitening)


def test_ar_initialisation_floors_a_repeated_frame_against_the_pooled_fit(device):
    """docs/math.md#ar-variance-floor: frame 1 repeats frame 0 in every training sequence."""
    p, rho = 3, RELATIVE_RESIDUAL_VARIANCE_FLOOR
    x = _ar_process(41, 20, device)
    x[:, 1] = x[:, 0]
    train, test = x[:40], x[40:].clone()
    test[:, 1] = _ar_process(1, 20, device)[:, 1]  # a test sequence that breaks the repetition
    layer = AutoregressiveLinear(2, p).to(device=device, dtype=F64)
    layer.initialize(train)
    covariances = _covariances(layer).cpu().numpy()
    for j in range(p + 1):
        exact, pooled = _residual_covariances(train, p, j)
        relative, vectors = scipy.linalg.eigh(exact, pooled)  # vectors.T @ pooled @ vectors = I
        expected = pooled @ vectors @ np.diag(np.maximum(relative, rho)) @ vectors.T @ pooled
        np.testing.assert_allclose(covariances[j], expected, rtol=1e-7, atol=1e-12)
        assert (relative.max() < 1e-12) == (j == 1), j  # the floor binds for sub-model 1 only
        if j != 1:
            np.testing.assert_allclose(covariances[j], exact, rtol=1e-7, atol=1e-12)
    # The whitening scale is bounded by the pooled fit: ||L_1||^2 = 1 / min eig(Sigma_1).
    _, pooled = _residual_covariances(train, p, 1)
    scale = torch.linalg.matrix_norm(layer.whitening_matrix()[1].detach(), ord=2).item()
    assert scale**2 <= (1 + 1e-9) / (rho * np.linalg.eigvalsh(pooled).min())
    # The broken repetition costs a finite, bounded amount at frame 1: its density is the
    # Gaussian of the floored sub-model, its Mahalanobis term at most that of rho times the pooled
    # covariance, and far below the 1e-6 floor alone (Sigma_1 = 1e-6 I before this rule).
    z, logdet = layer.eval()(test)
    lags, bias, _ = _sub_model(layer, 1)
    delta = test[0, 1].cpu().numpy() - (bias + lags[0] @ test[0, 0]).detach().cpu().numpy()
    mahalanobis = z[0, 1].square().sum().item()
    log_density = -0.5 * mahalanobis - math.log(2 * math.pi) + layer.log_diag[1].sum().item()
    expected = multivariate_normal(np.zeros(2), covariances[1]).logpdf(delta)
    assert math.isclose(log_density, expected, rel_tol=1e-9) and torch.isfinite(logdet).all()
    assert mahalanobis <= (1 + 1e-9) * delta @ np.linalg.solve(rho * pooled, delta)
    assert mahalanobis < 1e-2 * (delta @ delta) / MIN_INIT_RESIDUAL_VARIANCE


def test_ar_initialisation_keeps_small_innovation_variances(device):
    """Innovation variances near 1e-3 (Japanese Vowels in standard units) are fits, not floors."""
    p = 3
    x = 0.06 * _ar_process(40, 20, device)
    layer = AutoregressiveLinear(2, p).to(device=device, dtype=F64)
    layer.initialize(x)
    covariances = _covariances(layer).cpu().numpy()
    for j in range(p + 1):
        exact, _ = _residual_covariances(x, p, j)
        np.testing.assert_allclose(covariances[j], exact, rtol=1e-8, atol=0)
    assert np.linalg.eigvalsh(covariances[p]).max() < 1e-2  # an absolute 1e-2 floor would bind


def test_ar_initialisation_without_enough_frames_starts_a_sub_model_as_the_identity(device):
    # 2 x 4 frames, D = 2: sub-models 0 and 1 are pooled fits (8 >= 3, 6 >= 5 frames), sub-model
    # 2 has 4 < 7 frames with two real predecessors.
    x = torch.randn(2, 4, 2, dtype=F64, device=device)
    # Vectors have no history: sub-model 0 is fitted, 1 and 2 start as the identity.
    vectors = torch.randn(20, 2, dtype=F64, device=device)
    for data, identity in ((x, [2]), (vectors, [1, 2])):
        layer = AutoregressiveLinear(2, 2).to(device=device, dtype=F64).train()
        with torch.no_grad():
            for p in layer.parameters():
                p.fill_(0.3)
        with pytest.warns(UserWarning, match=f"sub-models {identity[0]} "):
            layer.initialize(data)
        assert bool(layer.initialized)
        for j in range(3):
            is_identity = torch.equal(
                layer.whitening_matrix()[j], torch.eye(2, dtype=F64, device=device)
            ) and not layer.bias[j].any() and not layer.lag_weights[j].any()
            assert is_identity == (j in identity), j
    z, logabsdet = layer.eval()(x)  # frames with h(t) = 2 pass through sub-model 2 unchanged
    assert torch.equal(z[:, 2:], x[:, 2:]) and not torch.equal(z[:, :2], x[:, :2])


def test_ar_only_initialize_sets_the_layer(device):
    x = _ar_process(4, 8, device)
    layer = AutoregressiveLinear(2, 1).to(device=device, dtype=F64)
    layer.eval()(x)
    layer.train().inverse(x)
    assert not bool(layer.initialized) and torch.count_nonzero(layer.lag_weights) == 0
    with pytest.raises(RuntimeError, match="initialize"):
        layer(x)  # a training forward refuses an uninitialised layer
    layer.initialize(x)
    state = {k: v.clone() for k, v in layer.state_dict().items()}
    layer(3 * x + 1)
    for key, value in layer.state_dict().items():
        assert torch.equal(value, state[key]), key
    loaded = AutoregressiveLinear(2, 1).to(device=device, dtype=F64).train()
    loaded.load_state_dict(state)
    assert torch.equal(loaded(x + 5)[0], layer(x + 5)[0])  # not re-initialised


def test_ar_gradients_reach_every_parameter(device):
    layer = _random_ar(3, 2, device)
    x, mask = _gap_batch(device)  # frames with h(t) = 0, 1 and 2
    z, logdet = layer(x, mask=mask)
    (z.square().sum() + logdet.sum()).backward()
    strictly_lower = torch.ones(3, 3, dtype=torch.bool, device=device).tril(-1)
    for j in range(3):
        used = {
            "lag_weights": layer.lag_weights.grad[j, :j],
            "bias": layer.bias.grad[j],
            "log_diag": layer.log_diag.grad[j],
            "lower": layer.lower.grad[j][strictly_lower],
        }
        for name, grad in used.items():
            assert grad.numel() == 0 or (grad != 0).all(), (name, j)
    # Lags a sub-model does not use get no gradient.
    assert not layer.lag_weights.grad[0].any() and not layer.lag_weights.grad[1, 1].any()


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
