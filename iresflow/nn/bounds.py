r"""Lipschitz bounds of L2 multi-head self-attention (Kim et al., Theorem 3.2, and a refinement).

The bounds of docs/math.md#l2-bounds, evaluated on weight matrices in the *math orientation* of
docs/math.md#conventions (tokens are rows, weights act by right multiplication, ``X @ W``).
Kim's Theorem 3.2 gives

.. math::
    \mathrm{lip}_\infty(F) \le \Big(4\varphi^{-1}(N-1) + \frac{1}{\sqrt{d_h}}\Big)
        \|W^{O\top}\|_\infty \max_h \|W^{Q,h}\|_\infty \|W^{Q,h\top}\|_\infty
        \max_h \|W^{V,h\top}\|_\infty ,

.. math::
    \mathrm{lip}_2(F) \le \frac{\sqrt N}{\sqrt{d_h}} \big(4\varphi^{-1}(N-1) + 1\big)
        \Big(\sum_h \|W^{Q,h}\|_2^4 \|W^{V,h}\|_2^2\Big)^{1/2} \|W^O\|_2 ,

with :math:`\varphi(x) = x e^{x+1}` and :math:`\varphi^{-1}(N-1) = W_0((N-1)/e)` (principal Lambert
W branch; the off-by-one :math:`W_0(N/e)` of third-party code is looser,
docs/math.md#l2-bounds (C.1)). The power 4 in the 2-bound is the degree-consistent form
(docs/math.md#l2-bounds (C.2), check H5 (docs/math.md#checks)). The :math:`\infty`-bound
computed here is the same argument carried out head by head and output column by output column
(docs/math.md#l2-bounds-heads), never larger than Kim's, and it extends to a learned
relative-position bias in the scores (docs/math.md#relative-bias), where :math:`N - 1` becomes a
bias-weighted count of the other real tokens.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from scipy.special import lambertw
from torch import Tensor

from iresflow._validation import check_int, values_checked
from iresflow.nn._heads import relative_scores

__all__ = ["causal_l2_attention_bound", "check_norm", "l2_attention_bound", "phi", "phi_inv"]

# Halley's iteration for W_0 starting from Winitzki's approximation reaches float64 precision in
# two steps on [0, 1e12] (checked against scipy); four leave a wide margin.
_HALLEY_STEPS = 4


def phi(x: float | Tensor) -> float | Tensor:
    r"""The function :math:`\varphi(x) = x e^{x+1}` of Kim's Theorem 3.2 (docs/math.md#l2-bounds).

    Args:
        x: Non-negative number or tensor of any shape.

    Returns:
        :math:`\varphi(x)`, same type and shape as ``x``.

    Example:
        >>> round(phi(1.0), 6)
        7.389056
    """
    if isinstance(x, Tensor):
        return x * torch.exp(x + 1)
    return x * math.exp(x + 1)


def phi_inv(y: float | Tensor) -> float | Tensor:
    r"""Inverse of :math:`\varphi(x) = x e^{x+1}` on :math:`[0, \infty)`: :math:`W_0(y / e)`.

    Python numbers are evaluated on the host with ``scipy.special.lambertw`` (float64). Tensors are
    evaluated in torch with a fixed number of Halley steps (no data-dependent control flow, so it
    runs under ``torch.func.vmap``; the value checks follow
    :func:`~iresflow._validation.values_checked`); the result is differentiable in ``y`` with the
    exact derivative :math:`1/\varphi'(x)`, and exact second derivatives (two Newton steps at the
    converged value carry the graph; the bound with a relative bias is differentiated twice).

    Args:
        y: Non-negative finite number, or a tensor of any shape (integer tensors are converted to
            the default floating dtype).

    Returns:
        :math:`\varphi^{-1}(y)`, a float or a tensor of the same shape as ``y``.

    Raises:
        TypeError: ``y`` is neither a real number nor a tensor.
        ValueError: ``y`` is negative, NaN or infinite.

    Example:
        >>> round(phi_inv(9.0), 6)  # N = 10 in docs/math.md#l2-bounds
        1.101003
        >>> phi_inv(torch.tensor([1.0, 9.0], dtype=torch.float64))
        tensor([0.2785, 1.1010], dtype=torch.float64)
    """
    if isinstance(y, Tensor):
        if not y.is_floating_point():
            y = y.to(torch.get_default_dtype())
        if values_checked(y):
            if not bool(torch.isfinite(y).all()):
                raise ValueError("y contains NaN or Inf values")
            if bool((y < 0).any()):
                raise ValueError("y must be non-negative (phi_inv is defined on [0, inf))")
        return _phi_inv_tensor(y)
    if isinstance(y, bool) or not isinstance(y, (int, float)):
        raise TypeError(f"y must be a real number or a torch.Tensor, got {type(y).__name__}")
    if not math.isfinite(y) or y < 0:
        raise ValueError(f"y must be a finite non-negative number, got {y}")
    return float(lambertw(y / math.e).real)


def l2_attention_bound(
    w_query: Tensor,
    w_value: Tensor,
    w_out: Tensor,
    heads: int,
    seq_len: int | Tensor,
    p: Literal["inf", "2"] | float = "inf",
    relative_bias: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    r"""Certified Lipschitz bound of L2-MHA from its weights (docs/math.md#l2-bounds).

    Head ``h`` uses the columns ``h * d_h : (h + 1) * d_h`` of ``w_query`` and ``w_value``
    (:math:`W^{Q,h}, W^{V,h} \in \mathbb R^{D \times d_h}`) and the same rows of ``w_out``
    (:math:`W^{O,h} \in \mathbb R^{d_h \times D}`). The :math:`\infty`-bound is the head-by-head
    form of docs/math.md#l2-bounds-heads, with :math:`G_h = W^{Q,h\top} W^{V,h} W^{O,h}`,

    .. math::
        B_\infty = \max_c \sum_h \Big( \frac{\|(W^{Q,h} G_h)_{:,c}\|_1}{\sqrt{d_h}}
            + 4\varphi^{-1}(R_h)\, \|W^{Q,h\top}\|_\infty \|(G_h)_{:,c}\|_1 \Big),

    at most Kim's Theorem 3.2 bound; the 2-bound is Kim's (module docstring). Without a bias
    :math:`R_h = N - 1`; with a relative-position bias :math:`b_h` (docs/math.md#relative-bias)
    :math:`R_h = \max_i \sum_{k \ne i} e^{b_h(k - i) - b_h(0)}` over the real tokens ``i, k``.
    The bound is differentiable in the weights and the bias (abs/max are sub-differentiable) and
    carries no gradient in ``seq_len``.

    Args:
        w_query: :math:`W^Q`, shape ``(D, D)``.
        w_value: :math:`W^V`, shape ``(D, D)``.
        w_out: :math:`W^O`, shape ``(D, D)``.
        heads: Number of heads ``H`` (divides ``D``).
        seq_len: Sequence length ``N >= 1``: an int, or a tensor of per-sequence lengths (any
            shape, e.g. ``(B,)``; not with ``relative_bias``).
        p: ``"inf"`` (or ``math.inf``) for the :math:`\infty`-norm bound, ``"2"`` (or ``2``) for the
            2-norm bound, both on :math:`\mathrm{vec}(X)`.
        relative_bias: Optional per-head table :math:`b_h` over the clipped offsets
            :math:`-W, \dots, W`, shape ``(H, 2W + 1)`` (``"inf"`` only: no 2-bound is derived
            with a bias).
        mask: Optional boolean padding mask ``(B, N)``, ``N = seq_len`` (an int): each sequence's
            bound counts only its real tokens (with a bias, at their positions; gaps allowed).

    Returns:
        The bound: a 0-dim tensor for an int ``seq_len`` without a mask, otherwise of
        ``seq_len``'s shape, or ``(B,)`` with a mask.

    Raises:
        ValueError: weights that are not ``(D, D)`` with ``heads`` dividing ``D``, a bias table
            of another shape, a bias with ``p = "2"``, or a mask that does not match ``seq_len``.

    Example:
        >>> w = torch.eye(2, dtype=torch.float64)
        >>> l2_attention_bound(w, w, w, heads=1, seq_len=10)  # 4 * 1.101003 + 1 / sqrt(2)
        tensor(5.1111, dtype=torch.float64)
        >>> bias = torch.zeros(1, 3, dtype=torch.float64)  # a zero bias changes nothing
        >>> l2_attention_bound(w, w, w, heads=1, seq_len=10, relative_bias=bias)
        tensor(5.1111, dtype=torch.float64)
    """
    norm = check_norm(p)
    dim = _check_weights(w_query, w_value, w_out, heads)
    if relative_bias is not None and norm == "2":
        raise ValueError("the 2-norm bound is not derived with a relative bias: use p='inf'")
    lengths = seq_len if mask is None else _check_bound_mask(mask, seq_len).sum(dim=-1)
    if relative_bias is None:
        spread = _length_term(lengths, w_query)[..., None]  # phi^{-1}(N - 1), every head
    else:
        spread = _biased_spread(relative_bias, heads, seq_len, mask)  # phi^{-1}(R_h), (..., H)
    if norm == "inf":
        direct, through_scores = _column_factors(w_query, w_value, w_out, heads)
        return (direct + 4 * spread[..., None] * through_scores).sum(dim=-2).amax(dim=-1)
    d_head = dim // heads
    wq = w_query.reshape(dim, heads, d_head).transpose(0, 1)  # (H, D, d_h)
    wv = w_value.reshape(dim, heads, d_head).transpose(0, 1)
    q_spec = torch.linalg.matrix_norm(wq, ord=2)  # ||W^{Q,h}||_2, (H,)
    v_spec = torch.linalg.matrix_norm(wv, ord=2)  # ||W^{V,h}||_2, (H,)
    weights = (q_spec**4 * v_spec**2).sum().sqrt() * torch.linalg.matrix_norm(w_out, ord=2)
    n = lengths.to(spread) if isinstance(lengths, Tensor) else spread.new_tensor(lengths)
    return torch.sqrt(n / d_head) * (4 * spread[..., 0] + 1) * weights


def causal_l2_attention_bound(
    w_query: Tensor,
    w_value: Tensor,
    w_out: Tensor,
    heads: int,
    seq_len: int,
    relative_bias: Tensor | None = None,
    mask: Tensor | None = None,
) -> Tensor:
    r"""Certified bound of every row of causal L2-MHA, in the :math:`\infty`-norm
    (docs/math.md#causal-attention).

    Row :math:`i` of the causal map (query :math:`i` reads the keys :math:`j \le i`) obeys the
    head-by-head bound of :func:`l2_attention_bound` with :math:`R_h` replaced by the row's own
    :math:`R^h_i = \sum_{k < i} e^{b_h(k - i) - b_h(0)}` over its real keys (without a bias, their
    number): the largest absolute row sum of the Jacobian's rows of output frame :math:`i` is at
    most entry :math:`i`. Each entry depends on the weights, the bias and the mask at or before
    frame :math:`i` only, so a branch that divides frame :math:`i` by it stays causal.

    Args:
        w_query: :math:`W^Q`, shape ``(D, D)``.
        w_value: :math:`W^V`, shape ``(D, D)``.
        w_out: :math:`W^O`, shape ``(D, D)``.
        heads: Number of heads ``H`` (divides ``D``).
        seq_len: Sequence length ``N >= 1``.
        relative_bias: Optional per-head table over the clipped offsets, ``(H, 2W + 1)``.
        mask: Optional boolean padding mask ``(B, N)``: only real keys count.

    Returns:
        ``(N,)``, or ``(B, N)`` with a mask.

    Example:
        >>> w = torch.eye(2, dtype=torch.float64)
        >>> causal_l2_attention_bound(w, w, w, heads=1, seq_len=10)[[0, 9]]  # frames 0 and 9
        tensor([0.7071, 5.1111], dtype=torch.float64)
    """
    _check_weights(w_query, w_value, w_out, heads)
    n = check_int(seq_len, "seq_len", 1)
    mask = None if mask is None else _check_bound_mask(mask, n)
    earlier = torch.ones(n, n, dtype=torch.bool, device=w_query.device).tril(-1)
    weight = earlier.to(w_query.dtype).expand(heads, n, n)  # (H, N, N): query i, key k < i
    if relative_bias is not None:
        weight = weight * _bias_weights(relative_bias, heads, n)
    spread = phi_inv(_key_mass(weight, mask))  # (..., H, N)
    direct, through_scores = _column_factors(w_query, w_value, w_out, heads)
    per_column = direct.sum(0) + 4 * torch.einsum("...hi,hc->...ic", spread, through_scores)
    return per_column.amax(dim=-1)


def _column_factors(w_query: Tensor, w_value: Tensor, w_out: Tensor,
                    heads: int) -> tuple[Tensor, Tensor]:
    r"""The two factors of the head-by-head :math:`\infty`-bound (docs/math.md#l2-bounds-heads),
    per head and output column, each ``(H, D)``: :math:`\|(W^{Q,h} G_h)_{:,c}\|_1 / \sqrt{d_h}`
    and :math:`\|W^{Q,h\top}\|_\infty \|(G_h)_{:,c}\|_1`."""
    dim = w_query.shape[0]
    d_head = dim // heads
    wq = w_query.reshape(dim, heads, d_head).transpose(0, 1)  # (H, D, d_h)
    wv = w_value.reshape(dim, heads, d_head).transpose(0, 1)
    g = wq.transpose(1, 2) @ wv @ w_out.reshape(heads, d_head, dim)  # G_h, (H, d_h, D)
    direct = (wq @ g).abs().sum(dim=1) * d_head**-0.5
    return direct, wq.abs().sum(dim=1).amax(dim=1, keepdim=True) * g.abs().sum(dim=1)


def _phi_inv_tensor(y: Tensor) -> Tensor:
    """``W_0(y / e)`` for a floating tensor ``y >= 0`` without value checks (vmap-safe)."""
    z = y / math.e
    zd = z.detach()
    log1p = torch.log1p(zd)
    w = log1p * (1 - torch.log1p(log1p) / (2 + log1p))  # Winitzki's approximation
    for _ in range(_HALLEY_STEPS):
        ew = torch.exp(w)
        residual = w * ew - zd
        w = w - residual / (ew * (w + 1) - (w + 2) * residual / (2 * w + 2))
    # Two Newton steps at the converged value carry the graph: the values are unchanged; the
    # first (graph on z only) makes dw/dz = 1 / (e^w (w + 1)) exact, the second (graph on z and w)
    # also the second and third derivatives (each step doubles the order of contact with W_0).
    for _ in range(2):
        ew = torch.exp(w)
        w = w - (w * ew - z) / (ew * (w + 1))
    return w


def _length_term(seq_len: int | Tensor, like: Tensor) -> Tensor:
    r""":math:`\varphi^{-1}(N - 1)` as a tensor with ``like``'s dtype and device."""
    if isinstance(seq_len, Tensor):
        n = seq_len.to(dtype=like.dtype, device=like.device)
        # Skipped under torch.func transforms and for callers that validated the lengths (a
        # mask's real lengths are >= 1 by check_mask).
        if values_checked(n) and not bool((n >= 1).all()):
            raise ValueError("seq_len must be >= 1 everywhere")
        return _phi_inv_tensor(n - 1)
    return like.new_tensor(phi_inv(float(check_int(seq_len, "seq_len", 1) - 1)))


def _check_weights(w_query: Tensor, w_value: Tensor, w_out: Tensor, heads: int) -> int:
    """Check three square ``(D, D)`` weights with ``heads`` dividing ``D``; return ``D``."""
    check_int(heads, "heads", 1)
    for name, w in (("w_query", w_query), ("w_value", w_value), ("w_out", w_out)):
        if not isinstance(w, Tensor) or w.dim() != 2 or w.shape[0] != w.shape[1]:
            shape = tuple(w.shape) if isinstance(w, Tensor) else type(w).__name__
            raise ValueError(f"{name} must be a square (D, D) tensor, got {shape}")
    dim = w_query.shape[0]
    if w_value.shape[0] != dim or w_out.shape[0] != dim or dim % heads != 0:
        raise ValueError(
            f"weights must all be ({dim}, {dim}) with D divisible by heads={heads}, got "
            f"{tuple(w_query.shape)}, {tuple(w_value.shape)}, {tuple(w_out.shape)}"
        )
    return dim


def _biased_spread(
    table: Tensor, heads: int, seq_len: int | Tensor, mask: Tensor | None
) -> Tensor:
    r""":math:`\varphi^{-1}(R_h)` with :math:`R_h = \max_i \sum_{k \ne i} e^{b_h(k-i) - b_h(0)}`
    over the real tokens (docs/math.md#relative-bias); shape ``(H,)``, or ``(B, H)`` with a mask."""
    if isinstance(seq_len, Tensor):
        raise ValueError("with a relative bias, give the real tokens as a mask, not as lengths")
    n = check_int(seq_len, "seq_len", 1)
    weight = _bias_weights(table, heads, n)
    weight = weight.masked_fill(torch.eye(n, dtype=torch.bool, device=table.device), 0.0)
    rows = _key_mass(weight, mask)
    if mask is not None:
        rows = rows.masked_fill(~mask[:, None, :], 0.0)  # real queries only
    return phi_inv(rows.amax(dim=-1))


def _key_mass(weight: Tensor, mask: Tensor | None) -> Tensor:
    """Every query's sum of ``weight`` ``(H, N, N)`` (query, key) over the real keys of
    ``mask`` ``(B, N)``: ``(H, N)``, or ``(B, H, N)`` with a mask."""
    if mask is None:
        return weight.sum(dim=-1)
    return torch.einsum("hik,bk->bhi", weight, mask.to(weight.dtype))


def _bias_weights(table: Tensor, heads: int, length: int) -> Tensor:
    r""":math:`e^{b_h(k - i) - b_h(0)}` for every query :math:`i` and key :math:`k` of a
    sequence of ``length`` tokens, ``(H, N, N)``, from a checked table ``(H, 2W + 1)``."""
    if not isinstance(table, Tensor) or table.dim() != 2 or table.shape[0] != heads or (
        table.shape[1] % 2 == 0
    ):
        shape = tuple(table.shape) if isinstance(table, Tensor) else type(table).__name__
        raise ValueError(f"relative_bias must have shape (heads={heads}, 2W + 1), got {shape}")
    window = table.shape[1] // 2
    return torch.exp(relative_scores(table, length) - table[:, window, None, None])


def _check_bound_mask(mask: Tensor, seq_len: int | Tensor) -> Tensor:
    """Check that a mask of real tokens is boolean ``(B, N)`` with ``N = seq_len`` (an int)."""
    if (
        not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2
        or isinstance(seq_len, Tensor) or mask.shape[1] != seq_len
    ):
        shape = tuple(mask.shape) if isinstance(mask, Tensor) else type(mask).__name__
        raise ValueError(
            f"mask must be a boolean (B, N) tensor with N = seq_len (an int), got {shape} and "
            f"seq_len={seq_len!r}"
        )
    return mask


def check_norm(p: object) -> Literal["inf", "2"]:
    r"""Validate the norm of a Lipschitz bound: the vector norm on :math:`\mathrm{vec}(X)`.

    Args:
        p: ``"inf"`` or ``math.inf`` (the max norm), ``"2"`` or ``2`` (the Euclidean norm).

    Returns:
        ``"inf"`` or ``"2"``.

    Raises:
        ValueError: any other value.

    Example:
        >>> check_norm(2)
        '2'
    """
    if p in ("inf", math.inf):
        return "inf"
    if p in ("2", 2):
        return "2"
    raise ValueError(f"p must be 'inf' or '2', got {p!r}")
