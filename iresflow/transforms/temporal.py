r"""A linear flow over time: whitening by an autoregressive model of the frames.

The map is linear in the frames and block lower triangular in time, so its log-determinant is
closed-form and exact (docs/math.md#temporal-linear); it honours the padding contract of
:class:`~iresflow.transforms.base.SequenceTransform`.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from iresflow._validation import check_float, check_int
from iresflow.nn.conditional import ContextShift, check_context
from iresflow.transforms.actnorm import DataInitializedTransform, tokenwise_result
from iresflow.transforms.ar_fit import conditional_gaussian_fit, relative_floor, whitening_of
from iresflow.transforms.base import LogDetRequest

__all__ = ["AutoregressiveLinear", "history_lengths"]


class AutoregressiveLinear(DataInitializedTransform):
    r"""Whitening by a Gaussian AR(p) model over frames, with lower-order models for short pasts.

    For a real frame :math:`t` let :math:`h(t) \in \{0, \dots, p\}` be the number of consecutive
    real frames immediately before it (:math:`t-1, t-2, \dots`, stopping at the start of the
    sequence or at the first padded/missing frame), capped at :math:`p`. The layer holds
    :math:`p + 1` sub-models :math:`j = 0, \dots, p` and maps every real frame
    :math:`x_t \in \mathbb R^D` with sub-model :math:`h = h(t)` (docs/math.md#temporal-linear):

    .. math::
        z_t = L_h\Big(x_t - b_h - \sum_{k=1}^{h} A_{h,k}\, x_{t-k}\Big), \qquad
        \log|\det J| = \sum_{t \text{ real}} \sum_{d=1}^{D} \log (L_{h(t)})_{dd},

    with :math:`L_j` lower triangular with positive diagonal (``log_diag[j]`` and the strictly
    lower part of ``lower[j]``), bias :math:`b_j` (``bias[j]``) and lag matrices :math:`A_{j,k}`
    (``lag_weights[j, k - 1]``, ``D x D``; entries with :math:`k > j` are unused). Only real
    frames enter a history, so frames before a gap never influence frames after it. The Jacobian
    over the real frames is block lower triangular in time with diagonal blocks
    :math:`L_{h(t)}`, hence the log-determinant. Since :math:`h(t)`
    depends on the mask only, the inverse is a forward substitution over time. Padded frames are
    returned unchanged, add nothing to the log-determinant and never influence a real output.
    A ``(B, D)`` batch of vectors is treated as sequences of length 1 (sub-model 0 only).

    Followed by a standard normal base, the layer *is* the Gaussian autoregression
    :math:`x_t \mid x_{<t} \sim \mathcal N(b_h + \sum_{k \le h} A_{h,k} x_{t-k}, \Sigma_h)`,
    :math:`\Sigma_h = (L_h^\top L_h)^{-1}`, :math:`h = h(t)`: the AR(p) Gaussian whose frames with
    fewer than :math:`p` real predecessors use their own lower-order conditional.

    Initialisation (:class:`~iresflow.transforms.actnorm.DataInitializedTransform`):
    :meth:`initialize` fits every sub-model :math:`j` by
    conditional maximum likelihood: :math:`(A_{j,1..j}, b_j)` by least squares of :math:`x_t` on
    :math:`[x_{t-1}, \dots, x_{t-j}, 1]` (minimum-norm solution if the regressors are
    collinear), :math:`\Sigma_j` the mean outer product of the residuals, and
    :math:`L_j = C_j^{-1}` with :math:`C_j` the Cholesky factor of :math:`\Sigma_j`. The frames
    of the fit are, with :math:`m_j = (j + 1) D + 1`:

    * the real frames with :math:`h(t) = j` exactly (for :math:`j = p`: every real frame with at
      least :math:`p` real predecessors), if there are at least :math:`m_j` of them; this is the
      exact maximiser of the likelihood of those frames, which sub-model :math:`j` maps;
    * otherwise the real frames with :math:`h(t) \ge j`, using their first :math:`j` lags (a
      pooled AR(j) fit), if there are at least :math:`m_j` of them;
    * otherwise none: sub-model :math:`j` starts as the identity (:math:`A_{j,\cdot} = 0`,
      :math:`b_j = 0`, :math:`L_j = I`) and a ``UserWarning`` says so (the training loop
      initialises its model from a large batch, see
      :meth:`~iresflow.models.flow.SequenceFlow.initialize`).

    A sub-model fitted on its exact frames (the first case, :math:`j < p`) is compared with the
    pooled AR(j) fit :math:`R_j` of the second case (docs/math.md#ar-variance-floor): every
    eigenvalue :math:`\lambda` of :math:`R_j^{-1/2} \Sigma_j R_j^{-\top/2}` is raised to
    :math:`\rho =` :data:`~iresflow.transforms.ar_fit.RELATIVE_RESIDUAL_VARIANCE_FLOOR`, so in no
    direction is its variance below :math:`\rho` times the pooled one. A sub-model whose frames are
    predicted exactly (a repeated frame in every training sequence) would otherwise get a near-zero
    variance and a huge whitening scale, and a test sequence without the repetition an enormous NLL.
    Where no :math:`\lambda` is below :math:`\rho`, :math:`\Sigma_j` is kept as fitted. Last,
    every eigenvalue of :math:`\Sigma_j` (and of :math:`R_j`) below
    :data:`~iresflow.transforms.ar_fit.MIN_INIT_RESIDUAL_VARIANCE` is raised to it.

    Conditional version (``context_features = C > 0``): every sequence's context
    :math:`c \in \mathbb R^C` shifts the parameters of all sub-models,
    :math:`A_{j,k}(c) = A_{j,k} + \Delta A_k(c)`, :math:`b_j(c) = b_j + \Delta b(c)`, the
    strictly lower part of :math:`L_j(c)` by :math:`\Delta L(c)` and its log-diagonal by
    :math:`S \tanh(\Delta s(c) / S)` (``max_log_scale``), all from one small MLP of the context
    whose last layer starts at zero (docs/math.md#temporal-linear). The map stays unit-block
    lower triangular in time for every context, so the log-determinant above holds with
    :math:`L_{h(t)}(c)` and the inverse is the same forward substitution; with per-class contexts
    (a label embedding) the layer contains a separate AR(p) Gaussian per class. The
    initialisation fits the context-free parameters as above (the context net starts at zero).

    Args:
        features: Feature size ``D``.
        order: Autoregressive order ``p >= 1``.
        context_features: Context size ``C`` (0: unconditional).
        context_hidden: Hidden width of the context network.
        max_log_scale: Bound :math:`S > 0` on the context's change of every log-diagonal entry.

    Example:
        >>> layer = AutoregressiveLinear(2, order=1)
        >>> x = torch.cumsum(torch.randn(8, 10, 2), dim=1)  # random walks: strongly AR(1)
        >>> layer.initialize(x)  # fits the sub-models
        >>> z, logabsdet = layer(x)
        >>> bool(layer.initialized), z.shape, logabsdet.shape
        (True, torch.Size([8, 10, 2]), torch.Size([8]))
        >>> torch.allclose(layer.inverse(z)[0], x, atol=1e-4)
        True
    """

    causal = True  # output frame t reads input frames <= t

    def __init__(
        self,
        features: int,
        order: int = 1,
        *,
        context_features: int = 0,
        context_hidden: int = 32,
        max_log_scale: float = 3.0,
    ) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        self.order = check_int(order, "order", 1)
        self.context_features = check_int(context_features, "context_features", 0)
        self.max_log_scale = check_float(max_log_scale, "max_log_scale", 0.0)
        p, d = self.order, self.features
        self.lag_weights = nn.Parameter(torch.zeros(p + 1, p, d, d))
        self.bias = nn.Parameter(torch.zeros(p + 1, d))
        self.log_diag = nn.Parameter(torch.zeros(p + 1, d))
        self.lower = nn.Parameter(torch.zeros(p + 1, d, d))
        # Deltas of the lags (p D^2), the bias (D), the log-diagonal (D) and the lower part (D^2).
        self.context_net = (
            ContextShift(context_features, (p + 1) * d * d + 2 * d, context_hidden)
            if context_features else None
        )

    def whitening_matrix(self) -> Tensor:
        r"""The lower-triangular :math:`L_j` (positive diagonal) at ``[j]``.

        Returns:
            ``(p + 1, D, D)``: the context-free ones of a conditional layer.
        """
        return self._sub_models(None)[2].squeeze(0)

    def _used_lags(self) -> Tensor:
        """``(p + 1, p, 1, 1)``: 1 where sub-model ``j`` uses lag ``k`` (``k <= j``), else 0."""
        used = torch.ones(self.order + 1, self.order, dtype=torch.bool, device=self.bias.device)
        return used.tril(-1)[..., None, None]

    def _check_options(self, inputs: Tensor, context: Tensor | None, logdet: object) -> None:
        if self.context_net is None:
            return
        if context is None:
            raise ValueError(
                f"a conditional AutoregressiveLinear needs context of shape "
                f"(B, {self.context_features})"
            )
        check_context(context, inputs.shape[0], self.context_features, inputs)

    def _sub_models(self, context: Tensor | None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        r"""Every sequence's sub-models: lags, biases, whitening matrices, log-diagonals.

        Args:
            context: ``(B, C)`` for a conditional layer; ``None`` gives the context-free
                sub-models.

        Returns:
            ``lags (b, p + 1, p, D, D)`` with ``[., j, p - k]`` holding :math:`A_{j,k}`,
            ``bias (b, p + 1, D)``, ``whitening (b, p + 1, D, D)``, ``log_diag (b, p + 1, D)``;
            ``b = B`` for a conditional layer, else 1.
        """
        lags, bias = self.lag_weights.unsqueeze(0), self.bias.unsqueeze(0)
        log_diag, lower = self.log_diag.unsqueeze(0), self.lower.unsqueeze(0)
        if self.context_net is not None and context is not None:
            p, d = self.order, self.features
            delta_lags, delta_bias, delta_scale, delta_lower = self.context_net(context).split(
                [p * d * d, d, d, d * d], dim=-1)
            lags = lags + delta_lags.view(-1, 1, p, d, d)
            bias = bias + delta_bias.unsqueeze(1)
            scale = self.max_log_scale * torch.tanh(delta_scale / self.max_log_scale)
            log_diag = log_diag + scale.unsqueeze(1)
            lower = lower + delta_lower.view(-1, 1, d, d)
        lags = (lags * self._used_lags()).flip(2)  # [., j, p - k] matches the windows
        whitening = torch.tril(lower, -1) + torch.diag_embed(torch.exp(log_diag))
        return lags, bias, whitening, log_diag

    @staticmethod
    def _predictions(windows: Tensor, lags: Tensor, bias: Tensor) -> Tensor:
        r"""Every sub-model's prediction :math:`b_j + \sum_{k \le j} A_{j,k} x_{t-k}`.

        Args:
            windows: Histories ``(B, N, D, p)`` whose entry ``[..., :, p - k]`` is lag ``k``.
            lags: ``(b, p + 1, p, D, D)`` from :meth:`_sub_models`, ``b`` in ``{1, B}``.
            bias: ``(b, p + 1, D)``.

        Returns:
            ``(B, N, p + 1, D)``.
        """
        lags = lags.expand(windows.shape[0], *lags.shape[1:])
        return bias.unsqueeze(1) + torch.einsum("bnik,bjkoi->bnjo", windows, lags)

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Map data to noise, :math:`z_t = L_h(x_t - b_h - \sum_k A_{h,k} x_{t-k})`."""
        x = inputs.unsqueeze(1) if inputs.dim() == 2 else inputs
        lags, bias, whitening, log_diag = self._sub_models(context)
        windows = _history_windows(x, mask, self.order)
        residuals = x.unsqueeze(-2) - self._predictions(windows, lags, bias)
        # Whiten with every sub-model (p + 1 small products per frame), then pick h(t).
        whitening = whitening.expand(x.shape[0], *whitening.shape[1:])
        whitened = torch.einsum("bnjd,bjod->bnjo", residuals, whitening)
        lengths = history_lengths(x, mask, self.order)
        outputs = _select(whitened, lengths).reshape(inputs.shape)
        per_frame = torch.gather(log_diag.sum(-1).expand(x.shape[0], -1), 1, lengths)
        return tokenwise_result(inputs, outputs, mask, per_frame, logdet)

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Map noise to data by forward substitution over time (:meth:`_recover`):
        :math:`x_t = L_h^{-1} z_t + b_h + \sum_{k \le h} A_{h,k} x_{t-k}`, :math:`h = h(t)`, for
        :math:`t = 0, 1, \dots`."""
        z = inputs.unsqueeze(1) if inputs.dim() == 2 else inputs
        batch, length, d = z.shape
        lengths = history_lengths(z, mask, self.order)
        models = self._sub_models(context)
        history = z.new_zeros(batch, 1, d, self.order)  # [..., p - k] holds x~_{t-k}
        outputs = self._recover(z, lengths, models, mask, 0, history).reshape(inputs.shape)
        per_frame = torch.gather(models[3].sum(-1).expand(batch, -1), 1, lengths)
        return tokenwise_result(inputs, outputs, mask, -per_frame, logdet)

    def inverse_pinned(
        self, inputs: Tensor, state: Tensor, known: Tensor, context: Tensor | None,
        mask: Tensor | None,
    ) -> Tensor:
        """The inverse on new frames with the known frames held at ``state``
        (docs/forecasting.md#pinned-inverse): the forward substitution starts at the first frame
        that is new in some sequence, its history the states of the frames before it, and a
        frame still known after it keeps its state; the frames before it are not visited."""
        if inputs.dim() != 3:
            return super().inverse_pinned(inputs, state, known, context, mask)
        length, p = inputs.shape[1], self.order
        real = known if mask is None else mask
        positions = torch.arange(length, device=inputs.device)
        first = int(torch.where(real & ~known, positions, length).amin())
        outputs = torch.where(known.unsqueeze(-1), state, inputs)
        if first == length:
            return outputs
        past = state if mask is None else torch.where(mask.unsqueeze(-1), state, 0.0)
        past = F.pad(past[:, max(first - p, 0):first], (0, 0, max(p - first, 0), 0))
        history = past.transpose(1, 2).unsqueeze(1)  # (B, 1, D, p), [..., p - k] is x_{t-k}
        lengths = history_lengths(inputs, mask, p)
        recovered = self._recover(inputs, lengths, self._sub_models(context), mask, first,
                                  history, (known, state))
        if mask is not None:
            recovered = torch.where(mask[:, first:, None], recovered, inputs[:, first:])
        return torch.cat([outputs[:, :first], recovered], dim=1)

    def _recover(self, z: Tensor, lengths: Tensor, models: tuple[Tensor, ...],
                 mask: Tensor | None, first: int, history: Tensor,
                 pinned: tuple[Tensor, Tensor] | None = None) -> Tensor:
        r"""Frames ``first, first + 1, ...`` of :math:`x` from their noise ``z`` ``(B, N, D)`` by
        forward substitution: the triangular solves of all of them in one batched call, then one
        step per frame (batched over the sequences) adds the prediction from the frames already
        recovered, starting from ``history`` ``(B, 1, D, p)`` (without padding, pinned frames or
        a graph, from frame :math:`p` on by :meth:`_recover_steady`); with ``pinned = (known,
        state)`` a known frame takes its state instead. Returns ``(B, N - first, D)``."""
        lags, bias, whitening, _ = models
        w = _select(_unwhiten(whitening, z[:, first:]), lengths[:, first:])
        # Without padding, pinned frames from `first` on or a graph to record, every frame from p
        # on is predicted by the full model from its p predecessors: _recover_steady, one
        # product per frame (a forecast's known frames all come before its first new one).
        general = (not (mask is None or bool(mask.all())) or torch.is_grad_enabled()
                   or (pinned is not None and bool(pinned[0][:, first:].any())))
        steady = z.shape[1] if general else max(first, self.order)
        frames = []
        for t in range(first, min(steady, z.shape[1])):
            prediction = self._predictions(history, lags, bias).squeeze(1)
            frame = w[:, t - first] + _select(prediction, lengths[:, t])
            if pinned is not None:
                frame = torch.where(pinned[0][:, t, None], pinned[1][:, t], frame)
            frames.append(frame)
            if mask is not None:  # padded frames never enter a history
                frame = torch.where(mask[:, t, None], frame, 0.0)
            history = torch.cat([history[..., 1:], frame[:, None, :, None]], dim=-1)
        recovered = [torch.stack(frames, dim=1)] if frames else []
        if steady < z.shape[1]:
            recovered.append(self._recover_steady(w[:, steady - first:], lags, bias, history))
        return torch.cat(recovered, dim=1)

    def _recover_steady(self, w: Tensor, lags: Tensor, bias: Tensor, history: Tensor) -> Tensor:
        r"""Frames whose :math:`p` predecessors are all real, by the full model alone:
        :math:`x_t = w_t + b_p + \sum_k A_{p,k} x_{t-k}`, one batched product per frame written
        into a buffer of the recovered frames (in place: no graph).

        Args:
            w: The whitened noise :math:`L_p^{-1} z_t` of the frames, ``(B, n, D)``.
            lags: ``(b, p + 1, p, D, D)`` and ``bias`` ``(b, p + 1, D)`` from
                :meth:`_sub_models`, ``b`` in ``{1, B}``.
            history: The :math:`p` frames before the first, ``(B, 1, D, p)``, ``[..., p - k]``
                holding :math:`x_{t-k}`.

        Returns:
            ``(B, n, D)``.
        """
        p, (batch, n, d) = self.order, w.shape
        # row k D + i of the full model's matrix multiplies feature i of frame t - p + k
        full = lags[:, p].permute(0, 1, 3, 2).reshape(-1, p * d, d).expand(batch, -1, -1)
        base = w + bias[:, p].unsqueeze(1)
        x = torch.cat([history[:, 0].transpose(1, 2), torch.empty_like(base)], dim=1)
        for s in range(n):
            window = x[:, s:s + p].reshape(batch, 1, p * d)
            x[:, p + s] = torch.baddbmm(base[:, s, None], window, full)[:, 0]
        return x[:, p:]

    def _initialize(self, inputs: Tensor, mask: Tensor | None) -> None:
        p, d = self.order, self.features
        x = inputs.unsqueeze(1) if inputs.dim() == 2 else inputs
        work = torch.promote_types(x.dtype, torch.float32)
        real = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask
        lengths = history_lengths(x, mask, p)
        # lags[..., (k - 1) D : k D] is x_{t-k} (zero where it is not history: never used below).
        lags = _history_windows(x, mask, p).flip(-1).transpose(-1, -2).reshape(*x.shape[:2], p * d)
        # Real frames with h(t) = j and with h(t) >= j, read on the host once.
        sub_models = torch.arange(p + 1, device=x.device)
        exact = (real.unsqueeze(-1) & (lengths.unsqueeze(-1) == sub_models)).sum(dim=(0, 1))
        counts = torch.stack([exact, exact.flip(0).cumsum(0).flip(0)]).tolist()

        def fit(rows: Tensor, j: int) -> tuple[Tensor, Tensor]:
            targets = x[rows].to(work)
            regressors = torch.cat([lags[rows][:, : j * d], targets.new_ones(len(targets), 1)], 1)
            return conditional_gaussian_fit(targets, regressors.to(work))

        identity = []
        for j in range(p + 1):
            needed = (j + 1) * d + 1
            if counts[1][j] < needed:
                identity.append(f"{j} ({counts[1][j]} of {needed})")
                for parameter in (self.lag_weights, self.bias, self.log_diag, self.lower):
                    parameter[j].zero_()
                continue
            pooled = real & (lengths >= j)
            own = counts[0][j] >= needed and counts[0][j] < counts[1][j]
            coefficients, covariance = fit(real & (lengths == j) if own else pooled, j)
            if own:  # the exact frames: floored against the pooled fit of the same order
                covariance = relative_floor(covariance, fit(pooled, j)[1])
            whitening = whitening_of(covariance)
            # coefficients[(k - 1) D + i, o] multiplies feature i of x_{t-k}: A_{j,k}[o, i].
            self.lag_weights[j].zero_()
            self.lag_weights[j, :j].copy_(coefficients[: j * d].reshape(j, d, d).transpose(1, 2))
            self.bias[j].copy_(coefficients[j * d])
            self.lower[j].copy_(torch.tril(whitening, -1))
            self.log_diag[j].copy_(torch.log(torch.diagonal(whitening)))
        if identity:
            warnings.warn(
                f"AutoregressiveLinear(features={d}, order={p}): sub-model j needs at least "
                f"(j + 1) * features + 1 real frames with at least j real predecessors to fit "
                f"its initialisation; sub-models {', '.join(identity)} start as the identity "
                f"(call initialize() with a larger batch to fit them)",
                stacklevel=2,
            )

    def extra_repr(self) -> str:
        conditional = f", context_features={self.context_features}" if self.context_net else ""
        return f"features={self.features}, order={self.order}{conditional}"


def history_lengths(x: Tensor, mask: Tensor | None, order: int) -> Tensor:
    r"""The capped history length :math:`h(t)` of every frame.

    Args:
        x: Sequences ``(B, N, D)``.
        mask: Optional boolean padding mask ``(B, N)``.
        order: The cap ``p``.

    Returns:
        ``(B, N)`` integers: the number of consecutive real frames immediately before frame
        ``t`` (stopping at the start or at a padded frame), at most ``order``.
    """
    batch, length = x.shape[:2]
    if mask is None:
        positions = torch.arange(length, device=x.device).clamp(max=order)
        return positions.expand(batch, length)
    before = F.pad(mask, (order, 0), value=False).unfold(1, order, 1)[:, :length]
    # before.flip(-1)[..., k - 1] is frame t - k; a run of real frames ends at the first gap.
    return before.flip(-1).long().cumprod(dim=-1).sum(dim=-1)


def _select(values: Tensor, index: Tensor) -> Tensor:
    """Pick one sub-model per entry: ``values (..., p + 1, D)``, ``index (...)`` -> ``(..., D)``."""
    index = index[..., None, None].expand(*index.shape, 1, values.shape[-1])
    return torch.gather(values, -2, index).squeeze(-2)


def _unwhiten(whitening: Tensor, z: Tensor) -> Tensor:
    r""":math:`L_j^{-1} z_t` for every sub-model :math:`j` and frame: ``whitening`` ``(b, p + 1,
    D, D)`` (lower-triangular), ``z`` ``(B, n, D)`` -> ``(B, n, p + 1, D)``. Every frame is a
    right-hand side of one triangular solve per sub-model (``b = 1``; per sequence and sub-model
    for a conditional layer), not a solve of its own."""
    batch, n, d = z.shape
    if whitening.shape[0] == 1:
        columns = z.reshape(-1, d).T.expand(whitening.shape[1], d, batch * n)
        w = torch.linalg.solve_triangular(whitening[0], columns, upper=False)
        return w.view(-1, d, batch, n).permute(2, 3, 0, 1)
    w = torch.linalg.solve_triangular(whitening, z.transpose(1, 2).unsqueeze(1), upper=False)
    return w.permute(0, 3, 1, 2)


def _history_windows(x: Tensor, mask: Tensor | None, order: int) -> Tensor:
    r"""The ``order`` frames before every frame, zero before the start and at padded frames.

    Args:
        x: Sequences ``(B, N, D)``.
        mask: Optional boolean padding mask ``(B, N)``.
        order: Window length ``p``.

    Returns:
        A view-based tensor ``(B, N, D, p)`` whose entry ``[b, t, :, j]`` is
        :math:`\tilde x_{t - p + j}` (so ``j = p - k`` holds lag ``k``).
    """
    history = x if mask is None else torch.where(mask.unsqueeze(-1), x, 0.0)
    padded = F.pad(history, (0, 0, order, 0))  # (B, N + p, D)
    return padded.unfold(1, order, 1)[:, : x.shape[1]]
