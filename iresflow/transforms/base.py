r"""Sequence transforms: nflows transforms that carry a padding mask.

:class:`SequenceTransform` fixes the signature every iresflow transform implements,

.. code-block:: text

    forward(inputs, context=None, *, mask=None) -> (outputs, logabsdet)   # data -> noise
    inverse(inputs, context=None, *, mask=None) -> (outputs, logabsdet)   # noise -> data

with ``inputs`` of shape ``(B, N, D)`` (or ``(B, D)``), an optional boolean ``mask`` ``(B, N)``
(``True`` = real token) and ``logabsdet`` of shape ``(B,)``. Since it subclasses
:class:`nflows.transforms.Transform`, nflows' own ``CompositeTransform``, ``InverseTransform``
and ``Flow`` work unchanged for fixed-length data (``mask=None``);
:class:`SequenceCompositeTransform` chains transforms and passes ``mask=`` through, for
variable-length batches.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable

from nflows.transforms.base import Transform
from torch import Tensor, nn

from iresflow._validation import check_mask, check_sequence

__all__ = ["SequenceCompositeTransform", "SequenceTransform"]


class SequenceTransform(Transform, ABC):
    r"""An invertible map of sequences with a padding mask (an nflows ``Transform``).

    Contract: padded positions pass through unchanged and contribute nothing to ``logabsdet``;
    padded inputs never influence real outputs; ``inverse`` undoes ``forward`` and returns the
    log-determinant of the inverse map, so that for :math:`y = f(x)` the two log-determinants sum
    to zero.
    """

    @abstractmethod
    def forward(
        self, inputs: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        r"""Map data to noise.

        Args:
            inputs: Sequences ``(B, N, D)`` or vectors ``(B, D)``.
            context: Conditioning input (``None`` for unconditional transforms).
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.

        Returns:
            ``outputs`` with the shape of ``inputs`` and
            :math:`\log|\det J_f(x)|` per sequence, shape ``(B,)``.
        """

    @abstractmethod
    def inverse(
        self, inputs: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        r"""Map noise to data.

        Args:
            inputs: Sequences ``(B, N, D)`` or vectors ``(B, D)``.
            context: Conditioning input (``None`` for unconditional transforms).
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.

        Returns:
            ``outputs`` with the shape of ``inputs`` and
            :math:`\log|\det J_{f^{-1}}(y)|` per sequence, shape ``(B,)``.
        """


class SequenceCompositeTransform(SequenceTransform):
    r"""Chain of transforms, applied in the given order, passing ``mask=`` to each.

    .. math:: f = f_K \circ \cdots \circ f_1, \qquad
        \log|\det J_f(x)| = \sum_{k=1}^K \log|\det J_{f_k}(x_{k-1})| .

    Any nflows ``Transform`` may be part of the chain; with a ``mask`` every member must be a
    :class:`SequenceTransform`, since only those honour the padding contract. The context is
    passed on to every member.

    Args:
        transforms: Iterable of nflows ``Transform`` objects.

    Example:
        >>> import torch
        >>> from nflows.transforms import IdentityTransform
        >>> chain = SequenceCompositeTransform([IdentityTransform(), IdentityTransform()])
        >>> y, logabsdet = chain(torch.randn(2, 5, 3))
        >>> y.shape, logabsdet.shape
        (torch.Size([2, 5, 3]), torch.Size([2]))
    """

    def __init__(self, transforms: Iterable[Transform]) -> None:
        super().__init__()
        transforms = list(transforms)
        for i, t in enumerate(transforms):
            if not isinstance(t, Transform):
                raise TypeError(
                    f"transforms[{i}] must be an nflows Transform, got {type(t).__name__}"
                )
        self._transforms = nn.ModuleList(transforms)

    def forward(
        self, inputs: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Apply the members in order; see :meth:`SequenceTransform.forward`."""
        return self._cascade(inputs, context, mask, inverse=False)

    def inverse(
        self, inputs: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Apply the members' inverses in reverse order; see :meth:`SequenceTransform.inverse`."""
        return self._cascade(inputs, context, mask, inverse=True)

    def _cascade(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, *, inverse: bool
    ) -> tuple[Tensor, Tensor]:
        inputs = check_sequence(inputs, "inputs")
        mask = check_mask(mask, inputs)
        members = list(self._transforms)[::-1] if inverse else list(self._transforms)
        if mask is not None:
            for t in members:
                if not isinstance(t, SequenceTransform):
                    raise TypeError(
                        f"a mask needs every member to be a SequenceTransform, got "
                        f"{type(t).__name__}"
                    )
        outputs = inputs
        total = inputs.new_zeros(inputs.shape[0])
        for t in members:
            call = t.inverse if inverse else t
            if mask is None:
                outputs, logabsdet = call(outputs, context)
            else:
                outputs, logabsdet = call(outputs, context, mask=mask)
            total = total + logabsdet
        return outputs, total
