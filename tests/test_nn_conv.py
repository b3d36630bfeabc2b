"""Temporal convolution branch: circular-embedding certificate (docs/math.md#temporal-conv)."""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from oracles import jacobian_logdet, padded_batch, residual_map

from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.nn.conv import SpectralConv1d, TemporalConvBranch, circular_conv_norm
from iresflow.nn.diagnostics import empirical_lipschitz, jacobian_norm
from iresflow.nn.frames import conv_frames
from iresflow.transforms.residual import ResidualTransform

F64 = torch.float64


def _circulant(weight: torch.Tensor, period: int) -> torch.Tensor:
    """Explicit ``(P out) x (P in)`` circular convolution: ``y_t = sum_j W_j x_{(t+j-r) mod P}``."""
    out, inp, k = weight.shape
    r = k // 2
    matrix = weight.new_zeros(period, out, period, inp)
    for t in range(period):
        for j in range(k):
            matrix[t, :, (t + j - r) % period] += weight[:, :, j]
    return matrix.reshape(period * out, period * inp)


def _zero_padded(weight: torch.Tensor, length: int) -> torch.Tensor:
    """Explicit ``(N out) x (N in)`` "same" zero-padded convolution of length ``N``."""
    out, inp, k = weight.shape
    r = k // 2
    matrix = weight.new_zeros(length, out, length, inp)
    for t in range(length):
        for j in range(k):
            s = t + j - r
            if 0 <= s < length:
                matrix[t, :, s] = weight[:, :, j]
    return matrix.reshape(length * out, length * inp)


def _branch(device, *, coeff=0.9, max_len=5, hidden=4, kernel_size=3, scale=3.0):
    """A small float64 branch whose raw weights exceed the bound, so normalisation is active."""
    branch = TemporalConvBranch(3, hidden, kernel_size, coeff, max_len=max_len)
    branch = branch.to(device=device, dtype=F64)
    with torch.no_grad():
        for name, p in branch.named_parameters():
            if name.endswith("weight"):
                p.mul_(scale)
            elif name.endswith("bias"):
                p.normal_(std=0.3)
    return branch


@pytest.mark.parametrize(("out", "inp"), [(5, 2), (2, 5), (1, 4), (3, 3)])  # both associations
@pytest.mark.parametrize(("k", "dilation"), [(1, 1), (3, 1), (3, 2), (4, 3)])
@pytest.mark.parametrize("causal", [False, True])
def test_conv_frames_is_conv1d(device, out, inp, k, dilation, causal):
    if k % 2 == 0 and not causal:
        pytest.skip("'same' padding needs an odd kernel")
    h = torch.randn(3, 7, inp, dtype=F64, device=device)
    weight = torch.randn(out, inp, k, dtype=F64, device=device)
    bias = torch.randn(out, dtype=F64, device=device)
    span = dilation * (k - 1) + 1
    left = span - 1 if causal else span // 2
    frames = F.pad(h.transpose(1, 2), (left, span - 1 - left))
    expected = F.conv1d(frames, weight, bias, dilation=dilation).transpose(1, 2)
    got = conv_frames(h, weight, bias, causal=causal, dilation=dilation)
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    torch.testing.assert_close(conv_frames(h, weight, causal=causal, dilation=dilation),
                               expected - bias, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match=r"h \(R, N, C_in\)"):
        conv_frames(h.transpose(1, 2), weight)


def test_jacobians_under_vmap_need_no_fallback(device):
    # torch.func.jacrev vmaps the branch's backward; an op without a batching rule (unfold)
    # would fall back to a loop and warn the user
    branch = _branch(device)
    x = torch.randn(2, 5, 3, dtype=F64, device=device)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert jacobian_norm(branch, x, "2").shape == (2,)


