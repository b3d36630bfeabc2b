r"""A causal GRU over frames: the recurrent conditioner of the autoregressive step
(docs/math.md#autoregressive-step).

Like the causal Transformer of :mod:`iresflow.nn.causal` it carries no Lipschitz certificate
and needs none. It reads the past in order, so the inverse of the step it parameterises costs one
GRU update per frame, where the Transformer attends to every earlier frame.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import Tensor, nn

from iresflow._validation import check_int, check_mask
from iresflow.nn.causal import CausalConditioner, check_window

__all__ = ["CausalGRU", "RecurrentWindows", "left_align", "real_first"]


class CausalGRU(CausalConditioner):
    r"""A GRU whose output at frame :math:`t` reads only the real frames before :math:`t` (and
    the context).

    The tokens are a learned start vector followed by the real frames in order,
    :math:`h_0 = e_{\rm start} + P_{r_0}`, :math:`h_{k+1} = W_{\rm in} x_{r_k} + P_{r_{k+1}}` for
    the real frames :math:`r_0 < r_1 < \dots`: every token carries the positional row :math:`P` of
    the frame whose output follows it. A conditional network (``context_features = C > 0``) adds
    a linear map of the context :math:`W_c c` to every token. A GRU of ``depth`` layers reads them
    in order, and the output at a real frame :math:`t = r_k` is :math:`W_{\rm out} o_k`,
    :math:`o_k` its state after the tokens :math:`0, \dots, k`. So ``out[b, t]`` is a function
    of ``x[b, u]`` for the real frames ``u < t`` and of ``context[b]`` alone: padded frames are
    skipped, not read as zeros, and a gap leaves the state as it was. Frame 0's output depends
    on the context only. The output layer starts at zero, so the network outputs zeros until
    training moves it.

    Args:
        features: Frame size ``D``.
        out_features: Output size per frame.
        width: Width of the tokens and of the GRU's state.
        depth: Number of GRU layers.
        positional: ``"sinusoidal"`` (any length) or ``"learned"`` (``max_len`` rows).
        max_len: Longest sequence, required by ``positional="learned"``.
        context_features: Context size ``C`` (0: unconditional).

    Example:
        >>> net = CausalGRU(3, 6, width=8)
        >>> net(torch.randn(2, 5, 3)).shape
        torch.Size([2, 5, 6])
    """

    def __init__(
        self,
        features: int,
        out_features: int,
        *,
        width: int = 64,
        depth: int = 1,
        positional: Literal["sinusoidal", "learned"] = "sinusoidal",
        max_len: int | None = None,
        context_features: int = 0,
    ) -> None:
        check_int(depth, "depth", 1)
        super().__init__(features, out_features, width=width, positional=positional,
                         max_len=max_len, context_features=context_features)
        self.depth = depth
        self.gru = nn.GRU(width, width, num_layers=depth, batch_first=True)
        self.head = self._output_layer()

    def forward(
        self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        """Per-frame outputs from the past of every frame, ``(B, N, out_features)``: the output
        layer on :meth:`states` (same arguments); row ``t`` depends on the real frames before
        ``t`` only."""
        return self.head(self.states(x, mask, context))

    def states(
        self, x: Tensor, mask: Tensor | None = None, context: Tensor | None = None
    ) -> Tensor:
        """The state of the GRU's last layer that every frame's output reads (before the output
        layer): after the start token and the tokens of the real frames before the frame.

        Args:
            x: Frames ``(B, N, D)``; values at padded frames are ignored.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real frames.
            context: Context ``(B, C)`` of a conditional network, else ``None``.

        Returns:
            ``(B, N, width)``; row ``t`` depends on the real frames before ``t`` only.
        """
        frames, rank, positions = x, None, self.positional_rows(x)
        if mask is not None:  # the real frames first, in order; padding after them, as zeros
            order = real_first(mask)
            frames = _gather_frames(torch.where(mask.unsqueeze(-1), x, 0.0), order)
            positions = positions[order]  # token k: the position of the k-th real frame
            rank = (mask.cumsum(1) - mask.long()).unsqueeze(-1)  # real frames before t
        tokens = self._frame_tokens(frames[:, :-1], positions)
        states, _ = self.gru(self._with_context(tokens, context))
        if rank is not None:
            states = states.gather(1, rank.expand(-1, -1, self.width))
        return states

    def _frame_tokens(self, frames: Tensor, positions: Tensor) -> Tensor:
        """The start token and the tokens of ``frames`` ``(B, L, D)``, with their positional
        rows ``positions`` (broadcastable to ``(B, L + 1, width)``) added:
        ``(B, L + 1, width)``."""
        return torch.cat([self._start_tokens(len(frames)), self.embed(frames)], dim=1) + positions

    def windows(self, x: Tensor, mask: Tensor | None = None,
                context: Tensor | None = None, *,
                memory: Tensor | None = None) -> RecurrentWindows:
        """An evaluator of the outputs on windows of frames of sequences whose earlier frames
        no longer change (see :class:`RecurrentWindows`).

        Args:
            x: Frames ``(B, N, D)``: the batch and length the evaluator serves (its values are
                not read).
            mask: Optional boolean padding mask ``(B, N)``, fixed for the evaluator's life.
            context: Context ``(B, C)`` of a conditional network, else ``None``.
            memory: Optional :meth:`states` ``(B, N, width)`` of a one-layer network at frames
                equal to ``x``'s before the first call's window (see
                :class:`RecurrentWindows`).
        """
        return RecurrentWindows(self, x, mask, context, memory)

    def extra_repr(self) -> str:
        return (f"features={self.features}, out_features={self.out_features}, "
                f"width={self.width}, depth={self.depth}, positional={self.positional!r}, "
                f"max_len={self.max_len}, context_features={self.context_features}")


class RecurrentWindows:
    r"""The outputs of a :class:`CausalGRU` on a window of frames ``start`` to ``stop - 1``,
    from the states kept from the calls before.

    Output frame :math:`t` is the state after token :math:`t` (token :math:`u + 1` holds frame
    :math:`u`, skipped when it is padded). A call continues from the state kept after token
    ``start - 1`` through the tokens of its window and keeps their states (the first call runs
    through the tokens before its window too, or takes the state after them from ``memory``).
    Under the call rules of
    :class:`~iresflow.nn.causal.WindowEvaluator` (every ``start`` after the first call's between
    the ``start`` and the ``stop`` of the call before, ``x`` unchanged on the frames before
    ``start - 1``) the outputs equal the network's on the whole sequence
    (``net(x)[:, start:stop]``, to rounding), and a sweep of one frame costs one GRU update.
    Runs without gradient tracking.

    Args:
        net: The network.
        x: Frames ``(B, N, D)`` of the batch and length served (values not read).
        mask: Optional boolean padding mask ``(B, N)``.
        context: Context ``(B, C)`` of a conditional network, else ``None``.
        memory: Optional :meth:`CausalGRU.states` ``(B, N, width)`` of a one-layer network, from
            frames (and a mask) equal to those of the first call on the frames before its
            ``start - 1``: that call reads its state after token ``start - 1`` there instead of
            running the GRU through the tokens before its window (a forecast's trace computed
            it already).

    Raises:
        ValueError: ``memory`` of another shape, or for a network of more than one layer.
    """

    def __init__(self, net: CausalGRU, x: Tensor, mask: Tensor | None,
                 context: Tensor | None, memory: Tensor | None = None) -> None:
        batch, length, _ = x.shape
        if memory is not None and (net.depth != 1 or memory.shape != (batch, length, net.width)):
            raise ValueError(f"memory must be the states ({batch}, {length}, {net.width}) of a "
                             f"one-layer network, got {tuple(memory.shape)} for depth "
                             f"{net.depth}")
        self.net, self.mask, self.memory = net, mask, memory
        # states[t]: the GRU's layers after token t, (depth, B, width)
        self.states = x.new_zeros(length, net.depth, batch, net.width)
        self.length = length
        self.stored: tuple[int, int] | None = None  # the window of the call before
        table = net.positional_rows(x)
        # token t (frame t - 1) carries the position of the first real frame from t on: frame t
        # itself without padding
        self.positions = table.expand(batch, -1, -1)  # (B, N, width)
        if mask is not None:
            following = torch.arange(length, device=x.device).expand(batch, -1)
            following = torch.where(mask, following, length - 1).flip(1).cummin(1).values.flip(1)
            self.positions = table[following]
        self.weights = [tuple(getattr(net.gru, f"{name}_l{layer}") for name in
                              ("weight_ih", "weight_hh", "bias_ih", "bias_hh"))
                        for layer in range(net.depth)]
        with torch.no_grad():
            self.context_token = (None if net.context_embed is None
                                  else net.context_embed(context))
            w_ih, _, b_ih, _ = self.weights[0]
            # Without a context or padding, the input map and the positions fold into the first
            # layer's input weights and biases: a frame enters the gates by one (D -> 3 width)
            # product instead of two.
            self.folded = None
            if self.context_token is None and mask is None:
                biases = torch.addmm(b_ih, table, w_ih.T) + w_ih @ net.embed.bias
                self.folded = (w_ih @ net.embed.weight, biases)

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
        first = self.stored is None
        check_window(self.stored, start, stop, self.length)
        self.stored = (start, stop)
        begin = start  # the first call reads the frames before its window
        if first and start and self.memory is not None:  # or their state, kept by the caller
            self.states[start - 1] = self.memory[:, start - 1]
        elif first and start and self.mask is None:  # their tokens in one call of the GRU
            self.states[start - 1] = self._prefix(x, start)
        elif first:
            begin = 0
        state = self.states[begin - 1] if begin else torch.zeros_like(self.states[0])
        outputs = []
        for t in range(begin, stop):  # one GRU update per token (a window is usually one)
            self.states[t] = state = self._update(x, t, state)
            if t >= start:
                outputs.append(state[-1])
        if not outputs:
            return x.new_empty(x.shape[0], 0, self.net.out_features)
        return self.net.head(torch.stack(outputs, dim=1))

    def _prefix(self, x: Tensor, count: int) -> Tensor:
        """The layers' states ``(depth, B, width)`` after the first ``count >= 1`` tokens of
        frames ``x`` ``(B, N, D)`` without padding. Sequences whose frames before ``count - 1``
        (and context) are equal, such as the draws of one forecast, share one pass."""
        width = (count - 1) * x.shape[-1]
        rows = x[:, :count - 1].flatten(1)
        if self.context_token is not None:
            rows = torch.cat([rows, self.context_token], dim=1)
        if rows.shape[1]:
            rows, shared = torch.unique(rows, dim=0, return_inverse=True)
        else:  # the start token alone, the same for every sequence
            rows, shared = rows[:1], torch.zeros(len(x), dtype=torch.long, device=x.device)
        frames = rows[:, :width].reshape(len(rows), count - 1, x.shape[-1])
        tokens = self.net._frame_tokens(frames, self.positions[: len(rows), :count])
        if self.context_token is not None:
            tokens = tokens + rows[:, None, width:]
        return self.net.gru(tokens)[1][:, shared]

    def _update(self, x: Tensor, t: int, state: Tensor) -> Tensor:
        """The layers' states ``(depth, B, width)`` after token ``t`` from those before it."""
        net = self.net
        (w_ih, w_hh, b_ih, b_hh), *upper = self.weights
        if t == 0:  # the start token
            inputs = net.start + self.positions[:, 0]
        else:  # token t holds frame t - 1
            inputs = x[:, t - 1]
            if self.mask is not None:
                inputs = torch.where(self.mask[:, t - 1, None], inputs, 0.0)
            if self.folded is not None:
                w_ih, b_ih = self.folded[0], self.folded[1][t]
            else:
                inputs = net.embed(inputs) + self.positions[:, t]
        if self.context_token is not None:  # (never folded)
            inputs = inputs + self.context_token
        layers = [torch.gru_cell(inputs, state[0], w_ih, w_hh, b_ih, b_hh)]
        for layer, weights in enumerate(upper, start=1):
            layers.append(torch.gru_cell(layers[-1], state[layer], *weights))
        new = torch.stack(layers)
        if t > 0 and self.mask is not None:  # a padded frame's token is skipped
            new = torch.where(self.mask[None, :, t - 1, None], new, state)
        return new


