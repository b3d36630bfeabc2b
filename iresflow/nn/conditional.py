r"""Conditioning by composition: residual branches :math:`g(x, c)` whose certificate in
:math:`x` holds for every context :math:`c` (docs/math.md#conditional-branches).

The context, a per-sequence vector :math:`c` of shape ``(B, C)``, enters through a small
unconstrained network :math:`s(c)` (:class:`ContextShift`, last layer zero at initialisation)
composed into a branch at its *shift point* (:class:`ConditionalBranch`): after the first layer
of the MLP and convolution branches,

.. math:: g(x, c) = W_3\, \phi\big(W_2\, \phi(W_1 x + b_1 + s(c)) + b_2\big) + b_3 ,

and at the input of attention, :math:`g(x, c) = f_{\rm attn}(x + s(c))`. For fixed :math:`c`
the shift is a constant, so the Jacobian in :math:`x` is that of the unconditional branch at a
shifted point and :math:`\mathrm{lip}_x(g(\cdot, c))` has the unconditional certificate,
whatever :math:`c` is; the residual step :math:`x \mapsto x + g(x, c)` is invertible in
:math:`x` for every :math:`c`, and a conditional branch starts as the unconditional one.

:class:`ContextEncoder` turns what a user conditions on (integer class labels through a learned
embedding, or continuous covariates) into that vector, with the validation of the entry point.
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from torch import Tensor, nn

from iresflow._validation import (
    check_dtype_device,
    check_finite,
    check_int,
    under_functorch_transform,
)
from iresflow.nn.base import BranchWrapper, Linearization, LipschitzBranch

__all__ = ["ConditionalBranch", "ContextEncoder", "ContextShift", "check_context", "shifted"]


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


class ContextShift(nn.Sequential):
    r"""The unconstrained network :math:`s(c)` of a context, zero at initialisation.

    ``Linear(C, hidden) -> SiLU -> Linear(hidden, out)`` with the last layer's weight and bias
    zero, so :math:`s \equiv 0` until training moves it: whatever it is composed into starts as
    its context-free self. Used as the shift of a :class:`ConditionalBranch` and as the
    parameter network of the conditional autoregressive layer and affine map
    (:mod:`iresflow.transforms`).

    Args:
        context_features: Context size ``C``.
        out_features: Output size.
        hidden: Hidden width.

    Example:
        >>> shift = ContextShift(2, 3, hidden=4)
        >>> shift(torch.randn(5, 2)).abs().max().item()
        0.0
    """

    def __init__(self, context_features: int, out_features: int, hidden: int = 32) -> None:
        check_int(context_features, "context_features", 1)
        check_int(out_features, "out_features", 1)
        check_int(hidden, "context_hidden", 1)
        last = nn.Linear(hidden, out_features)
        nn.init.zeros_(last.weight)
        nn.init.zeros_(last.bias)
        super().__init__(nn.Linear(context_features, hidden), nn.SiLU(), last)


class ConditionalBranch(BranchWrapper):
    r"""A branch conditioned on a per-sequence context: :math:`g(x, c) = g(x; s(c))`.

    Composes a :class:`ContextShift` :math:`s` of the context ``(B, C)`` into a branch at its
    shift point (:func:`shifted`): after the first layer of a branch that declares one
    (:attr:`~iresflow.nn.base.LipschitzBranch.shift_features`: the MLP and convolution
    branches), else at its input, a translation (attention). For a fixed
    :math:`c` the shift is a constant, so :math:`\mathrm{lip}_x(g(\cdot, c))` has the wrapped
    branch's certificate for every context (docs/math.md#conditional-branches), and the branch
    starts as the wrapped one (:math:`s = 0`). Its structure and :meth:`lipschitz_constant` are
    the wrapped branch's (:class:`~iresflow.nn.base.BranchWrapper`).

    A :class:`~iresflow.transforms.residual.ResidualTransform` recognises a conditional branch
    by its ``context_features``; it binds the context (:meth:`bind`) for the log-det engines and
    passes it to the fixed-point inverse.

    Args:
        branch: The wrapped branch; it must declare ``shift_features`` or ``features``.
        context_features: Context size ``C``.
        context_hidden: Hidden width of :math:`s`.

    Raises:
        TypeError: ``branch`` is not a :class:`~iresflow.nn.base.LipschitzBranch`.
        ValueError: the branch declares neither a shift point nor its features.

    Example:
        >>> from iresflow.nn.mlp import LipschitzMLP
        >>> g = ConditionalBranch(LipschitzMLP((3, 8, 3)), context_features=2).double()
        >>> x = torch.randn(4, 5, 3, dtype=torch.float64)
        >>> g(x, context=torch.randn(4, 2, dtype=torch.float64)).shape
        torch.Size([4, 5, 3])
    """

    def __init__(
        self, branch: LipschitzBranch, context_features: int, context_hidden: int = 32
    ) -> None:
        super().__init__(branch)
        width = branch.shift_features or getattr(branch, "features", None)
        if width is None:
            raise ValueError(f"{type(branch).__name__} declares neither shift_features nor "
                             f"features: no shift point to condition on")
        self.context_features = check_int(context_features, "context_features", 1)
        self.context_net = ContextShift(context_features, width, context_hidden)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        """Evaluate :math:`g(x, c)`.

        Args:
            x: Sequences ``(B, N, D)`` (or vectors ``(B, D)`` where the wrapped branch takes them).
            mask: Optional boolean padding mask ``(B, N)``.
            context: Context ``(B, C)`` (required).

        Returns:
            ``g(x, c)`` with the shape of ``x``, exactly zero at padded positions.

        Raises:
            TypeError, ValueError: invalid ``x``, ``mask`` or ``context``.
        """
        if not isinstance(x, Tensor) or x.dim() < 2:  # the wrapped branch rejects x
            return self.branch(x, mask)
        if not under_functorch_transform():
            check_context(context, x.shape[0], self.context_features, self.context_net[0].weight)
        return shifted(self.branch, x, mask, self.context_net(context))

    def bind(self, context: Tensor) -> LipschitzBranch:
        r"""The branch :math:`x \mapsto g(x, c)` at a fixed context, for the log-det engines.

        The engines evaluate a branch on the batch repeated along the rows; row ``r`` of an
        input with ``k B`` rows belongs to sequence ``r mod B`` and gets its shift. The shift
        :math:`s(c)` is listed among the parameters of the bound branch, so the
        memory-efficient Neumann backward returns its gradient (on to :math:`s` and whatever
        produced ``context``, e.g. a label embedding).

        Args:
            context: Validated context ``(B, C)``.

        Returns:
            A branch of the same structure and certificate, taking ``(x, mask)``.
        """
        return _ShiftedBranch(self.branch, self.context_net(context))

    def extra_repr(self) -> str:
        return f"context_features={self.context_features}"


class _ShiftedBranch(BranchWrapper):
    """A branch with its per-sequence shift fixed (see :meth:`ConditionalBranch.bind`)."""

    def __init__(self, branch: LipschitzBranch, shift: Tensor) -> None:
        super().__init__(branch)
        self.shift = shift

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        rows, batch = x.shape[0], self.shift.shape[0]
        if rows % batch:
            raise RuntimeError(f"{rows} rows do not repeat a batch of {batch} shifts")
        shift = self.shift if rows == batch else self.shift.repeat(rows // batch, 1)
        return shifted(self.branch, x, mask, shift)

    def linearize(self, shift: Tensor | None = None) -> Linearization | None:
        """The wrapped branch's linearization at the fixed shift (``None`` if it has none, or
        for a translated input)."""
        if shift is not None:
            raise ValueError("the shift of a bound conditional branch is already fixed")
        if self.branch.shift_features is None:
            return None
        return self.branch.linearize(shift=self.shift)

    def parameters(self, recurse: bool = True) -> Iterator[nn.Parameter]:
        yield from super().parameters(recurse)
        if self.shift.requires_grad:
            yield self.shift  # type: ignore[misc]


def shifted(branch: LipschitzBranch, x: Tensor, mask: Tensor | None, shift: Tensor) -> Tensor:
    """A branch with a per-sequence shift at its shift point: its own (``shift_features``), or
    else its input, translated (docs/math.md#conditional-branches).

    Args:
        branch: The branch.
        x: Sequences ``(B, N, D)`` (or vectors ``(B, D)`` where the branch takes them).
        mask: Optional boolean padding mask ``(B, N)``.
        shift: ``(B, shift_features)``, or ``(B, D)`` for a branch without a shift point.

    Returns:
        The branch's output, shape of ``x``.
    """
    if branch.shift_features is not None:
        return branch(x, mask, shift=shift)
    return branch(x + (shift.unsqueeze(1) if x.dim() == 3 else shift), mask)


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