@pytest.mark.parametrize(("out", "inp", "k", "period"), [(3, 2, 3, 7), (2, 2, 5, 9), (1, 4, 1, 4)])
def test_circular_norm_is_the_circulant_singular_value(device, out, inp, k, period):
    weight = torch.randn(out, inp, k, dtype=F64, device=device)
    expected = torch.linalg.matrix_norm(_circulant(weight, period), 2)
    torch.testing.assert_close(circular_conv_norm(weight, period), expected, rtol=1e-12, atol=0)


def test_circular_norm_bounds_every_zero_padded_length(device):
    weight = torch.randn(3, 2, 3, dtype=F64, device=device)
    max_len = 6
    period = max_len + 2
    bound = circular_conv_norm(weight, period)
    circulant = _circulant(weight, period)
    for length in range(1, max_len + 1):
        matrix = _zero_padded(weight, length)
        # The explicit matrix is F.conv1d's map (checked against autograd) ...
        def conv_map(v: torch.Tensor, length: int = length) -> torch.Tensor:
            frames = v.reshape(1, length, 2).transpose(1, 2)
            return F.conv1d(frames, weight, padding=1).transpose(1, 2).reshape(-1)

        zeros = torch.zeros(length * 2, dtype=F64, device=device)
        torch.testing.assert_close(torch.autograd.functional.jacobian(conv_map, zeros), matrix)
        # ... a block of rows and columns of the circulant (no wrap-around onto real frames) ...
        rows = torch.arange(length * 3, device=device)
        cols = torch.arange(length * 2, device=device)
        torch.testing.assert_close(circulant[rows][:, cols], matrix)
        # ... so its norm is at most the bound.
        assert torch.linalg.matrix_norm(matrix, 2) <= bound * (1 + 1e-12)


def test_circular_norm_gradient_matches_finite_differences(device):
    weight = torch.randn(2, 2, 3, dtype=F64, device=device, requires_grad=True)
    assert torch.autograd.gradcheck(lambda w: circular_conv_norm(w, 6), (weight,))


@pytest.mark.parametrize("kernel_size", [1, 3, 5])
def test_layer_norm_and_gradient_match_the_direct_computation(device, kernel_size):
    layer = SpectralConv1d(3, 2, kernel_size, 0.8, max_len=5).to(device=device, dtype=F64)
    direct = circular_conv_norm(layer.weight, layer.period)
    (direct_grad,) = torch.autograd.grad(direct, layer.weight)
    cached = layer.operator_norm()
    (cached_grad,) = torch.autograd.grad(cached, layer.weight)
    torch.testing.assert_close(cached, direct, rtol=1e-12, atol=0)
    torch.testing.assert_close(cached_grad, direct_grad, rtol=1e-9, atol=1e-12)


def test_layer_cache_follows_weight_values(device):
    layer = SpectralConv1d(2, 2, 3, 0.8, max_len=5).to(device=device, dtype=F64)
    layer.operator_norm()
    cache = layer._cache
    layer.operator_norm()
    assert layer._cache is cache  # same weights: no new SVD
    with torch.no_grad():
        layer.weight.mul_(2.0)
    torch.testing.assert_close(
        layer.operator_norm(), circular_conv_norm(layer.weight, layer.period), rtol=1e-12, atol=0
    )
    assert layer._cache is not cache


def test_layer_is_normalised_to_its_coefficient(device):
    layer = SpectralConv1d(2, 3, 3, 0.7, max_len=4).to(device=device, dtype=F64)
    with torch.no_grad():
        layer.weight.mul_(10.0)
    assert layer.operator_norm() > 0.7
    torch.testing.assert_close(layer.lipschitz_constant(), torch.tensor(0.7, dtype=F64,
                                                                          device=device))
    effective = circular_conv_norm(layer.weight_normalized(), layer.period)
    torch.testing.assert_close(effective, layer.lipschitz_constant(), rtol=1e-12, atol=0)
    for length in (1, 3, 4):
        x = torch.randn(2, 2, length, dtype=F64, device=device)
        norms = jacobian_norm(
            lambda v: layer(v.transpose(1, 2)).transpose(1, 2), x.transpose(1, 2), "2"
        )
        assert (norms <= 0.7 * (1 + 1e-12)).all()
    # Below the bound the taps are left as they are.
    small = SpectralConv1d(2, 2, 3, 0.9, max_len=4).to(device=device, dtype=F64)
    with torch.no_grad():
        small.weight.mul_(0.5 / float(small.operator_norm()))
    assert torch.equal(small.weight_normalized(), small.weight)


