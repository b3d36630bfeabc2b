r"""Activation normalisation for sequences (docs/math.md#actnorm; Kingma & Dhariwal, 2018)."""

from __future__ import annotations

from abc import abstractmethod

import torch
from torch import Tensor, nn

from iresflow._validation import check_int, value_checks
from iresflow.transforms.base import FRAMES, LogDetRequest, SequenceTransform

__all__ = ["ActNorm", "DataInitializedTransform"]

#: Variance floor of the data-dependent initialisation (docs/math.md#actnorm).
MIN_INIT_VARIANCE = 0.2


class DataInitializedTransform(SequenceTransform):
    r"""A sequence transform whose parameters are set from a batch of data.

    The shared initialisation mechanism of :class:`ActNorm`,
    :class:`~iresflow.transforms.temporal.AutoregressiveLinear` and
    :class:`~iresflow.transforms.positionwise.PositionwiseAffine`: :meth:`initialize` (of the
    layer, or of a chain or flow holding it) calls :meth:`_initialize` on a batch under
    ``torch.no_grad``; a forward never does. Whether it has happened is recorded in the boolean
    buffer ``initialized``, which is part of the ``state_dict`` so that a loaded model is not
    re-initialised, and mirrored in a host-side flag (read by
    :attr:`~iresflow.transforms.base.SequenceTransform.is_initialized`) so that no call
    synchronises with the device to read it. The checked forward of a layer in training mode
    refuses to run before its initialisation (see
    :meth:`~iresflow.transforms.base.SequenceTransform.forward`); in evaluation mode the
    current parameters are used as they are.

    Subclasses implement :meth:`_initialize`.
    """

    initialized: Tensor

    def __init__(self) -> None:
        super().__init__()
        self.register_buffer("initialized", torch.tensor(False))
        # Host-side mirror of the buffer, so that no call synchronises with the device.
        self._initialized = False
        self.register_load_state_dict_post_hook(_sync_initialized)

    def initialize(
        self,
        inputs: Tensor,
        mask: Tensor | None = None,
        *,
        context: Tensor | None = None,
        check: bool = True,
    ) -> None:
        """Set the parameters from ``inputs`` now, whatever the mode and also when initialised.

        Unlike a chain's :meth:`~iresflow.transforms.base.SequenceTransform.initialize`, which
        initialises only the layers that are not initialised yet, the layer's own call fits it
        again.

        Args:
            inputs: Sequences ``(B, N, D)`` or vectors ``(B, D)``.
            mask: Optional boolean padding mask ``(B, N)`` (only with ``(B, N, D)`` inputs).
            context: Conditioning input (checked; the fit does not depend on it).
            check: Validate the call (see :meth:`forward`).
        """
        if check:
            inputs, mask = self.check_call(inputs, context, mask=mask, logdet=False)
        with value_checks(False):
            self._run_initialization(inputs, mask)

    def _initialization_pass(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None
    ) -> Tensor:
        if not self._initialized:
            self._run_initialization(inputs, mask)
        return self._forward(inputs, context, mask, False)[0]

    def _run_initialization(self, inputs: Tensor, mask: Tensor | None) -> None:
        with torch.no_grad():
            self._initialize(inputs, mask)
            self.initialized.fill_(True)
        self._initialized = True

    @abstractmethod
    def _initialize(self, inputs: Tensor, mask: Tensor | None) -> None:
        """Set the parameters from the real tokens of a validated batch (runs without grad)."""


