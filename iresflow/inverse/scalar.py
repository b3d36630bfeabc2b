r"""Starting points for the frames of a per-frame branch on one feature, from its inverse
tabulated on a grid (docs/guide.md#inversion, docs/math.md#fixed-point-inverse).

On one feature a position-wise branch is one scalar map :math:`g` applied to every frame, and
:math:`f(x) = x + g(x)` is strictly increasing: :math:`f' \ge 1 - L > 0` where :math:`L < 1`
is the branch's Lipschitz constant. Its inverse is therefore a smooth increasing function of one
number, which a table of :math:`f` at a thousand points, interpolated, gives to about the
solver's tolerance for every frame at once: the fixed-point solve that starts there mostly
checks its start instead of iterating towards it. The start changes where the solve begins, not
what it returns: the solution is still the one that meets the solver's stopping rule.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor

from iresflow._validation import check_finite

__all__ = ["TABLE_POINTS", "scalar_start"]

# Rounds of moving the ends of the bracket outwards, each twice as far: from a quarter of |g|
# at the ends, far beyond the 1 / (1 - L) times |g| that brackets for every L < 1 - 1e-6.
_WIDENINGS = 24

#: Points of the table: the interpolation error falls with the cube of their spacing, and below
#: this many frames to solve the table would cost more evaluations than it saves.
TABLE_POINTS = 1024


@torch.no_grad()
def scalar_start(g: Callable[[Tensor], Tensor], values: Tensor, points: int = TABLE_POINTS
                 ) -> Tensor:
    r"""Approximate solutions of :math:`x + g(x) = v` for many numbers :math:`v` at once, for a
    scalar map :math:`g` with Lipschitz constant below 1.

    The table of :math:`f(x) = x + g(x)` spans a bracket :math:`[a, b]` of the solutions of the
    smallest and largest value, :math:`f(a) \le \min v` and :math:`f(b) \ge \max v` (the first
    fixed-point iterates of the two values, moved outwards by a quarter of :math:`|g|` there and
    then by twice as much until they bracket), holds ``points`` equally spaced :math:`x_i \in
    [a, b]`, and the inverse of :math:`f` is interpolated between the :math:`f(x_i)` by cubic
    Hermite polynomials whose slopes are those of the parabolas through neighbouring points of
    the table (error :math:`O(h^3)` in the spacing :math:`h`). Where no bracket is found or the
    table is not strictly increasing (``g`` not contractive), the start is ``values`` itself.

    Args:
        g: The scalar map, called as the fixed-point solver calls a position-wise branch on one
            feature: on sequences ``(b, m, 1)``, returning that shape.
        values: The right-hand sides ``v``, shape ``(n,)``, finite, floating point.
        points: Points of the table, at least 4.

    Returns:
        Starting points, shape ``(n,)``, dtype and device of ``values``, without a graph.

    Raises:
        TypeError: ``values`` is not a floating-point tensor or ``points`` not an int.
        ValueError: ``values`` is not ``(n,)`` with ``n >= 1`` or holds NaN/Inf, or
            ``points < 4``.

    Example:
        >>> v = torch.linspace(-3.0, 3.0, 50, dtype=torch.float64)
        >>> x = scalar_start(lambda x: 0.5 * torch.sin(x), v, points=64)
        >>> bool((x + 0.5 * torch.sin(x) - v).abs().max() < 1e-4)
        True
    """
    if not isinstance(values, Tensor) or not values.is_floating_point():
        raise TypeError(f"values must be a floating-point tensor, got {type(values).__name__}"
                        + (f" of dtype {values.dtype}" if isinstance(values, Tensor) else ""))
    if values.dim() != 1 or values.numel() == 0:
        raise ValueError(f"values must have shape (n,) with n >= 1, got {tuple(values.shape)}")
    check_finite(values, "values")
    if isinstance(points, bool) or not isinstance(points, int):
        raise TypeError(f"points must be an int, got {type(points).__name__}")
    if points < 4:
        raise ValueError(f"points must be at least 4, got {points}")
    bracket = _bracket(g, torch.stack([values.min(), values.max()]))
    if bracket is None:
        return values.clone()
    a, b = bracket
    grid = torch.linspace(0.0, 1.0, points, dtype=values.dtype, device=values.device)
    xs = a + (b - a) * grid
    fs = xs + g(xs.view(1, -1, 1)).view(-1)
    steps = fs.diff()
    if not bool((steps > 0).all()):
        return values.clone()
    slopes = _slopes(xs.diff() / steps, steps)
    i = (torch.searchsorted(fs, values) - 1).clamp(0, points - 2)
    width = steps[i]
    t = (values - fs[i]) / width
    t2, t3 = t * t, t * t * t
    return ((2 * t3 - 3 * t2 + 1) * xs[i] + (t3 - 2 * t2 + t) * (slopes[i] * width)
            + (3 * t2 - 2 * t3) * xs[i + 1] + (t3 - t2) * (slopes[i + 1] * width))


def _bracket(g: Callable[[Tensor], Tensor], ends: Tensor) -> Tensor | None:
    """Points ``(a, b)`` with ``a + g(a) <= ends[0]`` and ``b + g(b) >= ends[1]`` (``ends``
    ``(2,)``, the smallest and largest value), or ``None`` if :data:`_WIDENINGS` rounds find
    none."""
    image = g(ends.view(1, 2, 1)).view(2)
    outward = torch.tensor([-1.0, 1.0], dtype=ends.dtype, device=ends.device)
    # a quarter of |g|, never below rounding, so that the bracket widens even where g is 0
    reach = image.abs() / 4 + torch.finfo(ends.dtype).eps * (1 + ends.abs())
    for _ in range(_WIDENINGS):
        x = ends - image + outward * reach
        f = x + g(x.view(1, 2, 1)).view(2)
        if bool((f[0] <= ends[0]) & (f[1] >= ends[1])):
            return x
        reach = 2 * reach
    return None


def _slopes(secants: Tensor, steps: Tensor) -> Tensor:
    """dx/df at the ``K`` points of a table from its ``K - 1`` secant slopes and steps of f: the
    derivative of the parabola through every point and its neighbours (second order for any
    spacing), through the first or last three points at the ends."""
    inner = (steps[:-1] * secants[1:] + steps[1:] * secants[:-1]) / (steps[:-1] + steps[1:])
    first = ((2 * steps[0] + steps[1]) * secants[0] - steps[0] * secants[1]) / (steps[0] + steps[1])
    last = (((2 * steps[-1] + steps[-2]) * secants[-1] - steps[-1] * secants[-2])
            / (steps[-1] + steps[-2]))
    return torch.cat([first.view(1), inner, last.view(1)])
