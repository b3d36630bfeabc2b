r"""Positional encodings added *inside* a residual branch (docs/math.md#contractive-attention,
"iresflow block").

A residual branch :math:`g` that sees :math:`X + E` instead of :math:`X`, for a table
:math:`E\in\mathbb R^{N\times D}` that does not depend on :math:`X`, has the same Jacobian
:math:`J_g(X+E)` and therefore the same Lipschitz constant: a translation changes neither the
certificate of the branch nor the invertibility of :math:`x + g(x + E)`. This is how position
information enters the otherwise permutation-equivariant attention branch.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn

from iresflow._validation import check_int
from iresflow.nn.base import BranchWrapper, LipschitzBranch

__all__ = [
    "LearnedPositionalEncoding",
    "PositionalBranch",
    "SinusoidalPositionalEncoding",
    "make_positional_encoding",
]


class SinusoidalPositionalEncoding(nn.Module):
    r"""Fixed sinusoidal table (Vaswani et al., 2017).

    .. math::
        E_{n,2i} = \sin(n\,\omega_i),\qquad E_{n,2i+1} = \cos(n\,\omega_i),\qquad
        \omega_i = \mathrm{base}^{-2i/D},

    for positions :math:`n = 0, \dots, N-1` and feature index :math:`0 \le 2i, 2i+1 < D`. The
    table has no parameters and is computed on the fly for any length, in the input's dtype and
    device.

    Args:
        features: Feature size ``D``.
        base: Wavelength base (``10000`` in the Transformer paper).

    Example:
        >>> enc = SinusoidalPositionalEncoding(4)
        >>> enc(torch.zeros(2, 3, 4)).shape
        torch.Size([3, 4])
    """

    def __init__(self, features: int, base: float = 10000.0) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        if not (isinstance(base, (int, float)) and math.isfinite(base) and base > 1.0):
            raise ValueError(f"base must be a finite number > 1, got {base!r}")
        self.base = float(base)

    def forward(self, x: Tensor) -> Tensor:
        """Return the table for the sequence length of ``x``.

        Args:
            x: Sequences, shape ``(B, N, D)``; only ``N``, dtype and device are used.

        Returns:
            ``E``, shape ``(N, D)``.
        """
        _check_table_input(x, self.features)
        n, d = x.shape[1], self.features
        position = torch.arange(n, dtype=x.dtype, device=x.device).unsqueeze(1)
        index = torch.arange(d, dtype=x.dtype, device=x.device)
        # Features 2i and 2i+1 share the frequency base^(-2i/D).
        frequency = self.base ** (-2.0 * torch.div(index, 2, rounding_mode="floor") / d)
        angle = position * frequency
        even = (torch.arange(d, device=x.device) % 2 == 0).unsqueeze(0)
        return torch.where(even, torch.sin(angle), torch.cos(angle))

    def extra_repr(self) -> str:
        return f"features={self.features}, base={self.base}"


class LearnedPositionalEncoding(nn.Module):
    r"""Learned table :math:`E\in\mathbb R^{N_{\max}\times D}`, one free vector per position.

    Args:
        features: Feature size ``D``.
        max_len: Largest sequence length ``N_max`` the table covers; longer inputs raise
            ``ValueError``.
        init_std: Standard deviation of the normal initialisation (drawn from torch's global
            generator).

    Example:
        >>> enc = LearnedPositionalEncoding(4, max_len=8)
        >>> enc(torch.zeros(2, 3, 4)).shape
        torch.Size([3, 4])
    """

    def __init__(self, features: int, max_len: int, init_std: float = 0.02) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        self.max_len = check_int(max_len, "max_len", 1)
        if not (isinstance(init_std, (int, float)) and math.isfinite(init_std) and init_std >= 0):
            raise ValueError(f"init_std must be a finite number >= 0, got {init_std!r}")
        self.table = nn.Parameter(torch.randn(self.max_len, self.features) * init_std)

    def forward(self, x: Tensor) -> Tensor:
        """Return the first ``N`` rows of the table.

        Args:
            x: Sequences, shape ``(B, N, D)`` with ``N <= max_len``.

        Returns:
            ``E``, shape ``(N, D)``.

        Raises:
            ValueError: ``N > max_len``.
        """
        _check_table_input(x, self.features)
        n = x.shape[1]
        if n > self.max_len:
            raise ValueError(
                f"sequence length {n} exceeds the learned positional table (max_len={self.max_len})"
            )
        return self.table[:n].to(dtype=x.dtype)

    def extra_repr(self) -> str:
        return f"features={self.features}, max_len={self.max_len}"


def _check_table_input(x: Tensor, features: int) -> None:
    if x.dim() != 3 or x.shape[-1] != features:
        raise ValueError(f"x must have shape (B, N, {features}), got {tuple(x.shape)}")


def make_positional_encoding(
    kind: Literal["sinusoidal", "learned"], features: int, max_len: int
) -> nn.Module:
    """Build a positional encoding by name.

    Args:
        kind: ``"sinusoidal"`` (fixed table, any length) or ``"learned"`` (``max_len`` rows).
        features: Feature size ``D``.
        max_len: Table size for ``"learned"``; ignored by ``"sinusoidal"``.

    Returns:
        The encoding module (maps ``(B, N, D)`` to an ``(N, D)`` table).

    Example:
        >>> make_positional_encoding("learned", 3, max_len=5).table.shape
        torch.Size([5, 3])
    """
    if kind == "sinusoidal":
        return SinusoidalPositionalEncoding(features)
    if kind == "learned":
        return LearnedPositionalEncoding(features, max_len)
    raise ValueError(f"positional must be 'sinusoidal' or 'learned', got {kind!r}")


class PositionalBranch(BranchWrapper):
    r"""A branch evaluated on position-shifted inputs: :math:`g_E(X) = g(X + E)`.

    Since :math:`J_{g_E}(X) = J_g(X + E)`, the wrapped branch's certificate holds unchanged
    (docs/math.md#contractive-attention); its structure and :meth:`lipschitz_constant` are the
    wrapped branch's (:class:`~iresflow.nn.base.BranchWrapper`), and a shift is passed on to
    it. Padded positions also receive :math:`E`, but the wrapped branch ignores padded inputs
    and returns zeros there, so the mask contract is kept.

    Args:
        branch: The wrapped branch (typically contractive attention).
        encoding: Module mapping ``(B, N, D)`` to an ``(N, D)`` table, e.g.
            :class:`SinusoidalPositionalEncoding` or :class:`LearnedPositionalEncoding`.

    Example:
        >>> from iresflow.nn.mlp import LipschitzMLP
        >>> g = PositionalBranch(LipschitzMLP([3, 8, 3]), SinusoidalPositionalEncoding(3))
        >>> g(torch.zeros(2, 4, 3)).shape
        torch.Size([2, 4, 3])
    """

    def __init__(self, branch: LipschitzBranch, encoding: nn.Module) -> None:
        super().__init__(branch)
        if not isinstance(encoding, nn.Module):
            raise TypeError(f"encoding must be an nn.Module, got {type(encoding).__name__}")
        self.encoding = encoding

    @property  # type: ignore[override]
    def shift_features(self) -> int | None:
        """Width of the shift the wrapped branch takes (passed on to it)."""
        return self.branch.shift_features

    def forward(
        self, x: Tensor, mask: Tensor | None = None, shift: Tensor | None = None
    ) -> Tensor:
        """Evaluate :math:`g(X + E)`.

        Args:
            x: Sequences, shape ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.
            shift: Optional shift, passed on to the wrapped branch (which must take one).

        Returns:
            Shape ``(B, N, D)``, zero at padded positions.
        """
        if shift is None:
            return self.branch(x + self.encoding(x), mask)
        return self.branch(x + self.encoding(x), mask, shift=shift)
