"""SeriesLogDet: exact-trace series, truncation bound, Hutchinson traces (docs/math.md#hutchinson,
#truncation)."""

from __future__ import annotations

import math

import pytest
import torch
from oracles import (
    MixingBranch,
    ScaleBranch,
    TanhMLPBranch,
    jacobian_logdet,
    padded_batch,
    residual_map,
)

from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.series import SeriesLogDet

F64 = torch.float64
BRANCHES = {
    "mlp": lambda device, lip: TanhMLPBranch(3, 5, lip, positional=True, device=device),
    "mixing": lambda device, lip: MixingBranch(3, lip, max_len=4, device=device),
}


@pytest.mark.parametrize("kind", sorted(BRANCHES))
@pytest.mark.parametrize("masked", [False, True])
def test_exact_trace_series_converges_to_slogdet(device, kind, masked):
    """H10: 80 exact-trace terms agree with slogdet to 1e-12 for L <= 0.6."""
    branch = BRANCHES[kind](device, 0.6)
    x, mask = padded_batch(device, 0.3)
    mask = mask if masked else None
    out, logdet = SeriesLogDet(n_terms=80, exact_trace=True)(branch, x, mask)
    expected = jacobian_logdet(residual_map(branch), x, mask)
    assert expected.abs().min() > 0.05  # a non-trivial log-determinant
    torch.testing.assert_close(logdet, expected, atol=1e-12, rtol=0)
    torch.testing.assert_close(out, branch(x, mask), atol=0, rtol=0)


@pytest.mark.parametrize("kind", sorted(BRANCHES))
@pytest.mark.parametrize("lip", [0.5, 0.9])
def test_truncation_error_within_bound(device, kind, lip):
    """H11: |error at n terms| <= d * sum_{k>n} L^k / k with the certified L and d = real N D."""
    branch = BRANCHES[kind](device, lip)
    x, mask = padded_batch(device, 0.3)
    lipschitz = branch.lipschitz_constant().item()
    assert lipschitz == pytest.approx(lip)
    _, exact = ExactLogDet()(branch, x, mask)
    dims = mask.sum(1).to(F64) * x.shape[-1]
    for n in range(1, 9):
        _, truncated = SeriesLogDet(n_terms=n, exact_trace=True)(branch, x, mask)
        tail = -math.log(1 - lipschitz) - sum(lipschitz**k / k for k in range(1, n + 1))
        error = (truncated - exact).abs()
        assert (error <= dims * tail).all(), (n, error, dims * tail)
        assert (error > 0).all()


def test_rademacher_traces_of_scaled_identity_are_exact(device):
    """With J = c I and Rademacher probes, v^T J^k v = d c^k for every probe."""
    c = -0.6
    branch = ScaleBranch(c, device=device)
    x, mask = padded_batch(device, 0.3)
    gen = torch.Generator(device=device).manual_seed(0)
    n = 7
    _, logdet = SeriesLogDet(n_terms=n, n_probes=3, generator=gen)(branch, x, mask)
    dims = mask.sum(1).to(F64) * x.shape[-1]
    expected = dims * sum((-1) ** (k + 1) / k * c**k for k in range(1, n + 1))
    torch.testing.assert_close(logdet, expected, atol=1e-13, rtol=0)


@pytest.mark.parametrize("probe", ["rademacher", "gaussian"])
def test_hutchinson_series_is_unbiased_for_the_truncated_series(device, probe):
    """Independent draws (the batch repeated R times) average to the exact-trace series."""
    branch = BRANCHES["mixing"](device, 0.6)
    x, mask = padded_batch(device, 0.3)
    repeats = 2000
    gen = torch.Generator(device=device).manual_seed(1)
    estimator = SeriesLogDet(n_terms=4, probe=probe, generator=gen)
    with torch.no_grad():
        _, draws = estimator(branch, x.repeat(repeats, 1, 1), mask.repeat(repeats, 1))
    draws = draws.view(repeats, -1)
    _, expected = SeriesLogDet(n_terms=4, exact_trace=True)(branch, x, mask)
    z = (draws.mean(0) - expected) / (draws.std(0) / math.sqrt(repeats))
    assert (z.abs() < 4).all(), z


def test_probes_share_one_chain_and_average(device):
    """n_probes = P equals the mean of the P single-probe estimates drawn in the same order."""
    branch = BRANCHES["mlp"](device, 0.6)
    x, mask = padded_batch(device, 0.3)
    seed = 5
    gen = torch.Generator(device=device).manual_seed(seed)
    _, multi = SeriesLogDet(n_terms=5, n_probes=4, generator=gen)(branch, x, mask)
    gen = torch.Generator(device=device).manual_seed(seed)
    _, stacked = SeriesLogDet(n_terms=5, generator=gen)(
        branch, x.repeat(4, 1, 1), mask.repeat(4, 1)
    )
    torch.testing.assert_close(multi, stacked.view(4, -1).mean(0), atol=1e-14, rtol=0)


@pytest.mark.parametrize("exact_trace", [False, True])
def test_gradcheck(device, exact_trace):
    """Gradients are those of the estimate (fixed probes: a fresh generator per evaluation)."""
    branch = BRANCHES["mixing"](device, 0.6)
    x, mask = padded_batch(device, 0.3)
    x.requires_grad_()

    def estimate(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        gen = torch.Generator(device=device).manual_seed(2)
        estimator = SeriesLogDet(n_terms=4, n_probes=2, exact_trace=exact_trace, generator=gen)
        return estimator(branch, t, mask)

    assert torch.autograd.gradcheck(estimate, (x,))


def test_parameter_gradients_reach_every_parameter(device):
    branch = BRANCHES["mixing"](device, 0.6)
    x, mask = padded_batch(device, 0.3)
    _, logdet = SeriesLogDet(n_terms=3)(branch, x, mask)
    logdet.sum().backward()
    for name, p in branch.named_parameters():
        assert p.grad is not None and p.grad.abs().sum() > 0, name


def test_padding_does_not_matter(device):
    branch = BRANCHES["mixing"](device, 0.6)
    x, mask = padded_batch(device, 0.3)
    other = torch.where(mask[..., None], x, torch.randn_like(x))
    results = []
    for inputs in (x, other):
        gen = torch.Generator(device=device).manual_seed(3)
        results.append(SeriesLogDet(n_terms=6, n_probes=2, generator=gen)(branch, inputs, mask))
    torch.testing.assert_close(results[0][1], results[1][1], atol=0, rtol=0)
    assert results[0][0][~mask].abs().max() == 0


def test_no_grad_and_dtype(device):
    branch = TanhMLPBranch(3, 5, 0.6, dtype=torch.float32, device=device)
    x = torch.randn(2, 3, 3, device=device, requires_grad=True)
    with torch.no_grad():
        out, logdet = SeriesLogDet(n_terms=3)(branch, x)
    assert not out.requires_grad and not logdet.requires_grad
    assert logdet.dtype == torch.float32 and logdet.device == x.device


def test_bad_arguments():
    with pytest.raises(ValueError, match="n_terms"):
        SeriesLogDet(n_terms=0)
    with pytest.raises(ValueError, match="n_probes"):
        SeriesLogDet(n_probes=0)
    with pytest.raises(ValueError, match="probe"):
        SeriesLogDet(probe="uniform")
    with pytest.raises(TypeError, match="exact_trace"):
        SeriesLogDet(exact_trace=1)
    with pytest.raises(TypeError, match="generator"):
        SeriesLogDet(generator=0)