def test_branch_certificate_holds_against_adversarial_search(device):
    branch = _branch(device, coeff=0.9, max_len=5)
    bound = branch.lipschitz_constant()
    torch.testing.assert_close(bound, torch.tensor(0.9, dtype=F64, device=device))
    x = torch.randn(4, 5, 3, dtype=F64, device=device)
    gen = torch.Generator(device=device).manual_seed(0)
    estimate = empirical_lipschitz(branch, x, "2", steps=40, lr=0.2, generator=gen)
    assert 0 < estimate.value <= bound
    mask = torch.tensor([[True] * 5, [True, True, False, True, True]] * 2, device=device)
    exact = jacobian_norm(lambda v: branch(v, mask), estimate.inputs, "2")
    assert (exact <= bound).all()


def test_padding_never_influences_real_outputs(device):
    branch = _branch(device, max_len=4)
    x, mask = padded_batch(device)
    other = torch.where(mask[..., None], x, 100 * torch.randn_like(x))
    out, out_other = branch(x, mask), branch(other, mask)
    assert torch.equal(out, out_other)
    assert out[~mask].abs().max() == 0


def test_exact_logdet_matches_the_jacobian_oracle(device):
    branch = _branch(device, max_len=4)
    block = ResidualTransform(branch, logdet="exact")
    x, mask = padded_batch(device)
    y, logdet = block(x, mask=mask)
    torch.testing.assert_close(logdet, jacobian_logdet(residual_map(branch), x, mask))
    assert torch.equal(y[~mask], x[~mask])
    _, logdet_full = block(x)
    torch.testing.assert_close(logdet_full, jacobian_logdet(residual_map(branch), x))
    # Padded values change neither the density nor a real output.
    other = torch.where(mask[..., None], x, torch.randn_like(x))
    y_other, logdet_other = block(other, mask=mask)
    torch.testing.assert_close(logdet_other, logdet, rtol=1e-12, atol=1e-12)
    assert torch.equal(y_other[mask], y[mask])


def test_inverse_round_trip_with_padding(device):
    block = ResidualTransform(_branch(device, max_len=4), logdet="exact").eval()
    x, mask = padded_batch(device)
    y, logdet = block(x, mask=mask)
    x_back, logdet_inv = block.inverse(y, mask=mask)
    torch.testing.assert_close(x_back, x, atol=1e-9, rtol=0)
    torch.testing.assert_close(logdet_inv, -logdet)


@pytest.mark.parametrize("logdet", ["exact", "roulette"])
def test_gradients_reach_every_parameter(device, logdet):
    branch = _branch(device, max_len=4)
    block = ResidualTransform(branch, logdet=logdet)
    x, mask = padded_batch(device)
    y, logdet = block(x, mask=mask)
    (y.square().sum() + logdet.sum()).backward()
    for name, p in branch.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_gradients_under_torch_func_match_autograd(device):
    branch = _branch(device, max_len=4)
    x, mask = padded_batch(device)
    params = dict(branch.named_parameters())

    def loss(p):
        return torch.func.functional_call(branch, p, (x, mask)).square().sum()

    grads = torch.func.grad(loss)(params)
    loss(params).backward()
    for name, p in params.items():
        torch.testing.assert_close(grads[name], p.grad, rtol=1e-9, atol=1e-12)


