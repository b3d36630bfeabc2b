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

__all__ = ["CausalConditioner", "CausalTransformer", "WindowEvaluator", "check_window"]

#: Hidden width of the feed-forward part of a layer, in multiples of the model width.
_FEEDFORWARD_RATIO = 4


class CausalConditioner(nn.Module):
    r"""What the conditioners of the autoregressive step share: a learned start token, an input
    map :math:`W_{\rm in}` of the frames, a positional table, an optional linear map
    :math:`W_c` of the context and an output layer that starts at zero.

    Subclasses build their layers after calling this constructor, then their output layer
    (``_output_layer``), so that the parameters are created, and drawn, in that order.

    Args:
        features: Frame size ``D``.
        out_features: Output size per frame.
        width: Token width.
        positional: ``"sinusoidal"`` (any length) or ``"learned"`` (``max_len`` rows).
        max_len: Longest sequence, required by ``positional="learned"``.
        context_features: Context size ``C`` (0: unconditional).
    """

    def __init__(
        self,
        features: int,
        out_features: int,
        *,
        width: int,
        positional: Literal["sinusoidal", "learned"],
        max_len: int | None,
        context_features: int,
    ) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        self.out_features = check_int(out_features, "out_features", 1)
        self.width = check_int(width, "width", 1)
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

    def _output_layer(self) -> nn.Linear:
        """The output layer ``width -> out_features``, at zero."""
        head = nn.Linear(self.width, self.out_features)
        nn.init.zeros_(head.weight)
        nn.init.zeros_(head.bias)
        return head

    def _start_tokens(self, batch: int) -> Tensor:
        """The start token of every sequence, ``(batch, 1, width)``."""
        return self.start.expand(batch, 1, self.width)

    def _with_context(self, tokens: Tensor, context: Tensor | None) -> Tensor:
        """Tokens ``(B, L, width)`` with the context's map added to each (a conditional
        network's; unchanged otherwise)."""
        if self.context_embed is None:
            return tokens
        return tokens + self.context_embed(context).unsqueeze(1)

    def positional_rows(self, x: Tensor) -> Tensor:
        """The positional rows of the tokens of frames ``x``.

        Args:
            x: Frames ``(B, N, D)`` (only their number ``N`` is read).

        Returns:
            ``(N, width)``: row ``t`` is the position of token ``t``.
        """
        return self.encoding(x.new_empty(1, x.shape[1], self.width))


class CausalTransformer(CausalConditioner):
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
        check_int(depth, "depth", 1)
        check_int(heads, "heads", 1)
        if width % heads:
            raise ValueError(f"heads must divide width, got width={width}, heads={heads}")
        super().__init__(features, out_features, width=width, positional=positional,
                         max_len=max_len, context_features=context_features)
        self.heads = heads
        self.layers = nn.ModuleList(_CausalLayer(width, heads) for _ in range(depth))
        self.norm = nn.LayerNorm(width)
        self.head = self._output_layer()

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
        h = self._tokens(x, 0, x.shape[1], mask, context, self.positional_rows(x))
        allowed = _allowed(x.shape[0], x.shape[1], mask, x.device)
        for layer in self.layers:
            h = layer(h, allowed)
        return self.head(self.norm(h))

    def windows(self, x: Tensor, mask: Tensor | None = None,
                context: Tensor | None = None) -> WindowEvaluator:
        """An evaluator of the outputs on windows of frames of sequences whose earlier frames
        no longer change (see :class:`WindowEvaluator`).

        Args:
            x: Frames ``(B, N, D)``: the batch and length the evaluator serves (its values are
                not read).
            mask: Optional boolean padding mask ``(B, N)``, fixed for the evaluator's life.
            context: Context ``(B, C)`` of a conditional network, else ``None``.
        """
        return WindowEvaluator(self, x, mask, context)

    def _tokens(self, x: Tensor, start: int, stop: int, mask: Tensor | None,
                context: Tensor | None, table: Tensor) -> Tensor:
        """Tokens ``start`` to ``stop - 1`` ``(B, stop - start, width)`` of frames ``x``
        ``(B, N, D)`` (token ``u + 1`` holds frame ``u``, token 0 the start vector); ``table``
        the positional rows of all ``N`` tokens."""
        first, last = max(start - 1, 0), max(stop - 1, 0)
        frames = x[:, first:last]
        if mask is not None:  # padded values must not reach any token, even as 0 * inf
            frames = torch.where(mask[:, first:last, None], frames, 0.0)
        h = self.embed(frames)
        if start == 0 < stop:
            h = torch.cat([self._start_tokens(x.shape[0]), h], dim=1)
        return self._with_context(h + table[start:stop], context)

    def extra_repr(self) -> str:
        return (f"features={self.features}, out_features={self.out_features}, "
                f"width={self.width}, heads={self.heads}, positional={self.positional!r}, "
                f"max_len={self.max_len}, context_features={self.context_features}")


