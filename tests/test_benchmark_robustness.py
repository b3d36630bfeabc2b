"""The degradation rule and the synthetic data of ``benchmarks/robustness.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from benchmarks.robustness import DEGRADATION_EPOCHS, degraded_run, synthetic_sequences


@pytest.mark.parametrize(
    ("curve", "longest"),
    [
        ([3.0, 2.9, 2.8, 2.7], 0),  # improving
        ([2.99, 3.08, 3.09, 3.10, 3.07, 3.06, 3.05], 6),  # the observed jump, never recovered
        ([3.0, 3.06, 3.0, 3.06, 3.06], 2),  # a recovery resets the run
        ([3.0, 3.04, 3.04, 3.04], 0),  # within the threshold
        ([3.0, 2.0, 2.06, 2.06, 1.9, 1.96], 2),  # measured against the best so far
    ],
)
def test_degraded_run_counts_epochs_above_the_best_so_far(
    curve: list[float], longest: int
) -> None:
    assert degraded_run([{"train_nll": value} for value in curve], 0.05) == longest
    assert DEGRADATION_EPOCHS == 5


def test_synthetic_sequences_are_padded_ar_processes() -> None:
    x, lengths = synthetic_sequences(3, 200, 24, torch.Generator().manual_seed(0))
    assert x.shape == (200, 24, 3) and lengths.shape == (200,)
    assert lengths.min() >= 12 and lengths.max() <= 24
    padding = np.arange(24)[None, :] >= lengths[:, None]
    assert (x[padding] == 0).all() and np.isfinite(x).all()
    # neighbouring frames are correlated (AR(1) with a seasonal term), far ones much less
    real = x[:, :12]
    lag1 = np.mean([np.corrcoef(real[:, t, 0], real[:, t + 1, 0])[0, 1] for t in range(11)])
    assert lag1 > 0.3
    again, _ = synthetic_sequences(3, 200, 24, torch.Generator().manual_seed(0))
    assert np.array_equal(x, again)
