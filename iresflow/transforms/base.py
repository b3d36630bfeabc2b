r"""Sequence transforms: nflows transforms that carry a padding mask.

:class:`SequenceTransform` fixes the signature every iresflow transform implements,

.. code-block:: text

    forward(inputs, context=None, *, mask=None, logdet=True) -> (outputs, logabsdet)  # to noise
    inverse(inputs, context=None, *, mask=None, logdet=True) -> (outputs, logabsdet)  # to data

with ``inputs`` of shape ``(B, N, D)`` (or ``(B, D)``), an optional boolean ``mask`` ``(B, N)``
(``True`` = real token) and ``logabsdet`` of shape ``(B,)``; ``logdet=False`` skips the
log-determinant (``logabsdet`` is ``None``), for callers that need the map only. Since it
subclasses :class:`nflows.transforms.Transform`, nflows' own ``CompositeTransform``,
``InverseTransform`` and ``Flow`` work unchanged for fixed-length data (``mask=None``);
:class:`~iresflow.transforms.composite.SequenceCompositeTransform` chains transforms and passes
``mask=`` and ``logdet=`` through, for variable-length batches.

**Checked and unchecked paths.** The public :meth:`~SequenceTransform.forward` and
:meth:`~SequenceTransform.inverse` validate once (:meth:`~SequenceTransform.check_call`: one
host synchronisation for the values, see :mod:`iresflow._validation`) and then run the
``_forward`` / ``_inverse`` that subclasses implement, with value checks switched off for the
layers they call. ``check=False`` is the unchecked entry for callers that validated the batch
already (a model calls its chain that way); a chain calls the ``_forward`` / ``_inverse`` of its
members directly, so a batch is validated once per call of the outermost entry point.

**Data-dependent initialisation.** Layers whose parameters come from data
(:class:`~iresflow.transforms.actnorm.ActNorm`, the autoregressive layer) are set by
:meth:`~SequenceTransform.initialize` only, from a whole batch, in one pass that leaves every
other state as it was; a forward never initialises. The checked :meth:`~SequenceTransform.forward`
of a transform refuses to run while such a layer is in training mode but not initialised (a
:class:`~iresflow.models.flow.SequenceFlow` initialises its chain itself, see its
:meth:`~iresflow.models.flow.SequenceFlow.log_prob`).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Mapping

import torch
from nflows.transforms.base import Transform
from torch import Tensor

from iresflow._validation import check_inputs, value_checks
from iresflow.logdet.base import LogDetEstimator

__all__ = [
    "FRAMES",
    "LogDetRequest",
    "SequenceTransform",
    "check_logdet",
]

#: The ``logdet`` argument of a transform: ``True`` (the transform's own log-determinant),
#: ``False`` (none: the map only), a log-determinant estimator (instance or name, see
#: :func:`~iresflow.logdet.factory.make_logdet`) that residual blocks use instead of their
#: configured one for this call, or a mapping from residual blocks to the estimator each uses
#: in this call (how a flow hands every block its share of the random draws of a pass, see
#: :meth:`~iresflow.logdet.policy.LogDetPolicy.pass_request`; blocks it does not name use their
#: configured one). Other transforms treat anything but ``False`` and :data:`FRAMES` like
#: ``True``.
LogDetRequest = bool | str | LogDetEstimator | Mapping["SequenceTransform", LogDetEstimator]

#: The ``logdet`` argument asking a :attr:`~SequenceTransform.causal` transform's forward for
#: its log-determinant frame by frame, ``(B, N)``: the log-determinants of the diagonal blocks
#: of its block lower-triangular Jacobian (exact; zero at padded frames), which sum to the
#: whole one (docs/forecasting.md#frame-scores).
FRAMES = "frames"


def check_logdet(logdet: object) -> LogDetRequest:
    """Validate the ``logdet`` argument of a transform call.

    Args:
        logdet: ``True``, ``False``, an estimator name, a
            :class:`~iresflow.logdet.base.LogDetEstimator` or a mapping from blocks to
            estimators (:data:`LogDetRequest`).

    Returns:
        ``logdet`` unchanged.

    Raises:
        TypeError: anything else.

    Example:
        >>> check_logdet(False)
        False
    """
    if not isinstance(logdet, (bool, str, LogDetEstimator, Mapping)):
        raise TypeError(
            f"logdet must be a bool, an estimator name, a LogDetEstimator or a mapping from "
            f"blocks to estimators, got {type(logdet).__name__}"
        )
    return logdet


class SequenceTransform(Transform, ABC):
    r"""An invertible map of sequences with a padding mask (an nflows ``Transform``).

    Contract: padded positions pass through unchanged and contribute nothing to ``logabsdet``;
    padded inputs never influence real outputs; ``inverse`` undoes ``forward`` and returns the
    log-determinant of the inverse map, so that for :math:`y = f(x)` the two log-determinants sum
    to zero.

    Subclasses implement ``_forward(inputs, context, mask, logdet)`` and ``_inverse(...)``
    (same arguments, inputs already validated, returning ``(outputs, logabsdet or None)``),
    which only :class:`SequenceTransform` calls, may set ``features`` (the feature size ``D``
    they require) and may extend ``_check_options(inputs, context, logdet)`` with checks that
    read no tensor values. Layers initialised from data are
    :class:`~iresflow.transforms.actnorm.DataInitializedTransform` s.
    """

    #: Feature size ``D`` the transform requires, or ``None`` for any.
    features: int | None = None
    #: Whether output frame :math:`t` depends on the input frames :math:`s \le t` only, in both
    #: directions of the map (frame-wise transforms are causal; docs/math.md#causal-steps). A
    #: flow whose chain is causal forecasts and scores frames (docs/forecasting.md).
    causal: bool = False
    #: ``False`` while a layer initialised from data waits for :meth:`initialize` (host flag).
    _initialized: bool = True

    def forward(
        self,
        inputs: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        logdet: LogDetRequest = True,
        check: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        r"""Map data to noise.

        Args:
            inputs: Sequences ``(B, N, D)`` or vectors ``(B, D)``.
            context: Conditioning input (``None`` for unconditional transforms).
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.
            logdet: ``True``, ``False`` or an estimator (see :data:`LogDetRequest`).
            check: Validate the call (:meth:`check_call`). ``False`` is the unchecked entry
                for callers that validated ``inputs``, ``mask`` and ``logdet`` already (no
                host read).

        Returns:
            ``outputs`` with the shape of ``inputs`` and
            :math:`\log|\det J_f(x)|` per sequence, shape ``(B,)`` (``None`` with
            ``logdet=False``).
        """
        if check:
            inputs, mask = self.check_call(inputs, context, mask=mask, logdet=logdet)
            self._refuse_uninitialized_training()
        with value_checks(False):
            return self._forward(inputs, context, mask, logdet)

    def inverse(
        self,
        inputs: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        logdet: LogDetRequest = True,
        check: bool = True,
    ) -> tuple[Tensor, Tensor | None]:
        r"""Map noise to data.

        Args:
            inputs: Sequences ``(B, N, D)`` or vectors ``(B, D)``.
            context: Conditioning input (``None`` for unconditional transforms).
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.
            logdet: ``True``, ``False`` or an estimator (see :data:`LogDetRequest`).
            check: Validate the call (:meth:`check_call`). ``False`` is the unchecked entry
                for callers that validated ``inputs``, ``mask`` and ``logdet`` already (no
                host read).

        Returns:
            ``outputs`` with the shape of ``inputs`` and
            :math:`\log|\det J_{f^{-1}}(y)|` per sequence, shape ``(B,)`` (``None`` with
            ``logdet=False``).
        """
        if check:
            inputs, mask = self.check_call(inputs, context, mask=mask, logdet=logdet)
        with value_checks(False):
            return self._inverse(inputs, context, mask, logdet)

    def check_call(
        self,
        inputs: object,
        context: Tensor | None = None,
        *,
        mask: object = None,
        logdet: object = True,
        name: str = "inputs",
    ) -> tuple[Tensor, Tensor | None]:
        """The entry-point validation of :meth:`forward` and :meth:`inverse`.

        Shapes, dtypes and devices, then one fused value check of ``inputs`` and ``mask``
        (:func:`~iresflow._validation.check_inputs`), then the transform's own option checks.

        Args:
            inputs: Candidate batch.
            context: Conditioning input.
            mask: Candidate padding mask.
            logdet: Candidate ``logdet`` argument.
            name: Name of the data argument in error messages.

        Returns:
            ``(inputs, mask)``, the mask on the inputs' device.

        Raises:
            TypeError: wrong types, dtypes or devices.
            ValueError: wrong shapes, non-finite values, an all-padding sequence or an option
                the transform does not support.
        """
        inputs, mask = check_inputs(
            inputs, mask, name, features=self.features, like=next(self.parameters(), None)
        )
        self.check_options(inputs, context, mask=mask, logdet=logdet)
        return inputs, mask

    def check_options(
        self,
        inputs: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        logdet: object = True,
    ) -> None:
        """The checks of a call that read no values: ``logdet``, then the transform's options.

        :meth:`check_call` runs them after :func:`~iresflow._validation.check_inputs`; a caller
        that validated the batch itself (a flow) runs them alone.

        Args:
            inputs: Validated batch ``(B, N, D)`` or ``(B, D)``.
            context: Conditioning input.
            mask: Validated padding mask ``(B, N)`` or ``None``.
            logdet: Candidate ``logdet`` argument.

        Raises:
            TypeError: an invalid ``logdet``.
            ValueError: an option the transform does not support.
        """
        check_logdet(logdet)
        self._check_options(inputs, context, logdet)

    @property
    def is_initialized(self) -> bool:
        """Whether every layer of the transform that is initialised from data has been (True
        without such layers; a chain when all its members are). Reads host flags only."""
        for module in self.modules():
            if isinstance(module, SequenceTransform) and not module._initialized:
                return False
        return True

    @torch.no_grad()
    def initialize(
        self,
        inputs: Tensor,
        mask: Tensor | None = None,
        *,
        context: Tensor | None = None,
        check: bool = True,
    ) -> None:
        """Initialise the layers set from data that are not initialised yet from one batch.

        One pass from data to noise in training mode, without log-determinants and gradients,
        in which every such layer sets its parameters from its inputs (e.g.
        :class:`~iresflow.transforms.actnorm.ActNorm`) before mapping them; the buffers of
        every other module (e.g. power-iteration vectors) and the training flags are restored
        afterwards. Does nothing when :attr:`is_initialized`. This is the only place where
        such layers are set: call it with the first (global) batch before training, e.g. on
        every rank of a distributed run.

        Args:
            inputs: Sequences ``(B, N, D)`` or vectors ``(B, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.
            context: Conditioning input (``None`` for unconditional transforms).
            check: Validate the call (see :meth:`forward`).
        """
        if check:
            inputs, mask = self.check_call(inputs, context, mask=mask, logdet=False)
        if self.is_initialized:
            return
        waiting = {id(m) for m in self.modules()
                   if isinstance(m, SequenceTransform) and not m._initialized}
        saved = {(module, name): buffer.clone()
                 for module in self.modules() if id(module) not in waiting
                 for name, buffer in module.named_buffers(recurse=False)}
        modes = {module: module.training for module in self.modules()}
        self.train()
        try:
            with value_checks(False):
                self._initialization_pass(inputs, context, mask)
        finally:
            for module, training in modes.items():
                module.training = training
            for (module, name), value in saved.items():
                getattr(module, name).copy_(value)

    def _refuse_uninitialized_training(self) -> None:
        """Refuse a layer initialised from data in training mode but not initialised (only
        :meth:`initialize` sets it, never a forward): ``RuntimeError``."""
        for module in self.modules():
            waiting = isinstance(module, SequenceTransform) and not module._initialized
            if waiting and module.training:
                raise RuntimeError(
                    f"{type(module).__name__} is not initialised from data yet: call "
                    "initialize(inputs, mask) (of the layer, or of the chain or flow holding "
                    "it) with a training batch before a training-mode forward"
                )

    def _initialization_pass(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None
    ) -> Tensor:
        """The pass of :meth:`initialize`: map validated inputs to noise (no log-determinant),
        setting the layers initialised from data that are not yet, in order, on the way."""
        return self._forward(inputs, context, mask, False)[0]

    def _check_options(self, inputs: Tensor, context: Tensor | None, logdet: object) -> None:
        """Checks of a call specific to the transform; must not read tensor values."""

    def forward_with_memory(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None
    ) -> tuple[Tensor, Tensor | None]:
        """The unchecked forward without log-determinant, and what :meth:`inverse_pinned` may
        reuse of it as its ``memory`` (``None`` here: nothing).

        Args:
            inputs: Validated sequences ``(B, N, D)``.
            context: Conditioning input, or ``None``.
            mask: Optional boolean padding mask ``(B, N)``.

        Returns:
            The outputs ``(B, N, D)`` and the memory: ``None``, or a tensor whose first dimension
            is the batch's (a forecast repeats it with the states, one copy per draw).
        """
        return self._forward(inputs, context, mask, False)[0], None

    def inverse_pinned(
        self, inputs: Tensor, state: Tensor, known: Tensor, context: Tensor | None,
        mask: Tensor | None,
    ) -> Tensor:
        """The inverse of a :attr:`causal` transform on new frames, with the known frames held
        at their input ``state`` (docs/forecasting.md#pinned-inverse); unchecked.

        Here: the whole inverse, then the known frames put back. A transform may solve for the
        new frames alone (the residual step does, on the frames its branch reaches).

        Args:
            inputs: Outputs ``(B, N, D)`` to invert; correct on the known frames.
            state: The transform's inputs ``(B, N, D)``, correct on the known frames.
            known: Boolean mask ``(B, N)`` of the known frames, which precede the new ones.
            context: Conditioning input, or ``None``.
            mask: Boolean mask ``(B, N)`` of all real frames, or ``None``.

        Returns:
            Inputs ``(B, N, D)``: ``state`` on the known frames.
        """
        inverse = self._inverse(inputs, context, mask, False)[0]
        return torch.where(known.unsqueeze(-1), state, inverse)

    @abstractmethod
    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        """Unchecked :meth:`forward` on validated inputs."""

    @abstractmethod
    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        """Unchecked :meth:`inverse` on validated inputs."""