def test_roulette_is_unbiased_with_the_conv_branch(device):
    """Mean of independent roulette calls within 4 standard errors of the exact log-det.

    The centre taps are made near-diagonal with a negative last layer and the inputs put where
    LipSwish is steep, so the branch Jacobian is close to -0.7 I: the terms beyond the exact ones
    carry a large part of the log-det and mis-weighted terms would shift the mean.
    """
    branch = _branch(device, coeff=0.8, max_len=3, hidden=3, scale=0.1)
    with torch.no_grad():
        convs = [layer for layer in branch.net if isinstance(layer, SpectralConv1d)]
        for sign, conv in zip((1, 1, -1), convs, strict=True):
            centre = conv.kernel_size // 2
            conv.weight[:, :, centre] += sign * torch.eye(3, dtype=F64, device=device)
    x = 3 + torch.randn(2, 3, 3, dtype=F64, device=device)
    mask = torch.tensor([[True, True, True], [True, False, True]], device=device)
    _, exact = ExactLogDet()(branch, x, mask)
    assert exact.max() < -2
    gen = torch.Generator(device=device).manual_seed(1)
    estimator = RouletteLogDet(n_probes=16, generator=gen)
    calls = 200
    with torch.no_grad():
        draws = torch.stack([estimator(branch, x, mask)[1] for _ in range(calls)])
    z = (draws.mean(0) - exact) / (draws.std(0) / math.sqrt(calls))
    assert (z.abs() < 4).all(), z


def test_bad_arguments_raise(device):
    branch = TemporalConvBranch(2, 4, 3, 0.9, max_len=4).to(device=device, dtype=F64)
    x = torch.randn(2, 4, 2, dtype=F64, device=device)
    with pytest.raises(ValueError, match="max_len=4"):
        branch(torch.randn(2, 5, 2, dtype=F64, device=device))
    with pytest.raises(ValueError, match="max_len=4"):
        branch.lipschitz_constant(5)
    layer = branch.net[0]
    with pytest.raises(ValueError, match="max_len=4"):  # the layer on its own, both layouts
        layer(torch.randn(2, 2, 5, dtype=F64, device=device))
    with pytest.raises(ValueError, match="max_len=4"):
        layer.forward_frames(torch.randn(2, 5, 2, dtype=F64, device=device))
    with pytest.raises(ValueError, match="2 features"):
        branch(torch.randn(2, 4, 3, dtype=F64, device=device))
    with pytest.raises(ValueError, match=r"\(B, N, D\)"):
        branch(x[:, 0])
    with pytest.raises(TypeError, match="dtype"):
        branch(x.float())
    with pytest.raises(ValueError, match="odd"):
        TemporalConvBranch(2, 4, 2, 0.9, max_len=4)
    with pytest.raises(ValueError, match="coeff"):
        TemporalConvBranch(2, 4, 3, 1.0, max_len=4)
    with pytest.raises(TypeError, match="max_len"):
        TemporalConvBranch(2, 4, 3, 0.9)  # type: ignore[call-arg]
    with pytest.raises(ValueError, match="period"):
        circular_conv_norm(torch.randn(1, 1, 5, dtype=F64), 4)
    with pytest.raises(ValueError, match="shape"):
        SpectralConv1d(2, 2, 3, 0.9, max_len=4)(torch.randn(1, 3, 4))
    with pytest.raises(ValueError, match="dilation must be positive"):
        TemporalConvBranch(2, 4, 3, 0.9, max_len=4, dilation=0)
    with pytest.raises(TypeError, match="dilation must be an int"):
        SpectralConv1d(2, 2, 3, 0.9, max_len=4, dilation=1.5)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="dilation must be positive"):
        circular_conv_norm(torch.randn(1, 1, 3, dtype=F64), 8, 0)


@pytest.mark.parametrize("kernel_size", [1, 3, 5])
def test_receptive_radius_is_the_band_of_the_jacobian(device, kernel_size):
    branch = _branch(device, max_len=9, kernel_size=kernel_size)
    radius = branch.receptive_radius
    x = torch.randn(1, 9, 3, dtype=F64, device=device)
    jac = torch.autograd.functional.jacobian(lambda t: branch(t), x)[0, :, :, 0]  # (N, D, N, D)
    distance = (torch.arange(9)[:, None] - torch.arange(9)[None, :]).abs().to(device)
    blocks = jac.abs().amax(dim=(1, 3))  # (N, N): largest entry of each token block
    assert blocks[distance > radius].max() == 0
    assert bool((blocks[distance == radius] > 0).all())