def left_align(x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor]:
    """Move the real frames of every sequence to its front, keeping their order.

    Args:
        x: Sequences ``(B, N, D)``.
        mask: Padding mask ``(B, N)`` (``True`` = real) or ``None`` (all real).

    Returns:
        ``(x', mask')``: ``x'`` ``(B, N, D)`` with the real frames first and zeros after them,
        ``mask'`` ``(B, N)`` with ``mask'[b, t] = t < length_b``.

    Raises:
        TypeError: ``mask`` is not a boolean tensor.
        ValueError: ``x`` is not ``(B, N, D)``, or ``mask`` not ``(B, N)`` or with a sequence
            of padding only.

    Example:
        >>> x = torch.arange(3.0).reshape(1, 3, 1)
        >>> aligned, mask = left_align(x, torch.tensor([[False, True, True]]))
        >>> aligned.flatten().tolist(), mask.tolist()
        ([1.0, 2.0, 0.0], [[True, True, False]])
    """
    if not isinstance(x, Tensor) or x.dim() != 3:
        raise ValueError(f"x must be a tensor of shape (B, N, D), got "
                         f"{tuple(x.shape) if isinstance(x, Tensor) else type(x).__name__}")
    if mask is None:
        return x, torch.ones(x.shape[:2], dtype=torch.bool, device=x.device)
    check_mask(mask, x)
    aligned = _gather_frames(x, real_first(mask))
    lengths = mask.sum(1, keepdim=True)
    new_mask = torch.arange(x.shape[1], device=x.device) < lengths
    return torch.where(new_mask.unsqueeze(-1), aligned, 0.0), new_mask


