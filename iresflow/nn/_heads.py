r"""Multi-head plumbing shared by the attention maps: heads, the masked softmax, relative offsets.

Execution path of :func:`attend`: when no autograd graph is recorded (``torch.no_grad``, e.g.
fixed-point inversion and sampling) and no ``torch.func`` transform is active, attention runs
through :func:`torch.nn.functional.scaled_dot_product_attention` (fused kernel); otherwise
through an explicit max-subtracted softmax. The fused CPU kernel has no forward-mode derivative,
no double-backward and no vmap batching rule, all of which the log-determinant estimators and
the exact log-det engine need; both paths compute the same function, with or without an additive
score bias (checked to 1e-10 in float64).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from iresflow._validation import under_functorch_transform

__all__ = ["attend", "causal_keys", "merge_heads", "relative_scores", "split_heads"]


def attend(
    q: Tensor, k: Tensor, v: Tensor, mask: Tensor | None, scale: float, bias: Tensor | None = None,
    causal: bool = False,
) -> Tensor:
    """``softmax(q k^T * scale + bias) v`` per (batch, head), padded keys excluded.

    Shapes: ``q, k`` ``(B, H, N, E)``, ``v`` ``(B, H, N, d)``, ``mask`` ``(B, N)``, ``bias``
    ``(H, N, N)`` (added to the scaled scores, not scaled itself); returns ``(B, H, N, d)``. See
    the module docstring for the choice of path. ``causal``: query ``i`` reads the keys
    ``j <= i`` only (:func:`causal_keys`).
    """
    key_mask = None if mask is None else mask[:, None, None, :]
    if causal:
        key_mask = causal_keys(q.shape[-2], None if mask is None else mask[:, None], q.device)
    if torch.is_grad_enabled() or under_functorch_transform():
        logits = (q * scale) @ k.transpose(-1, -2)  # scaling q is cheaper than scaling logits
        if bias is not None:
            logits = logits + bias
        if key_mask is not None:
            logits = logits.masked_fill(~key_mask, -math.inf)
        # torch.softmax subtracts the row maximum before exponentiating.
        return torch.softmax(logits, dim=-1) @ v
    if bias is not None:  # one additive float mask: the bias, -inf at padded keys
        bias = bias.to(q.dtype)
        key_mask = bias if key_mask is None else torch.where(key_mask, bias, -math.inf)
    # The fused kernels need equal head sizes for q, k and v: pad v with zeros and drop them.
    width = v.shape[-1]
    v = F.pad(v, (0, q.shape[-1] - width))
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=key_mask, scale=scale)
    return out[..., :width]


def causal_keys(length: int, mask: Tensor | None, device: torch.device) -> Tensor:
    """The keys every query reads under a causal mask: the real keys at or before it, and
    itself (a padded query too, so that no row of the softmax is empty; its output is zeroed).

    Args:
        length: Sequence length ``N``.
        mask: Optional boolean padding mask ``(..., N)`` of the keys.
        device: Device of the result.

    Returns:
        Boolean ``(N, N)`` without a mask, ``(..., N, N)`` with one: entry ``[i, j]`` is whether
        query ``i`` reads key ``j``.

    Example:
        >>> causal_keys(3, torch.tensor([True, False, True]), torch.device("cpu")).int().tolist()
        [[1, 0, 0], [1, 1, 0], [1, 0, 1]]
    """
    earlier = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    if mask is None:
        return earlier
    itself = torch.eye(length, dtype=torch.bool, device=device)
    return (earlier & mask[..., None, :]) | itself


def relative_scores(table: Tensor, length: int) -> Tensor:
    r"""Expand a relative-position table to score biases :math:`b_h(\mathrm{clip}(j - i, -W, W))`.

    Args:
        table: Per-head values over the offsets :math:`-W, \dots, W`, shape ``(H, 2W + 1)``.
        length: Sequence length ``N`` (tensor positions, padding included).

    Returns:
        The biases, shape ``(H, N, N)``; entry ``[h, i, j]`` is ``table[h, clip(j - i) + W]``.
    """
    window = (table.shape[-1] - 1) // 2
    position = torch.arange(length, device=table.device)
    offset = (position[None, :] - position[:, None]).clamp(-window, window) + window
    return table[:, offset]


def split_heads(x: Tensor, heads: int) -> Tensor:
    """``(B, N, D) -> (B, H, N, D / H)``."""
    b, n, d = x.shape
    return x.reshape(b, n, heads, d // heads).transpose(1, 2)


def merge_heads(x: Tensor, w_out: Tensor, mask: Tensor | None) -> Tensor:
    """Concatenate heads ``(B, H, N, d_h) -> (B, N, D)``, apply ``W^O``, zero padded positions."""
    b, h, n, d = x.shape
    out = x.transpose(1, 2).reshape(b, n, h * d) @ w_out
    if mask is not None:
        out = out.masked_fill(~mask[..., None], 0.0)
    return out