def _causal_zero_padded(weight: torch.Tensor, length: int) -> torch.Tensor:
    """Explicit ``(N out) x (N in)`` causal convolution ``y_t = sum_j W_j x_{t + j - (k - 1)}``."""
    out, inp, k = weight.shape
    matrix = weight.new_zeros(length, out, length, inp)
    for t in range(length):
        for j in range(k):
            s = t + j - (k - 1)
            if s >= 0:
                matrix[t, :, s] = weight[:, :, j]
    return matrix.reshape(length * out, length * inp)


@pytest.mark.parametrize("kernel_size", [1, 2, 3, 4])
def test_causal_layer_is_the_causal_operator_within_its_bound(device, kernel_size):
    """Left padding only (even kernels allowed), and the circular bound covers every length."""
    conv = SpectralConv1d(2, 3, kernel_size, 0.7, max_len=6, causal=True).to(device, F64)
    with torch.no_grad():
        conv.weight.mul_(4.0)
    taps = conv.weight_normalized().detach()
    bound = conv.lipschitz_constant().detach()
    torch.testing.assert_close(bound, torch.tensor(0.7, dtype=F64, device=device))
    for length in range(1, 7):
        x = torch.randn(2, 2, length, dtype=F64, device=device)
        matrix = _causal_zero_padded(taps, length)
        expected = (matrix @ x.transpose(1, 2).reshape(2, -1, 1)).view(2, length, 3)
        torch.testing.assert_close(conv(x) - conv.bias[:, None], expected.transpose(1, 2))
        assert torch.linalg.matrix_norm(matrix, ord=2) <= bound + 1e-12


@pytest.mark.parametrize("kernel_size", [1, 2, 3])
def test_causal_branch_jacobian_is_block_lower_triangular(device, kernel_size):
    """Frame t reads frames t - R .. t only: zero above the block diagonal, a full band below."""
    branch = TemporalConvBranch(3, 4, kernel_size, 0.9, max_len=9, causal=True)
    branch = branch.to(device=device, dtype=F64)
    radius = branch.receptive_radius
    assert branch.causal and radius == 2 * (kernel_size - 1)
    x = torch.randn(1, 9, 3, dtype=F64, device=device)
    jac = torch.autograd.functional.jacobian(lambda t: branch(t), x)[0, :, :, 0]  # (N, D, N, D)
    lag = (torch.arange(9)[:, None] - torch.arange(9)[None, :]).to(device)  # t - s
    blocks = jac.abs().amax(dim=(1, 3))
    assert blocks[(lag < 0) | (lag > radius)].max() == 0
    assert bool((blocks[(lag >= 0) & (lag <= radius)] > 0).all())


def test_causal_branch_masks_padding_and_gaps_and_keeps_its_certificate(device):
    branch = TemporalConvBranch(3, 4, 3, 0.9, max_len=5, causal=True).to(device, F64)
    with torch.no_grad():
        for p in branch.parameters():
            p.mul_(3.0)
    bound = branch.lipschitz_constant()
    torch.testing.assert_close(bound, torch.tensor(0.9, dtype=F64, device=device))
    x = torch.randn(4, 5, 3, dtype=F64, device=device)
    mask = torch.tensor([[True] * 5, [True, True, False, True, True], [True] * 3 + [False] * 2,
                         [False, True, True, True, True]], device=device)
    other = torch.where(mask[..., None], x, 100 * torch.randn_like(x))
    out = branch(x, mask)
    assert torch.equal(out, branch(other, mask)) and out[~mask].abs().max() == 0
    gen = torch.Generator(device=device).manual_seed(0)
    estimate = empirical_lipschitz(branch, x, "2", steps=40, lr=0.2, generator=gen)
    assert 0 < estimate.value <= bound
    assert (jacobian_norm(lambda v: branch(v, mask), estimate.inputs, "2") <= bound).all()


