r"""Steps whose inverse settles frames in order: the inverse machinery shared by the causal steps
that are not residual blocks (docs/math.md#autoregressive-step).

A step :math:`y = f(x)` whose frame :math:`t` is an invertible function of :math:`x_t` given the
frames before it is inverted by the fixed point of a strictly causal map
:math:`x_t = T_y(x)_t`, a function of :math:`y_t` and :math:`x_{<t}`; the step declares
:math:`T_y` on windows of frames (:meth:`SettlingStep._image`) and
:func:`~iresflow.inverse.causal.causal_fixed_point_inverse` solves it, settling the frames in
order, for ``inverse`` and for a forecast's pinned inverse alike.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from iresflow._validation import check_float, check_int
from iresflow.inverse.causal import causal_fixed_point_inverse
from iresflow.inverse.fixed_point import InverseStats
from iresflow.transforms.base import SequenceTransform

__all__ = ["SettlingStep"]


class SettlingStep(SequenceTransform):
    """A causal step inverted by :func:`~iresflow.inverse.causal.causal_fixed_point_inverse`.

    Subclasses implement :meth:`_image`; :meth:`_solve` runs the solver with the options given
    here, on the real frames (padded frames are solved as zeros and returned unchanged), and
    keeps its statistics in :attr:`last_inverse_stats`.

    Args:
        inverse_tol: Max-abs tolerance of a frame's step; ``None`` uses the dtype default of
            :func:`~iresflow.inverse.fixed_point.default_tolerance`.
        inverse_max_iter: Cap on the sweeps; ``None``: ``N`` for sequences of length ``N``.
        inverse_window: Frames evaluated per sweep (``None``: all).
        on_failure: ``"raise"`` or ``"warn"`` when the inverse does not settle every frame.
    """

    causal = True  # output frame t reads input frames <= t

    last_inverse_stats: InverseStats | None

    def __init__(
        self,
        *,
        inverse_tol: float | None = None,
        inverse_max_iter: int | None = None,
        inverse_window: int | None = None,
        on_failure: Literal["raise", "warn"] = "raise",
    ) -> None:
        super().__init__()
        self.inverse_tol = None if inverse_tol is None else check_float(
            inverse_tol, "inverse_tol", 0.0)
        self.inverse_max_iter = None if inverse_max_iter is None else check_int(
            inverse_max_iter, "inverse_max_iter", 1)
        self.inverse_window = None if inverse_window is None else check_int(
            inverse_window, "inverse_window", 1)
        if on_failure not in ("raise", "warn"):
            raise ValueError(f"on_failure must be 'raise' or 'warn', got {on_failure!r}")
        self.on_failure = on_failure
        self.last_inverse_stats = None

    @abstractmethod
    def _image(self, target: Tensor, context: Tensor | None, mask: Tensor | None,
               memory: Tensor | None = None) -> Callable[[Tensor, int, int], Tensor]:
        r"""The map :math:`T_y` for ``y = target`` ``(B, N, D)`` (zero at padded frames), as
        ``image(x, start, stop)``: the frames ``start`` to ``stop - 1`` of :math:`T_y(x)`,
        ``(B, stop - start, D)``, under the call rules of
        :func:`~iresflow.inverse.causal.causal_fixed_point_inverse`. ``mask`` is ``None`` when
        no frame is padded; ``memory`` is the step's :meth:`forward_with_memory` of frames
        equal to the solve's solved ones, or ``None``."""

    def _solve(self, y: Tensor, context: Tensor | None, mask: Tensor | None,
               x0: Tensor | None = None, solved: Tensor | None = None,
               memory: Tensor | None = None) -> Tensor:
        """The frames ``(B, N, D)`` that ``y`` ``(B, N, D)`` is the image of, from ``x0``
        (default ``y``) whose first ``solved`` ``(B,)`` frames are solutions (``memory``: see
        :meth:`_image`)."""
        with torch.no_grad():
            if mask is not None and bool(mask.all()):
                mask = None  # no padding: nothing to mask

            def real(values: Tensor) -> Tensor:
                # Padded frames are solved as zeros (T_y is 0 there): the default tolerance
                # scales with the largest entry of each sample, which padding must not loosen.
                return values if mask is None else torch.where(mask.unsqueeze(-1), values, 0.0)

            target = real(y)
            x, stats = causal_fixed_point_inverse(
                self._image(target, context, mask, memory), target, window=self.inverse_window,
                tol=self.inverse_tol, max_iter=self.inverse_max_iter,
                on_failure=self.on_failure, x0=None if x0 is None else real(x0), solved=solved,
            )
            self.last_inverse_stats = stats
            return x if mask is None else torch.where(mask.unsqueeze(-1), x, y)

    def inverse_pinned(
        self, inputs: Tensor, state: Tensor, known: Tensor, context: Tensor | None,
        mask: Tensor | None, memory: Tensor | None = None,
    ) -> Tensor:
        """The inverse with the known frames, and the missing ones before the first new frame,
        settled from the start at their inputs ``state``: the sweeps evaluate the new frames
        only (:meth:`SequenceTransform.inverse_pinned`, same arguments; ``memory``: the step's
        :meth:`forward_with_memory` of ``state`` with ``known`` as its mask)."""
        new = known.logical_not() if mask is None else mask & ~known
        solved = torch.where(new.any(1), new.long().argmax(1), new.shape[1])
        x = self._solve(inputs, context, mask, torch.where(known.unsqueeze(-1), state, inputs),
                        solved, memory)
        return torch.where(known.unsqueeze(-1), state, x)

    def extra_repr(self) -> str:
        return (f"inverse_tol={self.inverse_tol}, inverse_max_iter={self.inverse_max_iter}, "
                f"inverse_window={self.inverse_window}")