def real_first(mask: Tensor) -> Tensor:
    """The frame indices of every sequence, its real frames first, each part in order.

    Args:
        mask: Padding mask ``(B, N)`` (``True`` = real).

    Returns:
        ``(B, N)`` int64: row ``b`` lists the real frames of sequence ``b`` in order, then its
        padded ones.

    Raises:
        TypeError: ``mask`` is not a boolean tensor.
        ValueError: ``mask`` is not ``(B, N)``.

    Example:
        >>> real_first(torch.tensor([[False, True, True]])).tolist()
        [[1, 2, 0]]
    """
    if not isinstance(mask, Tensor) or mask.dtype != torch.bool:
        raise TypeError(f"mask must be a boolean tensor, got "
                        f"{mask.dtype if isinstance(mask, Tensor) else type(mask).__name__}")
    if mask.dim() != 2:
        raise ValueError(f"mask must have shape (B, N), got {tuple(mask.shape)}")
    return torch.argsort(mask.logical_not().to(torch.uint8), dim=1, stable=True)


def _gather_frames(x: Tensor, order: Tensor) -> Tensor:
    """Frames ``x`` ``(B, N, D)`` reordered along time by ``order`` ``(B, N)``."""
    return torch.gather(x, 1, order.unsqueeze(-1).expand_as(x))
