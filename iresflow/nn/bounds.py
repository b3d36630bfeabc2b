r"""Lipschitz bounds of L2 multi-head self-attention (Kim et al., Theorem 3.2).

The bounds of docs/math.md#l2-bounds, evaluated on weight matrices in the *math orientation* of
docs/math.md#conventions (tokens are rows, weights act by right multiplication, ``X @ W``):

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
(docs/math.md#l2-bounds (C.2), check H5 (docs/math.md#checks)).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from scipy.special import lambertw
from torch import Tensor

from iresflow._validation import check_int, values_checked

__all__ = ["check_norm", "l2_attention_bound", "phi", "phi_inv"]

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
    exact derivative :math:`1/\varphi'(x)` (one implicit-function Newton step carries the gradient).

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
) -> Tensor:
    r"""Kim's Theorem 3.2 bound of L2-MHA from its weights (docs/math.md#l2-bounds, boxed forms).

    Head ``h`` uses the columns ``h * d_h : (h + 1) * d_h`` of ``w_query`` and ``w_value``
    (:math:`W^{Q,h}, W^{V,h} \in \mathbb R^{D \times d_h}`); ``w_out`` is :math:`W^O`. Norm glossary
    (docs/math.md#l2-bounds): :math:`\|W^{Q,h}\|_\infty` is the max abs row sum of :math:`W^{Q,h}`,
    and :math:`\|W^{Q,h\top}\|_\infty`, :math:`\|W^{V,h\top}\|_\infty`, :math:`\|W^{O\top}\|_\infty`
    are max abs column sums. The bound is differentiable in the weights (abs/max are
    sub-differentiable) and carries no gradient in ``seq_len``.

    Args:
        w_query: :math:`W^Q`, shape ``(D, D)``.
        w_value: :math:`W^V`, shape ``(D, D)``.
        w_out: :math:`W^O`, shape ``(D, D)``.
        heads: Number of heads ``H`` (divides ``D``).
        seq_len: Sequence length ``N >= 1``: an int, or a tensor of per-sequence lengths (any
            shape, e.g. ``(B,)``).
        p: ``"inf"`` (or ``math.inf``) for the :math:`\infty`-norm bound, ``"2"`` (or ``2``) for the
            2-norm bound, both on :math:`\mathrm{vec}(X)`.

    Returns:
        The bound: a 0-dim tensor for an int ``seq_len``, otherwise of ``seq_len``'s shape.

    Example:
        >>> w = torch.eye(2, dtype=torch.float64)
        >>> l2_attention_bound(w, w, w, heads=1, seq_len=10)  # 4 * 1.101003 + 1 / sqrt(2)
        tensor(5.1111, dtype=torch.float64)
    """
    norm = check_norm(p)
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
    d_head = dim // heads
    length = _length_term(seq_len, w_query)
    # (D, H, d_h): axis 0 indexes the rows of W^{Q,h}, axis 2 its columns.
    wq = w_query.reshape(dim, heads, d_head)
    wv = w_value.reshape(dim, heads, d_head)
    if norm == "inf":
        q_rows = wq.abs().sum(dim=2).amax(dim=0)  # ||W^{Q,h}||_inf, (H,)
        q_cols = wq.abs().sum(dim=0).amax(dim=1)  # ||W^{Q,h T}||_inf, (H,)
        v_cols = wv.abs().sum(dim=0).amax(dim=1)  # ||W^{V,h T}||_inf, (H,)
        o_cols = w_out.abs().sum(dim=0).amax()  # ||W^{O T}||_inf
        weights = o_cols * (q_rows * q_cols).amax() * v_cols.amax()
        return (4 * length + d_head**-0.5) * weights
    q_spec = torch.linalg.matrix_norm(wq.transpose(0, 1), ord=2)  # ||W^{Q,h}||_2, (H,)
    v_spec = torch.linalg.matrix_norm(wv.transpose(0, 1), ord=2)  # ||W^{V,h}||_2, (H,)
    weights = (q_spec**4 * v_spec**2).sum().sqrt() * torch.linalg.matrix_norm(w_out, ord=2)
    n = length.new_tensor(seq_len) if isinstance(seq_len, int) else seq_len.to(length)
    return torch.sqrt(n / d_head) * (4 * length + 1) * weights


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
    # Converged Newton step with the graph on z only: value unchanged, dw/dz = 1 / (e^w (w + 1)).
    ew = torch.exp(w)
    return w - (w * ew - z) / (ew * (w + 1))


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
