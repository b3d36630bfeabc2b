r"""Conditional residual branches :math:`g(x, c)` whose certificate in :math:`x` holds for every
context :math:`c` (docs/math.md#contractive-attention, docs/math.md#spectral-norm).

The context, a per-sequence vector :math:`c` of shape ``(B, C)``, enters outside the
Lipschitz-constrained path: as an additive shift :math:`s(c)` after the first layer,

.. math:: g(x, c) = W_3\, \phi\big(W_2\, \phi(W_1 x + b_1 + s(c)) + b_2\big) + b_3 ,

with :math:`s` an unconstrained small MLP of :math:`c` alone. For fixed :math:`c` the shift is
a constant, so :math:`\mathrm{lip}_x(g(\cdot, c)) \le \prod_l \|W_l\|\,\mathrm{lip}(\phi)^2`,
the certificate of the unconditional branch, whatever :math:`c` is; the residual step
:math:`x \mapsto x + g(x, c)` is therefore invertible in :math:`x` for every :math:`c`. The last
layer of :math:`s` starts at zero, so a conditional branch starts as the unconditional one.

:class:`ContextEncoder` turns what a user conditions on (integer class labels through a learned
embedding, or continuous covariates) into that vector, with the validation of the entry point.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Literal

import torch
from torch import Tensor, nn

from iresflow._validation import (
    check_dtype_device,
    check_finite,
    check_int,
    check_mask,
    check_sequence,
    under_functorch_transform,
)
from iresflow.nn.conv import TemporalConvBranch
from iresflow.nn.mlp import LipschitzMLP

__all__ = [
    "ConditionalLipschitzMLP",
    "ConditionalTemporalConvBranch",
    "ContextEncoder",
    "check_context",
]


def check_context(context: object, batch: int, features: int, like: Tensor) -> Tensor:
    """Validate a context batch ``(B, C)`` by shape, dtype and device (reads no values).

    Args:
        context: Candidate context.
        batch: Expected number of rows ``B``.
        features: Expected context size ``C``.
        like: Reference tensor giving the dtype and device.

    Returns:
        ``context``.

    Raises:
        TypeError: not a tensor, or the wrong dtype or device.
        ValueError: not of shape ``(B, C)``.

    Example:
        >>> check_context(torch.zeros(2, 3), 2, 3, torch.zeros(1)).shape
        torch.Size([2, 3])
    """
    if not isinstance(context, Tensor):
        raise TypeError(f"context must be a tensor of shape (B, C), got {type(context).__name__}")
    if context.shape != (batch, features):
        raise ValueError(
            f"context must have shape (B, C) = ({batch}, {features}), got {tuple(context.shape)}"
        )
    return check_dtype_device(context, like, "context")


def _shift_net(context_features: int, out_features: int, hidden: int) -> nn.Sequential:
    """The unconstrained MLP :math:`s(c)`, its last layer zero so that :math:`s = 0` at start."""
    check_int(context_features, "context_features", 1)
    check_int(hidden, "context_hidden", 1)
    last = nn.Linear(hidden, out_features)
    nn.init.zeros_(last.weight)
    nn.init.zeros_(last.bias)
    return nn.Sequential(nn.Linear(context_features, hidden), nn.SiLU(), last)


class ConditionalLipschitzMLP(LipschitzMLP):
    r"""Position-wise spectrally normalised LipSwish MLP with a context shift after layer 1.

    :math:`g(x, c) = \mathrm{MLP}(x)` with :math:`s(c)` added to the first pre-activation (module
    docstring); :meth:`lipschitz_constant` is that of :class:`~iresflow.nn.mlp.LipschitzMLP`
    and holds in :math:`x` for every context.

    Args:
        dims: Layer sizes ``(D, ..., D)``, at least three entries.
        context_features: Context size ``C``.
        coeff: Per-layer Lipschitz coefficient (see :class:`~iresflow.nn.mlp.LipschitzMLP`).
        n_power_iterations: Power iterations per training forward.
        sigma: ``"exact"`` or ``"power"`` spectral norms in training.
        context_hidden: Hidden width of the context network :math:`s`.

    Example:
        >>> g = ConditionalLipschitzMLP((3, 8, 3), context_features=2).double()
        >>> x = torch.randn(4, 5, 3, dtype=torch.float64)
        >>> g(x, context=torch.randn(4, 2, dtype=torch.float64)).shape
        torch.Size([4, 5, 3])
    """

    def __init__(
        self,
        dims: Sequence[int],
        context_features: int,
        coeff: float = 0.97,
        n_power_iterations: int = 1,
        sigma: Literal["power", "exact"] = "exact",
        context_hidden: int = 32,
    ) -> None:
        super().__init__(dims, coeff, n_power_iterations, sigma=sigma)
        if len(self.net) < 2:
            raise ValueError(f"dims must hold at least 3 sizes for a context shift, got {dims}")
        self.context_features = check_int(context_features, "context_features", 1)
        self.context_net = _shift_net(context_features, self.net[0].out_features, context_hidden)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        """Evaluate the branch token by token.

        Args:
            x: Sequences ``(B, N, D)`` or vectors ``(B, D)``.
            mask: Optional boolean padding mask ``(B, N)``.
            context: Context ``(B, C)`` (required).

        Returns:
            ``g(x, c)`` with the shape of ``x``, exactly zero at padded positions.

        Raises:
            TypeError, ValueError: invalid ``x``, ``mask`` or ``context``.
        """
        if not under_functorch_transform():
            check_sequence(x, "x", features=self.features, like=self.net[0].weight)
            mask = check_mask(mask, x)
            check_context(context, x.shape[0], self.context_features, self.net[0].weight)
        shift = self.context_net(context)
        h = self.net[0](x) + (shift.unsqueeze(1) if x.dim() == 3 else shift)
        out = self.net[1:](h)
        if mask is not None:
            out = torch.where(mask.unsqueeze(-1), out, 0.0)
        return out

    def linearize(self) -> None:
        """No hand-written Jacobian products: the engines use autograd."""
        return None


class ConditionalTemporalConvBranch(TemporalConvBranch):
    r"""Temporal convolution branch with a context shift after its first convolution.

    The shift :math:`s(c)` is added to every frame of the first convolution's output (module
    docstring); :meth:`lipschitz_constant` is that of
    :class:`~iresflow.nn.conv.TemporalConvBranch` (docs/math.md#temporal-conv) and holds in
    :math:`x` for every context.

    Args:
        features: Feature size ``D``.
        hidden: Hidden channels.
        context_features: Context size ``C``.
        kernel_size: Odd kernel size of the outer convolutions.
        coeff: Certified Lipschitz bound of the branch, in ``(0, 1)``.
        max_len: Longest sequence accepted.
        context_hidden: Hidden width of the context network :math:`s`.

    Example:
        >>> g = ConditionalTemporalConvBranch(3, 8, 2, max_len=6).double()
        >>> x = torch.randn(4, 5, 3, dtype=torch.float64)
        >>> g(x, context=torch.randn(4, 2, dtype=torch.float64)).shape
        torch.Size([4, 5, 3])
    """

    def __init__(
        self,
        features: int,
        hidden: int,
        context_features: int,
        kernel_size: int = 3,
        coeff: float = 0.9,
        *,
        max_len: int,
        context_hidden: int = 32,
    ) -> None:
        super().__init__(features, hidden, kernel_size, coeff, max_len=max_len)
        self.context_features = check_int(context_features, "context_features", 1)
        self.context_net = _shift_net(context_features, hidden, context_hidden)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        """Evaluate the branch.

        Args:
            x: Sequences ``(B, N, D)`` with ``N <= max_len``.
            mask: Optional boolean padding mask ``(B, N)``.
            context: Context ``(B, C)`` (required).

        Returns:
            ``g(x, c)``, shape ``(B, N, D)``, exactly zero at padded frames.

        Raises:
            TypeError, ValueError: invalid ``x``, ``mask`` or ``context``, or ``N > max_len``.
        """
        if not under_functorch_transform():
            check_sequence(x, "x", features=self.features, allow_2d=False, like=self.net[0].weight)
            mask = check_mask(mask, x)
            check_context(context, x.shape[0], self.context_features, self.net[0].weight)
        return self._convolve(x, mask, self.context_net(context))

    def linearize(self) -> None:
        """No hand-written Jacobian products (they would miss the context shift): autograd."""
        return None


class ContextEncoder(nn.Module):
    r"""What a flow is conditioned on, as a context vector ``(B, C)``.

    With ``num_classes > 0`` the input is a batch of integer class labels ``(B,)`` in
    ``[0, num_classes)``, mapped by a learned ``nn.Embedding(num_classes, C)``; otherwise it is
    a batch of continuous covariates ``(B, C)``, passed through unchanged.

    Args:
        context_features: Context size ``C``.
        num_classes: Number of classes (0: covariates).

    Example:
        >>> encoder = ContextEncoder(4, num_classes=3)
        >>> encoder(torch.tensor([0, 2])).shape
        torch.Size([2, 4])
    """

    def __init__(self, context_features: int, num_classes: int = 0) -> None:
        super().__init__()
        self.context_features = check_int(context_features, "context_features", 1)
        self.num_classes = check_int(num_classes, "num_classes", 0)
        self.embedding = (
            nn.Embedding(num_classes, context_features) if num_classes > 0 else None
        )

    def check(self, context: object, batch: int, like: Tensor) -> Tensor:
        """Validate a context input for a batch of ``batch`` sequences (reads its values).

        Args:
            context: Labels ``(B,)`` (integer) or covariates ``(B, C)`` (of ``like``'s dtype).
            batch: Number of sequences ``B``.
            like: Reference tensor giving the dtype and device.

        Returns:
            ``context``.

        Raises:
            TypeError: not a tensor, or the wrong dtype or device.
            ValueError: wrong shape, a label out of range, or non-finite covariates.
        """
        if self.embedding is None:
            return check_finite(check_context(context, batch, self.context_features, like),
                                "context")
        if not isinstance(context, Tensor) or context.dtype in (torch.bool,) or (
            context.is_floating_point() or context.is_complex()
        ):
            raise TypeError(f"context must be an integer tensor of class labels (B,), got "
                            f"{getattr(context, 'dtype', type(context).__name__)}")
        if context.shape != (batch,):
            raise ValueError(f"context must hold one label per sequence, shape ({batch},), got "
                             f"{tuple(context.shape)}")
        if context.device != like.device:
            raise TypeError(f"context must be on {like.device}, got {context.device}")
        if batch and not bool(((context >= 0) & (context < self.num_classes)).all()):
            raise ValueError(f"context labels must lie in [0, {self.num_classes})")
        return context

    def forward(self, context: Tensor) -> Tensor:
        """The context vector ``(B, C)`` of labels ``(B,)`` or covariates ``(B, C)``."""
        return context if self.embedding is None else self.embedding(context)

    def extra_repr(self) -> str:
        return f"context_features={self.context_features}, num_classes={self.num_classes}"
