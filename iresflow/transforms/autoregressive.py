r"""A frame-autoregressive affine step with a causal Transformer or GRU conditioner, inverted by
fixed-point sweeps that settle its frames in order (docs/math.md#autoregressive-step)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal

import torch
from torch import Tensor

from iresflow._validation import check_float, check_int
from iresflow.nn.causal import CausalTransformer
from iresflow.nn.conditional import check_context
from iresflow.nn.made import MaskedFrameNet
from iresflow.nn.recurrent import CausalGRU
from iresflow.transforms.base import FRAMES, LogDetRequest
from iresflow.transforms.settling import SettlingStep

__all__ = ["AutoregressiveAffine"]


class AutoregressiveAffine(SettlingStep):
    r"""Affine map of every real frame, its shift and log-scale functions of the frames before it.

    From data to noise (docs/math.md#autoregressive-step),

    .. math::
        y_t = \big(x_t - \mu_t(x_{<t}, c)\big) \odot e^{-s_t(x_{<t}, c)}, \qquad
        s_t = S \tanh(a_t / S), \qquad
        \log|\det J| = -\sum_{t \text{ real}} \sum_{d=1}^{D} s_{t,d},

    with :math:`(\mu_t, a_t)` the outputs at frame :math:`t` of a conditioner, a
    :class:`~iresflow.nn.causal.CausalTransformer` or a :class:`~iresflow.nn.recurrent.CausalGRU`,
    which reads only the real frames before :math:`t` (and the context :math:`c`), and
    :math:`|s_{t,d}| \le S` (``max_log_scale``). The Jacobian over the real frames is block
    lower triangular with diagonal blocks :math:`\mathrm{diag}(e^{-s_t})`, hence the exact
    log-determinant; no Lipschitz bound is needed. The network's output layer starts at
    zero, so the step starts as the identity. Padded frames pass through unchanged, add nothing
    to the log-determinant and never influence a real frame (with gaps, a real frame sees the
    real frames before it only). A ``(B, D)`` batch of vectors is a batch of one-frame sequences:
    an affine map whose shift and scale depend on the context only.

    With ``within_frame``, feature :math:`d` of frame :math:`t` is also conditioned on the
    frame's features before it: the conditioner's output at frame :math:`t` is a summary
    :math:`h_t` of the past (width ``width``) and a masked MLP
    (:class:`~iresflow.nn.made.MaskedFrameNet`) computes :math:`(\mu_{t,d}, a_{t,d})` from
    :math:`h_t` and :math:`x_{t,<d}`: a masked autoregressive flow over the features of every
    frame given the past. The diagonal blocks are then triangular with diagonal
    :math:`e^{-s_t}`, so the log-determinant is the same sum.

    The inverse solves the fixed point of the Jacobi map
    :math:`T_y(x)_t = \mu_t(x_{<t}) + y_t \odot e^{s_t(x_{<t})}` from :math:`x^0 = y` with
    :func:`~iresflow.inverse.causal.causal_fixed_point_inverse` (its tolerance, its residual
    :math:`\|x - T_y(x)\|_\infty` per frame and its errors): the frames settle from the first
    on, every sweep evaluates the conditioner on a window of the unsettled frames only: the
    Transformer attends to the keys and values it kept for the settled ones
    (:class:`~iresflow.nn.causal.WindowEvaluator`), the GRU continues from the state it kept
    (:class:`~iresflow.nn.recurrent.RecurrentWindows`); and :math:`N` sweeps always suffice, for any
    network. With ``within_frame``, :math:`T_y(x)_t` is frame :math:`t` solved from
    :math:`x_{<t}` by :math:`D` passes of the masked MLP, each fixing one more feature. With the
    default window of one frame, each sweep solves one frame exactly from the frames before it;
    a wider window (``inverse_window``) moves more frames per sweep at once, Jacobi style. The
    diagnostics of the last inverse are kept in :attr:`last_inverse_stats` (``iterations`` are
    the sweeps per sample). ``inverse`` runs without gradient tracking.

    Args:
        features: Frame size ``D``.
        width: Token width of the conditioner (and the GRU's state width).
        depth: Number of Transformer or GRU layers.
        heads: Attention heads of a Transformer (must divide ``width``; unused by a GRU).
        max_len: Longest sequence; required with ``positional="learned"``, where longer
            sequences are rejected.
        positional: ``"sinusoidal"`` or ``"learned"`` positions.
        conditioner: ``"transformer"`` (attention over all earlier frames) or ``"gru"`` (a
            recurrent state; its inverse costs one GRU update per frame).
        context_features: Context size ``C`` (0: unconditional).
        max_log_scale: Bound :math:`S > 0` on every log-scale.
        inverse_tol: Max-abs residual tolerance of the inverse; ``None`` uses the dtype default
            of :func:`~iresflow.inverse.fixed_point.default_tolerance`.
        inverse_max_iter: Cap on the sweeps of the inverse; ``None``: ``N`` for sequences of
            length ``N``.
        inverse_window: Frames evaluated per sweep of the inverse: 1 (the default) solves the
            frames one after another, each with one pass of the Transformer over one token per
            sequence (the fewest evaluations, and the fastest on a CPU); ``None``, all frames
            at once (Jacobi sweeps, fewer when later frames converge early, each over all
            tokens).
        on_failure: ``"raise"`` or ``"warn"`` when the inverse does not reach its tolerance.
        within_frame: Condition every feature on the frame's features before it too (a
            masked MLP of hidden width ``width`` after the conditioner).
        reverse_features: With ``within_frame``, order the features ``D, ..., 1``.

    Example:
        >>> step = AutoregressiveAffine(3, width=8, depth=1, heads=2).double()
        >>> with torch.no_grad():
        ...     _ = step.conditioner.head.weight.normal_()  # away from the identity
        >>> x = torch.randn(2, 6, 3, dtype=torch.float64)
        >>> y, logabsdet = step(x)
        >>> x_back, inverse_logabsdet = step.inverse(y)
        >>> torch.allclose(x_back, x), torch.allclose(inverse_logabsdet, -logabsdet)
        (True, True)
        >>> bool(step.last_inverse_stats.iterations.max() <= 7)
        True
    """

    def __init__(
        self,
        features: int,
        *,
        width: int = 64,
        depth: int = 2,
        heads: int = 4,
        max_len: int | None = None,
        positional: Literal["sinusoidal", "learned"] = "sinusoidal",
        conditioner: Literal["transformer", "gru"] = "transformer",
        context_features: int = 0,
        max_log_scale: float = 3.0,
        inverse_tol: float | None = None,
        inverse_max_iter: int | None = None,
        inverse_window: int | None = 1,
        on_failure: Literal["raise", "warn"] = "raise",
        within_frame: bool = False,
        reverse_features: bool = False,
    ) -> None:
        super().__init__(inverse_tol=inverse_tol, inverse_max_iter=inverse_max_iter,
                         inverse_window=inverse_window, on_failure=on_failure)
        self.features = check_int(features, "features", 1)
        self.context_features = check_int(context_features, "context_features", 0)
        self.max_log_scale = check_float(max_log_scale, "max_log_scale", 0.0)
        if reverse_features and not within_frame:
            raise ValueError("reverse_features needs within_frame=True")
        # the past's summary h_t for the masked MLP, else the shift and raw log-scale
        outputs = width if within_frame else 2 * features
        self.conditioner: CausalTransformer | CausalGRU
        if conditioner == "transformer":
            self.conditioner = CausalTransformer(
                features, outputs, width=width, depth=depth, heads=heads,
                positional=positional, max_len=max_len, context_features=context_features,
            )
        elif conditioner == "gru":
            self.conditioner = CausalGRU(
                features, outputs, width=width, depth=depth, positional=positional,
                max_len=max_len, context_features=context_features,
            )
        else:
            raise ValueError(f"conditioner must be 'transformer' or 'gru', got {conditioner!r}")
        self.frame_net = None
        if within_frame:  # h_t starts as a random summary: the masked MLP's output starts at 0
            self.conditioner.head.reset_parameters()
            self.frame_net = MaskedFrameNet(features, width, hidden=width,
                                            reverse=reverse_features)

    def _check_options(self, inputs: Tensor, context: Tensor | None, logdet: object) -> None:
        length = 1 if inputs.dim() == 2 else inputs.shape[1]
        max_len = self.conditioner.max_len
        if self.conditioner.positional == "learned" and length > max_len:
            raise ValueError(
                f"sequence length {length} exceeds max_len={max_len} of the learned positions"
            )
        if not self.context_features:
            if context is not None:
                raise ValueError("AutoregressiveAffine is unconditional: context must be None")
            return
        if context is None:
            raise ValueError(
                f"a conditional AutoregressiveAffine needs context of shape "
                f"(B, {self.context_features})"
            )
        check_context(context, inputs.shape[0], self.context_features, inputs)

    def shift_and_log_scale(
        self, x: Tensor, context: Tensor | None = None, mask: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        r"""The conditioner's :math:`\mu_t` and :math:`s_t` of every frame (zero at padded ones).

        Args:
            x: Validated frames ``(B, N, D)``.
            context: Context ``(B, C)`` of a conditional step, else ``None``.
            mask: Optional boolean padding mask ``(B, N)``.

        Returns:
            ``(shift, log_scale)``, each ``(B, N, D)``; row ``t`` depends on the real frames
            before ``t`` only, and ``|log_scale| <= max_log_scale``.
        """
        return self._shift_and_log_scale(x, self.conditioner(x, mask, context), mask)

    def _shift_and_log_scale(self, x: Tensor, outputs: Tensor,
                             mask: Tensor | None) -> tuple[Tensor, Tensor]:
        """:meth:`shift_and_log_scale` from the conditioner's outputs ``(B, N, O)``."""
        if self.frame_net is not None:
            outputs = self.frame_net(x, outputs)
        shift, log_scale = self._split(outputs)
        if mask is not None:
            real = mask.unsqueeze(-1)
            shift, log_scale = torch.where(real, shift, 0.0), torch.where(real, log_scale, 0.0)
        return shift, log_scale

    def _split(self, outputs: Tensor) -> tuple[Tensor, Tensor]:
        """The conditioner's outputs ``(B, n, 2 D)`` as the shift and the bounded log-scale
        ``s = S tanh(a / S)``, each ``(B, n, D)``."""
        shift, raw = outputs.chunk(2, dim=-1)
        return shift, self.max_log_scale * torch.tanh(raw / self.max_log_scale)

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        vector = inputs.dim() == 2
        x = inputs.unsqueeze(1) if vector else inputs
        shift, log_scale = self.shift_and_log_scale(x, context, mask)
        y = (x - shift) * torch.exp(-log_scale)  # = x exactly at padded frames (0 and 0)
        logabsdet = None
        if logdet is not False:  # log_scale is 0 at padded frames
            logabsdet = -log_scale.sum(-1) if logdet == FRAMES else -log_scale.sum((1, 2))
        return (y.squeeze(1) if vector else y), logabsdet

    def forward_with_memory(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """The forward without log-determinant and, for a one-layer GRU conditioner, its
        :meth:`~iresflow.nn.recurrent.CausalGRU.states` ``(B, N, width)``: a pinned inverse of
        the same known frames starts from them instead of reading those frames again
        (:class:`~iresflow.nn.recurrent.RecurrentWindows`). Other conditioners keep nothing."""
        net = self.conditioner
        if not isinstance(net, CausalGRU) or net.depth != 1 or inputs.dim() != 3:
            return super().forward_with_memory(inputs, context, mask)
        states = net.states(inputs, mask, context)
        shift, log_scale = self._shift_and_log_scale(inputs, net.head(states), mask)
        return (inputs - shift) * torch.exp(-log_scale), states

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        vector = inputs.dim() == 2
        y = inputs.unsqueeze(1) if vector else inputs
        x = self._solve(y, context, mask)
        logabsdet = None
        if logdet is not False:
            with torch.no_grad():
                logabsdet = self.shift_and_log_scale(x, context, mask)[1].sum((1, 2))
        return (x.squeeze(1) if vector else x), logabsdet

    def _image(self, target: Tensor, context: Tensor | None, mask: Tensor | None,
               memory: Tensor | None = None) -> Callable[[Tensor, int, int], Tensor]:
        net = self.conditioner
        windows = (net.windows(target, mask, context, memory=memory)
                   if isinstance(net, CausalGRU) else net.windows(target, mask, context))

        # one pass from the conditioner's outputs; with a frame net, D passes, pass k fixing
        # the k-th feature of the order from those before it
        passes = 1 if self.frame_net is None else self.features

        def image(x: Tensor, start: int, stop: int) -> Tensor:  # T_y(x) on the window
            outputs, y = windows(x, start, stop), target[:, start:stop]
            net = (lambda _: outputs) if self.frame_net is None else self.frame_net.given(outputs)
            value = y
            for _ in range(passes):
                shift, log_scale = self._split(net(value))
                value = shift + y * torch.exp(log_scale)
            return value if mask is None else torch.where(mask[:, start:stop, None], value, 0.0)

        return image

    def extra_repr(self) -> str:
        return (f"features={self.features}, context_features={self.context_features}, "
                f"within_frame={self.frame_net is not None}, "
                f"max_log_scale={self.max_log_scale}, {super().extra_repr()}")
