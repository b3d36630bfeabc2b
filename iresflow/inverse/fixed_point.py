r"""The single inverse engine: solve :math:`x + g(x) = y` by fixed-point iteration
(docs/math.md#contractive-attention, #fixed-point-inverse).

For a contractive residual branch, :math:`\mathrm{lip}(g) \le L < 1`, the map
:math:`T_y(x) = y - g(x)` is a contraction, so the inverse of :math:`x \mapsto x + g(x)` is its
unique fixed point; the plain iteration :math:`x^{k+1} = T_y(x^k)` from :math:`x^0 = y` converges
geometrically, with :math:`\|x^k - x^*\| \le \frac{L^k}{1 - L}\|x^1 - x^0\|` (Banach). The
accelerated solver applies Anderson mixing to the same map (:mod:`iresflow.inverse.anderson`).

Stopping rule: a sample stops once the max-abs residual of its current iterate,
:math:`\|x^k + g(x^k) - y\|_\infty` (which is also the step :math:`\|T_y(x^k) - x^k\|_\infty`),
falls below a true tolerance, and the solver returns that iterate :math:`x^k`, so the reported
residual is the residual of the returned solution. (Returning the unverified next iterate
:math:`T_y(x^k)` instead would report the residual of another point: when ``g`` contracts in the
2-norm of the whole sequence, as the spectral and LipschitzNorm certificates do, the max-abs
residual of :math:`T_y(x^k)` can exceed that of :math:`x^k` by up to :math:`L\sqrt{ND}`.)
Samples are solved independently: a converged sample is frozen and ``g`` is evaluated only on the
active ones. For a position-wise ``g`` on one feature the frames of a sample are independent
scalar equations too (``position_wise=True``): a frame within the tolerance keeps its value and
is not evaluated again, and the others take secant steps.

The solver runs under :func:`torch.no_grad`: the inverse serves sampling and evaluation, and its
output carries no gradient.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import torch
from torch import Tensor

from iresflow.inverse.anderson import AndersonMixer, SecantMixer
from iresflow.inverse.arguments import check_arguments
from iresflow.inverse.chord import ChordSteps

__all__ = [
    "InverseStats",
    "InversionError",
    "InversionWarning",
    "default_tolerance",
    "fixed_point_inverse",
]

# Unit-scale max-abs residual tolerance per dtype. float64: at L = 0.97 the a-posteriori bound
# tol / (1 - L) = 3.3e-10 keeps inverse(forward(x)) == x to 1e-9; the others sit about ten
# units in the last place above rounding noise at unit scale.
_UNIT_TOLERANCE = {
    torch.float64: 1e-11,
    torch.float32: 1e-6,
    torch.float16: 1e-2,
    torch.bfloat16: 1e-1,
}


# Anderson mixing starts for a sample once plain steps are predicted to need more evaluations
# than this (below it, the per-step cost of mixing outweighs the saved evaluations).
_PLAIN_BUDGET = 12

# With a Jacobian, the evaluation whose iterate gives the chord steps their matrix: the first
# after the start (one plain step closer to the solution than the start; later matrices, or
# fresh ones every few steps, cost more than the steps they save on a GunPoint forecast).
_CHORD_AT = 2

# The rounding floor. With the default tolerance, a sample whose residual has not fallen below
# _PROGRESS times its lowest value for _STALL evaluations, and is within _FLOOR times its
# tolerance, has met the rounding noise of its dtype (the tolerance sits a few units in the last
# place above it, and the iteration can amplify the noise of one evaluation up to 1 / (1 - L)
# times): it stops there, its tolerance raised to _FLOOR times the default.
_PROGRESS = 0.9
_STALL = 20
_FLOOR = 10.0


class InversionError(RuntimeError):
    r"""The fixed-point iteration did not reach its tolerance for every sample.

    Attributes:
        residual: Max-abs residual :math:`\|x + g(x) - y\|_\infty` of the returned ``x`` per
            sample, shape ``(B,)`` (NaN or Inf if the iteration diverged).
        iterations: Evaluations of ``g`` spent per sample, shape ``(B,)``, ``int64``.
    """

    def __init__(self, message: str, residual: Tensor, iterations: Tensor) -> None:
        super().__init__(message)
        self.residual = residual
        self.iterations = iterations


class InversionWarning(RuntimeWarning):
    """Issued instead of :class:`InversionError` when ``on_failure="warn"``."""


@dataclass(frozen=True)
class InverseStats:
    r"""Diagnostics of one call of :func:`fixed_point_inverse`.

    Attributes:
        iterations: Evaluations of ``g`` per sample until it stopped, shape ``(B,)``, ``int64``.
        residual: Max-abs residual :math:`\|x + g(x) - y\|_\infty` of the returned solution
            ``x`` per sample, ``(B,)`` (computed from ``g`` at that very ``x``; NaN or Inf if the
            iteration diverged).
        converged: Whether ``residual < tolerance``, ``(B,)``, ``bool``.
        evaluations: Number of calls of ``g`` (each on the sub-batch of active samples).
        tolerance: The per-sample tolerance the residual was compared with, ``(B,)``: ``tol``, or
            :func:`default_tolerance` (relative to :math:`\|y_b\|_\infty` when that exceeds 1),
            ten times that for a sample stopped at the rounding floor
            (:func:`fixed_point_inverse`).
    """

    iterations: Tensor
    residual: Tensor
    converged: Tensor
    evaluations: int
    tolerance: Tensor


def default_tolerance(y: Tensor) -> Tensor:
    r"""Per-sample default tolerance on the max-abs residual.

    :math:`\tau_b = \tau_{\rm dtype}\max(1, \|y_b\|_\infty)` with :math:`\tau_{\rm dtype}` =
    ``1e-11`` (float64), ``1e-6`` (float32), ``1e-2`` (float16), ``1e-1`` (bfloat16): an absolute
    tolerance for unit-scale data that turns relative for large inputs, so that rounding noise
    (a few units in the last place of :math:`y`) cannot stall the iteration.

    Args:
        y: Right-hand sides, shape ``(B, ...)``, floating point.

    Returns:
        Tolerances, shape ``(B,)``, dtype and device of ``y``.

    Example:
        >>> default_tolerance(torch.tensor([[0.5, -3.0]], dtype=torch.float64))
        tensor([3.0000e-11], dtype=torch.float64)
    """
    unit = _UNIT_TOLERANCE.get(y.dtype)
    if unit is None:
        raise TypeError(f"y must have a floating-point dtype, got {y.dtype}")
    return unit * y.detach().reshape(y.shape[0], -1).abs().amax(1).clamp_min(1.0)


def fixed_point_inverse(
    g: Callable[..., Tensor],
    y: Tensor,
    *,
    args: tuple[Tensor, ...] = (),
    tol: float | None = None,
    max_iter: int = 1000,
    solver: Literal["plain", "anderson"] = "plain",
    memory: int = 5,
    on_failure: Literal["raise", "warn"] = "raise",
    x0: Tensor | None = None,
    position_wise: bool = False,
    jacobian: Callable[..., tuple[Tensor, Tensor]] | None = None,
) -> tuple[Tensor, InverseStats]:
    r"""Solve :math:`x + g(x) = y` per sample by fixed-point iteration
    (docs/math.md#fixed-point-inverse, check H9 (docs/math.md#checks)).

    Iterates :math:`x \leftarrow T_y(x) = y - g(x)` from :math:`x^0 = y` (``solver="plain"``) or
    Anderson-accelerates it (``solver="anderson"``, :class:`~.anderson.AndersonMixer`) for a
    sample whose last contraction ratio predicts more than 12 further plain steps. A sample
    stops once the max-abs residual :math:`r_k = \|x^k + g(x^k) - y\|_\infty` of its iterate
    is below its tolerance and returns that :math:`x^k` (``stats.residual`` is :math:`r_k`);
    with the default tolerance, a sample whose residual has not fallen by 10% for 20
    evaluations within ten times its tolerance stops at that rounding floor, its tolerance
    raised tenfold. The error is at most :math:`r_k / (1 - L)` in the norm of the certificate
    :math:`L` of ``g``. Stopped samples are frozen: ``g`` sees only the rows still active, so it
    must act on every sample independently and accept any sub-batch.

    With ``position_wise=True`` and one feature, every frame is a scalar equation
    (docs/guide.md#inversion): a frame within the sample's tolerance keeps its value and is not
    evaluated again (``g`` sees the moving frames as sequences ``(b', 1, 1)``, every argument
    split alike), the others take secant steps (``solver="anderson"``); stopping rule and
    statistics stay the sample's; with several features the sample is solved whole. Runs under
    :func:`torch.no_grad`, with one host synchronisation per iteration.

    Args:
        g: The residual branch, called as ``g(x, *args)`` on a sub-batch ``x`` of shape
            ``(b, ...)`` (the trailing shape of ``y``) with ``args`` sliced to the same rows;
            returns a tensor of the same shape.
        y: Right-hand sides, shape ``(B, ...)``, finite, floating point.
        args: Extra per-sample tensors (leading dimension ``B``), e.g. a padding mask,
            passed to ``g`` sliced alongside ``x``; with ``position_wise=True`` per frame,
            ``(B, N, ...)`` (a per-sequence value repeated over the frames).
        tol: Absolute tolerance on a sample's max-abs residual (``None``: default_tolerance).
        max_iter: Maximum number of evaluations of ``g`` per sample.
        solver: ``"plain"`` fixed-point iteration or ``"anderson"`` acceleration (several
            times fewer evaluations for slowly contracting samples, ``benchmarks/inverse.py``).
        memory: Anderson depth (number of previous iterates mixed with the current one).
        on_failure: ``"raise"`` an :class:`InversionError` or ``"warn"`` with an
            :class:`InversionWarning` and return the last evaluated (reported) iterate when some
            sample did not converge.
        x0: Optional starting point, same shape as ``y`` (default ``y``).
        position_wise: Whether ``g`` is position-wise, ``y`` ``(B, N, D)`` (with ``D = 1``
            every frame an equation of its own).
        jacobian: For ``g`` causal over frames on one feature: ``jacobian(x, *args)`` returns
            ``g(x)`` and lower-triangular :math:`I + J_g(x)` ``(b, n, n)``; called at the second
            iterate, then chord steps (:class:`~.chord.ChordSteps`; not with position_wise).

    Returns:
        ``x`` of the shape of ``y`` and the :class:`InverseStats` of the solve.

    Raises:
        InversionError: Some sample did not converge within ``max_iter`` evaluations or
            diverged (only with ``on_failure="raise"``).

    Example:
        >>> y = torch.tensor([[1.0], [2.0]], dtype=torch.float64)
        >>> x, stats = fixed_point_inverse(lambda x: 0.5 * torch.sin(x), y)
        >>> torch.allclose(x + 0.5 * torch.sin(x), y), bool(stats.converged.all())
        (True, True)
    """
    check_arguments(g, y, args, tol, max_iter, solver, memory, on_failure, x0, position_wise,
                    jacobian)
    # on one feature, every frame is a scalar equation of its own
    parts = y.shape[1] if position_wise and y.shape[-1] == 1 else 1
    with torch.no_grad():
        x, stats = _iterate(g, y, args, tol, max_iter, solver, memory, x0, parts, jacobian)
    if not bool(stats.converged.all()):
        report_failure(stats, max_iter, on_failure)
    return x, stats


def report_failure(stats: InverseStats, max_iter: int, on_failure: str) -> None:
    """Raise :class:`InversionError` or warn (``on_failure``: ``"raise"`` or ``"warn"``) for a
    solve that did not converge for every sample, with its counts and largest residual.

    Args:
        stats: The solve's statistics.
        max_iter: Its cap on the evaluations per sample (for the message).
        on_failure: ``"raise"`` or ``"warn"``.
    """
    failed = int((~stats.converged).sum())
    diverged = int((~torch.isfinite(stats.residual)).sum())
    message = (
        f"fixed-point inverse did not converge for {failed} of {len(stats.converged)} samples "
        f"({diverged} with non-finite iterates; the others reached max_iter={max_iter}, "
        f"largest final max-abs residual {float(stats.residual.nan_to_num(0.0).max()):.3e}); "
        "the branch may not be contractive, or tol/max_iter are too strict"
    )
    if on_failure == "raise":
        raise InversionError(message, stats.residual, stats.iterations)
    warnings.warn(message, InversionWarning, stacklevel=3)


def _iterate(g: Callable[..., Tensor], y: Tensor, args: tuple[Tensor, ...], tol: float | None,
             max_iter: int, solver: str, memory: int, x0: Tensor | None, parts: int,
             jacobian: Callable[..., tuple[Tensor, Tensor]] | None) -> tuple[Tensor, InverseStats]:
    """The solve of :func:`fixed_point_inverse`, every sample split into ``parts`` independent
    problems of equal size: its frames (secant steps) for a position-wise ``g`` on one feature,
    else one (Anderson mixing of depth ``memory``, or chord steps with ``jacobian``)."""
    batch, event = y.shape[0], y.shape[1:]
    y_flat = y.detach().reshape(batch, -1)
    out = y_flat.clone()
    tolerance = default_tolerance(y) if tol is None else torch.full_like(y_flat[:, 0], tol)
    iterations = torch.zeros(batch, dtype=torch.int64, device=y.device)
    residual = torch.full_like(y_flat[:, 0], float("inf"))
    converged = torch.zeros(batch, dtype=torch.bool, device=y.device)
    # once plain steps are predicted slow, or from the second evaluation with a Jacobian
    mixer: AndersonMixer | SecantMixer | ChordSteps | None = None
    mixing = False  # whether every row of the mixer is engaged
    budget = _PLAIN_BUDGET if parts == 1 else 0

    # The running samples are kept compact (rows of x, y, args, tol and the Anderson state);
    # they are gathered again only when some sample stops. Parts that keep their value too.
    active = torch.arange(batch, device=y.device)
    moving: Tensor | None = None  # (b, parts), once some part of a running sample stands still
    g_x = torch.empty_like(y_flat)  # the images of the last evaluation
    x = (y_flat if x0 is None else x0.detach().reshape(batch, -1)).clone()
    y_a, args_a, tol_a = y_flat, args, tolerance.clone()
    previous = torch.full((batch, parts), float("inf"), dtype=y.dtype, device=y.device)
    lowest, stalled = tolerance.new_full((batch,), float("inf")), torch.zeros_like(iterations)
    evaluations = 0
    for k in range(1, max_iter + 1):
        if k == _CHORD_AT and jacobian is not None:
            g_x, mixer = _chord_start(jacobian, x, event, args_a)
        else:
            g_x = _evaluate(g, x, event, args_a) if moving is None else _evaluate_moving(
                g, x, event, args_a, moving, g_x)
        image = y_a - g_x
        # Max-abs residual of every part of x, the point returned when the sample stops (equal
        # to the step |T(x) - x| up to rounding), and of the whole sample.
        part_residual = (x + g_x - y_a).view(x.shape[0], parts, -1).abs().amax(2)
        x_residual = part_residual.amax(1)
        evaluations += 1
        if tol is None:  # an explicit tolerance has no rounding floor
            lowest, stalled, tol_a = _rounding_floor(x_residual, lowest, stalled, tol_a, k)
        done = x_residual < tol_a  # False for NaN
        current = x
        if solver == "anderson" or mixer is not None:
            # once every row mixes, none is left to engage
            slow = None if mixing else _plain_is_slow(part_residual, previous, tol_a[:, None],
                                                      budget)
            if mixer is None and slow is not None and bool(slow.any()):
                rows, size = x.shape[0] * parts, x.shape[1] // parts
                mixer = (AndersonMixer(rows, size, memory, x) if parts == 1
                         else SecantMixer(rows, size, x))
            if mixer is not None:
                image = _mix(mixer, x, image, part_residual, slow)
                mixing = mixing or bool(mixer.engaged.all())
        x, moving = (image, None) if parts == 1 else _hold_still(current, image, part_residual,
                                                                 tol_a)
        previous = part_residual

        running = ~done & torch.isfinite(x_residual)
        if k == max_iter or not bool(running.all()):
            iterations[active] = k
            residual[active] = x_residual
            converged[active] = done
            tolerance[active] = tol_a
            out[active] = current
            if not bool(running.any()):
                break
            active, x, y_a, tol_a = active[running], x[running], y_a[running], tol_a[running]
            g_x, moving = g_x[running], None if moving is None else moving[running]
            previous, lowest, stalled = previous[running], lowest[running], stalled[running]
            args_a = tuple(a[running] for a in args_a)
            if mixer is not None:
                mixer.keep(running.repeat_interleave(parts))

    return out.view_as(y), InverseStats(iterations, residual, converged, evaluations, tolerance)


def _evaluate(g: Callable[..., Tensor], x: Tensor, event: torch.Size,
              args: tuple[Tensor, ...]) -> Tensor:
    """``g`` on the flat iterates ``x`` ``(b, n)`` shaped as samples ``(b, *event)``, flat again;
    ``ValueError`` if it returns another shape."""
    g_x = g(x.view(-1, *event), *args)
    if g_x.shape != (x.shape[0], *event):
        raise ValueError(
            f"g must return the shape of its input {(x.shape[0], *event)}, got {tuple(g_x.shape)}"
        )
    return g_x.reshape(x.shape)


def _rounding_floor(residual: Tensor, lowest: Tensor, stalled: Tensor, tol: Tensor, k: int
                    ) -> tuple[Tensor, Tensor, Tensor]:
    """Every sample's lowest ``residual`` ``(b,)``, evaluations since it last fell by
    :data:`_PROGRESS`, and tolerance, raised where it met its rounding floor at evaluation ``k``."""
    progress = residual < _PROGRESS * lowest
    lowest = torch.where(progress, residual, lowest)
    stalled = torch.where(progress, 0, stalled + 1)
    if k >= _STALL:  # no sample can have stalled for _STALL evaluations before
        floor = (stalled >= _STALL) & (residual < _FLOOR * tol)
        tol = torch.where(floor & (residual >= tol), _FLOOR * tol, tol)
    return lowest, stalled, tol


def _chord_start(jacobian: Callable[..., tuple[Tensor, Tensor]], x: Tensor, event: torch.Size,
                 args: tuple[Tensor, ...]) -> tuple[Tensor, ChordSteps]:
    """The images ``(b, n)`` of the flat iterates ``x`` ``(b, n)`` and the chord steps of their
    matrices, from ``jacobian`` (``ValueError`` for other shapes than ``(b, *event)`` and
    ``(b, n, n)``)."""
    g_x, matrix = jacobian(x.view(-1, *event), *args)
    if g_x.shape != (x.shape[0], *event) or matrix.shape != (*x.shape, x.shape[1]):
        raise ValueError(f"jacobian must return g(x) {(x.shape[0], *event)} and a matrix "
                         f"{(*x.shape, x.shape[1])}, got {tuple(g_x.shape)} and "
                         f"{tuple(matrix.shape)}")
    return g_x.reshape(x.shape), ChordSteps(matrix)


def _hold_still(x: Tensor, image: Tensor, part_residual: Tensor, tol: Tensor
                ) -> tuple[Tensor, Tensor | None]:
    """The next iterates ``(b, n)``: ``image``, but ``x`` on the parts within the tolerance
    ``tol`` ``(b,)`` (``part_residual`` ``(b, parts)``), and the parts that move (``None`` if all
    do)."""
    still = part_residual < tol[:, None]
    held = torch.where(still.unsqueeze(-1), x.view(*still.shape, -1),
                       image.view(*still.shape, -1)).view(image.shape)
    return held, ~still if bool(still.any()) else None


def _evaluate_moving(g: Callable[..., Tensor], x: Tensor, event: torch.Size,
                     args: tuple[Tensor, ...], moving: Tensor, g_x: Tensor) -> Tensor:
    """The last images ``g_x`` of the flat iterates ``x`` ``(b, n)``, in place, with the parts
    ``moving`` ``(b, parts)`` evaluated again as one-frame sequences (arguments split alike)."""
    g_x.view(*moving.shape, -1)[moving] = _evaluate(
        g, x.view(*moving.shape, -1)[moving], torch.Size((1, *event[1:])),
        tuple(a[moving].unsqueeze(1) for a in args))
    return g_x


def _mix(mixer: AndersonMixer | SecantMixer | ChordSteps, x: Tensor, image: Tensor,
         part_residual: Tensor, engage: Tensor | None) -> Tensor:
    """The mixer's next iterates ``(b, n)`` from ``x`` and its image ``(b, n)``, every part of
    a sample ``part_residual`` ``(b, parts)`` a row of the mixer (engaged where ``engage``,
    everywhere if ``None``)."""
    rows = part_residual.numel()
    mixed = mixer.step(x.view(rows, -1), image.view(rows, -1), part_residual.view(rows),
                       engage=None if engage is None else engage.view(rows))
    return mixed.view(x.shape)


def _plain_is_slow(step: Tensor, previous: Tensor, tol: Tensor, budget: int) -> Tensor:
    """Per problem: are plain steps predicted to need more than ``budget`` evaluations?

    The prediction extrapolates the problem's last contraction ratio ``step / previous``
    geometrically down to its tolerance (never true at the first step, with no ratio yet).
    Anderson mixing of a whole sample only pays off beyond a few iterations (``budget``
    :data:`_PLAIN_BUDGET`), the secant step of one frame from the second (``budget`` 0); the
    decision depends on the problem alone, so results do not depend on the batch.

    Returns:
        Boolean tensor of the shape of ``step``.
    """
    ratio = (step / previous).clamp(max=1.0 - 1e-6)
    remaining = torch.log(tol / step) / torch.log(ratio)
    return remaining > budget
