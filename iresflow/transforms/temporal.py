r"""Linear flows over frames: an autoregressive whitening map and an LU feature mixing.

Both are linear in the frames, so their log-determinants are closed-form and exact
(docs/math.md#temporal-linear, docs/math.md#feature-mixing), and both honour the padding
contract of :class:`~iresflow.transforms.base.SequenceTransform`.
"""

from __future__ import annotations

import warnings

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from iresflow._validation import check_generator, check_int
from iresflow.transforms.actnorm import DataInitializedTransform, tokenwise_result
from iresflow.transforms.base import LogDetRequest, SequenceTransform

__all__ = ["AutoregressiveLinear", "FeatureMixing"]

#: Eigenvalue floor of the residual covariance in the initialisation of
#: :class:`AutoregressiveLinear` (docs/math.md#temporal-linear).
MIN_INIT_RESIDUAL_VARIANCE = 1e-6


class AutoregressiveLinear(DataInitializedTransform):
    r"""Whitening by an AR(p) model over frames: the flow form of a Gaussian autoregression.

    For every real frame :math:`x_t \in \mathbb R^D` (docs/math.md#temporal-linear),

    .. math::
        z_t = L\Big(x_t - b - \sum_{k=1}^{p} A_k \tilde x_{t-k}\Big), \qquad
        \log|\det J| = n \sum_{d=1}^{D} \log L_{dd},

    with :math:`L` lower triangular with positive diagonal (parameters ``log_diag`` and the
    strictly lower part of ``lower``), lag matrices :math:`A_k` (``lag_weights[k - 1]``,
    ``D x D``), bias :math:`b` and :math:`n` the number of real frames of the sequence. The
    *history* :math:`\tilde x_s` is :math:`x_s` if frame :math:`s` exists and is real, and
    :math:`0` if :math:`s < 0` (before the start) or frame :math:`s` is padding (``mask`` ``False``,
    also in the middle of a sequence). The Jacobian is block lower triangular in time with the
    block :math:`L` on the diagonal at every real frame, hence the log-determinant. Padded frames
    are returned unchanged, add nothing to the log-determinant and never influence a real output.
    A ``(B, D)`` batch of vectors is treated as sequences of length 1 (no history).

    Followed by a standard normal base, the layer *is* the Gaussian AR(p) model
    :math:`x_t \mid \tilde x_{<t} \sim \mathcal N(b + \sum_k A_k \tilde x_{t-k}, \Sigma)` with
    :math:`\Sigma = (L^\top L)^{-1}`.

    Initialisation (:class:`~iresflow.transforms.actnorm.DataInitializedTransform`): the first
    forward in training mode, or :meth:`initialize`, fits that model by conditional maximum
    likelihood on the real frames :math:`t \ge p` whose :math:`p` predecessors are all real
    ("full-history frames"): :math:`(A, b)` by least squares of :math:`x_t` on
    :math:`[x_{t-1}, \dots, x_{t-p}, 1]` (minimum-norm solution if the regressors are
    collinear), :math:`\Sigma` the mean outer product of the residuals, and
    :math:`L = C^{-1}` with :math:`C` the Cholesky factor of :math:`\Sigma`, so that
    :math:`L \Sigma L^\top = I`. This is exact (the maximiser of the conditional likelihood of
    the full-history frames) unless an eigenvalue of :math:`\Sigma` is below
    :data:`MIN_INIT_RESIDUAL_VARIANCE`, which is then raised to it. Frames with an incomplete
    history do not enter the fit; the fitted model treats their missing predecessors as zeros,
    as above. The fit needs at least :math:`(p + 1) D + 1` full-history frames; with fewer the
    layer starts as the identity (:math:`A = 0`, :math:`b = 0`, :math:`L = I`) and warns (the
    training loop initialises its model from a large batch, see
    :meth:`~iresflow.models.flow.SequenceFlow.initialize`).

    Args:
        features: Feature size ``D``.
        order: Autoregressive order ``p >= 1``.

    Example:
        >>> layer = AutoregressiveLinear(2, order=1)
        >>> x = torch.cumsum(torch.randn(8, 10, 2), dim=1)  # random walks: strongly AR(1)
        >>> z, logabsdet = layer(x)  # training mode: fits the AR(1) model first
        >>> bool(layer.initialized), z.shape, logabsdet.shape
        (True, torch.Size([8, 10, 2]), torch.Size([8]))
        >>> torch.allclose(layer.inverse(z)[0], x, atol=1e-4)
        True
    """

    def __init__(self, features: int, order: int = 1) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        self.order = check_int(order, "order", 1)
        d = self.features
        self.lag_weights = nn.Parameter(torch.zeros(self.order, d, d))
        self.bias = nn.Parameter(torch.zeros(d))
        self.log_diag = nn.Parameter(torch.zeros(d))
        self.lower = nn.Parameter(torch.zeros(d, d))

    def whitening_matrix(self) -> Tensor:
        r"""The lower-triangular :math:`L` (positive diagonal), shape ``(D, D)``."""
        return torch.tril(self.lower, -1) + torch.diag_embed(torch.exp(self.log_diag))

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Map data to noise, :math:`z_t = L(x_t - b - \sum_k A_k \tilde x_{t-k})`."""
        self._initialize_if_needed(inputs, mask)
        x = inputs.unsqueeze(1) if inputs.dim() == 2 else inputs
        prediction = self.bias + torch.einsum(
            "bndj,jod->bno", _history_windows(x, mask, self.order), self.lag_weights.flip(0)
        )
        outputs = (x - prediction) @ self.whitening_matrix().mT
        outputs = outputs.reshape(inputs.shape)
        return tokenwise_result(inputs, outputs, mask, self.log_diag.sum(), logdet)

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Map noise to data by forward substitution over time.

        :math:`x_t = L^{-1} z_t + b + \sum_k A_k \tilde x_{t-k}` for :math:`t = 0, 1, \dots`;
        the triangular solves of all frames are one batched call, then one step per frame
        (batched over the sequences) adds the prediction from the frames already recovered.
        """
        z = inputs.unsqueeze(1) if inputs.dim() == 2 else inputs
        batch, length, d = z.shape
        # Row vectors: L w_t = z_t  <=>  w_t^T L^T = z_t^T.
        w = torch.linalg.solve_triangular(self.whitening_matrix().mT, z, upper=True, left=False)
        w = w + self.bias
        # history = [x~_{t-1}, ..., x~_{t-p}] flattened; rows (k - 1) D + j of lags hold A_k[:, j].
        lags = self.lag_weights.transpose(1, 2).reshape(self.order * d, d)
        history = z.new_zeros(batch, self.order * d)
        frames = []
        for t in range(length):
            frame = w[:, t] + history @ lags
            frames.append(frame)
            if mask is not None:
                frame = torch.where(mask[:, t, None], frame, 0.0)
            history = torch.cat([frame, history[:, : (self.order - 1) * d]], dim=1)
        outputs = torch.stack(frames, dim=1).reshape(inputs.shape)
        return tokenwise_result(inputs, outputs, mask, -self.log_diag.sum(), logdet)

    def _initialize(self, inputs: Tensor, mask: Tensor | None) -> None:
        p, d = self.order, self.features
        x = inputs.unsqueeze(1) if inputs.dim() == 2 else inputs
        work = torch.promote_types(x.dtype, torch.float32)
        real = torch.ones(x.shape[:2], dtype=torch.bool, device=x.device) if mask is None else mask
        # A frame has a full history when it and its p predecessors exist and are real.
        full = F.pad(real, (p, 0), value=False).unfold(1, p + 1, 1).all(dim=-1)
        rows = int(full.sum())
        needed = (p + 1) * d + 1
        if rows < needed:
            warnings.warn(
                f"AutoregressiveLinear(features={d}, order={p}) needs at least "
                f"(order + 1) * features + 1 = {needed} real frames preceded by {p} real frames "
                f"to fit its initialisation, got {rows} in this batch; it starts as the "
                f"identity (call initialize() with a larger batch to fit it)",
                stacklevel=2,
            )
            for parameter in (self.lag_weights, self.bias, self.log_diag, self.lower):
                parameter.zero_()
            return
        windows = _history_windows(x, mask, p)[full]  # (R, D, p): frames t-p .. t-1
        regressors = torch.cat(
            [windows.transpose(1, 2).reshape(rows, p * d), windows.new_ones(rows, 1)], dim=1
        ).to(work)
        targets = x[full].to(work)
        coefficients = torch.linalg.pinv(regressors) @ targets  # (p D + 1, D)
        residuals = targets - regressors @ coefficients
        covariance = residuals.mT @ residuals / rows
        eigenvalues, eigenvectors = torch.linalg.eigh(covariance)
        eigenvalues = eigenvalues.clamp_min(MIN_INIT_RESIDUAL_VARIANCE)
        covariance = (eigenvectors * eigenvalues) @ eigenvectors.mT
        cholesky = torch.linalg.cholesky(covariance)
        eye = torch.eye(d, dtype=work, device=x.device)
        whitening = torch.linalg.solve_triangular(cholesky, eye, upper=False)
        # coefficients[j D + i, o] multiplies frame t - p + j, feature i: (A_{p - j})[o, i].
        lag_weights = coefficients[: p * d].reshape(p, d, d).transpose(1, 2).flip(0)
        self.lag_weights.copy_(lag_weights)
        self.bias.copy_(coefficients[p * d])
        self.lower.copy_(torch.tril(whitening, -1))
        self.log_diag.copy_(torch.log(torch.diagonal(whitening)))

    def extra_repr(self) -> str:
        return f"features={self.features}, order={self.order}"


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


