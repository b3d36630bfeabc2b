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
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["AndersonMixer"]

# Tikhonov weight of the least-squares problem relative to the mean squared residual norm.
_RELATIVE_REGULARISATION = {torch.float64: 1e-12, torch.float32: 1e-6}


class AndersonMixer:
    r"""Per-sample Anderson state for a batch of ``B`` fixed-point problems in :math:`\mathbb R^n`.

    Samples are addressed by their batch index, so a solver may pass any subset of active samples
    at every step.

    Args:
        batch: Number of problems ``B``.
        features: Flattened problem size ``n``.
        memory: Depth ``m >= 1``: previous iterates mixed with the current one.
        like: Tensor whose dtype and device the state follows.

    Example:
        >>> mixer = AndersonMixer(1, 1, 2, torch.zeros(1, 1, dtype=torch.float64))
        >>> idx = torch.tensor([0])
        >>> x = torch.zeros(1, 1, dtype=torch.float64)
        >>> for _ in range(4):  # T(x) = 1 - x / 2, fixed point 2 / 3
        ...     image = 1 - x / 2
        ...     x = mixer.step(idx, x, image, (image - x).abs().amax(1))
        >>> round(x.item(), 12)
        0.666666666667
    """

    def __init__(self, batch: int, features: int, memory: int, like: Tensor) -> None:
        if memory < 1:
            raise ValueError(f"memory must be >= 1, got {memory}")
        slots = memory + 1
        self.slots = slots
        self.residuals = like.new_zeros(batch, slots, features)
        self.images = like.new_zeros(batch, slots, features)
        self.valid = torch.zeros(batch, slots, dtype=torch.bool, device=like.device)
        self.count = torch.zeros(batch, dtype=torch.int64, device=like.device)
        self.previous_step = torch.full((batch,), float("inf"), dtype=like.dtype,
                                        device=like.device)
        self.extrapolated = torch.zeros(batch, dtype=torch.bool, device=like.device)
        self.regularisation = _RELATIVE_REGULARISATION.get(like.dtype, 1e-3)

    def step(self, index: Tensor, x: Tensor, image: Tensor, step: Tensor) -> Tensor:
        r"""Record :math:`(x^k, T(x^k))` for the samples ``index`` and return their next iterates.

        Args:
            index: Batch indices of the samples, shape ``(b,)``, ``int64``.
            x: Current iterates, shape ``(b, n)``.
            image: :math:`T(x^k)`, shape ``(b, n)``.
            step: Max-abs residual :math:`\|T(x^k) - x^k\|_\infty`, shape ``(b,)``.

        Returns:
            Next iterates :math:`x^{k+1}`, shape ``(b, n)``.
        """
        reject = self.extrapolated[index] & ~(step <= self.previous_step[index])
        x_next = torch.empty_like(x)
        if bool(reject.any()):
            rows = reject.nonzero().squeeze(1)
            idx = index[rows]
            last = (self.count[idx] - 1) % self.slots
            self.valid[idx] = False
            self.valid[idx, last] = True
            self.extrapolated[idx] = False
            x_next[rows] = self.images[idx, last]
        accept = ~reject
        if bool(accept.any()):
            rows = accept.nonzero().squeeze(1)
            idx = index[rows]
            slot = self.count[idx] % self.slots
            self.residuals[idx, slot] = image[rows] - x[rows]
            self.images[idx, slot] = image[rows]
            self.valid[idx, slot] = True
            self.count[idx] += 1
            self.previous_step[idx] = step[rows]
            x_next[rows], self.extrapolated[idx] = self._mix(idx, slot)
        return x_next

    def _mix(self, idx: Tensor, current: Tensor) -> tuple[Tensor, Tensor]:
        residuals, images = self.residuals[idx], self.images[idx]
        valid = self.valid[idx]
        w = valid.to(residuals.dtype)
        gram = torch.bmm(residuals, residuals.transpose(1, 2)) * (w[:, :, None] * w[:, None, :])
        scale = (gram.diagonal(dim1=1, dim2=2).sum(1) / w.sum(1)).clamp_min(
            torch.finfo(gram.dtype).tiny
        )
        # Unused slots get an identity row and a zero constraint weight, hence alpha_i = 0.
        diag = self.regularisation * scale[:, None] * w + (1 - w)
        system = gram + torch.diag_embed(diag)
        solve_dtype = torch.float64 if system.device.type != "mps" else system.dtype
        z, info = torch.linalg.solve_ex(system.to(solve_dtype), w.to(solve_dtype)[:, :, None])
        z = z.squeeze(2)
        alpha = z / z.sum(1, keepdim=True)
        usable = (info == 0) & torch.isfinite(alpha).all(1)
        plain = torch.nn.functional.one_hot(current, self.slots).to(solve_dtype)
        alpha = torch.where(usable[:, None], alpha, plain).to(images.dtype)
        x_next = torch.einsum("bs,bsn->bn", alpha, images)
        return x_next, valid.sum(1) >= 2
