r"""LipschitzNorm (Dasoulas et al.): normalised attention scores and their certificates.

docs/math.md#lipschitznorm, moved to the row orientation of the rest of iresflow (tokens are rows,
:math:`X \in \mathbb R^{n \times d}`; Das write columns). For row-stochastic
:math:`S = \mathrm{softmax}_{\mathrm{row}}(g(X)) \in \mathbb R^{m \times n}` the attention output is
:math:`S X`. Scores are divided by norms of their inputs so that they are bounded by
:math:`\alpha` and scale invariant; the resulting maps are globally Lipschitz with the derived,
numerically checked certificates of F5-F7 (2-norm on :math:`\mathrm{vec}(X)`):

* :func:`softmax_norm_bound` (F3): :math:`\|S\|_2 \le s_{\max} = \sqrt{m e^{2\alpha} /
  (e^{2\alpha} + n - 1)}` when :math:`|g_{ij}| \le \alpha`;
* :func:`linear_score_bound` (F5, F8): :math:`s_{\max} + 4\alpha` for
  :class:`LinearScoreAttention`;
* :func:`transformer_head_bound` (F6) and :func:`multihead_bound` (F7) for the quadratic
  (Transformer) scores of :func:`lipschitz_norm_scale`, used by
  :class:`~iresflow.nn.attention.DotProductMultiheadAttention` and
  :class:`~iresflow.nn.attention.ContractiveLipschitzNormAttention`.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn

from iresflow._validation import check_int, check_sequence, under_functorch_transform

__all__ = [
    "LinearScoreAttention",
    "check_positive",
    "chi2_to_uniform",
    "linear_score_bound",
    "lipschitz_norm_scale",
    "multihead_bound",
    "softmax_norm_bound",
    "transformer_head_bound",
]


def lipschitz_norm_scale(
    q: Tensor, k: Tensor, v: Tensor, alpha: float = 1.0, mask: Tensor | None = None
) -> Tensor:
    r"""Factor :math:`c` with LipschitzNorm scores :math:`g = c\,Q K^\top`
    (docs/math.md#lipschitznorm (F6)).

    .. math::
        g = \alpha \frac{Q K^\top}{\max\{uv, uw, vw\}},\quad u = \|Q\|_F,\
        v = \max_j \|k_j\|_2,\ w = \max_j \|v_j\|_2 ,

    all over the real tokens, so :math:`|g_{ij}| \le \alpha` and :math:`g` is invariant under
    :math:`X \to sX`. An all-zero input gets :math:`c = 0` (uniform attention, output 0).

    Args:
        q: Queries, shape ``(..., N, d)`` (tokens as rows).
        k: Keys, shape ``(..., N, d)``.
        v: Values, shape ``(..., N, d_v)``.
        alpha: Score bound :math:`\alpha > 0`.
        mask: Optional boolean ``(..., N)`` (broadcastable), ``True`` for real tokens; padded
            tokens do not enter :math:`u, v, w`.

    Returns:
        :math:`\alpha / \max\{uv, uw, vw\}`, shape ``(..., 1, 1)``.

    Example:
        >>> q = k = v = torch.eye(3)
        >>> g = lipschitz_norm_scale(q, k, v) * q @ k.T
        >>> float(g.abs().max()) <= 1.0
        True
    """
    check_positive(alpha, "alpha")
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, Tensor) or t.dim() < 2:
            raise ValueError(f"{name} must be a tensor of shape (..., N, d)")
    q_norms, k_norms, v_norms = (_vector_norm(t) for t in (q, k, v))
    if mask is not None:
        q_norms, k_norms, v_norms = (t.masked_fill(~mask, 0.0) for t in (q_norms, k_norms, v_norms))
    u = _vector_norm(q_norms)
    kv = k_norms.amax(dim=-1)
    w = v_norms.amax(dim=-1)
    denom = torch.maximum(torch.maximum(u * kv, u * w), kv * w)
    positive = denom > 0
    scale = torch.where(positive, alpha / torch.where(positive, denom, 1.0), 0.0)
    return scale[..., None, None]


def _vector_norm(t: Tensor) -> Tensor:
    r"""Euclidean norm over the last dimension, twice differentiable at 0 (``(..., d) -> (...)``).

    ``torch.linalg.vector_norm`` has the subgradient 0 at a zero vector, but its second
    derivative there is NaN (a 0/0 in the backward of its backward), and masking the norm
    afterwards does not remove the NaN from the graph. Zero rows are therefore replaced by ones
    before the norm and their result by 0 (the double-``where`` pattern): the value and first
    derivative equal ``vector_norm``'s everywhere (0 at a zero row) and every derivative at a
    zero row is 0, so training through a zero token (padding or data) stays finite.
    """
    zero = (t == 0).all(dim=-1, keepdim=True)
    norms = torch.linalg.vector_norm(torch.where(zero, 1.0, t), dim=-1)
    return torch.where(zero.squeeze(-1), 0.0, norms)


def chi2_to_uniform(probs: Tensor) -> Tensor:
    r""":math:`\chi^2` divergence of each row of a row-stochastic matrix from uniform
    (docs/math.md#lipschitznorm (F3)).

    .. math::
        d_{\chi^2}(S_i, U_n) = \sum_j \frac1n (n S_{ij} - 1)^2 ,\qquad
        \|S\|_F^2 = \frac1n \sum_i \big(1 + d_{\chi^2}(S_i, U_n)\big) .

    Args:
        probs: Row-stochastic matrices :math:`S`, shape ``(..., m, n)``.

    Returns:
        The divergences, shape ``(..., m)``; 0 for uniform rows, :math:`n - 1` for one-hot rows.

    Example:
        >>> chi2_to_uniform(torch.tensor([[0.25, 0.25, 0.25, 0.25], [1.0, 0.0, 0.0, 0.0]]))
        tensor([0., 3.])
    """
    if not isinstance(probs, Tensor) or probs.dim() < 2:
        raise ValueError("probs must be a tensor of shape (..., m, n)")
    n = probs.shape[-1]
    return ((n * probs - 1) ** 2).sum(dim=-1) / n


def softmax_norm_bound(alpha: float, seq_len: int | Tensor, queries: int | None = None) -> Tensor:
    r"""Bound :math:`s_{\max}` on :math:`\|S\|_2` for scores bounded by :math:`\alpha`
    (docs/math.md#lipschitznorm (F3)).

    .. math::
        \|S\|_2 \le \sqrt{\|S\|_1 \|S\|_\infty} \le
        s_{\max} = \sqrt{\frac{m\,e^{2\alpha}}{e^{2\alpha} + n - 1}} \le e^\alpha \sqrt{m / n} .

    Args:
        alpha: Score bound :math:`\alpha > 0`.
        seq_len: Number of keys :math:`n \ge 1` (int or tensor of lengths).
        queries: Number of queries :math:`m`; defaults to :math:`n` (self-attention).

    Returns:
        :math:`s_{\max}`, a float64 0-dim tensor for an int ``seq_len``, else of its shape/dtype.

    Example:
        >>> softmax_norm_bound(1.0, 1)
        tensor(1., dtype=torch.float64)
    """
    check_positive(alpha, "alpha")
    n = (
        seq_len
        if isinstance(seq_len, Tensor)
        else torch.tensor(check_int(seq_len, "seq_len", 1))
    )
    if not n.is_floating_point():
        n = n.to(torch.float64)
    m = n if queries is None else check_int(queries, "queries", 1)
    e = math.exp(2 * alpha)
    return torch.sqrt(m * e / (e + n - 1))


def linear_score_bound(alpha: float, adjacency: Tensor) -> Tensor:
    r"""Certificate of :class:`LinearScoreAttention` in the 2-norm
    (docs/math.md#lipschitznorm (F5, F8)).

    .. math::
        \mathrm{lip}_2(f) \le s_{\max}(\mathcal N) + 4\alpha,\qquad
        s_{\max}(\mathcal N)^2 = \max_j \sum_{i:\, j \in \mathcal N(i)}
            \frac{e^{2\alpha}}{e^{2\alpha} + |\mathcal N(i)| - 1} ,

    the F3 row/column-sum argument restricted to the neighbourhoods :math:`\mathcal N(i)` (each
    :math:`S_{ij} \le e^{2\alpha} / (e^{2\alpha} + |\mathcal N(i)| - 1)`); with full attention it
    equals F5's :math:`\sqrt{m e^{2\alpha} / (e^{2\alpha} + n - 1)} + 4\alpha`. The
    :math:`4\alpha` term is F2 with neighbour-wise maxima :math:`v_i`.

    Args:
        alpha: Score bound :math:`\alpha > 0`.
        adjacency: Boolean ``(..., m, n)``: ``adjacency[..., i, j]`` is ``True`` iff key ``j`` is
            in the neighbourhood of query ``i``; every row needs a ``True``.

    Returns:
        The bound, shape ``(...)`` (float64 on ``adjacency``'s device).

    Example:
        >>> linear_score_bound(1.0, torch.ones(4, 4, dtype=torch.bool))
        tensor(5.6867, dtype=torch.float64)
    """
    check_positive(alpha, "alpha")
    adj = _check_adjacency(adjacency)
    e = math.exp(2 * alpha)
    weights = adj.to(torch.float64)
    row_max = e / (e + weights.sum(dim=-1, keepdim=True) - 1)  # max entry of row i of S
    s_max = torch.sqrt((weights * row_max).sum(dim=-2).amax(dim=-1))
    return s_max + 4 * alpha


def transformer_head_bound(
    alpha: float,
    seq_len: int | Tensor,
    w_query: Tensor,
    w_key: Tensor,
    w_value: Tensor,
    heads: int,
) -> Tensor:
    r"""Per-head 2-norm certificate of LipschitzNorm'd dot-product attention
    (docs/math.md#lipschitznorm (F6)).

    For head :math:`h` with :math:`(Q, K, V) = (X W^{Q,h}, X W^{K,h}, X W^{V,h})` and the scores
    of :func:`lipschitz_norm_scale` (self-attention, :math:`m = n = N`):

    .. math::
        L_h = \sqrt{32\alpha^2 + (s_{\max} + 2\alpha)^2}\,
            \big\|[W^{Q,h}, W^{K,h}, W^{V,h}]\big\|_2 ,

    the stacked spectral norm of docs/math.md#lipschitznorm (F6; transposed to the row orientation,
    which leaves it unchanged). Differentiable in the weights.

    Args:
        alpha: Score bound :math:`\alpha > 0`.
        seq_len: Sequence length :math:`N \ge 1` (int or tensor of lengths, e.g. ``(B,)``).
        w_query: :math:`W^Q`, shape ``(D, D)``; head ``h`` uses columns ``h*d_h:(h+1)*d_h``.
        w_key: :math:`W^K`, shape ``(D, D)``.
        w_value: :math:`W^V`, shape ``(D, D)``.
        heads: Number of heads ``H`` (divides ``D``).

    Returns:
        :math:`(L_1, \dots, L_H)`, shape ``seq_len.shape + (H,)`` (``(H,)`` for an int).

    Example:
        >>> w = torch.eye(4, dtype=torch.float64)
        >>> transformer_head_bound(1.0, 1, w, w, w, heads=2)  # sqrt(32 + 9) * sqrt(3)
        tensor([11.0905, 11.0905], dtype=torch.float64)
    """
    dim = w_query.shape[0]
    if isinstance(heads, bool) or not isinstance(heads, int) or heads < 1 or dim % heads:
        raise ValueError(f"heads must be a positive int dividing D={dim}, got {heads!r}")
    for name, w in (("w_query", w_query), ("w_key", w_key), ("w_value", w_value)):
        if w.shape != (dim, dim):
            raise ValueError(f"{name} must have shape ({dim}, {dim}), got {tuple(w.shape)}")
    if isinstance(seq_len, Tensor):
        seq_len = seq_len.to(dtype=w_query.dtype, device=w_query.device)
    s_max = softmax_norm_bound(alpha, seq_len).to(dtype=w_query.dtype, device=w_query.device)
    factor = torch.sqrt(32 * alpha**2 + (s_max + 2 * alpha) ** 2)
    stacked = torch.cat([w.reshape(dim, heads, -1) for w in (w_query, w_key, w_value)], dim=2)
    spectral = _spectral_norm(stacked.transpose(0, 1))  # (H,)
    return factor[..., None] * spectral


def multihead_bound(head_bounds: Tensor, w_out: Tensor) -> Tensor:
    r"""Combine per-head 2-norm certificates through the output projection
    (docs/math.md#lipschitznorm (F7)).

    .. math::
        \mathrm{lip}_2(\mathrm{MHA}) \le \|W^O\|_2 \Big(\sum_h L_h^2\Big)^{1/2},

    where :math:`L_h` bounds :math:`X \mapsto f_h(X)` including its input projection (F7's
    :math:`\|W_h\|_2 L_h`); concatenating heads adds squared norms.

    Args:
        head_bounds: :math:`(L_1, \dots, L_H)`, shape ``(..., H)``.
        w_out: :math:`W^O`, shape ``(D, D)``.

    Returns:
        The bound, shape ``(...)``.

    Example:
        >>> multihead_bound(torch.tensor([3.0, 4.0]), 2 * torch.eye(2))
        tensor(10.)
    """
    return _spectral_norm(w_out) * torch.linalg.vector_norm(head_bounds, dim=-1)


def _spectral_norm(w: Tensor) -> Tensor:
    """``torch.linalg.matrix_norm(w, 2)``, computed in float32 for float16/bfloat16 ``w``.

    The SVD behind the spectral norm has no half-precision kernels; the float32 result is cast
    back to ``w``'s dtype (differentiably), so low-precision modules keep a certificate in their
    own dtype.
    """
    if w.dtype in (torch.float16, torch.bfloat16):
        return torch.linalg.matrix_norm(w.float(), ord=2).to(w.dtype)
    return torch.linalg.matrix_norm(w, ord=2)


class LinearScoreAttention(nn.Module):
    r"""Attention with LipschitzNorm'd linear scores (Das Eq. (17),
    docs/math.md#lipschitznorm (F5, F8)).

    ``queries`` learned vectors :math:`q_i` attend over the tokens :math:`x_j` of a sequence (or
    over the neighbourhood :math:`\mathcal N(i)` given by an adjacency mask, graph attention):

    .. math::
        g_{ij} = \alpha \frac{q_i^\top x_j}{\|Q\|_F\, v_i},\quad
        v_i = \max_{j \in \mathcal N(i)} \|x_j\|_2,\qquad
        f(X)_i = \sum_{j \in \mathcal N(i)} \mathrm{softmax}_j(g_{i\cdot})\, x_j .

    Then :math:`|g_{ij}| \le \alpha`, :math:`f(sX) = s f(X)` for :math:`s > 0`, and
    :math:`\mathrm{lip}_2(f) \le` :func:`linear_score_bound`.

    Args:
        dim: Token dimension ``D``.
        queries: Number of learned queries ``m``.
        alpha: Score bound :math:`\alpha > 0`.

    Example:
        >>> attn = LinearScoreAttention(dim=3, queries=2)
        >>> attn(torch.randn(4, 5, 3)).shape
        torch.Size([4, 2, 3])
    """

    def __init__(self, dim: int, queries: int, alpha: float = 1.0) -> None:
        super().__init__()
        check_int(dim, "dim", 1)
        check_int(queries, "queries", 1)
        check_positive(alpha, "alpha")
        self.alpha = float(alpha)
        self.query = nn.Parameter(torch.empty(queries, dim))
        nn.init.normal_(self.query)

    def scores(self, x: Tensor, adjacency: Tensor | None = None) -> Tensor:
        """Normalised scores :math:`g` (entries outside the neighbourhoods are not used).

        Args:
            x: Sequences, shape ``(B, N, D)``.
            adjacency: Optional boolean ``(m, N)`` or ``(B, m, N)``; ``None`` = full attention.

        Returns:
            :math:`g`, shape ``(B, m, N)``.
        """
        adjacency = self._check(x, adjacency)
        norms = _vector_norm(x)[:, None, :]  # (B, 1, N)
        if adjacency is not None:
            norms = norms.masked_fill(~adjacency, 0.0)
        v = norms.amax(dim=-1, keepdim=True)  # (B, m or 1, 1)
        v = torch.where(v > 0, v, 1.0)  # all-zero neighbourhood: scores 0 (uniform)
        u = _vector_norm(self.query.flatten())
        return self.alpha * (self.query @ x.transpose(1, 2)) / (u * v)

    def forward(self, x: Tensor, adjacency: Tensor | None = None) -> Tensor:
        """Attend from the learned queries to the (neighbouring) tokens.

        Args:
            x: Sequences, shape ``(B, N, D)``.
            adjacency: Optional boolean ``(m, N)`` or ``(B, m, N)``; ``None`` = full attention.

        Returns:
            :math:`f(X)`, shape ``(B, m, D)``.
        """
        g = self.scores(x, adjacency)
        if adjacency is not None:
            g = g.masked_fill(~adjacency, -math.inf)
        return torch.softmax(g, dim=-1) @ x

    def _check(self, x: Tensor, adjacency: Tensor | None) -> Tensor | None:
        if under_functorch_transform():
            return adjacency
        check_sequence(x, "x", features=self.query.shape[1], allow_2d=False)
        if adjacency is None:
            return None
        adjacency = _check_adjacency(adjacency)
        shape = (self.query.shape[0], x.shape[1])
        if adjacency.shape[-2:] != shape or adjacency.dim() not in (2, 3):
            raise ValueError(
                f"adjacency must have shape (m, N) = {shape} or (B, m, N), "
                f"got {tuple(adjacency.shape)}"
            )
        if adjacency.dim() == 3 and adjacency.shape[0] != x.shape[0]:
            raise ValueError(f"adjacency batch size {adjacency.shape[0]} != x batch {x.shape[0]}")
        return adjacency.to(x.device)


def _check_adjacency(adjacency: object) -> Tensor:
    if not isinstance(adjacency, Tensor) or adjacency.dtype != torch.bool:
        raise TypeError("adjacency must be a torch.bool tensor of shape (..., m, n)")
    if adjacency.dim() < 2:
        raise ValueError(f"adjacency must have shape (..., m, n), got {tuple(adjacency.shape)}")
    if not under_functorch_transform() and not bool(adjacency.any(dim=-1).all()):
        raise ValueError("adjacency has a query with an empty neighbourhood")
    return adjacency


def check_positive(value: object, name: str) -> None:
    r"""Validate a positive finite real hyper-parameter (e.g. the score bound ``alpha``).

    Args:
        value: Candidate value (int or float, not bool).
        name: Argument name used in the message.

    Raises:
        ValueError: not a real number, or not in :math:`(0, \infty)`.

    Example:
        >>> check_positive(1.0, "alpha")
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value < math.inf:
        raise ValueError(f"{name} must be a positive finite float, got {value!r}")
