"""The base densities of sequence flows (docs/math.md#masks, docs/math.md#student-t-base) and the
padding masks of samples."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from scipy import stats

from iresflow.models.distributions import (
    NU_INIT,
    NU_MIN,
    StandardNormalSequence,
    StudentTSequence,
    make_base,
    sample_mask,
)


def _mask(lengths: list[int], n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def test_standard_normal_base_matches_torch_distributions(device, dtype):
    base = StandardNormalSequence(3)
    z = torch.randn(2, 4, 3, device=device, dtype=dtype)
    mask = _mask([4, 2], 4, device)
    expected = (torch.distributions.Normal(0.0, 1.0).log_prob(z).sum(-1) * mask).sum(-1)
    torch.testing.assert_close(base.log_prob(z, mask), expected)
    samples = base.sample(mask, torch.Generator(device).manual_seed(1), 0.5, dtype=dtype)
    again = base.sample(mask, torch.Generator(device).manual_seed(1), 0.5, dtype=dtype)
    assert torch.equal(samples, again) and samples.dtype == dtype
    assert bool((samples[~mask] == 0).all())
    big = base.sample(torch.ones(4000, 1, dtype=torch.bool, device=device),
                      torch.Generator(device).manual_seed(2), 0.5, dtype=torch.float64)
    # The standard deviation of the sample std of n normals is about sigma / sqrt(2 n).
    assert abs(float(big.std()) - 0.5) < 4 * 0.5 / math.sqrt(2 * big.numel())
    with pytest.raises(TypeError, match="mask"):
        base.sample(torch.ones(2, 3, device=device))
    with pytest.raises(ValueError, match="temperature"):
        base.sample(mask, temperature=-1.0)


def test_sample_mask_from_a_length_or_per_sample_lengths(device):
    assert sample_mask(2, 3, None, 4, device).tolist() == [[True] * 3] * 2
    lengths = torch.tensor([2, 4, 1], device=device)
    assert torch.equal(sample_mask(3, None, lengths, 4, device), _mask([2, 4, 1], 4, device))
    assert sample_mask(1, 50, None, None).shape == (1, 50)  # no max_len: any length
    with pytest.raises(ValueError, match="max_len"):
        sample_mask(1, 5, None, 4)


# -- Student-t bases (docs/math.md#student-t-base) -------------------------------------------


def _student_t(features: int, nu: list[float] | float, group: str, device, dtype):
    base = StudentTSequence(features, group=group).to(device=device, dtype=dtype)
    with torch.no_grad():
        base.log_excess.copy_(torch.log(torch.as_tensor(nu, dtype=dtype) - NU_MIN))
    return base


def test_independent_student_t_log_prob_matches_scipy(device, dtype):
    nu = [2.5, 4.0, 40.0]
    base = _student_t(3, nu, "feature", device, dtype)
    z = 3 * torch.randn(3, 6, 3, device=device, dtype=dtype)
    mask = torch.tensor([[1, 1, 1, 1, 1, 1], [1, 0, 0, 1, 1, 0], [0, 1, 1, 1, 0, 0]],
                        dtype=torch.bool, device=device)  # gaps and padding
    per_frame = stats.t.logpdf(z.cpu().double().numpy(), df=np.array(nu)).sum(-1)
    expected = (per_frame * mask.cpu().numpy()).sum(-1)
    np.testing.assert_allclose(base.log_prob(z, mask).detach().cpu().numpy(), expected,
                               rtol=1e-10 if dtype == torch.float64 else 1e-5)
    z_changed = torch.where(mask.unsqueeze(-1), z, 1e3)  # masked frames never enter
    torch.testing.assert_close(base.log_prob(z_changed, mask), base.log_prob(z, mask))
    torch.testing.assert_close(base.log_prob(z), base.log_prob(z, torch.ones_like(mask)))


def test_multivariate_t_log_prob_matches_scipy(device, dtype):
    base = _student_t(4, 3.5, "frame", device, dtype)
    z = 2 * torch.randn(2, 5, 4, device=device, dtype=dtype)
    mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 1, 1]], dtype=torch.bool, device=device)
    frames = z.cpu().double().numpy().reshape(-1, 4)
    per_frame = stats.multivariate_t.logpdf(frames, shape=np.eye(4), df=3.5).reshape(2, 5)
    expected = (per_frame * mask.cpu().numpy()).sum(-1)
    np.testing.assert_allclose(base.log_prob(z, mask).detach().cpu().numpy(), expected,
                               rtol=1e-10 if dtype == torch.float64 else 1e-5)


def test_sequence_t_log_prob_is_one_multivariate_t_over_the_real_frames(device, dtype):
    base = _student_t(3, 2.7, "sequence", device, dtype)
    z = 2 * torch.randn(3, 5, 3, device=device, dtype=dtype)
    mask = torch.tensor([[1, 0, 1, 1, 0], [1, 1, 1, 1, 1], [0, 0, 1, 0, 0]], dtype=torch.bool,
                        device=device)  # a gap, a full sequence, one real frame
    values = z.cpu().double().numpy()
    expected = [stats.multivariate_t.logpdf(values[b][m].reshape(-1), df=2.7,
                                            shape=np.eye(3 * int(m.sum())))
                for b, m in enumerate(mask.cpu().numpy())]
    np.testing.assert_allclose(base.log_prob(z, mask).detach().cpu().numpy(), expected,
                               rtol=1e-10 if dtype == torch.float64 else 1e-5)
    z_changed = torch.where(mask.unsqueeze(-1), z, 1e3)  # masked frames never enter
    torch.testing.assert_close(base.log_prob(z_changed, mask), base.log_prob(z, mask))
    torch.testing.assert_close(base.log_prob(z), base.log_prob(z, torch.ones_like(mask)))


@pytest.mark.parametrize("group", ["feature", "frame", "sequence"])
def test_student_t_log_prob_is_differentiable_in_nu(group):
    nu = [3.0, 7.0, 20.0] if group == "feature" else 5.0
    base = _student_t(3, nu, group, "cpu", torch.float64)
    z = 2 * torch.randn(2, 4, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 0, 1], [1, 1, 1, 0]], dtype=torch.bool)

    start = base.log_excess.detach().clone().requires_grad_()
    del base.log_excess  # the parameter becomes the input of gradcheck

    def log_prob(log_excess: torch.Tensor) -> torch.Tensor:
        base.log_excess = log_excess
        return base.log_prob(z, mask)

    assert torch.autograd.gradcheck(log_prob, start)


@pytest.mark.parametrize("group", ["feature", "frame", "sequence"])
def test_student_t_samples_follow_scipy(device, group):
    """Kolmogorov-Smirnov tests at a fixed seed: every coordinate is Student-t (scaled by the
    temperature); the squared norm of a group of k coordinates is k F(k, nu), so over a frame
    it is F(D, nu) for the frame and sequence groups, not for independent features; over a
    sequence of two frames it is F(2D, nu) for the sequence group only."""
    nu, features = 4.0, 3
    base = _student_t(features, nu, group, device, torch.float64)
    mask = torch.ones(4000, 2, dtype=torch.bool, device=device)
    z = base.sample(mask, torch.Generator(device).manual_seed(3), 0.5,
                    dtype=torch.float64).cpu().numpy()
    for d in range(features):
        assert stats.kstest(z[:, 0, d], stats.t(df=nu, scale=0.5).cdf).pvalue > 1e-3
    frame = np.square(2 * z[:, 0]).sum(-1) / features
    p_frame = stats.kstest(frame, stats.f(features, nu).cdf).pvalue
    assert (p_frame > 1e-3) if group != "feature" else (p_frame < 1e-3)
    sequence = np.square(2 * z).sum((1, 2)) / (2 * features)
    p_sequence = stats.kstest(sequence, stats.f(2 * features, nu).cdf).pvalue
    assert (p_sequence > 1e-3) if group == "sequence" else (p_sequence < 1e-3)


def test_student_t_sampling_respects_the_mask_and_the_generator(device, dtype):
    base = _student_t(2, [3.0, 9.0], "feature", device, dtype)
    mask = _mask([4, 2, 1], 4, device)
    draw = base.sample(mask, torch.Generator(device).manual_seed(1), dtype=dtype)
    again = base.sample(mask, torch.Generator(device).manual_seed(1), dtype=dtype)
    assert torch.equal(draw, again) and draw.dtype == dtype and draw.device.type == device.type
    assert bool((draw[~mask] == 0).all()) and bool(draw[mask].ne(0).all())
    assert torch.isfinite(base.log_prob(draw, mask)).all()
    with pytest.raises(TypeError, match="mask"):
        base.sample(torch.ones(2, 3, device=device))
    with pytest.raises(ValueError, match="temperature"):
        base.sample(mask, temperature=0.0)


def test_make_base_and_student_t_arguments():
    assert isinstance(make_base("normal", 2), StandardNormalSequence)
    independent, joint = make_base("student-t", 3), make_base("multivariate-t", 3)
    sequence = make_base("sequence-t", 3)
    assert (independent.group, joint.group, sequence.group) == ("feature", "frame", "sequence")
    torch.testing.assert_close(independent.nu, torch.full((3,), NU_INIT))
    torch.testing.assert_close(joint.nu, torch.full((1,), NU_INIT))
    torch.testing.assert_close(sequence.nu, torch.full((1,), NU_INIT))
    with pytest.raises(ValueError, match="base must be one of normal, student-t"):
        make_base("cauchy", 3)
    with pytest.raises(ValueError, match="nu_init"):
        StudentTSequence(3, nu_init=NU_MIN)
    with pytest.raises(ValueError, match="group must be one of feature, frame, sequence"):
        StudentTSequence(3, group="batch")
