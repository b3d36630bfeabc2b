r"""An unconstrained causal Transformer over frames: the conditioner of the autoregressive step
(docs/math.md#autoregressive-step).

Unlike the branches of this package it carries no Lipschitz certificate and needs none: the
step it parameterises is invertible because frame :math:`t` is a function of earlier frames only.
"""

from __future__ import annotations

from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from iresflow._validation import check_int
from iresflow.nn.positional import make_positional_encoding

__all__ = ["CausalTransformer"]

#: Hidden width of the feed-forward part of a layer, in multiples of the model width.
_FEEDFORWARD_RATIO = 4


class CausalTransformer(nn.Module):
    r"""A pre-norm Transformer whose output at frame :math:`t` reads only the real frames
    before :math:`t` (and the context).

    The tokens are a learned start vector followed by the frames shifted by one,
    :math:`h_0 = e_{\rm start}`, :math:`h_t = W_{\rm in} x_{t-1}` (:math:`t = 1, \dots, N-1`),
    plus a positional table at token index :math:`t` and, for a conditional network
    (``context_features = C > 0``), a linear map of the context :math:`W_c c` on every token.
    Each of ``depth`` layers is :math:`h \leftarrow h + \mathrm{Attn}(\mathrm{LN}(h))`,
    :math:`h \leftarrow h + \mathrm{MLP}(\mathrm{LN}(h))` with multi-head attention in which token
    :math:`t` attends to token 0 and to the tokens :math:`u + 1 \le t` of *real* frames
    :math:`u`; the output at frame :math:`t` is :math:`W_{\rm out}\,\mathrm{LN}(h_t)`. So
    ``out[b, t]`` is a function of ``x[b, u]`` for the real frames ``u < t`` and of
    ``context[b]`` alone: padded frames and frames after a gap's position never enter it, and
    every token attends at least to the start token, so no attention row is empty. Frame 0's
    output depends on the context only. The output layer starts at zero, so the network
    outputs zeros until training moves it.

    Args:
        features: Frame size ``D``.
        out_features: Output size per frame.
        width: Token width.
        depth: Number of layers.
        heads: Attention heads (must divide ``width``).
        positional: ``"sinusoidal"`` (any length) or ``"learned"`` (``max_len`` rows).
        max_len: Longest sequence, required by ``positional="learned"``.
        context_features: Context size ``C`` (0: unconditional).

    Example:
        >>> net = CausalTransformer(3, 6, width=8, depth=1, heads=2)
        >>> net(torch.randn(2, 5, 3)).shape
        torch.Size([2, 5, 6])
    """

    def __init__(
        self,
        features: int,
        out_features: int,
        *,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        positional: Literal["sinusoidal", "learned"] = "sinusoidal",
        max_len: int | None = None,
        context_features: int = 0,
    ) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        self.out_features = check_int(out_features, "out_features", 1)
        self.width = check_int(width, "width", 1)
        check_int(depth, "depth", 1)
        self.heads = check_int(heads, "heads", 1)
        if width % heads:
            raise ValueError(f"heads must divide width, got width={width}, heads={heads}")
        if positional == "learned" and max_len is None:
            raise ValueError("positional='learned' needs max_len")
        self.max_len = None if max_len is None else check_int(max_len, "max_len", 1)
        self.positional = positional
        self.context_features = check_int(context_features, "context_features", 0)
        # (a sinusoidal table ignores max_len)
        self.encoding = make_positional_encoding(positional, width, max_len or 1)
        self.start = nn.Parameter(0.02 * torch.randn(width))
        self.embed = nn.Linear(features, width)
        self.context_embed = nn.Linear(context_features, width) if context_features else None
        self.layers = nn.ModuleList(_CausalLayer(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, out_features)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    def forward(
        self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        """Per-frame outputs from the past of every frame.

        Args:
            x: Frames ``(B, N, D)``; values at padded frames are ignored.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real frames.
            context: Context ``(B, C)`` of a conditional network, else ``None``.

        Returns:
            ``(B, N, out_features)``; row ``t`` depends on the real frames before ``t`` only.
        """
        batch, length, _ = x.shape
        if mask is not None:  # padded values must not reach any token, even as 0 * inf
            x = torch.where(mask.unsqueeze(-1), x, 0.0)
        start = self.start.expand(batch, 1, self.width)
        h = torch.cat([start, self.embed(x[:, :-1])], dim=1)
        h = h + self.encoding(h)
        if self.context_embed is not None:
            h = h + self.context_embed(context).unsqueeze(1)
        # Token u + 1 holds frame u: a key if that frame is real; the start token always is.
        keys = torch.ones(batch, length, dtype=torch.bool, device=x.device)
        if mask is not None:
            keys[:, 1:] = mask[:, :-1]
        causal = torch.ones(length, length, dtype=torch.bool, device=x.device).tril()
        allowed = (causal & keys[:, None, :]).unsqueeze(1)  # (B, 1, query, key)
        for layer in self.layers:
            h = layer(h, allowed)
        return self.head(self.norm(h))

    def extra_repr(self) -> str:
        return (f"features={self.features}, out_features={self.out_features}, "
                f"width={self.width}, heads={self.heads}, positional={self.positional!r}, "
                f"max_len={self.max_len}, context_features={self.context_features}")


class _CausalLayer(nn.Module):
    """One pre-norm Transformer layer with an explicit boolean attention mask."""

    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.heads = heads
        self.attention_norm = nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)
        self.feedforward_norm = nn.LayerNorm(width)
        self.feedforward = nn.Sequential(
            nn.Linear(width, _FEEDFORWARD_RATIO * width),
            nn.GELU(),
            nn.Linear(_FEEDFORWARD_RATIO * width, width),
        )

    def forward(self, h: Tensor, allowed: Tensor) -> Tensor:
        batch, length, width = h.shape
        q, k, v = (
            self.qkv(self.attention_norm(h))
            .view(batch, length, 3, self.heads, width // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        h = h + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return h + self.feedforward(self.feedforward_norm(h))
