r"""A masked sequence flow: a transform chain plus a base distribution.

:class:`SequenceFlow` is nflows' ``Flow(transform, base)`` for variable-length sequences: a
:class:`~iresflow.transforms.base.SequenceTransform` maps data to noise, and a
:class:`~iresflow.models.distributions.SequenceBase` (by default the standard normal
:class:`~iresflow.models.distributions.StandardNormalSequence`) is the density of the noise over
the real frames, so that

.. math:: \log p(X) = \log p_{\rm base}(Z) + \log|\det J_f(X)|, \qquad Z = f(X)

(docs/math.md#change-of-variables, docs/math.md#masks).

The flow only composes: every method validates once at the door and then calls the chain's
unchecked entry (``check=False``, see :mod:`iresflow.transforms.base`) and the base, which
trust it; the log-determinant method is chosen by
:func:`~iresflow.logdet.policy.logdet_policy`, whose
:meth:`~iresflow.logdet.policy.LogDetPolicy.pass_request` hands every residual block the
random counts drawn for it, and the data-dependent initialisation is the chain's
(:meth:`~iresflow.transforms.base.SequenceTransform.initialize`), which the data-to-noise
methods call at the door in training mode while the chain is not initialised. Ready-made models
such as :class:`~iresflow.models.residual_flow.ResidualSequenceFlow` only build the chain.
The path of one :meth:`SequenceFlow.log_prob`, step by step: docs/architecture.md#log-prob-path.
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from iresflow._validation import (
    check_float,
    check_generator,
    check_inputs,
    check_int,
)
from iresflow.logdet.base import LogDetEstimator
from iresflow.logdet.exact import splits_by_frames
from iresflow.logdet.policy import LogDetPolicy, logdet_policy, set_generator
from iresflow.models import evaluation
from iresflow.models.distributions import SequenceBase, StandardNormalSequence, sample_mask
from iresflow.models.forecasting import CausalMethods
from iresflow.nn.conditional import ContextEncoder
from iresflow.transforms.composite import SequenceCompositeTransform
from iresflow.transforms.residual import ResidualTransform

__all__ = ["SequenceFlow"]


class SequenceFlow(CausalMethods, nn.Module):
    r"""A normalising flow for (variable-length) sequences: a transform chain and a base.

    ``transform`` maps data to noise (nflows convention); :meth:`log_prob` adds its
    log-determinant to the base log-density, :meth:`sample` and :meth:`inverse` run it backwards.
    Padded frames pass through unchanged and never enter a density. Methods validate their
    inputs once (one host synchronisation, see :mod:`iresflow._validation`) and then call the
    chain's unchecked path, so they also run under ``torch.func`` transforms. The layers
    initialised from data are set by :meth:`initialize`; :meth:`log_prob` and
    :meth:`transform_to_noise` call it themselves, on their batch, when they run in training
    mode on a chain that is not initialised yet. A flow whose chain is causal over frames also
    scores frames, forecasts and gives densities given a past
    (:class:`~iresflow.models.forecasting.CausalMethods`).

    Args:
        transform: The chain from data to noise.
        base: Density of the noise, any :class:`~iresflow.models.distributions.SequenceBase`
            with ``features`` features; ``StandardNormalSequence(features)`` when ``None``. A
            conditional flow passes its context vector to the base too.
        features: Feature size ``D`` of every frame.
        max_len: Longest sequence accepted (``None``: any).
        context_encoder: For a conditional flow :math:`p(x \mid c)`, the
            :class:`~iresflow.nn.conditional.ContextEncoder` of the ``context`` argument of every
            method (class labels or covariates, one per sequence) into the context vector
            ``(B, C)`` passed to the chain; ``None`` (the default) for an unconditional flow,
            whose methods take no context.

    Example:
        >>> from iresflow.nn.mlp import LipschitzMLP
        >>> from iresflow.transforms.actnorm import ActNorm
        >>> chain = SequenceCompositeTransform(
        ...     [ActNorm(2), ResidualTransform(LipschitzMLP((2, 8, 2)), logdet="exact")])
        >>> flow = SequenceFlow(chain, features=2).double().eval()
        >>> x = torch.randn(3, 4, 2, dtype=torch.float64)
        >>> flow.log_prob(x).shape, torch.allclose(flow.inverse(flow.transform_to_noise(x)), x)
        (torch.Size([3]), True)
    """

    def __init__(
        self,
        transform: SequenceCompositeTransform,
        base: SequenceBase | None = None,
        *,
        features: int,
        max_len: int | None = None,
        context_encoder: ContextEncoder | None = None,
    ) -> None:
        super().__init__()
        if not isinstance(transform, SequenceCompositeTransform):
            raise TypeError(
                f"transform must be a SequenceCompositeTransform, got {type(transform).__name__}"
            )
        self.features = check_int(features, "features", 1)
        self.max_len = None if max_len is None else check_int(max_len, "max_len", 1)
        if base is None:
            base = StandardNormalSequence(self.features)
        if not isinstance(base, SequenceBase) or base.features != self.features:
            raise TypeError(f"base must be a SequenceBase with features={self.features}, got "
                            f"{base!r}")
        if context_encoder is not None and not isinstance(context_encoder, ContextEncoder):
            raise TypeError(f"context_encoder must be a ContextEncoder or None, got "
                            f"{type(context_encoder).__name__}")
        self.transform = transform
        self.base = base
        self.context_encoder = context_encoder

    # ----------------------------------------------------------------------------------------
    # densities and maps

    def log_prob(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        method: Literal["exact", "roulette"] | None = None,
        n_samples: int = 1,
        return_stderr: bool = False,
        chunk_size: int | None = None,
        context: Tensor | None = None,
        given: Tensor | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        r"""Log-density, in nats, of the sequences as given (docs/math.md#change-of-variables).

        The base log-density of the noise plus the log-determinant of the chain (padded frames
        never enter). Differentiable (for training) when grad mode is on.

        Args:
            x: Sequences, shape ``(B, N, D)`` with ``D = features`` and ``N <= max_len``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real frames.
            method: Log-determinant of the residual blocks
                (:func:`~iresflow.logdet.policy.logdet_policy`): ``None`` uses each block's
                configured estimator; ``"exact"`` the dense Jacobian of every block, evaluated
                in length-sorted chunks (:func:`~iresflow.models.evaluation.exact_in_chunks`);
                ``"roulette"`` the unbiased Russian-roulette estimator (20 exact terms in
                ``eval()`` mode), the configured ones where all blocks have one. In training
                mode an uninitialised chain is first initialised from the whole batch
                (:meth:`initialize`), whatever the method.
            n_samples: Number of independent estimates averaged (stochastic estimators only;
                must be 1 for ``"exact"``).
            return_stderr: Also return the standard error of the average
                (:func:`~iresflow.models.evaluation.average_estimates`; needs ``n_samples >= 2``
                for a stochastic estimator; zeros for ``"exact"``).
            chunk_size: Sequences per chunk of the exact method (``None``: automatic).
            context: Conditioning input of a conditional flow (see ``context_encoder``):
                labels ``(B,)`` or covariates ``(B, C)``; the density is then
                :math:`\log p(x \mid c)`. Must be ``None`` for an unconditional flow.
            given: Optional boolean mask ``(B, N)`` of observed frames, all before the other
                real frames of their sequence: the density of the others given them,
                :math:`\log p(x_{\rm new} \mid x_{\rm given})`, the sum of their
                :meth:`frame_log_prob` (exact; a :attr:`causal` flow only, with ``method``
                ``None`` or ``"exact"``, docs/forecasting.md#conditional-density).

        Returns:
            ``log_prob`` of shape ``(B,)``, or ``(log_prob, stderr)`` with ``return_stderr``.

        Raises:
            ValueError: invalid inputs or options.
        """
        if given is not None:
            return self._log_prob_given(x, mask, given, method, n_samples, return_stderr,
                                        context)
        blocks = self._residual_blocks()
        policy = logdet_policy([block.logdet for block in blocks], method)
        n_samples = check_int(n_samples, "n_samples", 1)
        if chunk_size is not None:
            chunk_size = check_int(chunk_size, "chunk_size", 1)
        if policy.exact and n_samples != 1:
            raise ValueError(f"the exact log-density is deterministic: n_samples must be 1, "
                             f"got {n_samples}")
        if return_stderr and not policy.exact and n_samples < 2:
            raise ValueError("return_stderr needs n_samples >= 2 for a stochastic estimator")
        x, mask, c = self._check(x, mask, "x", policy.request, context, initialize=True)

        # Validated: the chain runs unchecked (check=False) and the base checks nothing.
        if n_samples == 1 and not policy.exact:  # one stochastic pass (training)
            return self._log_prob(x, mask, blocks, policy, c)
        if policy.exact:
            value = evaluation.exact_in_chunks(
                lambda xc, mc, *cc: self._log_prob(xc, mc, blocks, policy, *cc), x, mask,
                chunk_size, () if c is None else (c,),
            )
            stderr = torch.zeros_like(value)
        else:
            value, stderr = evaluation.average_estimates(
                lambda: self._log_prob(x, mask, blocks, policy, c), n_samples
            )
        return (value, stderr) if return_stderr else value

    def transform_to_noise(
        self, x: Tensor, mask: Tensor | None = None, *, context: Tensor | None = None
    ) -> Tensor:
        """Map data to noise through the chain (no log-determinant, no random draws).

        In training mode an uninitialised chain is first initialised from ``x``
        (:meth:`initialize`).

        Args:
            x: Sequences ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``.
            context: Conditioning input of a conditional flow (see :meth:`log_prob`).

        Returns:
            ``z`` of shape ``(B, N, D)``, equal to ``x`` at padded positions.
        """
        x, mask, c = self._check(x, mask, "x", False, context, initialize=True)
        return self.transform(x, c, mask=mask, logdet=False, check=False)[0]

    def inverse(
        self, z: Tensor, mask: Tensor | None = None, *, context: Tensor | None = None
    ) -> Tensor:
        """Map noise to data, inverting the chain (docs/math.md#fixed-point-inverse).

        Runs without gradient tracking and without random draws; :meth:`inverse_diagnostics`
        reports the convergence of the last call.

        Args:
            z: Noise sequences ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``.
            context: Conditioning input of a conditional flow (see :meth:`log_prob`).

        Returns:
            ``x`` of shape ``(B, N, D)``, equal to ``z`` at padded positions.

        Raises:
            InversionError: a fixed-point iteration did not converge.
        """
        with torch.no_grad():
            z, mask, c = self._check(z, mask, "z", False, context)
            return self._invert(z, c, mask)

    def _invert(self, z: Tensor, c: Tensor | None, mask: Tensor | None) -> Tensor:
        """The chain's inverse of validated noise. A batch without padding is inverted without
        its mask: the same values, without masking every layer's input (docs/math.md#masks)."""
        unpadded = None if mask is None or bool(mask.all()) else mask
        return self.transform.inverse(z, c, mask=unpadded, logdet=False, check=False)[0]

    @torch.no_grad()
    def sample(
        self,
        num: int,
        seq_len: int | None = None,
        lengths: Tensor | None = None,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        context: Tensor | None = None,
    ) -> tuple[Tensor, Tensor]:
        r"""Draw sequences: base noise (``base.sample``), then invert the chain.

        Only ``generator`` is drawn from (torch's global generator when it is ``None``).

        Args:
            num: Number of sequences.
            seq_len: Common length ``N`` of all samples (exclusive with ``lengths``).
            lengths: Per-sample lengths, integer tensor ``(num,)`` with values in
                ``[1, max_len]``; ``N = max(lengths)`` and shorter samples are padded.
            generator: Optional ``torch.Generator`` for the noise (on the model's device).
            temperature: Scale :math:`T > 0` of the base noise (its standard deviation for the
                normal base; 1 = the model).
            context: Conditioning input of a conditional flow, one per sample (labels
                ``(num,)`` or covariates ``(num, C)``, see :meth:`log_prob`).

        Returns:
            ``(x, mask)``: samples ``(num, N, D)`` (zero at padding) and the mask ``(num, N)``.

        Raises:
            ValueError: neither or both of ``seq_len`` and ``lengths``, or invalid values.
        """
        num = check_int(num, "num", 1)
        temperature = check_float(temperature, "temperature", 0.0)
        generator = check_generator(generator)
        reference = self._reference()
        mask = sample_mask(num, seq_len, lengths, self.max_len, reference.device)
        c = self._context(context, num, reference)
        z = self.base.sample(mask, generator, temperature, context=c, dtype=reference.dtype)
        if c is not None:  # the chain's option checks of the context
            self.transform.check_call(z, c, mask=mask, logdet=False, name="z")
        return self._invert(z, c, mask), mask

    # ----------------------------------------------------------------------------------------
    # training support

    @torch.no_grad()
    def initialize(
        self, x: Tensor, mask: Tensor | None = None, *, context: Tensor | None = None
    ) -> None:
        """Initialise every data-dependent layer (ActNorm, autoregressive) from a whole batch.

        The chain's :meth:`~iresflow.transforms.base.SequenceTransform.initialize`: one pass in
        training mode without log-determinants; every other state is left as it was (buffers
        such as power-iteration vectors, the training flag, random generators). Call it with
        the first (global) batch before training, e.g. on every rank of a distributed run; a
        single process may also leave it to the first training-mode :meth:`log_prob` (or
        :meth:`transform_to_noise`), which calls it on its own batch while the chain is not
        initialised. No other call initialises anything.

        Args:
            x: Sequences ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``.
            context: Conditioning input of a conditional flow (see :meth:`log_prob`).
        """
        x, mask, c = self._check(x, mask, "x", False, context)
        self.transform.initialize(x, mask, context=c, check=False)

    def set_generator(self, generator: torch.Generator | None) -> None:
        """Make ``generator`` the generator of every stochastic log-determinant estimator.

        Args:
            generator: A ``torch.Generator`` on the model's device, or ``None`` for torch's
                global one.
        """
        set_generator(self.estimators(), generator)

    def estimators(self) -> list[LogDetEstimator]:
        """The configured log-determinant estimator of every residual block, in chain order."""
        return [block.logdet for block in self._residual_blocks()]

    def residual_steps(self) -> list[tuple[str, ResidualTransform]]:
        """``(name, block)`` of every residual block of the chain, in order."""
        return [(name, step) for name, step in self.transform.named_steps()
                if isinstance(step, ResidualTransform)]

    # ----------------------------------------------------------------------------------------
    # diagnostics

    def inverse_diagnostics(self) -> dict[str, Any]:
        """Convergence of the fixed-point inverses of the last :meth:`inverse` / :meth:`sample`.

        Every step inverted by the fixed-point engine reports (the residual blocks and the
        autoregressive steps, whose ``last_inverse_stats`` the engine fills); see
        :func:`~iresflow.models.evaluation.inverse_diagnostics`.
        """
        return evaluation.inverse_diagnostics([
            (name, step) for name, step in self.transform.named_steps()
            if hasattr(step, "last_inverse_stats")
        ])

    @property
    def exact_by_frames(self) -> bool:
        """Whether every residual step's branch is position-wise or causal over frames
        (:func:`~iresflow.logdet.exact.splits_by_frames`): then the exact log-density costs a
        few branch passes and one ``D x D`` determinant per frame and step, not a factorisation
        of each sequence's whole ``N D x N D`` Jacobian, and validation uses it
        (docs/forecasting.md#frame-scores)."""
        return all(splits_by_frames(block.branch) for block in self._residual_blocks())

    @torch.no_grad()
    def lipschitz_report(
        self,
        seq_len: int | None = None,
        *,
        n_inputs: int = 4,
        generator: torch.Generator | None = None,
    ) -> list[dict[str, Any]]:
        """Certified and observed Lipschitz constants of every residual branch.

        Probes ``n_inputs`` standard normal sequences of length ``seq_len`` (``None``:
        ``min(max_len, 16)``) drawn from ``generator``; see
        :func:`~iresflow.models.evaluation.lipschitz_report` for the fields. Runs in
        ``eval()`` mode (exact spectral norms) and restores the previous mode.
        """
        longest = self.max_len if self.max_len is not None else math.inf
        seq_len = min(longest, 16) if seq_len is None else check_int(seq_len, "seq_len", 1)
        if seq_len > longest:
            raise ValueError(f"seq_len must be <= max_len={self.max_len}, got {seq_len}")
        n_inputs = check_int(n_inputs, "n_inputs", 1)
        generator = check_generator(generator)
        reference = self._reference()
        x = torch.randn(n_inputs, seq_len, self.features, generator=generator,
                        device=reference.device, dtype=reference.dtype)
        was_training = self.training
        self.eval()
        try:
            return evaluation.lipschitz_report(self.residual_steps(), x)
        finally:
            self.train(was_training)

    # ----------------------------------------------------------------------------------------
    # internals

    def _reference(self) -> Tensor:
        """A parameter of the model, giving its device and dtype."""
        return next(self.parameters())

    def _context(self, context: object, batch: int, reference: Tensor) -> Tensor | None:
        """The validated context vector ``(B, C)`` of a call (``None`` when unconditional)."""
        if self.context_encoder is None:
            if context is not None:
                raise ValueError("the flow is unconditional: context must be None")
            return None
        if context is None:
            raise ValueError("the flow is conditional: context is required (labels (B,) or "
                             "covariates (B, C))")
        return self.context_encoder(self.context_encoder.check(context, batch, reference))

    def _residual_blocks(self) -> list[ResidualTransform]:
        """The residual blocks of the chain, in order."""
        return [step for step in self.transform.steps if isinstance(step, ResidualTransform)]

    def _check(
        self, x: object, mask: object, name: str, logdet: object, context: object = None,
        *, initialize: bool = False,
    ) -> tuple[Tensor, Tensor | None, Tensor | None]:
        """The one validation of a call, at the door: the batch and its mask with one fused
        value check, the length, the context, then the chain's option checks (which read no
        values). With ``initialize`` (the data-to-noise methods), a chain that is not
        initialised is then initialised from the batch in training mode: the one place where
        the flow initialises by itself. Returns ``(x, mask, context vector or None)``."""
        reference = self._reference()
        x, mask = check_inputs(x, mask, name, features=self.features, allow_2d=False,
                               like=reference)
        if self.max_len is not None and x.shape[1] > self.max_len:
            raise ValueError(
                f"{name} has length {x.shape[1]} > max_len={self.max_len} (shape (B, N, D) "
                f"with N <= max_len)"
            )
        c = self._context(context, x.shape[0], reference)
        self.transform.check_options(x, c, mask=mask, logdet=logdet)
        if initialize and self.training and not self.transform.is_initialized:
            self.transform.initialize(x, mask, context=c, check=False)
        return x, mask, c

    def _log_prob(
        self, x: Tensor, mask: Tensor | None, blocks: list[ResidualTransform],
        policy: LogDetPolicy, context: Tensor | None = None,
    ) -> Tensor:
        """One pass: the chain maps data to noise with its log-determinant (every residual
        block handed its estimator and roulette count of the pass), then the base density."""
        logdet = policy.pass_request(blocks)
        z, logabsdet = self.transform(x, context, mask=mask, logdet=logdet, check=False)
        return self.base.log_prob(z, mask, context) + logabsdet
