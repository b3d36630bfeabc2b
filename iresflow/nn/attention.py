r"""Multi-head self-attention: L2 (Lipschitz), dot-product, and their contractive residual branches.

All modules are batch-first: inputs ``(B, N, D)`` with an optional boolean padding mask ``(B, N)``
(``True`` = real token). Padded keys get no attention weight (masked before the softmax), outputs at
padded positions are exactly zero, and padded inputs never influence real outputs.

Weights are plain ``(D, D)`` parameters in the *math orientation* of docs/math.md#conventions:
tokens are rows and a weight acts by right multiplication, ``X @ W``; head ``h`` uses the columns
``h * d_h : (h + 1) * d_h`` of the query/key/value weights and ``d_h = D / H``. There are no
additive biases of the linear maps: Kim's Theorem 3.2 bound assumes none
(docs/math.md#dot-product-attention, #l2-attention). L2 attention may add a learned
relative-position bias to its scores, which its certificate covers (docs/math.md#relative-bias).

Execution path: when no autograd graph is recorded (``torch.no_grad``, e.g. fixed-point inversion
and sampling) and no ``torch.func`` transform is active, attention runs through the fused
:func:`torch.nn.functional.scaled_dot_product_attention`, otherwise through an explicit softmax
(which forward-mode derivatives, double-backward and ``vmap`` need); both paths compute the same
function, with or without a score bias (checked to 1e-10 in float64).
"""

from __future__ import annotations

import math
from abc import abstractmethod
from typing import Literal

import torch
from torch import Tensor, nn

from iresflow._validation import check_inputs, check_int, under_functorch_transform
from iresflow.nn._heads import attend, merge_heads, relative_scores, split_heads
from iresflow.nn.base import LipschitzBranch
from iresflow.nn.bounds import causal_l2_attention_bound, l2_attention_bound
from iresflow.nn.linear import check_coefficient
from iresflow.nn.lipschitz_norm import (
    check_positive,
    lipschitz_norm_scale,
    multihead_bound,
    transformer_head_bound,
)

__all__ = [
    "ContractiveL2MultiheadAttention",
    "ContractiveLipschitzNormAttention",
    "DotProductMultiheadAttention",
    "L2MultiheadAttention",
    "lipschitz_bound",
]


