"""Relative mixing branch (docs/math.md#relative-mixing): weights, masks and certificate."""

from __future__ import annotations

import pytest
import torch

from iresflow.models.config import ModelConfig
from iresflow.models.residual_flow import ResidualSequenceFlow
from iresflow.nn.diagnostics import empirical_lipschitz, jacobian_norm
from iresflow.nn.relative import SCORE_SCALE, RelativeMixingBranch

F64 = torch.float64


def _branch(window: int = 3, scale: float = 2.0, seed: int = 0) -> RelativeMixingBranch:
    torch.manual_seed(seed)
    branch = RelativeMixingBranch(features=2, hidden=8, window=window).double()
    with torch.no_grad():
        branch.scores.normal_(0.0, scale)
    return branch


def _direct_weights(scores: torch.Tensor, real: list[bool], window: int) -> torch.Tensor:
    """P entry by entry: softmax over the real keys of b(clip(j - i, -W, W))."""
    n = len(real)
    rows = []
    for i in range(n):
        logits = torch.tensor([float(scores[min(max(j - i, -window), window) + window])
                               if real[j] else -float("inf") for j in range(n)], dtype=F64)
        rows.append(torch.softmax(logits, 0))
    return torch.stack(rows)


def test_output_is_the_mlp_of_the_weighted_average_over_real_keys() -> None:
    branch = _branch()
    x = torch.randn(2, 7, 2, dtype=F64)
    mask = torch.tensor([[True] * 7, [True, False, True, True, True, False, False]])
    out = branch(x, mask)
    for b in range(2):
        weights = _direct_weights(SCORE_SCALE * branch.scores.detach(), mask[b].tolist(), 3)
        torch.testing.assert_close(branch.mixing_weights(7, mask)[b], weights)
        expected = branch.mlp(weights @ x[b : b + 1]) * mask[b, :, None]
        torch.testing.assert_close(out[b : b + 1], expected, rtol=1e-12, atol=1e-12)
    assert torch.all(out[1, ~mask[1]] == 0)


def test_padded_inputs_never_reach_real_outputs() -> None:
    branch = _branch()
    x = torch.randn(1, 6, 2, dtype=F64)
    mask = torch.tensor([[True, True, False, True, False, True]])
    changed = x.clone()
    changed[~mask] = torch.tensor([1e6, -1e6], dtype=F64)
    torch.testing.assert_close(branch(changed, mask), branch(x, mask), rtol=0, atol=0)


@pytest.mark.parametrize("length", [2, 5, 17])
def test_adversarial_jacobian_stays_below_the_certificate(length: int) -> None:
    # Exact infinity-norm Jacobians at random and adversarial inputs, sharp and flat scores.
    for scale in (0.0, 1.0, 6.0):
        branch = _branch(window=4, scale=scale, seed=length)
        certified = float(branch.lipschitz_constant())
        x = torch.randn(3, length, 2, dtype=F64) * 3
        assert float(jacobian_norm(branch, x, "inf").max()) <= certified + 1e-12
        found = empirical_lipschitz(branch, x, "inf", steps=25, lr=0.1)
        assert 0 < float(found.value) <= certified + 1e-12


def test_a_sharp_offset_copies_the_frame_that_far_back() -> None:
    # With all weight on offset -2, the MLP reads x_{i-2} (clipped at the start: nearest offset).
    branch = _branch(window=3, scale=0.0)
    with torch.no_grad():
        branch.scores[1] = 60.0 / SCORE_SCALE  # offset -2
    x = torch.randn(1, 6, 2, dtype=F64)
    out = branch(x)
    torch.testing.assert_close(out[:, 2:], branch.mlp(x[:, :-2]), rtol=1e-10, atol=1e-12)


def test_model_setting_builds_relative_layers() -> None:
    model = ResidualSequenceFlow(features=2, max_len=9, layers=("relative", "mlp"), n_blocks=1)
    (relative,) = [s.branch for s in model.transform.steps
                   if isinstance(getattr(s, "branch", None), RelativeMixingBranch)]
    assert relative.window == 8  # the longest sequence minus one
    config = ModelConfig(features=2, max_len=9, layers=("relative", "mlp"), relative_window=3,
                         attention="lipschitznorm")  # no attention layer: the kind is irrelevant
    model = ResidualSequenceFlow(config)
    assert [s.branch.window for s in model.transform.steps
            if isinstance(getattr(s, "branch", None), RelativeMixingBranch)] == [3] * 3
    with pytest.raises(ValueError, match="window"):
        RelativeMixingBranch(features=2, hidden=4, window=0)
    with pytest.raises(ValueError, match="hidden"):
        RelativeMixingBranch(features=2, hidden=0, window=2)
    with pytest.raises(ValueError, match="coeff"):
        RelativeMixingBranch(features=2, hidden=4, window=2, coeff=-0.5)
