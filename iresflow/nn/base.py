"""The abstract residual branch: what the log-det and inverse engines need to know."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import ClassVar, Literal

from torch import Tensor, nn

__all__ = ["LipschitzBranch"]


class LipschitzBranch(nn.Module, ABC):
    r"""A residual branch :math:`g` with a certified Lipschitz constant.

    A branch maps a batch of sequences ``(B, N, D)`` to ``(B, N, D)`` and declares

    * ``position_wise``: ``True`` if :math:`g` acts on every token independently (its Jacobian is
      block diagonal with ``N`` blocks of ``D x D``); the exact log-det engine then sums ``N``
      small ``slogdet`` s instead of one ``(N D) x (N D)`` determinant.
    * ``norm``: the vector norm (``"inf"`` or ``"2"``, on :math:`\mathrm{vec}(X)`) in which its
      certificate holds. Any induced norm bounds the spectral radius, so either suffices for the
      log-det series and the fixed-point inverse of :math:`x + g(x)`.
    * :meth:`lipschitz_constant`: the certified bound, which a contractive branch keeps ``< 1``
      structurally, in every forward, without any update call.

    Contract for masks: with a boolean ``mask`` of shape ``(B, N)`` (``True`` = real token), the
    output at padded positions is exactly zero and padded inputs never influence real outputs.
    """

    position_wise: ClassVar[bool]
    norm: ClassVar[Literal["inf", "2"]]

    @abstractmethod
    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Evaluate the branch.

        Args:
            x: Sequences, shape ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.

        Returns:
            ``g(x)``, shape ``(B, N, D)``, zero at padded positions.
        """

    @abstractmethod
    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        """Certified upper bound on the Lipschitz constant of the branch (0-dim tensor).

        Args:
            seq_len: Sequence length ``N`` for branches whose bound depends on it (attention);
                position-wise branches ignore it.
        """
