"""The base density of sequence flows and the padding masks of samples (docs/math.md#masks)."""

from __future__ import annotations

import math

import pytest
import torch

from iresflow.models.distributions import StandardNormalSequence, sample_mask


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
