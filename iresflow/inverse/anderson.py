r"""Safeguarded type-II Anderson acceleration of a batch of fixed-point iterations.

For a map :math:`T` with residual :math:`f(x) = T(x) - x`, Anderson mixing of depth :math:`m`
keeps the last :math:`m + 1` pairs :math:`(f_i, T(x_i))` and steps to

.. math::
    x^{k+1} = \sum_i \alpha_i T(x_i), \qquad
    \alpha = \arg\min_{\mathbf 1^\top \alpha = 1} \Big\|\sum_i \alpha_i f_i\Big\|_2^2
    = \frac{H^{-1}\mathbf 1}{\mathbf 1^\top H^{-1}\mathbf 1},
    \quad H = F F^\top + \lambda I ,

a small regularised least-squares problem solved per sample with :func:`torch.linalg.solve_ex`
(:math:`\lambda` relative to the mean diagonal of :math:`F F^\top`). With one pair this is the
plain step :math:`x^{k+1} = T(x^k)`.

Safeguard: an extrapolated iterate whose max-abs residual exceeds that of the iterate it came from
is rejected; the history restarts from that previous iterate and the next step is the plain step
from it (its image is already known, so the fallback costs no evaluation). A rejection is always
followed by a plain step, which contracts the error, so a poor extrapolation cannot stall the
iteration.

Depth one has a closed form (:class:`SecantMixer`): on one number per problem it is the secant
method, which the engine runs per frame for a position-wise branch on one feature.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["AndersonMixer", "SecantMixer"]

# Tikhonov weight of the least-squares problem relative to the mean squared residual norm.
_RELATIVE_REGULARISATION = {torch.float64: 1e-12, torch.float32: 1e-6}


class AndersonMixer:
    r"""Anderson state for a batch of independent fixed-point problems in :math:`\mathbb R^n`.

    Rows are positional: :meth:`step` takes one row per problem still running, and
    :meth:`keep` drops the rows of problems that stopped (the solver freezes converged samples).
    All samples share one ring position, while history validity is per sample.

    Args:
        batch: Number of problems ``B``.
        features: Flattened problem size ``n``.
        memory: Depth ``m >= 1``: previous iterates mixed with the current one.
        like: Tensor whose dtype and device the state follows.

    Example:
        >>> mixer = AndersonMixer(1, 1, 2, torch.zeros(1, 1, dtype=torch.float64))
        >>> x = torch.zeros(1, 1, dtype=torch.float64)
        >>> for _ in range(4):  # T(x) = 1 - x / 2, fixed point 2 / 3
        ...     image = 1 - x / 2
        ...     x = mixer.step(x, image, (image - x).abs().amax(1))
        >>> round(x.item(), 12)
        0.666666666667
    """

    def __init__(self, batch: int, features: int, memory: int, like: Tensor) -> None:
        if memory < 1:
            raise ValueError(f"memory must be >= 1, got {memory}")
        self.slots = memory + 1
        self.residuals = like.new_zeros(batch, self.slots, features)
        self.images = like.new_zeros(batch, self.slots, features)
        self.gram = like.new_zeros(batch, self.slots, self.slots)  # F F^T, updated per slot
        self.valid = torch.zeros(batch, self.slots, dtype=torch.bool, device=like.device)
        self.previous_step = torch.full(
            (batch,), float("inf"), dtype=like.dtype, device=like.device
        )
        self.extrapolated = torch.zeros(batch, dtype=torch.bool, device=like.device)
        self.engaged = torch.zeros(batch, dtype=torch.bool, device=like.device)
        self.position = 0
        self.regularisation = _RELATIVE_REGULARISATION.get(like.dtype, 1e-3)

    def keep(self, rows: Tensor) -> None:
        """Keep only the given rows of the state.

        Args:
            rows: Boolean mask over the current rows, shape ``(b,)``.
        """
        self.residuals, self.images = self.residuals[rows], self.images[rows]
        self.gram = self.gram[rows]
        self.valid, self.previous_step = self.valid[rows], self.previous_step[rows]
        self.extrapolated, self.engaged = self.extrapolated[rows], self.engaged[rows]

    def step(self, x: Tensor, image: Tensor, step: Tensor, engage: Tensor | None = None) -> Tensor:
        r"""Record :math:`(x^k, T(x^k))` for the engaged rows and return the next iterates.

        Args:
            x: Current iterates, shape ``(b, n)``.
            image: :math:`T(x^k)`, shape ``(b, n)``.
            step: Max-abs residual :math:`\|T(x^k) - x^k\|_\infty`, shape ``(b,)``.
            engage: Rows that start mixing from this step on, boolean ``(b,)`` (default: all).
                Rows never engaged take plain steps and keep no history.

        Returns:
            Next iterates :math:`x^{k+1}`, shape ``(b, n)``.
        """
        self.engaged = self.engaged | (True if engage is None else engage)
        current, last = self.position, (self.position - 1) % self.slots
        reject = self.extrapolated & (step > self.previous_step)
        accept = self.engaged & ~reject
        residual = image - x
        self.residuals[:, current] = residual
        self.images[:, current] = image
        # Only row and column `current` of the Gram matrix change. Elementwise products beat
        # batched matrix products for these tiny per-sample matrices.
        dots = (self.residuals * residual[:, None, :]).sum(2)
        self.gram[:, current, :] = dots
        self.gram[:, :, current] = dots
        self.valid[:, current] = accept
        rejected = bool(reject.any())  # rare: the common step skips the restart's operations
        if rejected:  # rejected rows restart from their previous (accepted) iterate, in `last`
            only_last = torch.zeros_like(self.valid[0])
            only_last[last] = True
            self.valid = torch.where(reject[:, None], only_last, self.valid)
        self.previous_step = torch.where(accept, step, self.previous_step)
        self.extrapolated = accept & (self.valid.sum(1) >= 2)
        self.position = (current + 1) % self.slots
        x_next = self._mix(current)
        if rejected:
            x_next = torch.where(reject[:, None], self.images[:, last], x_next)
        return torch.where(self.engaged[:, None], x_next, image)

    def _mix(self, current: int) -> Tensor:
        solve_dtype = torch.float64 if self.gram.device.type != "mps" else self.gram.dtype
        w = self.valid.to(solve_dtype)
        system = torch.where(self.valid[:, :, None] & self.valid[:, None, :], self.gram, 0.0)
        system = system.to(solve_dtype)
        diagonal = system.diagonal(dim1=1, dim2=2)
        scale = (diagonal.sum(1, keepdim=True) / w.sum(1, keepdim=True).clamp_min(1)).clamp_min(
            torch.finfo(self.gram.dtype).tiny
        )
        # Unused slots get an identity row and a zero constraint weight, hence alpha_i = 0.
        diagonal.add_(torch.addcmul(1 - w, scale, w, value=self.regularisation))
        z, info = torch.linalg.solve_ex(system, w.unsqueeze(2))
        alpha = z.squeeze(2) / z.sum(1)
        if bool(info.any()) or not bool(torch.isfinite(alpha).all()):  # the plain step there
            usable = (info == 0) & torch.isfinite(alpha).all(1)
            plain = torch.zeros_like(alpha)
            plain[:, current] = 1.0
            alpha = torch.where(usable[:, None], alpha, plain)
        return torch.bmm(alpha.to(self.images.dtype).unsqueeze(1), self.images).squeeze(1)


class SecantMixer:
    r"""Anderson mixing of depth one, in closed form: a secant step per problem.

    With the last accepted pair :math:`(f_{k-1}, T(x_{k-1}))` and the new one, the mixed iterate
    is :math:`T(x_k) - \gamma (T(x_k) - T(x_{k-1}))` with :math:`\gamma = \langle f_k, \Delta f
    \rangle / \|\Delta f\|^2`, :math:`\Delta f = f_k - f_{k-1}`: on one number per problem, the
    secant method. The safeguard, :meth:`keep` and the rows follow :class:`AndersonMixer`.

    The Tikhonov weight is that of :class:`AndersonMixer`, relative to the mean squared norm of
    the two residuals, so both give the same iterates to rounding.

    Args:
        batch: Number of problems ``B``.
        features: Problem size ``n``.
        like: Tensor whose dtype and device the state follows.

    Example:
        >>> mixer = SecantMixer(1, 1, torch.zeros(1, 1, dtype=torch.float64))
        >>> x = torch.zeros(1, 1, dtype=torch.float64)
        >>> for _ in range(6):  # T(x) = cos(x), fixed point 0.739085133215...
        ...     image = torch.cos(x)
        ...     x = mixer.step(x, image, (image - x).abs().amax(1))
        >>> round(x.item(), 9)
        0.739085133
    """

    def __init__(self, batch: int, features: int, like: Tensor) -> None:
        self.residual = like.new_zeros(batch, features)
        self.image = like.new_zeros(batch, features)
        self.has_last = torch.zeros(batch, dtype=torch.bool, device=like.device)
        self.previous_step = torch.full((batch,), float("inf"), dtype=like.dtype,
                                        device=like.device)
        self.extrapolated = torch.zeros_like(self.has_last)
        self.engaged = torch.zeros_like(self.has_last)
        self.regularisation = _RELATIVE_REGULARISATION.get(like.dtype, 1e-3)

    def keep(self, rows: Tensor) -> None:
        """Keep only the given rows of the state (boolean mask ``(b,)``)."""
        self.residual, self.image = self.residual[rows], self.image[rows]
        self.has_last, self.previous_step = self.has_last[rows], self.previous_step[rows]
        self.extrapolated, self.engaged = self.extrapolated[rows], self.engaged[rows]

    def step(self, x: Tensor, image: Tensor, step: Tensor, engage: Tensor | None = None) -> Tensor:
        r"""Record :math:`(x^k, T(x^k))` for the engaged rows and return the next iterates, as
        :meth:`AndersonMixer.step` does (the same arguments and safeguard).

        Args:
            x: Current iterates, shape ``(b, n)``.
            image: :math:`T(x^k)`, shape ``(b, n)``.
            step: Max-abs residual :math:`\|T(x^k) - x^k\|_\infty`, shape ``(b,)``.
            engage: Rows that start mixing from this step on, boolean ``(b,)`` (default: all).

        Returns:
            Next iterates :math:`x^{k+1}`, shape ``(b, n)``.
        """
        self.engaged = self.engaged | (True if engage is None else engage)
        reject = self.extrapolated & (step > self.previous_step)
        accept = self.engaged & ~reject
        residual = image - x
        change = residual - self.residual
        scale = (residual.square().sum(1) + self.residual.square().sum(1)) / 2
        gamma = (residual * change).sum(1) / (change.square().sum(1)
                                              + 2 * self.regularisation * scale)
        mix = accept & self.has_last & torch.isfinite(gamma)
        mixed = torch.addcmul(image, gamma.nan_to_num(0.0)[:, None], self.image - image)
        x_next = torch.where(reject[:, None], self.image, torch.where(mix[:, None], mixed, image))
        self.residual = torch.where(accept[:, None], residual, self.residual)
        self.image = torch.where(accept[:, None], image, self.image)
        self.has_last = self.has_last | accept
        self.previous_step = torch.where(accept, step, self.previous_step)
        self.extrapolated = mix
        return torch.where(self.engaged[:, None], x_next, image)
