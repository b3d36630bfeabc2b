"""ExactLogDet and the shared estimator interface (docs/math.md#change-of-variables)."""

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
    padded_batch,
    residual_map,
)

from iresflow.logdet.exact import ExactLogDet, jacobian_blocks
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.logdet.series import SeriesLogDet
from iresflow.nn.conditional import ConditionalBranch
from iresflow.nn.conv import TemporalConvBranch

F64 = torch.float64
BRANCHES = {
    "mlp": lambda device: TanhMLPBranch(3, 5, 0.6, device=device),
    "positional-mlp": lambda device: TanhMLPBranch(3, 5, 0.6, positional=True, device=device),
    "mixing": lambda device: MixingBranch(3, 0.6, max_len=4, device=device),
}


@pytest.mark.parametrize("kind", sorted(BRANCHES))
@pytest.mark.parametrize("masked", [False, True])
def test_matches_jacobian_oracle(device, kind, masked):
    branch = BRANCHES[kind](device)
    x, mask = padded_batch(device)
    mask = mask if masked else None
    out, logdet = ExactLogDet()(branch, x, mask)
    expected = jacobian_logdet(residual_map(branch), x, mask)
    assert logdet.shape == (3,) and out.shape == x.shape
    torch.testing.assert_close(logdet, expected, atol=1e-8, rtol=0)
    torch.testing.assert_close(out, branch(x, mask), atol=1e-12, rtol=0)


@pytest.mark.parametrize("kind", sorted(BRANCHES))
def test_prefix_mask_equals_truncated_sequence(device, kind):
    branch = BRANCHES[kind](device)
    x = torch.randn(1, 4, 3, dtype=F64, device=device)
    for real in (1, 2, 3):
        mask = (torch.arange(4, device=device) < real)[None]
        padded = x.clone()
        padded[:, real:] = 1e3  # padding values must not matter
        _, masked_logdet = ExactLogDet()(branch, padded, mask)
        _, short_logdet = ExactLogDet()(branch, x[:, :real])
        torch.testing.assert_close(masked_logdet, short_logdet, atol=1e-12, rtol=0)


def test_position_wise_blocks_are_diagonal_blocks_of_full_jacobian(device):
    branch = TanhMLPBranch(3, 5, 0.6, positional=True, device=device)
    x, mask = padded_batch(device)
    _, blocks = jacobian_blocks(branch, x, mask)
    mixing_view = copy.deepcopy(branch)
    mixing_view.position_wise = False  # instance override: dense path on the same map
    _, full = jacobian_blocks(mixing_view, x, mask)
    full = full[:, 0].reshape(3, 4, 3, 4, 3)
    for n in range(4):
        torch.testing.assert_close(blocks[:, n], full[:, n, :, n, :], atol=1e-14, rtol=0)
        if n > 0:  # off-diagonal blocks vanish for a position-wise branch
            assert full[:, n, :, 0, :].abs().max() == 0


def _long_conv_batch(device: torch.device) -> tuple[TemporalConvBranch, torch.Tensor, torch.Tensor]:
    """A radius-2 convolution branch on sequences longer than its band (9 > 5 tokens)."""
    branch = TemporalConvBranch(2, 4, 3, 0.6, max_len=9).to(device=device, dtype=F64)
    x = torch.randn(3, 9, 2, dtype=F64, device=device)
    mask = torch.ones(3, 9, dtype=torch.bool, device=device)
    mask[1, 6:] = False
    mask[2, 3:5] = False  # a gap inside the sequence
    return branch, x, mask


