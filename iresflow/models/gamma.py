r"""Gamma variates drawn from one ``torch.Generator`` (docs/math.md#gamma-sampling).

``torch.distributions.Gamma`` and ``Chi2`` take no generator, so a seeded sample of a flow with
a Student-t base could not be reproduced from the flow's own generator. :func:`sample_gamma`
draws with ``torch.randn`` and ``torch.rand`` from the given generator only: Marsaglia and
Tsang's rejection method for shapes :math:`\alpha \ge 1`, with the boost
:math:`\Gamma(\alpha) = \Gamma(\alpha + 1)\, U^{1/\alpha}` below 1.
"""

from __future__ import annotations

import torch
from torch import Tensor

from iresflow._validation import check_generator

__all__ = ["sample_gamma"]


def sample_gamma(concentration: Tensor, generator: torch.Generator | None = None) -> Tensor:
    r"""Draw one :math:`\mathrm{Gamma}(\alpha, 1)` variate per entry of ``concentration``.

    Marsaglia and Tsang's method (docs/math.md#gamma-sampling): with :math:`a = \alpha` (or
    :math:`\alpha + 1` for :math:`\alpha < 1`), :math:`d = a - 1/3`, :math:`c = 1/\sqrt{9d}`,
    propose :math:`v = (1 + c x)^3` with :math:`x \sim \mathcal N(0, 1)` and accept
    :math:`d v` when :math:`v > 0` and
    :math:`\log u < x^2/2 + d - d v + d \log v`, :math:`u \sim U(0, 1)`; the entries still
    rejected draw again, all at once, until none is left (each proposal is accepted with
    probability above 0.95). A shape below 1 multiplies the draw by :math:`U^{1/\alpha}`.
    Every random number comes from ``generator``, so a seeded generator reproduces the draw.

    Args:
        concentration: Shapes :math:`\alpha > 0`, a floating tensor of any shape (its dtype and
            device are those of the draw).
        generator: The only source of randomness (torch's global generator when ``None``), on
            the device of ``concentration``.

    Returns:
        Variates of the shape of ``concentration``, not differentiable.

    Raises:
        TypeError: ``concentration`` is not a floating tensor, or ``generator`` is not a
            ``torch.Generator``.
        ValueError: a shape is not positive and finite.

    Example:
        >>> draw = sample_gamma(torch.tensor([0.5, 2.0, 30.0]), torch.Generator().manual_seed(0))
        >>> draw.shape, bool((draw > 0).all())
        (torch.Size([3]), True)
    """
    if not isinstance(concentration, Tensor) or not concentration.is_floating_point():
        raise TypeError("concentration must be a floating torch.Tensor")
    generator = check_generator(generator)
    alpha = concentration.detach()
    if not bool(((alpha > 0) & alpha.isfinite()).all()):
        raise ValueError("concentration must be positive and finite")
    boosted = alpha < 1
    shape = torch.where(boosted, alpha + 1, alpha).reshape(-1)
    d = shape - 1 / 3
    c = torch.rsqrt(9 * d)
    draw = torch.empty_like(d)
    pending = torch.arange(d.numel(), device=d.device)
    while pending.numel():
        dp, cp = d[pending], c[pending]
        x = torch.randn(pending.shape, generator=generator, dtype=d.dtype, device=d.device)
        u = torch.rand(pending.shape, generator=generator, dtype=d.dtype, device=d.device)
        v = (1 + cp * x) ** 3
        accept = (v > 0) & (u.log() < 0.5 * x.square() + dp - dp * v + dp * v.log())
        draw[pending[accept]] = (dp * v)[accept]
        pending = pending[~accept]
    draw = draw.reshape(alpha.shape)
    if bool(boosted.any()):
        u = 1 - torch.rand(alpha.shape, generator=generator, dtype=d.dtype, device=d.device)
        draw = torch.where(boosted, draw * u.pow(1 / alpha), draw)
    return draw
