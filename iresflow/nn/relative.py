r"""Relative mixing: a contractive branch that reads frames at learned offsets, whatever their
content (docs/math.md#relative-mixing).

.. math::
    g(X)_i = h\Big(\sum_j P_{ij}\, x_j\Big),\qquad
    P_{ij} = \mathrm{softmax}_{j\ \text{real}}\, b\big(\mathrm{clip}(j - i, -W, W)\big),

with a learned table :math:`b` over the offsets :math:`-W, \dots, W` and :math:`h` a token-wise
MLP certified in the :math:`\infty`-norm. Every row of :math:`P` is a probability vector that does
not depend on :math:`X`, so :math:`X \mapsto P X` is 1-Lipschitz in the entrywise
:math:`\infty`-norm, and the branch inherits the MLP's certificate unchanged: no length term, as
content-based attention has (docs/math.md#l2-bounds-heads). It is the branch for dependence at a
fixed lag that lies beyond a convolution's reach (a season, a period).
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from iresflow._validation import check_int, check_mask, check_sequence
from iresflow.nn._heads import causal_keys, relative_scores
from iresflow.nn.base import LipschitzBranch
from iresflow.nn.linear import check_coefficient
from iresflow.nn.mlp import LipschitzMLP

__all__ = ["SCORE_SCALE", "RelativeMixingBranch"]

#: Scores are ``SCORE_SCALE`` times their parameters. Adam moves a parameter by about the
#: learning rate per step whatever its gradient's size, so unscaled scores would move by some
#: 0.2 in the first few hundred steps, far too little to single out an offset; scaled by 10 they
#: pick the lag of a seasonal process within a few epochs (docs/math.md#relative-mixing).
SCORE_SCALE = 10.0


class RelativeMixingBranch(LipschitzBranch):
    r"""Token-wise MLP of a learned, content-free weighted average over relative offsets.

    Args:
        features: Token dimension ``D``.
        hidden: Hidden width of the MLP ``D -> hidden -> hidden -> D``.
        window: Largest offset :math:`W \ge 1` with its own score; farther offsets share the
            score of :math:`\pm W`.
        coeff: Certified Lipschitz bound in :math:`(0, 1)` (each of the MLP's three linear
            layers gets ``coeff ** (1/3)``).
        causal: Whether frame :math:`i` averages the frames :math:`j \le i` only (the softmax
            over those; the certificate is unchanged, docs/math.md#causal-attention).

    Example:
        >>> g = RelativeMixingBranch(features=2, hidden=8, window=4)
        >>> x = torch.randn(3, 6, 2)
        >>> g(x).shape, bool(g.lipschitz_constant() <= 0.9 + 1e-6)
        (torch.Size([3, 6, 2]), True)
    """

    position_wise = False
    norm = "inf"

    def __init__(self, features: int, hidden: int, window: int, coeff: float = 0.9,
                 causal: bool = False) -> None:
        super().__init__()
        self.causal = bool(causal)
        self.features = check_int(features, "features", 1)
        self.window = check_int(window, "window", 1)
        hidden = check_int(hidden, "hidden", 1)
        coeff = check_coefficient(coeff, strict=True)
        self.mlp = LipschitzMLP((features, hidden, hidden, features), coeff=coeff ** (1 / 3),
                                norm="inf")
        #: Parameters of the scores of the offsets -W..W, which are ``SCORE_SCALE`` times these
        #: (zero: the plain average of the real frames).
        self.scores = nn.Parameter(torch.zeros(2 * window + 1))

    def mixing_weights(self, seq_len: int, mask: Tensor | None = None) -> Tensor:
        """The weights :math:`P` (query row, key column), zero at padded keys.

        Args:
            seq_len: Sequence length ``N``.
            mask: Optional boolean padding mask ``(B, N)``.

        Returns:
            ``(N, N)`` without a mask, ``(B, N, N)`` with one; rows sum to one over real keys
            (causal: the real keys at or before the row, and the row itself).
        """
        logits = SCORE_SCALE * relative_scores(self.scores[None], seq_len)[0]  # (N, N)
        if self.causal:
            keys = causal_keys(seq_len, mask, logits.device)
        elif mask is None:
            return torch.softmax(logits, dim=-1)
        else:
            keys = mask[:, None, :]
        return torch.softmax(logits.masked_fill(~keys, -torch.inf), dim=-1)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Evaluate :math:`g(X)`.

        Args:
            x: Sequences, shape ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.

        Returns:
            ``g(x)``, shape ``(B, N, D)``, zero at padded positions; padded inputs never reach a
            real output.
        """
        check_sequence(x, "x", features=self.features, allow_2d=False)
        mask = check_mask(mask, x)
        weights = self.mixing_weights(x.shape[1], mask).to(x.dtype)
        return self.mlp(weights @ x, mask)

    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        """Certified bound in the :math:`\\infty`-norm: the MLP's (the mixing is 1-Lipschitz).

        Args:
            seq_len: Ignored (the bound holds for every length).
        """
        return self.mlp.lipschitz_constant()

    def extra_repr(self) -> str:
        return f"features={self.features}, window={self.window}, causal={self.causal}"