def test_banded_jacobian_of_a_finite_radius_branch_is_the_full_jacobian(device):
    branch, x, mask = _long_conv_batch(device)
    assert branch.receptive_radius == 2
    _, banded = jacobian_blocks(branch, x, mask)
    dense_view = copy.deepcopy(branch)
    dense_view.receptive_radius = None  # instance override: one copy per Jacobian row
    _, full = jacobian_blocks(dense_view, x, mask)
    torch.testing.assert_close(banded, full, atol=1e-14, rtol=0)
    for m in (mask, None):
        _, logdet = ExactLogDet()(branch, x, m)
        torch.testing.assert_close(logdet, jacobian_logdet(residual_map(branch), x, m),
                                   atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize(("kernel_size", "dilation"), [(1, 1), (3, 1), (5, 1), (3, 2)])
@pytest.mark.parametrize("length", [7, 10, 13])
def test_block_tridiagonal_logdet_matches_dense_oracle(device, kernel_size, dilation, length):
    """Block LU over chunks of R tokens (R = 0, 2, 4; N not a multiple of R; gaps, padding)."""
    branch = TemporalConvBranch(2, 4, kernel_size, 0.8, max_len=length, dilation=dilation)
    branch = branch.to(device, F64)
    with torch.no_grad():  # weights beyond the bound: the rescaling is active
        for p in branch.parameters():
            p.mul_(3.0)
    x = torch.randn(3, length, 2, dtype=F64, device=device)
    mask = torch.ones(3, length, dtype=torch.bool, device=device)
    mask[1, length - 3 :] = False
    mask[2, 2:4] = False
    for m in (mask, None):
        _, logdet = ExactLogDet()(branch, x, m)
        expected = jacobian_logdet(residual_map(branch), x, m)
        assert expected.abs().min() > 1e-6  # a non-trivial determinant
        torch.testing.assert_close(logdet, expected, atol=1e-12, rtol=1e-12)


def test_banded_exact_logdet_gradients_match_finite_differences(device):
    branch, x, mask = _long_conv_batch(device)
    weights = torch.tensor([0.5, -1.5, 2.0], dtype=F64, device=device)

    def loss() -> torch.Tensor:
        return (ExactLogDet()(branch, x, mask)[1] * weights).sum()

    params = list(branch.parameters())
    grads = torch.autograd.grad(loss(), params, materialize_grads=True)
    for g, e in zip(grads, finite_difference_grad(loss, params), strict=True):
        torch.testing.assert_close(g, e, atol=1e-7, rtol=1e-6)


@pytest.mark.parametrize("kind", ["mlp", "mixing"])
def test_gradcheck_wrt_inputs(device, kind):
    branch = BRANCHES[kind](device)
    x, mask = padded_batch(device)
    x = x.requires_grad_()
    estimator = ExactLogDet()
    assert torch.autograd.gradcheck(lambda t: estimator(branch, t, mask), (x,))


@pytest.mark.parametrize("kind", ["mlp", "mixing"])
def test_parameter_gradients_match_finite_differences(device, kind):
    branch = BRANCHES[kind](device)
    x, mask = padded_batch(device)
    weights = torch.tensor([0.5, -1.5, 2.0], dtype=F64, device=device)
    estimator = ExactLogDet()

    def loss() -> torch.Tensor:
        return (estimator(branch, x, mask)[1] * weights).sum()

    params = list(branch.parameters())
    grads = torch.autograd.grad(loss(), params, materialize_grads=True)
    expected = finite_difference_grad(loss, params)
    for g, e in zip(grads, expected, strict=True):
        torch.testing.assert_close(g, e, atol=1e-7, rtol=1e-6)


def test_non_contractive_branch_raises(device):
    branch = ScaleBranch(-2.0, device=device)  # det(I - 2 I) = (-1)^3 on 3 features
    x = torch.randn(2, 2, 3, dtype=F64, device=device)
    with pytest.raises(ValueError, match="not contractive"):
        ExactLogDet()(branch, x)
    singular = ScaleBranch(-1.0, device=device)
    with pytest.raises(ValueError, match="not contractive"):
        ExactLogDet()(singular, x)


def test_stateful_branch_sees_one_forward(device):
    torch.manual_seed(3)
    branch = SpectralNormBranch(3, 0.6, device=device).train()
    x, mask = padded_batch(device)
    reference = copy.deepcopy(branch)
    out_all, logdet_all = ExactLogDet()(branch, x, mask)
    expected_out = reference(x, mask)  # one ordinary training forward
    # buffers advanced exactly once, as by that forward
    for b, r in zip(branch.buffers(), reference.buffers(), strict=True):
        assert torch.equal(b, r)
    torch.testing.assert_close(out_all, expected_out, atol=1e-14, rtol=0)
    frozen = reference.eval()  # evaluation mode reuses the advanced power-iteration state
    expected = jacobian_logdet(residual_map(frozen), x, mask)
    torch.testing.assert_close(logdet_all, expected, atol=1e-8, rtol=0)


def test_no_grad_gives_plain_tensors(device):
    branch = BRANCHES["mixing"](device)
    x, mask = padded_batch(device)
    with_grad = ExactLogDet()(branch, x.requires_grad_(), mask)
    with torch.no_grad():
        out, logdet = ExactLogDet()(branch, x, mask)
    assert not out.requires_grad and not logdet.requires_grad
    torch.testing.assert_close(logdet, with_grad[1].detach())


def test_float32_follows_input(device):
    branch = TanhMLPBranch(3, 5, 0.6, dtype=torch.float32, device=device)
    x = torch.randn(2, 3, 3, device=device)
    out, logdet = ExactLogDet()(branch, x)
    assert out.dtype == logdet.dtype == torch.float32
    assert out.device == logdet.device == x.device
    expected = jacobian_logdet(residual_map(branch.double()), x.double())
    torch.testing.assert_close(logdet.double(), expected, atol=1e-5, rtol=0)


ESTIMATORS = [
    ExactLogDet(),
    SeriesLogDet(n_terms=3),
    RouletteLogDet(),
]


@pytest.mark.parametrize("estimator", ESTIMATORS, ids=lambda e: type(e).__name__)
def test_input_validation(device, estimator):
    branch = ScaleBranch(0.5, device=device)
    x = torch.randn(2, 3, 4, dtype=F64, device=device)
    with pytest.raises(TypeError, match="branch"):
        estimator(torch.nn.Identity(), x)
    with pytest.raises(ValueError, match=r"\(B, N, D\)"):
        estimator(branch, x[:, 0])
    with pytest.raises(TypeError, match="floating-point"):
        estimator(branch, torch.ones(2, 3, 4, dtype=torch.long, device=device))
    with pytest.raises(TypeError, match="float32 or torch.float64"):
        estimator(branch, x.half())
    bad = x.clone()
    bad[0, 1, 2] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        estimator(branch, bad)
    with pytest.raises(ValueError, match="mask must have shape"):
        estimator(branch, x, torch.ones(2, 4, dtype=torch.bool, device=device))
    with pytest.raises(TypeError, match="torch.bool"):
        estimator(branch, x, torch.ones(2, 3, device=device))



def test_slogdet_is_exact_for_large_batches_with_several_threads():
    # Batched CPU LU with 2 threads returned log-dets off by ~1e-2 for 348 x 348 matrices.
    from iresflow.logdet.exact import _slogdet

    generator = torch.Generator().manual_seed(0)
    a = torch.eye(348, dtype=torch.float64) + 0.02 * torch.randn(
        5, 348, 348, dtype=torch.float64, generator=generator
    )
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        sign, logabsdet = _slogdet(a)
    finally:
        torch.set_num_threads(threads)
    expected = torch.stack([torch.logdet(m) for m in a])  # one matrix at a time, 1 thread
    assert bool((sign == 1).all())
    torch.testing.assert_close(logabsdet, expected, rtol=0, atol=1e-10)


def _causal_batch(
    device: torch.device, kernel_size: int, length: int, dilation: int = 1
) -> tuple[TemporalConvBranch, torch.Tensor, torch.Tensor]:
    """A causal convolution branch beyond its bound, sequences with end padding and a gap."""
    branch = TemporalConvBranch(2, 4, kernel_size, 0.8, max_len=length, causal=True,
                                dilation=dilation)
    branch = branch.to(device, F64)
    with torch.no_grad():
        for p in branch.parameters():
            p.mul_(3.0)
    x = torch.randn(3, length, 2, dtype=F64, device=device)
    mask = torch.ones(3, length, dtype=torch.bool, device=device)
    mask[1, length - 2 :] = False
    mask[2, 1:2] = False
    return branch, x, mask


@pytest.mark.parametrize(("kernel_size", "dilation"), [(1, 1), (2, 1), (3, 1), (2, 3)])
@pytest.mark.parametrize("length", [3, 9])
def test_causal_diagonal_blocks_are_those_of_the_dense_jacobian(device, kernel_size, dilation,
                                                                length):
    """Coloured with period R + 1 (R < N - 1) or one copy per row (R >= N - 1): the blocks are
    the diagonal of the dense Jacobian, which is zero above it."""
    branch, x, mask = _causal_batch(device, kernel_size, length, dilation)
    for m in (mask, None):
        _, blocks = jacobian_blocks(branch, x, m)
        assert blocks.shape == (3, length, 2, 2)
        full = jacobian(branch, x, m).reshape(3, length, 2, length, 2)
        for t in range(length):
            torch.testing.assert_close(blocks[:, t], full[:, t, :, t], atol=1e-14, rtol=0)
            assert (full[:, t, :, t + 1 :] == 0).all()  # block lower-triangular


@pytest.mark.parametrize("kernel_size", [1, 2, 3])
@pytest.mark.parametrize("length", [3, 9])
@pytest.mark.parametrize("conditional", [False, True])
def test_causal_logdet_matches_dense_oracle(device, kernel_size, length, conditional):
    """Sum of diagonal-block log-dets over real frames = slogdet of the whole step (gaps,
    padding; a conditional branch bound to its context)."""
    branch, x, mask = _causal_batch(device, kernel_size, length)
    context = torch.randn(3, 2, dtype=F64, device=device)
    if conditional:
        torch.manual_seed(0)
        wrapped = ConditionalBranch(branch, context_features=2, context_hidden=4).to(device, F64)
        with torch.no_grad():
            for p in wrapped.context_net.parameters():
                p.copy_(torch.randn_like(p))
        estimated = wrapped.bind(context)
        assert estimated.causal
    for m in (mask, None):
        _, logdet = ExactLogDet()(estimated if conditional else branch, x, m)
        expected = []
        for b in range(3):
            mb = None if m is None else m[b : b + 1]
            if conditional:
                g = lambda t, mt, b=b: wrapped(t, mt, context[b : b + 1])  # noqa: E731
            else:
                g = branch
            expected.append(jacobian_logdet(residual_map(g), x[b : b + 1], mb))
        expected = torch.cat(expected)
        assert expected.abs().min() > 1e-6  # a non-trivial determinant
        torch.testing.assert_close(logdet, expected, atol=1e-10, rtol=0)
