"""Evaluation helpers: chunked exact densities, averaged estimates, diagnostics."""

from __future__ import annotations

import math

import pytest
import torch

from iresflow.models.evaluation import (
    EXACT_COPIES_PER_CHUNK,
    average_estimates,
    exact_in_chunks,
    inverse_diagnostics,
    lipschitz_report,
)
from iresflow.nn.mlp import LipschitzMLP
from iresflow.transforms.residual import ResidualTransform
from tests.oracles import jacobian


def _mask(lengths: list[int], n: int, device: torch.device) -> torch.Tensor:
    return torch.arange(n, device=device)[None, :] < torch.tensor(lengths, device=device)[:, None]


def _padding_free_sum(xc: torch.Tensor, mc: torch.Tensor | None) -> torch.Tensor:
    """A per-sequence function that ignores padding, with the chunk length in its value."""
    real = xc.sum(-1) if mc is None else xc.sum(-1) * mc
    return real.sum(-1)


@pytest.mark.parametrize("chunk_size", [None, 1, 2, 5, 9])
def test_exact_in_chunks_keeps_order_and_values(device, dtype, chunk_size):
    x = torch.randn(7, 6, 3, device=device, dtype=dtype)
    mask = _mask([6, 1, 3, 6, 2, 5, 4], 6, device)
    lengths: list[tuple[int, int]] = []

    def recording(xc, mc):
        lengths.append((xc.shape[0], xc.shape[1]))
        return _padding_free_sum(xc, mc)

    torch.testing.assert_close(exact_in_chunks(recording, x, mask, chunk_size),
                               _padding_free_sum(x, mask))
    assert sum(c for c, _ in lengths) == 7
    if chunk_size is not None:
        assert all(c <= chunk_size for c, _ in lengths)
    else:  # automatic chunks respect the copy budget
        assert all(c == 1 or c * n * 3 <= EXACT_COPIES_PER_CHUNK for c, n in lengths)
    # Chunks of length-sorted sequences, each cut to its longest sequence.
    ends, stop = sorted([6, 1, 3, 6, 2, 5, 4]), 0
    for c, n in lengths:
        stop += c
        assert n == ends[stop - 1]
    torch.testing.assert_close(exact_in_chunks(_padding_free_sum, x, None, chunk_size),
                               _padding_free_sum(x, None))


def test_average_estimates_mean_and_standard_error(dtype):
    draws = torch.randn(5, 3, dtype=dtype)
    values = iter(draws)
    mean, stderr = average_estimates(lambda: next(values), 5)
    torch.testing.assert_close(mean, draws.mean(0))
    torch.testing.assert_close(stderr, draws.std(0) / math.sqrt(5))
    single, zero = average_estimates(lambda: draws[0], 1)
    assert torch.equal(single, draws[0]) and not bool(zero.any())


def test_inverse_diagnostics_and_lipschitz_report(device, dtype):
    block = ResidualTransform(LipschitzMLP((2, 8, 2), coeff=0.8), logdet="exact")
    block = block.to(device=device, dtype=dtype).eval()
    steps = [("mlp", block)]
    with pytest.raises(RuntimeError, match="no inverse"):
        inverse_diagnostics(steps)
    y = torch.randn(3, 4, 2, device=device, dtype=dtype)
    block.inverse(y)
    diagnostics = inverse_diagnostics(steps)
    stats = block.last_inverse_stats
    assert diagnostics["converged"] and diagnostics["blocks"][0]["name"] == "mlp"
    assert diagnostics["max_iterations"] == int(stats.iterations.max())
    assert diagnostics["max_residual"] == float(stats.residual.max())
    x = torch.randn(2, 3, 2, device=device, dtype=dtype)
    (row,) = lipschitz_report(steps, x)
    local = jacobian(lambda t, m: block.branch(t, m), x)
    expected = max(float(torch.linalg.matrix_norm(j, 2)) for j in local)
    assert row["estimate"] == pytest.approx(expected, rel=1e-6)
    assert row["estimate"] <= row["certified"] <= 0.8 + 1e-6 and row["raw_bound"] is None
    assert (row["name"], row["type"], row["norm"], row["seq_len"]) == ("mlp", "LipschitzMLP",
                                                                       "2", 3)
