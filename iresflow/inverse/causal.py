r"""Fixed-point solves of maps that are causal over frames, frame by frame as they settle
(docs/math.md#autoregressive-step).

For a map :math:`T` whose output frame :math:`t` reads its input frames before :math:`t` only
(the Jacobi map of an autoregressive step), the iteration :math:`x^{k+1} = T(x^k)` over all
frames at once is exact on frame :math:`t` once :math:`k > t`. Frames settle from the first on:
once the frames before :math:`t` no longer change, one more sweep makes frame :math:`t` exact.
:func:`causal_fixed_point_inverse` keeps, per sample, the frames that have settled fixed and
evaluates :math:`T` on the later frames only, so a sweep costs the frames still moving and
``T`` may keep what it computed for the settled ones (a Transformer its keys and values:
:class:`~iresflow.nn.causal.WindowEvaluator`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from iresflow._validation import check_int
from iresflow.inverse.arguments import check_arguments
from iresflow.inverse.fixed_point import InverseStats, default_tolerance, report_failure

__all__ = ["causal_fixed_point_inverse"]


def causal_fixed_point_inverse(
    image: Callable[[Tensor, int, int], Tensor],
    y: Tensor,
    *,
    window: int | None = None,
    tol: float | None = None,
    max_iter: int | None = None,
    on_failure: Literal["raise", "warn"] = "raise",
    x0: Tensor | None = None,
    solved: Tensor | None = None,
) -> tuple[Tensor, InverseStats]:
    r"""Solve :math:`x = T(x)` per sample for a map :math:`T` that is causal over frames, by
    sweeps over a window of the frames that have not settled.

    Every sweep evaluates :math:`T` on the ``window`` frames from the first unsettled one of the
    batch on (``image(x, start, stop)``) and moves every unsettled frame of the window to its
    image (Jacobi); the frames after the window wait. Per sample, the frames from its first
    unsettled one on settle, in order, while each has a max-abs step
    :math:`\|T(x)_t - x_t\|_\infty` below the sample's tolerance, at the value the step was
    measured at; the next frame moves to its image, which came from settled frames alone: it is
    the solution (to rounding) and settles too. So every sweep settles at least one frame of
    every sample whose first unsettled frame is the batch's, and ``N`` sweeps always suffice,
    whatever the map and the window. A sweep whose whole window settled by its steps (frames
    that were solutions already) doubles the window of the next; any other sweep leaves the
    next with ``window`` frames. ``window = 1`` solves the frames one after another, each with
    one evaluation; ``window = N`` is a Jacobi iteration over all frames at once, whose sweeps
    are fewer when later frames converge before the earlier ones have settled.
    ``stats.residual`` is the largest step of a sample's frames that settled by their step (a
    frame settled as exact adds none). Runs under :func:`torch.no_grad`.

    Args:
        image: :math:`T` as ``image(x, start, stop)``: ``x`` the iterates ``(B, N, D)``,
            returns :math:`T(x)` on frames ``start`` to ``stop - 1``, ``(B, stop - start, D)``.
            It is called first with ``start`` the first frame that some sample has not
            solved (0 without ``solved``; the frames before it are read, and their images not
            asked for), then with ``start`` between the ``start`` and ``stop`` of the call
            before and ``x`` unchanged on the frames before ``start - 1``, which are all that
            its outputs before ``start`` read: it may keep what it computed for them.
        y: Starting point and scale of the default tolerance, ``(B, N, D)``, finite.
        window: Frames per sweep after the frames already solved (``None``: all ``N``), doubled
            after a sweep that settles them all by their steps.
        tol: Absolute tolerance on the max-abs step of a frame; ``None`` uses
            :func:`~iresflow.inverse.fixed_point.default_tolerance` of ``y``.
        max_iter: Cap on the sweeps; ``None``: ``N``.
        on_failure: ``"raise"`` an :class:`~iresflow.inverse.fixed_point.InversionError` or
            ``"warn"`` when a sample does not settle within ``max_iter`` sweeps, or its first
            unsettled frame's image is not finite (which ends the solve); one more evaluation
            then measures the steps of its unsettled frames, which join its residual.
        x0: Optional starting point ``(B, N, D)`` (default ``y``).
        solved: Optional number of leading frames of ``x0`` that are the solution, per sample
            ``(B,)`` (int64): they are settled from the start, and the first sweep begins at
            the first frame that some sample has not solved.

    Returns:
        The solution ``(B, N, D)`` and the
        :class:`~iresflow.inverse.fixed_point.InverseStats` of the solve (``iterations``: the
        sweeps until a sample had settled; ``evaluations``: the calls of ``image``).

    Example:
        >>> y = torch.randn(2, 5, 1, dtype=torch.float64)
        >>> def image(x, start, stop):  # T(x)_t = y_t + sin(x_{t-1})
        ...     before = torch.nn.functional.pad(x, (0, 0, 1, 0))[:, start:stop]
        ...     return y[:, start:stop] + torch.sin(before)
        >>> x, stats = causal_fixed_point_inverse(image, y, window=1)
        >>> torch.allclose(image(x, 0, 5), x), stats.evaluations
        (True, 5)
    """
    # the fixed-point engine's checks (its solver and memory options do not apply here)
    check_arguments(image, y, (), tol, 1 if max_iter is None else max_iter, "plain", 1,
                    on_failure, x0, False)
    if y.dim() != 3:
        raise ValueError(f"y must have shape (B, N, D), got {tuple(y.shape)}")
    length = y.shape[1]
    window = length if window is None else check_int(window, "window", 1)
    max_iter = length if max_iter is None else max_iter
    with torch.no_grad():
        x, stats = _sweep(image, y.detach(), window, tol, max_iter, x0, _solved(solved, y))
    if not bool(stats.converged.all()):
        report_failure(stats, max_iter, on_failure)
    return x, stats


def _solved(solved: Tensor | None, y: Tensor) -> Tensor:
    """The checked ``solved`` argument (zeros for ``None``)."""
    batch, length = y.shape[:2]
    if solved is None:
        return torch.zeros(batch, dtype=torch.int64, device=y.device)
    if (not isinstance(solved, Tensor) or solved.dtype != torch.int64
            or solved.shape != (batch,) or bool(((solved < 0) | (solved > length)).any())):
        raise ValueError(f"solved must be an int64 tensor of shape ({batch},) with values in "
                         f"[0, {length}], got {solved!r}")
    return solved


def _sweep(image: Callable[[Tensor, int, int], Tensor], y: Tensor, window: int,
           tol: float | None, max_iter: int, x0: Tensor | None,
           settled: Tensor) -> tuple[Tensor, InverseStats]:
    """The sweeps of :func:`causal_fixed_point_inverse`, from ``settled`` ``(B,)`` frames."""
    length = y.shape[1]
    x = (y if x0 is None else x0.detach()).clone()
    tolerance = default_tolerance(y) if tol is None else torch.full_like(y[:, 0, 0], tol)
    residual = torch.zeros_like(tolerance)
    iterations = torch.where(settled == length, 0, max_iter)
    # Every call starts at the batch's first unsettled frame.
    sweeps = evaluations = 0
    size, start = window, int(settled.min())
    while start < length:
        sweeps = evaluations = sweeps + 1
        first, stop = start, min(start + size, length)
        t_x = image(x, start, stop)
        settle = _settle_frame if stop - start == 1 else _settle_window
        settled, residual, moved = settle(x, t_x, start, settled, tolerance, residual)
        size = window if moved else 2 * size
        iterations = torch.where((settled == length) & (iterations == max_iter), sweeps,
                                 iterations)
        start = int(settled.min())
        if start < length and (sweeps == max_iter or start == first):
            # Out of sweeps, or stopped by a non-finite image: the steps of the unsettled frames
            # of the iterate returned, measured by one more evaluation, join the residual.
            step = (image(x, start, length) - x[:, start:]).abs().amax(-1)
            unsettled = torch.arange(start, length, device=y.device) >= settled[:, None]
            residual = torch.maximum(residual, step.where(unsettled, 0.0).amax(1))
            evaluations += 1
            break
    converged = (settled == length) & (residual < tolerance)
    return x, InverseStats(iterations, residual, converged, evaluations, tolerance)


def _settle_window(x: Tensor, t_x: Tensor, start: int, settled: Tensor, tolerance: Tensor,
                   residual: Tensor) -> tuple[Tensor, Tensor, bool]:
    """One sweep's moves and settling on the window of frames ``start`` onwards that ``t_x``
    ``(B, W, D)`` is the image of: ``x`` is updated in place; returns the settled counts, the
    residuals and whether any frame moved."""
    stop = start + t_x.shape[1]
    part = x[:, start:stop]
    step = (t_x - part).abs().amax(-1)  # (B, W); NaN stays NaN
    position = torch.arange(start, stop, device=x.device)
    holds = (position < settled[:, None]) | (step < tolerance[:, None])
    moving = (~holds).cumsum(1) > 0  # from the first frame that does not hold
    newly = ~moving & (position >= settled[:, None])
    residual = torch.maximum(residual, step.where(newly, 0.0).amax(1))
    x[:, start:stop] = torch.where(moving[..., None], t_x, part)
    # The first moving frame's image came from settled frames alone: it is exact (if finite).
    lead = start + (~moving).sum(1)
    finite = torch.isfinite(t_x).all(-1)
    exact = (lead < stop) & finite.gather(1, (lead - start).clamp(max=stop - start - 1)
                                          [:, None]).squeeze(1)
    return torch.maximum(settled, lead + exact.long()), residual, bool(moving.any())


def _settle_frame(x: Tensor, t_x: Tensor, start: int, settled: Tensor, tolerance: Tensor,
                  residual: Tensor) -> tuple[Tensor, Tensor, bool]:
    """:func:`_settle_window` on a window of one frame, the batch's first unsettled one, in
    fewer operations: every sample whose frame it is settles it, by its step if that holds,
    else at its image, which is exact (if finite)."""
    image, part = t_x[:, 0], x[:, start]
    step = (image - part).abs().amax(-1)  # (B,); NaN stays NaN
    ahead = settled > start
    holds = ahead | (step < tolerance)
    residual = torch.maximum(residual, step.where(holds & ~ahead, 0.0))
    x[:, start] = torch.where(holds[:, None], part, image)
    settles = holds | torch.isfinite(image).all(-1)
    return torch.maximum(settled, start + settles.long()), residual, not bool(holds.all())