class L2MultiheadAttention(nn.Module):
    r"""L2 multi-head self-attention with tied query/key weights (Kim Eq. (8),
    docs/math.md#l2-attention).

    .. math::
        P^h_{ij} = \mathrm{softmax}_j\Big(-\frac{\|x_i^\top W^{Q,h} - x_j^\top W^{Q,h}\|_2^2}
            {\sqrt{d_h}} + b_h(\mathrm{clip}(j - i, -W, W))\Big),\qquad
        F(X) = \big[P^1 X A_1 W^{V,1}, \dots, P^H X A_H W^{V,H}\big] W^O ,

    with :math:`A_h = W^{Q,h} W^{Q,h\top} / \sqrt{d_h}` and an optional learned
    relative-position bias :math:`b_h` over the offsets :math:`-W, \dots, W` (``max_offset``
    :math:`= W`; none by default; docs/math.md#relative-bias). Offsets are tensor positions
    (padding included); padded keys still get no weight. Tying :math:`W^K = W^Q` is what makes the
    map Lipschitz (Kim Lemma F.1), so there is no key weight; the linear maps have no biases
    either (the Theorem 3.2 bound assumes none). Computed without the
    :math:`N \times N \times d_h` differences (docs/math.md#l2-attention): with
    :math:`Q^h = X W^{Q,h}` and :math:`s_j = \|q^h_j\|^2`,
    :math:`P^h = \mathrm{softmax}_{\mathrm{row}}((2 Q^h Q^{h\top} - \mathbf 1 s^\top) / \sqrt{d_h})`
    and the head output is :math:`P^h Q^h (W^{Q,h\top} W^{V,h}) / \sqrt{d_h} = P^h X (A_h W^{V,h})`,
    whose value map :math:`A_h W^{V,h}` (:math:`D \times d_h`) is formed through the
    :math:`d_h \times d_h` product without :math:`A_h`; cost :math:`O(N^2 D + N D^2)`; the bias
    is added to these scores. Its Lipschitz bounds are :func:`lipschitz_bound`.

    With ``causal=True`` query :math:`i` reads the keys :math:`j \le i` only: row :math:`i` is
    row :math:`i` of the unmasked map of the frames up to :math:`i` (docs/math.md#causal-attention).

    Args:
        dim: Token dimension ``D``.
        heads: Number of heads ``H`` (divides ``D``).
        max_offset: Window ``W >= 1`` of the relative-position bias, a parameter
            ``relative_bias`` of shape ``(H, 2W + 1)`` initialised to zero (the unbiased map);
            ``None`` (default): no bias.
        causal: Whether every query reads the keys at or before it only.

    Example:
        >>> attn = L2MultiheadAttention(dim=4, heads=2, max_offset=3)
        >>> attn(torch.randn(3, 5, 4)).shape, attn.relative_bias.shape
        (torch.Size([3, 5, 4]), torch.Size([2, 7]))
    """

    relative_bias: nn.Parameter | None

    def __init__(self, dim: int, heads: int, max_offset: int | None = None,
                 causal: bool = False) -> None:
        super().__init__()
        _check_dims(dim, heads)
        self.dim = dim
        self.heads = heads
        self.causal = bool(causal)
        self.max_offset = None if max_offset is None else check_int(max_offset, "max_offset", 1)
        self.w_query = nn.Parameter(torch.empty(dim, dim))
        self.w_value = nn.Parameter(torch.empty(dim, dim))
        self.w_out = nn.Parameter(torch.empty(dim, dim))
        self.relative_bias = None
        if self.max_offset is not None:
            self.relative_bias = nn.Parameter(torch.empty(heads, 2 * self.max_offset + 1))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every weight from :math:`U[-1/\\sqrt D, 1/\\sqrt D]` (``nn.Linear``'s default);
        the relative bias starts at zero."""
        for w in (self.w_query, self.w_value, self.w_out):
            nn.init.uniform_(w, -(self.dim**-0.5), self.dim**-0.5)
        if self.relative_bias is not None:
            nn.init.zeros_(self.relative_bias)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Apply L2-MHA.

        Args:
            x: Sequences, shape ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.

        Returns:
            :math:`F(X)`, shape ``(B, N, D)``, zero at padded positions.
        """
        mask = _check_inputs(x, mask, self.w_query)
        d_head = self.dim // self.heads
        wq = self.w_query.reshape(self.dim, self.heads, d_head).transpose(0, 1)  # (H, D, d_h)
        wv = self.w_value.reshape(self.dim, self.heads, d_head).transpose(0, 1)
        # Value map of head h: W^{Q,h} (W^{Q,h T} W^{V,h}) / sqrt(d_h) = A_h W^{V,h} (D x d_h),
        # built from d_h x d_h products; all heads together form one (D, D) matrix.
        w_qv = (wq @ (wq.transpose(1, 2) @ wv) / math.sqrt(d_head)).transpose(0, 1)
        value = split_heads(x @ w_qv.reshape(self.dim, self.dim), self.heads)
        q = split_heads(x @ self.w_query, self.heads)  # (B, H, N, d_h)
        sq = (q * q).sum(dim=-1, keepdim=True)
        # Augmented vectors: [2q_i, -1] . [q_j, |q_j|^2] = 2 q_i.q_j - |q_j|^2, i.e. the logits up
        # to the row constant -|q_i|^2, which cancels in the row softmax.
        query = torch.cat([2 * q, -torch.ones_like(sq)], dim=-1)
        key = torch.cat([q, sq], dim=-1)
        bias = None
        if self.relative_bias is not None:
            bias = relative_scores(self.relative_bias, x.shape[1])  # (H, N, N)
        heads = attend(query, key, value, mask, d_head**-0.5, bias, self.causal)
        return merge_heads(heads, self.w_out, mask)


class DotProductMultiheadAttention(nn.Module):
    r"""Dot-product multi-head self-attention (docs/math.md#dot-product-attention), optionally with
    LipschitzNorm (F6).

    .. math::
        \mathrm{DP}^h(X) = \mathrm{softmax}\Big(\frac{X W^{Q,h} (X W^{K,h})^\top}{\sqrt{d_h}}\Big)
            X W^{V,h},\qquad \mathrm{MHA}(X) = [\mathrm{DP}^1(X), \dots, \mathrm{DP}^H(X)] W^O .

    It is **not** Lipschitz (Kim Thm 3.1): a baseline, not a residual branch. With
    ``lipschitz_norm="transformer"`` the scores of each head become (Das,
    docs/math.md#lipschitznorm (F6)) :math:`\alpha Q K^\top / \max\{uv, uw, vw\}` with
    :math:`u = \|Q\|_F`, :math:`v = \max_j \|k_j\|`, :math:`w = \max_j \|v_j\|` over the real
    tokens, replacing the :math:`1/\sqrt{d_h}` scaling; scores are then bounded by :math:`\alpha`
    and the map has the certificate of :func:`iresflow.nn.lipschitz_norm.transformer_head_bound` per
    head.

    Args:
        dim: Token dimension ``D``.
        heads: Number of heads ``H`` (divides ``D``).
        lipschitz_norm: ``None`` (plain scaled dot product) or ``"transformer"`` (F6).
        alpha: Score bound :math:`\alpha > 0` of LipschitzNorm (ignored without it).

    Example:
        >>> attn = DotProductMultiheadAttention(dim=4, heads=2, lipschitz_norm="transformer")
        >>> attn(torch.randn(3, 5, 4)).shape
        torch.Size([3, 5, 4])
    """

    def __init__(
        self,
        dim: int,
        heads: int,
        lipschitz_norm: Literal["transformer"] | None = None,
        alpha: float = 1.0,
    ) -> None:
        super().__init__()
        _check_dims(dim, heads)
        if lipschitz_norm not in (None, "transformer"):
            raise ValueError(
                f"lipschitz_norm must be None or 'transformer', got {lipschitz_norm!r}"
            )
        check_positive(alpha, "alpha")
        self.dim = dim
        self.heads = heads
        self.lipschitz_norm = lipschitz_norm
        self.alpha = float(alpha)
        self.w_query = nn.Parameter(torch.empty(dim, dim))
        self.w_key = nn.Parameter(torch.empty(dim, dim))
        self.w_value = nn.Parameter(torch.empty(dim, dim))
        self.w_out = nn.Parameter(torch.empty(dim, dim))
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Draw every weight from :math:`U[-1/\\sqrt D, 1/\\sqrt D]` (``nn.Linear``'s default)."""
        for w in (self.w_query, self.w_key, self.w_value, self.w_out):
            nn.init.uniform_(w, -(self.dim**-0.5), self.dim**-0.5)

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Apply dot-product MHA.

        Args:
            x: Sequences, shape ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.

        Returns:
            ``MHA(X)``, shape ``(B, N, D)``, zero at padded positions.
        """
        mask = _check_inputs(x, mask, self.w_query)
        q = split_heads(x @ self.w_query, self.heads)
        k = split_heads(x @ self.w_key, self.heads)
        v = split_heads(x @ self.w_value, self.heads)
        if self.lipschitz_norm is None:
            scale = q.shape[-1] ** -0.5
        else:
            token_mask = None if mask is None else mask[:, None, :]
            q = q * lipschitz_norm_scale(q, k, v, self.alpha, token_mask)
            scale = 1.0
        return merge_heads(attend(q, k, v, mask, scale), self.w_out, mask)


class _ContractiveAttention(LipschitzBranch):
    r"""Shared body of the contractive attention branches: :math:`c\,F(X) / B(\theta, N)`.

    Subclasses set ``attention`` (the unnormalised map :math:`F`), ``coeff`` and ``length``
    (``"actual"``: each sequence's real tokens, from the mask, in the bound; ``"max"``: the padded
    length) and implement :meth:`raw_bound`.
    """

    position_wise = False
    attention: nn.Module
    coeff: float
    length: str

    @property
    def features(self) -> int:
        """Token dimension ``D`` the branch requires."""
        return self.attention.dim

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Evaluate :math:`c F(X) / B(\\theta, N)`.

        Args:
            x: Sequences, shape ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.

        Returns:
            Branch output, shape ``(B, N, D)``, zero at padded positions.
        """
        y = self.attention(x, mask)
        bound = self.raw_bound(x.shape[1], mask if self.length == "actual" or self.causal else None)
        return self.coeff * y / (bound[..., None] if self.causal else bound.reshape(-1, 1, 1))

    @abstractmethod
    def raw_bound(self, seq_len: int | Tensor, mask: Tensor | None = None) -> Tensor:
        """Certified bound :math:`B(\\theta, N)` of the unnormalised map for the current weights.

        Args:
            seq_len: Sequence length (int) or per-sequence lengths, e.g. shape ``(B,)``.
            mask: Optional boolean padding mask ``(B, N)`` with ``N = seq_len`` (an int): each
                sequence's bound then counts its real tokens only.

        Returns:
            The bound in the branch's norm: 0-dim, of ``seq_len``'s shape, or ``(B,)`` with a
            mask.
        """

    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        """Certified Lipschitz constant of the branch: ``coeff`` for every length.

        Args:
            seq_len: Unused; the normalisation makes the certificate length-free.

        Returns:
            ``coeff`` as a 0-dim tensor on the parameters' device and dtype.
        """
        return self.attention.w_query.new_tensor(self.coeff)


class ContractiveL2MultiheadAttention(_ContractiveAttention):
    r"""Contractive L2-MHA residual branch (docs/math.md#contractive-attention):
    :math:`c\,F(X) / B(\theta, N)`.

    :math:`F` is :class:`L2MultiheadAttention` and :math:`B` its bound for the current weights and
    relative bias (:func:`~iresflow.nn.bounds.l2_attention_bound`: the head-by-head
    :math:`\infty`-bound by default, docs/math.md#l2-bounds-heads, or Kim's 2-bound), recomputed
    in every forward and differentiated through (no update call;
    docs/math.md#contractive-attention), so the branch is :math:`c`-Lipschitz in that norm for any
    weights. With a mask and ``length="actual"`` the bound uses each sequence's real tokens (real
    outputs only see real tokens, so the bound of the shorter sequence holds; with a bias, the
    positions of its real tokens, docs/math.md#relative-bias); ``length="max"`` uses the padded
    length, also valid because :math:`\varphi^{-1}` increases. Causal: output frame :math:`t` is
    divided by its own row's bound, which reads no later frame, in the :math:`\infty`-norm only
    (:func:`~iresflow.nn.bounds.causal_l2_attention_bound`, docs/math.md#causal-attention).

    Args:
        dim: Token dimension ``D``.
        heads: Number of heads ``H`` (divides ``D``).
        coeff: Contraction coefficient :math:`c \in (0, 1)`.
        norm: Norm of the certificate: ``"inf"`` (the tighter one, default) or ``"2"`` (not
            with a relative bias).
        length: ``"actual"`` (per-sequence real tokens from the mask) or ``"max"`` (padded
            length).
        max_offset: Window ``W`` of a learned relative-position bias of the scores
            (:class:`L2MultiheadAttention`); ``None`` (default): none.
        causal: Whether output frame :math:`t` reads input frames :math:`\le t` only (``"inf"``).

    Example:
        >>> branch = ContractiveL2MultiheadAttention(dim=4, heads=2, coeff=0.9)
        >>> branch(torch.randn(3, 5, 4)).shape, branch.lipschitz_constant(5)
        (torch.Size([3, 5, 4]), tensor(0.9000))
    """

    norm = "inf"

    def __init__(
        self,
        dim: int,
        heads: int,
        coeff: float = 0.9,
        norm: Literal["inf", "2"] = "inf",
        length: Literal["actual", "max"] = "actual",
        max_offset: int | None = None,
        causal: bool = False,
    ) -> None:
        super().__init__()
        coeff = check_coefficient(coeff, strict=True)
        if norm not in ("inf", "2"):
            raise ValueError(f"norm must be 'inf' or '2', got {norm!r}")
        if length not in ("actual", "max"):
            raise ValueError(f"length must be 'actual' or 'max', got {length!r}")
        if norm == "2" and (max_offset is not None or causal):
            raise ValueError("norm='2' has no certificate with a relative bias (max_offset) or "
                             "a causal mask (causal=True)")
        self.attention = L2MultiheadAttention(dim, heads, max_offset, causal)
        self.causal = bool(causal)
        self.coeff = float(coeff)
        self.norm = norm  # type: ignore[misc]  # per-instance choice of the certified norm
        self.length = length

    def raw_bound(self, seq_len: int | Tensor, mask: Tensor | None = None) -> Tensor:
        """The bound :math:`B(\\theta, N)` of the unnormalised L2-MHA (:func:`lipschitz_bound`);
        causal: every frame's (``causal_l2_attention_bound``, ``(N,)`` or ``(B, N)``)."""
        if self.causal:
            a = self.attention
            return causal_l2_attention_bound(a.w_query, a.w_value, a.w_out, a.heads,
                                             int(seq_len), a.relative_bias, mask)
        return lipschitz_bound(self.attention, seq_len, self.norm, mask)


class ContractiveLipschitzNormAttention(_ContractiveAttention):
    r"""Contractive LipschitzNorm attention branch: :math:`c\,\mathrm{MHA}_{LN}(X) / B(\theta, N)`.

    :math:`\mathrm{MHA}_{LN}` is :class:`DotProductMultiheadAttention` with
    ``lipschitz_norm="transformer"`` (docs/math.md#lipschitznorm (F6)) and :math:`B` the 2-norm
    certificate obtained by combining the per-head F6 bounds with F7:
    :math:`B = \|W^O\|_2 (\sum_h L_h^2)^{1/2}`,
    :math:`L_h = \sqrt{32\alpha^2 + (s_{\max}(N) + 2\alpha)^2}\,
    \|[W^{Q,h}, W^{K,h}, W^{V,h}]\|_2`. Recomputed and differentiated in every forward; with a
    mask, :math:`N` is each sequence's real length.

    Args:
        dim: Token dimension ``D``.
        heads: Number of heads ``H`` (divides ``D``).
        coeff: Contraction coefficient :math:`c \in (0, 1)`.
        alpha: Score bound :math:`\alpha > 0` of LipschitzNorm.

    Example:
        >>> branch = ContractiveLipschitzNormAttention(dim=4, heads=2)
        >>> branch(torch.randn(3, 5, 4)).shape
        torch.Size([3, 5, 4])
    """

    norm = "2"

    def __init__(self, dim: int, heads: int, coeff: float = 0.9, alpha: float = 1.0) -> None:
        super().__init__()
        coeff = check_coefficient(coeff, strict=True)
        self.attention = DotProductMultiheadAttention(dim, heads, "transformer", alpha)
        self.coeff = float(coeff)
        self.length = "actual"

    def raw_bound(self, seq_len: int | Tensor, mask: Tensor | None = None) -> Tensor:
        """F6/F7 certificate :math:`B(\\theta, N)` of the unnormalised attention (2-norm), with
        :math:`N` the real length of each sequence of ``mask`` if given."""
        a = self.attention
        lengths = seq_len if mask is None else mask.sum(dim=1)
        heads = transformer_head_bound(
            a.alpha, lengths, a.w_query, a.w_key, a.w_value, a.heads
        )  # (..., H)
        return multihead_bound(heads, a.w_out)


def lipschitz_bound(
    attn: L2MultiheadAttention,
    seq_len: int | Tensor,
    p: Literal["inf", "2"] | float = "inf",
    mask: Tensor | None = None,
) -> Tensor:
    r"""Certified Lipschitz bound of an L2-MHA module for its current weights and relative bias.

    The bound of :func:`~iresflow.nn.bounds.l2_attention_bound` (docs/math.md#l2-bounds,
    #l2-bounds-heads, #relative-bias) on the module's parameters.

    Args:
        attn: An :class:`~iresflow.nn.attention.L2MultiheadAttention`.
        seq_len: Sequence length ``N >= 1`` (int), or a tensor of per-sequence lengths (not for a
            module with a relative bias: give a ``mask``).
        p: ``"inf"`` or ``"2"`` (see :func:`~iresflow.nn.bounds.l2_attention_bound`; ``"2"`` not
            with a relative bias).
        mask: Optional boolean padding mask ``(B, N)`` with ``N = seq_len``: per-sequence bounds
            over the real tokens.

    Returns:
        The bound :math:`B_p(\theta, N)`: 0-dim (int ``seq_len``), of ``seq_len``'s shape, or
        ``(B,)`` with a mask.

    Example:
        >>> attn = L2MultiheadAttention(dim=4, heads=2)
        >>> lipschitz_bound(attn, torch.tensor([3, 16]), p="inf").shape  # per-sequence lengths
        torch.Size([2])
    """
    if not isinstance(attn, L2MultiheadAttention):
        raise TypeError(f"attn must be an L2MultiheadAttention, got {type(attn).__name__}")
    return l2_attention_bound(
        attn.w_query, attn.w_value, attn.w_out, attn.heads, seq_len, p, attn.relative_bias, mask
    )


def _check_inputs(x: Tensor, mask: Tensor | None, weight: Tensor) -> Tensor | None:
    """Validate ``x (B, N, D)`` and ``mask (B, N)`` through the validation gate.

    Under ``torch.func`` transforms (the exact log-det engine calls branches inside
    ``vmap(jacrev(...))``) values cannot be inspected; the batch was validated before the transform.
    """
    if under_functorch_transform():
        return mask
    return check_inputs(x, mask, "x", features=weight.shape[0], allow_2d=False, like=weight)[1]


def _check_dims(dim: int, heads: int) -> None:
    if check_int(dim, "dim", 1) % check_int(heads, "heads", 1) != 0:
        raise ValueError(f"dim must be divisible by heads, got dim={dim}, heads={heads}")