def _spaced(weight: torch.Tensor, dilation: int) -> torch.Tensor:
    """The taps with ``dilation - 1`` zero taps between them, written out tap by tap."""
    out, inp, k = weight.shape
    spaced = weight.new_zeros(out, inp, dilation * (k - 1) + 1)
    for j in range(k):
        spaced[:, :, dilation * j] = weight[:, :, j]
    return spaced


@pytest.mark.parametrize(
    ("k", "dilation", "period"), [(3, 2, 9), (3, 3, 12), (2, 4, 8), (5, 2, 11)]
)
def test_dilated_circular_norm_is_that_of_the_spaced_taps(device, k, dilation, period):
    weight = torch.randn(3, 2, k, dtype=F64, device=device)
    expected = torch.linalg.matrix_norm(_circulant(_spaced(weight, dilation), period), 2)
    torch.testing.assert_close(circular_conv_norm(weight, period, dilation), expected,
                               rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="period"):
        circular_conv_norm(weight, dilation * (k - 1), dilation)


@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("dilation", [2, 3])
def test_dilated_layer_is_the_spaced_operator_within_its_bound(device, causal, dilation):
    """Taps d apart: the map of the spaced kernel on every length up to max_len, its norm within
    the bound, the cached norm and gradient those of the direct computation."""
    conv = SpectralConv1d(2, 3, 3, 0.7, max_len=7, causal=causal, dilation=dilation)
    conv = conv.to(device, F64)
    assert conv.span == 2 * dilation + 1 and conv.period == 7 + 2 * dilation
    direct = circular_conv_norm(conv.weight, conv.period, dilation)
    (direct_grad,) = torch.autograd.grad(direct, conv.weight)
    cached = conv.operator_norm()
    (cached_grad,) = torch.autograd.grad(cached, conv.weight)
    torch.testing.assert_close(cached, direct, rtol=1e-12, atol=0)
    torch.testing.assert_close(cached_grad, direct_grad, rtol=1e-9, atol=1e-12)
    with torch.no_grad():
        conv.weight.mul_(10.0 / float(direct))
    bound = conv.lipschitz_constant().detach()
    torch.testing.assert_close(bound, torch.tensor(0.7, dtype=F64, device=device))
    taps = _spaced(conv.weight_normalized().detach(), dilation)
    for length in range(1, 8):
        x = torch.randn(2, 2, length, dtype=F64, device=device)
        matrix = (_causal_zero_padded if causal else _zero_padded)(taps, length)
        expected = (matrix @ x.transpose(1, 2).reshape(2, -1, 1)).view(2, length, 3)
        torch.testing.assert_close(conv(x) - conv.bias[:, None], expected.transpose(1, 2))
        assert torch.linalg.matrix_norm(matrix, ord=2) <= bound * (1 + 1e-12)


@pytest.mark.parametrize("causal", [False, True])
def test_dilated_branch_reads_frames_dilation_apart(device, causal):
    """Two convolutions with taps d apart: output frame t reads the frames at lags that are
    multiples of d, up to the receptive radius, and no others."""
    dilation, length = 2, 11
    branch = TemporalConvBranch(3, 4, 3, 0.9, max_len=length, causal=causal, dilation=dilation)
    branch = branch.to(device, F64)
    radius = branch.receptive_radius
    assert radius == (2 if causal else 1) * dilation * 2
    x = torch.randn(1, length, 3, dtype=F64, device=device)
    jac = torch.autograd.functional.jacobian(lambda t: branch(t), x)[0, :, :, 0]  # (N, D, N, D)
    lag = (torch.arange(length)[:, None] - torch.arange(length)[None, :]).to(device)  # t - s
    read = (lag % dilation == 0) & (lag <= radius) & (lag >= (0 if causal else -radius))
    blocks = jac.abs().amax(dim=(1, 3))
    assert blocks[~read].max() == 0
    assert bool((blocks[read] > 0).all())