class ActNorm(DataInitializedTransform):
    r"""Per-feature affine map shared over positions, with data-dependent initialisation.

    For every real token :math:`x_i \in \mathbb R^D` of a sequence (docs/math.md#actnorm),

    .. math::
        y_i = (x_i + b) \odot e^{s}, \qquad x_i = y_i \odot e^{-s} - b, \qquad
        \log|\det J| = n \sum_{d=1}^{D} s_d ,

    where :math:`n` is the number of real tokens of the sequence. Padded tokens (``mask``
    ``False``) are returned unchanged and do not enter the log-determinant. A ``(B, D)`` batch of
    vectors is treated as sequences of length 1.

    Initialisation (:class:`DataInitializedTransform`): :meth:`initialize` sets, from the real
    tokens of a batch only, :math:`b = -\mathrm{mean}` and
    :math:`s = -\tfrac12 \log \max(\mathrm{var}, 0.2)` per feature (biased variance), so that the
    outputs have zero mean and unit variance unless the variance floor applies.

    ``forward``/``inverse`` are those of :class:`~iresflow.transforms.base.SequenceTransform`
    (``inputs (B, N, D)`` or ``(B, D)``, optional ``mask (B, N)``, ``logdet``); the context is
    ignored.

    Args:
        features: Feature size ``D``.

    Example:
        >>> actnorm = ActNorm(3)
        >>> x = torch.randn(4, 5, 3) * 2 + 1
        >>> actnorm.initialize(x)
        >>> y, logabsdet = actnorm(x)
        >>> bool(actnorm.initialized), y.shape, logabsdet.shape
        (True, torch.Size([4, 5, 3]), torch.Size([4]))
        >>> torch.allclose(actnorm.inverse(y)[0], x, atol=1e-5)
        True
    """

    causal = True  # frame-wise

    def __init__(self, features: int) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        self.shift = nn.Parameter(torch.zeros(self.features))
        self.log_scale = nn.Parameter(torch.zeros(self.features))

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Data to noise, :math:`y = (x + b)\odot e^{s}` on real tokens."""
        outputs = (inputs + self.shift) * torch.exp(self.log_scale)
        return tokenwise_result(inputs, outputs, mask, self.log_scale.sum(), logdet)

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Noise to data, :math:`x = y \odot e^{-s} - b` on real tokens."""
        outputs = inputs * torch.exp(-self.log_scale) - self.shift
        return tokenwise_result(inputs, outputs, mask, -self.log_scale.sum(), logdet)

    def _initialize(self, inputs: Tensor, mask: Tensor | None) -> None:
        frames = inputs.reshape(-1, self.features) if mask is None else inputs[mask]
        mean = frames.mean(dim=0)
        variance = (frames - mean).square().mean(dim=0)
        self.shift.copy_(-mean)
        self.log_scale.copy_(-0.5 * torch.log(variance.clamp_min(MIN_INIT_VARIANCE)))

    def extra_repr(self) -> str:
        return f"features={self.features}"


def tokenwise_result(
    inputs: Tensor,
    outputs: Tensor,
    mask: Tensor | None,
    logdet_per_token: Tensor,
    logdet: LogDetRequest = True,
) -> tuple[Tensor, Tensor | None]:
    """Outputs and log-determinant of a map whose Jacobian is block triangular over tokens.

    Padded tokens take their input back; the log-determinant is the sum of the diagonal blocks'
    log-determinants over the real tokens (``None`` when ``logdet`` is ``False``): the number
    of real tokens times ``logdet_per_token`` when every token has the same block.

    Args:
        inputs: Sequences ``(B, N, D)`` or vectors ``(B, D)`` (one token each).
        outputs: The map applied to every token, shape of ``inputs``.
        mask: Optional boolean padding mask ``(B, N)``.
        logdet_per_token: Log-determinant of the block of one token: 0-dim (the same for
            every token) or ``(B, N)`` (token by token; ``(B, 1)`` for vectors).
        logdet: The transform call's ``logdet`` argument.

    Returns:
        ``(outputs, logabsdet)`` of shapes ``inputs.shape`` and ``(B,)``; ``(B, N)`` token by
        token (zero at padding) when ``logdet`` is :data:`~iresflow.transforms.base.FRAMES`.
    """
    batch = inputs.shape[0]
    if mask is not None:
        outputs = torch.where(mask.unsqueeze(-1), outputs, inputs)
    if logdet is False:
        return outputs, None
    if logdet == FRAMES:
        per_token = logdet_per_token.expand(inputs.shape[:2])
        return outputs, per_token if mask is None else torch.where(mask, per_token, 0.0)
    if logdet_per_token.dim() > 0:
        if mask is not None:
            logdet_per_token = torch.where(mask, logdet_per_token, 0.0)
        return outputs, logdet_per_token.sum(dim=1)
    if mask is None:
        tokens = inputs.shape[1] if inputs.dim() == 3 else 1
        return outputs, logdet_per_token.expand(batch) * tokens
    return outputs, mask.sum(dim=1).to(outputs.dtype) * logdet_per_token


def _sync_initialized(module: nn.Module, incompatible_keys: object) -> None:
    """Mirror the loaded ``initialized`` buffer into the host-side flag."""
    module._initialized = bool(module.initialized)