class WindowEvaluator:
    r"""The outputs of a :class:`CausalTransformer` on a window of frames ``start`` to
    ``stop - 1``, with the keys and values of the earlier tokens kept from the calls before.

    Output frame :math:`t` reads tokens :math:`0, \dots, t` only, and token :math:`u + 1` holds
    frame :math:`u`. A call evaluates the tokens of its window, attending to the keys and values
    stored for the tokens before ``start``, and stores theirs in their place; the first call
    evaluates the tokens before its window too (their outputs are not asked for). The outputs
    equal the network's on the whole sequence (``net(x)[:, start:stop]``, to rounding) provided
    every call after the first has its ``start`` between the ``start`` and the ``stop`` of the
    call before, with ``x`` unchanged on the frames before ``start - 1``. A
    fixed-point solve whose frames settle from the first on
    (:func:`~iresflow.inverse.causal.causal_fixed_point_inverse`) makes such calls, and its
    sweeps then cost the tokens of their windows, not the whole sequence. Runs without gradient
    tracking.

    Args:
        net: The network.
        x: Frames ``(B, N, D)`` of the batch and length served (values not read).
        mask: Optional boolean padding mask ``(B, N)``.
        context: Context ``(B, C)`` of a conditional network, else ``None``.
    """

    def __init__(self, net: CausalTransformer, x: Tensor, mask: Tensor | None,
                 context: Tensor | None) -> None:
        batch, length, _ = x.shape
        self.net, self.mask, self.context = net, mask, context
        self.table = net.positional_rows(x)
        self.allowed = _allowed(batch, length, mask, x.device)
        head_width = net.width // net.heads
        self.keys = [x.new_empty(batch, net.heads, length, head_width) for _ in net.layers]
        self.values = [torch.empty_like(k) for k in self.keys]
        self.length = length
        self.stored: tuple[int, int] | None = None  # the window of the call before

    @torch.no_grad()
    def __call__(self, x: Tensor, start: int, stop: int) -> Tensor:
        """Outputs of frames ``start`` to ``stop - 1``, ``(B, stop - start, out_features)``.

        Args:
            x: Frames ``(B, N, D)``, equal to those of the call before on frames
                ``< start - 1``.
            start: First frame of the window: any on the first call, then between the
                ``start`` and the ``stop`` of the call before.
            stop: End of the window, ``start <= stop <= N``.

        Raises:
            ValueError: the window breaks these rules.
        """
        begin = 0 if self.stored is None else start  # the first call reads the frames before
        check_window(self.stored, start, stop, self.length)
        self.stored = (start, stop)
        net = self.net
        h = net._tokens(x, begin, stop, self.mask, self.context, self.table)
        # one query token of a batch without padding may attend to every stored token
        single = self.mask is None and stop - begin == 1
        allowed = None if single else self.allowed[:, :, begin:stop, :stop]
        for layer, keys, values in zip(net.layers, self.keys, self.values, strict=True):
            h = layer(h, allowed, keys, values, begin)
        return net.head(net.norm(h[:, start - begin:]))


def check_window(stored: tuple[int, int] | None, start: int, stop: int, length: int) -> None:
    """Check a window ``[start, stop)`` of an evaluator against its call rules.

    Args:
        stored: The window of the call before (``None`` before the first call).
        start: First frame of the window.
        stop: End of the window.
        length: Number of frames ``N`` served.

    Raises:
        ValueError: ``start`` is not between the ``start`` and the ``stop`` of the call before
            (0 and ``stop`` on the first call), or after ``stop``, or ``stop > N``.
    """
    lowest, highest = (0, stop) if stored is None else stored
    if not lowest <= start <= min(highest, stop) or stop > length:
        raise ValueError(f"the window [start, stop) must start between the start and the "
                         f"stop of the call before ({lowest} and {highest}) and end by "
                         f"N = {length}, got [{start}, {stop})")


def _allowed(batch: int, length: int, mask: Tensor | None, device: torch.device) -> Tensor:
    """Boolean attention mask ``(B, 1, query, key)`` of ``N`` tokens (``(1, 1, N, N)`` without
    ``mask``): causal, and token ``u + 1`` a key only if frame ``u`` is real (the start token
    always is)."""
    causal = torch.ones(length, length, dtype=torch.bool, device=device).tril()
    if mask is None:
        return causal[None, None]
    keys = torch.ones(batch, length, dtype=torch.bool, device=device)
    keys[:, 1:] = mask[:, :-1]
    return (causal & keys[:, None, :]).unsqueeze(1)


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

    def forward(self, h: Tensor, allowed: Tensor | None, keys: Tensor | None = None,
                values: Tensor | None = None, start: int = 0) -> Tensor:
        """Tokens ``h`` ``(B, L, width)`` attending where ``allowed`` (boolean, ``(B or 1, 1, L,
        keys)``; ``None``: to every key); with ``keys`` and ``values`` ``(B, heads, N, width /
        heads)``, ``h`` are tokens ``start`` to ``start + L - 1``, whose keys and values are
        stored there and which attend to those of tokens ``0`` to ``start + L - 1``."""
        batch, length, width = h.shape
        q, k, v = (
            self.qkv(self.attention_norm(h))
            .view(batch, length, 3, self.heads, width // self.heads)
            .permute(2, 0, 3, 1, 4)
        )
        if keys is not None and values is not None:
            stop = start + length
            keys[:, :, start:stop], values[:, :, start:stop] = k, v
            k, v = keys[:, :, :stop], values[:, :, :stop]
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed)
        h = h + self.out(attended.transpose(1, 2).reshape(batch, length, width))
        return h + self.feedforward(self.feedforward_norm(h))
