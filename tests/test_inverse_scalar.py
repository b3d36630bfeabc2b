"""Starting points from the tabulated inverse of a per-frame branch on one feature
(docs/guide.md#inversion): accuracy against the solved inverse, its fallbacks, and its use by the
residual step's inverse and its pinned (forecast) inverse."""

from __future__ import annotations

import pytest
import torch
from test_transforms_residual import make_branch, padding_mask, round_trip

from iresflow.inverse.fixed_point import fixed_point_inverse
from iresflow.inverse.scalar import TABLE_POINTS, scalar_start
from iresflow.transforms import residual
from iresflow.transforms.base import SequenceTransform
from iresflow.transforms.residual import ResidualTransform

F64 = torch.float64


def wavy(x: torch.Tensor) -> torch.Tensor:
    """A scalar map with Lipschitz constant 0.95 whose slope changes sign."""
    return 0.95 * torch.sin(x) + 0.3


def solved(g, values: torch.Tensor) -> torch.Tensor:
    """The inverse of ``x + g(x)`` at ``values`` ``(n,)`` by the engine, frame by frame."""
    x, stats = fixed_point_inverse(g, values.view(1, -1, 1), solver="anderson", position_wise=True)
    assert bool(stats.converged.all())
    return x.view(-1)


def test_the_start_approaches_the_inverse_with_the_cube_of_the_spacing(device):
    values = torch.linspace(-6.0, 5.0, 500, device=device, dtype=F64)
    truth = solved(wavy, values)
    errors = [float((scalar_start(wavy, values, points) - truth).abs().max())
              for points in (64, 128, 256)]
    assert errors[0] < 1e-2
    # each halving of the spacing divides the error by about eight (cubic interpolation)
    assert errors[1] < errors[0] / 5 and errors[2] < errors[1] / 5, errors


def test_the_table_reaches_the_smallest_and_largest_values(device):
    """The bracket's ends lie beyond the extreme values' solutions, however far ``g`` moves
    them (a constant of 40 needs several widenings), so no value is extrapolated."""
    values = torch.randn(300, device=device, dtype=F64) * 4
    ends = torch.stack([values.argmin(), values.argmax()])
    for g in (wavy, lambda x: wavy(x) + 40.0):
        start = scalar_start(g, values, points=256)
        torch.testing.assert_close(start[ends], solved(g, values[ends]), atol=1e-3, rtol=0)


def test_a_per_frame_branch_is_tabulated_at_its_points(device):
    branch = make_branch("mlp", device, 0.97, features=1)
    seen: list[tuple[int, ...]] = []

    def g(x: torch.Tensor) -> torch.Tensor:
        seen.append(tuple(x.shape))
        return branch(x)

    values = torch.randn(2000, device=device, dtype=F64) * 3
    start = scalar_start(g, values, points=256)
    assert (1, 256, 1) in seen
    with torch.no_grad():
        assert float((start - solved(branch, values)).abs().max()) < 1e-5


def test_one_value_starts_at_its_solution(device):
    values = torch.full((7,), 2.5, device=device, dtype=F64)
    torch.testing.assert_close(scalar_start(wavy, values, points=8),
                               solved(wavy, values[:1]).expand(7), atol=1e-3, rtol=0)


def test_a_map_that_is_not_contractive_starts_at_the_values(device):
    values = torch.linspace(-2.0, 2.0, 50, device=device, dtype=F64)
    for g in (lambda x: -1.5 * torch.sin(3 * x),  # x + g(x) is not monotone
              lambda x: 10.0 * torch.exp(-x)):  # x + g(x) = -2 has no solution
        assert torch.equal(scalar_start(g, values, points=16), values)


def test_bad_arguments_raise(device):
    with pytest.raises(ValueError, match="values must have shape"):
        scalar_start(wavy, torch.zeros(3, 2, device=device, dtype=F64))
    with pytest.raises(ValueError, match="points must be at least 4"):
        scalar_start(wavy, torch.zeros(3, device=device, dtype=F64), points=3)
    with pytest.raises(ValueError, match="values must have shape"):
        scalar_start(wavy, torch.zeros(0, device=device, dtype=F64))
    with pytest.raises(ValueError, match="values contains NaN or Inf"):
        scalar_start(wavy, torch.tensor([0.0, float("nan")], device=device, dtype=F64))
    with pytest.raises(TypeError, match="values must be a floating-point tensor"):
        scalar_start(wavy, torch.arange(3, device=device))
    with pytest.raises(TypeError, match="values must be a floating-point tensor"):
        scalar_start(wavy, [0.0, 1.0])
    with pytest.raises(TypeError, match="points must be an int"):
        scalar_start(wavy, torch.zeros(3, device=device, dtype=F64), points=8.0)


def many_frames(device, batch: int = 6, length: int = 200):
    """A per-frame step on one feature and padded sequences with more real frames than the
    table has points."""
    branch = make_branch("mlp", device, 0.97, features=1)
    block = ResidualTransform(branch, logdet="exact", inverse_solver="anderson")
    x = 3 * torch.randn(batch, length, 1, device=device, dtype=F64)
    mask = padding_mask([length, 190, 170, length, 185, 200][:batch], length, device)
    return block, x, mask


def test_the_residual_inverse_starts_from_the_table(device, monkeypatch):
    """With more frames than table points the inverse needs fewer evaluations than the same
    solve started at ``y``, and returns the same solution."""
    block, x, mask = many_frames(device)
    assert int(mask.sum()) > TABLE_POINTS
    y, x_rec, stats = round_trip(block, x, mask)
    monkeypatch.setattr(residual, "TABLE_POINTS", 10**9)  # no table: the solve starts at y
    plain, _ = block.inverse(y, mask=mask)
    assert int(stats.iterations.max()) < int(block.last_inverse_stats.iterations.max())
    assert float((x_rec - plain)[mask].abs().max()) < 1e-9


def test_few_frames_start_at_y(device):
    block, x, mask = many_frames(device, batch=2, length=100)
    assert int(mask.sum()) <= TABLE_POINTS
    y, _ = block(x, mask=mask)
    block.inverse(y, mask=mask)
    _, plain_stats = fixed_point_inverse(block.branch, torch.where(mask[..., None], y, 0.0),
                                         args=(mask,), solver="anderson", position_wise=True)
    assert torch.equal(block.last_inverse_stats.iterations, plain_stats.iterations)


def test_the_pinned_inverse_starts_its_new_frames_from_the_table(device, monkeypatch):
    """Forecasts: the new frames start from the table, the known ones are held, and the result
    is the whole inverse with the known frames put back."""
    block, x, mask = many_frames(device)
    known = mask & (torch.arange(x.shape[1], device=device) < 20)
    assert int((mask & ~known).sum()) > TABLE_POINTS
    y, _ = block(x, mask=mask)
    pinned = block.inverse_pinned(y, x, known, None, mask)
    iterations = int(block.last_inverse_stats.iterations.max())
    whole = SequenceTransform.inverse_pinned(block, y, x, known, None, mask)
    torch.testing.assert_close(pinned, whole, atol=1e-9, rtol=0)
    monkeypatch.setattr(residual, "TABLE_POINTS", 10**9)
    block.inverse_pinned(y, x, known, None, mask)
    assert iterations < int(block.last_inverse_stats.iterations.max())