class FeatureMixing(SequenceTransform):
    r"""Invertible linear map of the features of every frame, LU-parameterised (Glow's 1x1 conv).

    For every real frame (docs/math.md#feature-mixing),

    .. math::
        y_t = W x_t, \qquad W = P L \big(U + \mathrm{diag}(s \odot e^{\ell})\big), \qquad
        \log|\det J| = n \sum_{d=1}^{D} \ell_d ,

    with a fixed permutation :math:`P` (buffer ``permutation``: row :math:`i` of :math:`W` is
    row ``permutation[i]`` of :math:`L U`), :math:`L` unit lower triangular (strictly lower part
    of ``lower``), :math:`U` strictly upper triangular (strictly upper part of ``upper``), fixed
    signs :math:`s \in \{\pm 1\}^D` (buffer ``sign``), log-magnitudes :math:`\ell`
    (``log_abs_diag``) and :math:`n` the number of real frames. The inverse is
    :math:`x_t = U_\ell^{-1} L^{-1} P^\top y_t` by two triangular solves. Padded frames are
    returned unchanged and add nothing to the log-determinant. :math:`W` starts as the LU
    factorisation of a random proper rotation (:math:`\det W = 1`). A ``(B, D)`` batch of vectors
    is treated as sequences of length 1.

    Args:
        features: Feature size ``D``.
        generator: Optional ``torch.Generator`` for the random initial rotation.

    Example:
        >>> mixing = FeatureMixing(3, generator=torch.Generator().manual_seed(0))
        >>> x = torch.randn(4, 5, 3)
        >>> y, logabsdet = mixing(x)
        >>> torch.allclose(logabsdet, torch.zeros(4), atol=1e-5)
        True
        >>> torch.allclose(mixing.inverse(y)[0], x, atol=1e-5)
        True
    """

    permutation: Tensor
    sign: Tensor

    def __init__(self, features: int, *, generator: torch.Generator | None = None) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        generator = check_generator(generator)
        device = None if generator is None else generator.device
        rotation, _ = torch.linalg.qr(
            torch.randn(self.features, self.features, generator=generator, device=device)
        )
        # A proper rotation (det = +1): the layer starts orientation-preserving, like the
        # residual steps, so the Jacobian determinant of a whole flow stays positive.
        rotation[:, 0] *= torch.linalg.det(rotation).sign()
        permutation, lower, upper = torch.linalg.lu(rotation)
        diagonal = torch.diagonal(upper)
        # The permutation matrix has a single 1 per row: row i of P M is row argmax_j P[i, j].
        self.register_buffer("permutation", permutation.argmax(dim=1))
        self.register_buffer("sign", torch.sign(diagonal))
        self.lower = nn.Parameter(torch.tril(lower, -1))
        self.upper = nn.Parameter(torch.triu(upper, 1))
        self.log_abs_diag = nn.Parameter(torch.log(diagonal.abs()))

    def _factors(self) -> tuple[Tensor, Tensor]:
        """The unit lower and the upper triangular factor, each ``(D, D)``."""
        eye = torch.eye(self.features, dtype=self.lower.dtype, device=self.lower.device)
        lower = torch.tril(self.lower, -1) + eye
        diagonal = self.sign * torch.exp(self.log_abs_diag)
        upper = torch.triu(self.upper, 1) + torch.diag_embed(diagonal)
        return lower, upper

    def weight(self) -> Tensor:
        """The matrix :math:`W = P L U`, shape ``(D, D)``."""
        lower, upper = self._factors()
        return (lower @ upper)[self.permutation]

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Map data to noise, :math:`y_t = W x_t` on real frames."""
        outputs = inputs @ self.weight().mT
        return tokenwise_result(inputs, outputs, mask, self.log_abs_diag.sum(), logdet)

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Map noise to data, :math:`x_t = U^{-1} L^{-1} P^\top y_t` on real frames."""
        lower, upper = self._factors()
        # P v = y  <=>  v[permutation] = y; then row-vector solves a^T L^T = v^T, x^T U^T = a^T.
        unpermuted = inputs[..., torch.argsort(self.permutation)]
        solved = torch.linalg.solve_triangular(
            lower.mT, unpermuted, upper=True, left=False, unitriangular=True
        )
        outputs = torch.linalg.solve_triangular(upper.mT, solved, upper=False, left=False)
        return tokenwise_result(inputs, outputs, mask, -self.log_abs_diag.sum(), logdet)

    def extra_repr(self) -> str:
        return f"features={self.features}"
