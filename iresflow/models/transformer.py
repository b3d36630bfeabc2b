r"""The sequence residual-flow Transformer (MATH.md D, "iresflow block").

Every block is a composition of invertible maps (data to noise)

.. math::
    X \;\to\; \mathrm{ActNorm} \;\to\; (\cdot) + f_{\rm attn}(\cdot + E)
      \;\to\; \mathrm{ActNorm} \;\to\; (\cdot) + f_{\rm ffn}(\cdot),

with a contractive attention branch :math:`f_{\rm attn}` (L2 attention certified in the
:math:`\infty`-norm, MATH.md C, D; or LipschitzNorm attention certified in the 2-norm, MATH.md F)
that sees a positional table :math:`E` added inside the branch, and a
position-wise spectrally normalised LipSwish MLP :math:`f_{\rm ffn}` (MATH.md G6, G7). The noise
:math:`Z` has a standard normal density over the real tokens, so by the change of variables
(MATH.md G1)

.. math:: \log p(X) = \sum_{n\,:\,m_n = 1} \log\mathcal N(z_n; 0, I_D)
    + \sum_{\text{steps}} \log|\det J_{\text{step}}| .
"""

from __future__ import annotations

import math
from typing import Any, Literal

import torch
from torch import Tensor, nn

from iresflow._validation import check_float, check_generator, check_int, check_mask, check_sequence
from iresflow.logdet.base import LogDetEstimator
from iresflow.logdet.exact import ExactLogDet
from iresflow.logdet.roulette import RouletteLogDet
from iresflow.logdet.series import SeriesLogDet
from iresflow.nn.attention import (
    ContractiveL2MultiheadAttention,
    ContractiveLipschitzNormAttention,
)
from iresflow.nn.base import LipschitzBranch
from iresflow.nn.diagnostics import jacobian_norm
from iresflow.nn.mlp import LipschitzMLP
from iresflow.nn.positional import PositionalBranch, make_positional_encoding
from iresflow.transforms.actnorm import ActNorm
from iresflow.transforms.base import SequenceCompositeTransform
from iresflow.transforms.residual import ResidualTransform

__all__ = ["ResidualFlowTransformer", "default_heads"]

ATTENTION_KINDS = ("l2", "lipschitznorm", "none")
POSITIONAL_KINDS = ("sinusoidal", "learned")
LOGDET_METHODS = ("roulette", "exact", "series")
#: Linear layers of the position-wise MLP branch (dims ``(D, hidden, hidden, D)``).
MLP_LAYERS = 3
#: Sequence copies per chunk of the exact Jacobian when ``chunk_size`` is not given: a chunk of
#: ``c`` sequences costs ``c * N * D`` (attention) or ``c * D`` (MLP) branch evaluations.
EXACT_COPIES_PER_CHUNK = 4096
#: The log-det of a step is discarded where only the map is needed (``transform_to_noise``,
#: ``inverse``); a one-term series is the cheapest estimator that evaluates the branch.
_MAP_ONLY = SeriesLogDet(n_terms=1)


def default_heads(features: int) -> int:
    """Default number of attention heads: the largest of 4, 3, 2, 1 that divides ``features``.

    Four heads of width ``D / 4`` is the usual choice for small feature sizes (``D = 12`` gives
    head width 3); smaller ``D`` fall back to the largest divisor available.

    Args:
        features: Feature size ``D``.

    Returns:
        The number of heads.

    Example:
        >>> default_heads(12), default_heads(6), default_heads(5)
        (4, 3, 1)
    """
    return next(h for h in (4, 3, 2, 1) if features % h == 0)


class ResidualFlowTransformer(nn.Module):
    r"""Residual-flow Transformer: a normalising flow for (variable-length) sequences.

    ``n_blocks`` blocks of ``ActNorm -> x + f_attn(x + E) -> ActNorm -> x + f_ffn(x)`` (module
    docstring; MATH.md D), a standard normal base over the real tokens. With
    ``attention="none"`` every block is ``ActNorm -> x + f_ffn(x)``: a flow on single frames
    applied i.i.d. to every frame (the ablation without interactions between tokens).

    Branch certificates: the attention branch is ``coeff`` times the attention map divided by
    its certified bound (MATH.md D for L2 attention, F for LipschitzNorm); each of the three
    spectrally normalised layers of the MLP branch gets ``coeff ** (1/3)``, so that the MLP
    branch is also certified at ``coeff`` (2-norm). Every residual step is therefore invertible with
    :math:`\mathrm{lip}(g) \le` ``coeff`` ``< 1``.

    The flow from data to noise is :attr:`transform`, an nflows-compatible
    :class:`~iresflow.transforms.base.SequenceCompositeTransform` (usable inside
    ``nflows.flows.Flow`` for fixed-length data). :attr:`config` holds the constructor
    arguments (JSON-serialisable), so ``ResidualFlowTransformer(**model.config)`` rebuilds the
    architecture for a saved ``state_dict``.

    Spectral normalisation uses power-iteration estimates in training mode and exact norms in
    evaluation mode (:class:`~iresflow.nn.linear.SpectralLinear`), and ActNorm initialises from
    the first training forward: evaluate, invert and sample in ``eval()`` mode.

    Args:
        features: Feature size ``D`` of every token.
        n_blocks: Number of blocks.
        hidden: Hidden width of the MLP branch (dims ``(D, hidden, hidden, D)``).
        heads: Attention heads (must divide ``features``); ``None`` takes the largest of 4, 3,
            2, 1 dividing ``features`` (:func:`default_heads`).
        coeff: Certified Lipschitz bound of every residual branch, in ``(0, 1)``.
        attention: ``"l2"`` (contractive L2 multi-head attention, MATH.md B-D),
            ``"lipschitznorm"`` (LipschitzNorm attention, MATH.md F) or ``"none"``.
        positional: ``"sinusoidal"`` (fixed table) or ``"learned"`` (one table of ``max_len``
            rows shared by all attention branches), added inside the attention branch.
        max_len: Longest sequence the model accepts.
        logdet: Training log-determinant estimator of every residual step: ``"roulette"``
            (unbiased Russian roulette with Neumann gradient, MATH.md G4/G5), ``"exact"``
            (dense Jacobian, small models) or ``"series"`` (truncated power series, biased).
        n_power_iterations: Power-iteration steps per training forward of every spectrally
            normalised layer (with ``spectral_norm="power"``).
        spectral_norm: How the MLP layers get their spectral norm in training mode: ``"exact"``
            (an SVD per weight update, so the certificate holds in every forward; maximum
            likelihood rewards expansion, which makes power iteration lag behind the weights)
            or ``"power"`` (warm-started power iteration, cheaper for wide layers).

    Example:
        >>> model = ResidualFlowTransformer(3, n_blocks=1, hidden=8, max_len=6).double().eval()
        >>> x = torch.randn(2, 5, 3, dtype=torch.float64)
        >>> mask = torch.tensor([[True] * 5, [True] * 3 + [False] * 2])
        >>> model.log_prob(x, mask, method="exact").shape
        torch.Size([2])
        >>> torch.allclose(model.inverse(model.transform_to_noise(x, mask), mask), x, atol=1e-8)
        True
    """

    def __init__(
        self,
        features: int,
        n_blocks: int = 4,
        hidden: int = 64,
        heads: int | None = None,
        coeff: float = 0.9,
        attention: Literal["l2", "lipschitznorm", "none"] = "l2",
        positional: Literal["sinusoidal", "learned"] = "sinusoidal",
        max_len: int = 512,
        logdet: Literal["roulette", "exact", "series"] = "roulette",
        n_power_iterations: int = 1,
        spectral_norm: Literal["exact", "power"] = "exact",
    ) -> None:
        super().__init__()
        features = check_int(features, "features", 1)
        n_blocks = check_int(n_blocks, "n_blocks", 1)
        hidden = check_int(hidden, "hidden", 1)
        coeff = check_float(coeff, "coeff", 0.0, 1.0)
        max_len = check_int(max_len, "max_len", 1)
        n_power_iterations = check_int(n_power_iterations, "n_power_iterations", 1)
        if attention not in ATTENTION_KINDS:
            raise ValueError(f"attention must be one of {ATTENTION_KINDS}, got {attention!r}")
        if positional not in POSITIONAL_KINDS:
            raise ValueError(f"positional must be one of {POSITIONAL_KINDS}, got {positional!r}")
        if spectral_norm not in ("exact", "power"):
            raise ValueError(f'spectral_norm must be "exact" or "power", got {spectral_norm!r}')
        if logdet not in LOGDET_METHODS:
            raise ValueError(f"logdet must be one of {LOGDET_METHODS}, got {logdet!r}")
        heads = default_heads(features) if heads is None else check_int(heads, "heads", 1)
        if features % heads != 0:
            raise ValueError(f"heads must divide features={features}, got heads={heads}")

        self.features = features
        self.max_len = max_len
        self.config: dict[str, Any] = {
            "features": features,
            "n_blocks": n_blocks,
            "hidden": hidden,
            "heads": heads,
            "coeff": coeff,
            "attention": attention,
            "positional": positional,
            "max_len": max_len,
            "logdet": logdet,
            "n_power_iterations": n_power_iterations,
            "spectral_norm": spectral_norm,
        }
        encoding = None if attention == "none" else make_positional_encoding(
            positional, features, max_len
        )
        layer_coeff = coeff ** (1.0 / MLP_LAYERS)
        steps: list[nn.Module] = []
        names: list[str] = []
        for i in range(n_blocks):
            if encoding is not None:
                attn = _attention_branch(attention, features, heads, coeff)
                steps += [ActNorm(features), ResidualTransform(PositionalBranch(attn, encoding),
                                                               logdet=logdet)]
                names += [f"block{i}.actnorm_attention", f"block{i}.attention"]
            mlp = LipschitzMLP((features, hidden, hidden, features), coeff=layer_coeff,
                               n_power_iterations=n_power_iterations, sigma=spectral_norm)
            steps += [ActNorm(features), ResidualTransform(mlp, logdet=logdet)]
            names += [f"block{i}.actnorm_mlp", f"block{i}.mlp"]
        self.transform = SequenceCompositeTransform(steps)
        # Unregistered references to the same modules (registered once, under `transform`).
        self._steps: tuple[tuple[str, nn.Module], ...] = tuple(zip(names, steps, strict=True))

    # ----------------------------------------------------------------------------------------
    # densities

    def log_prob(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        method: Literal["exact", "roulette"] | None = None,
        n_samples: int = 1,
        return_stderr: bool = False,
        chunk_size: int | None = None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        r"""Log-density, in nats, of the sequences as given.

        .. math:: \log p(X) = \sum_{n\,:\,m_n=1}\log\mathcal N(z_n; 0, I_D)
            + \sum_{\text{steps}}\log|\det J_{\text{step}}|,

        the base log-density summed over the real tokens plus the log-determinants of all steps
        (padded tokens never enter). Differentiable (for training) when grad mode is on.

        Args:
            x: Sequences, shape ``(B, N, D)`` with ``D = features`` and ``N <= max_len``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.
            method: Log-determinant of the residual steps: ``None`` uses the configured training
                estimator (``config["logdet"]``); ``"exact"`` the dense Jacobian of every step
                (per-token ``D x D`` blocks for the MLP branches, the full ``(N D) x (N D)``
                Jacobian for attention), evaluated in chunks of sequences of similar length with
                the trailing padding common to a chunk removed (padding never changes a
                density); ``"roulette"`` the unbiased Russian-roulette estimator (in ``eval()``
                mode with 20 exact terms): the configured estimators, with their generators,
                when ``config["logdet"]`` is ``"roulette"``, else a default
                :class:`~iresflow.logdet.roulette.RouletteLogDet` on torch's global generator.
            n_samples: Number of independent estimates averaged (stochastic estimators only;
                must be 1 for ``"exact"``).
            return_stderr: Also return the standard error of the average: the sample standard
                deviation of the ``n_samples`` estimates over :math:`\sqrt{n}` (needs
                ``n_samples >= 2`` for a stochastic estimator; zeros for ``"exact"``).
            chunk_size: Sequences per chunk of the exact method. ``None`` sizes every chunk so
                that the attention Jacobian evaluates the branch on at most 4096 sequence
                copies (``EXACT_COPIES_PER_CHUNK``, ``chunk * N * D``), which keeps test sets
                with ``N D`` up to ~1000 within a few hundred MB when called under
                ``torch.no_grad()``. (With grad mode on, the graphs of all chunks are kept for
                the backward pass.)

        Returns:
            ``log_prob`` of shape ``(B,)``, or ``(log_prob, stderr)`` with ``return_stderr``.

        Raises:
            ValueError: invalid inputs or options.
        """
        x, mask = self._check_inputs(x, mask)
        if method not in (None, "exact", "roulette"):
            raise ValueError(f"method must be None, 'exact' or 'roulette', got {method!r}")
        n_samples = check_int(n_samples, "n_samples", 1)
        if chunk_size is not None:
            chunk_size = check_int(chunk_size, "chunk_size", 1)
        exact = method == "exact" or (method is None and self.config["logdet"] == "exact")
        if exact and n_samples != 1:
            raise ValueError(f"the exact log-density is deterministic: n_samples must be 1, "
                             f"got {n_samples}")
        if return_stderr and not exact and n_samples < 2:
            raise ValueError("return_stderr needs n_samples >= 2 for a stochastic estimator")

        if exact:
            estimates = [self._exact_log_prob(x, mask, chunk_size)]
        else:
            # The configured estimators (and their generators) serve whenever they match.
            configured = method is None or self.config["logdet"] == method
            estimator = None if configured else RouletteLogDet()
            estimates = []
            for _ in range(n_samples):
                z, logdet = self._cascade(x, mask, estimator)
                estimates.append(_base_log_prob(z, mask) + logdet)
        if n_samples == 1:
            value = estimates[0]
            stderr = torch.zeros_like(value)
        else:
            stacked = torch.stack(estimates)
            value = stacked.mean(0)
            stderr = stacked.detach().std(0) / math.sqrt(n_samples)
        return (value, stderr) if return_stderr else value

    def transform_to_noise(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Map data to noise through every step.

        Args:
            x: Sequences ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``.

        Returns:
            ``z`` of shape ``(B, N, D)``, equal to ``x`` at padded positions.
        """
        x, mask = self._check_inputs(x, mask)
        return self._cascade(x, mask, _MAP_ONLY)[0]

    def inverse(self, z: Tensor, mask: Tensor | None = None) -> Tensor:
        """Map noise to data, inverting every step, last first (fixed-point inverse, MATH.md G8).

        Runs without gradient tracking; :meth:`inverse_diagnostics` reports the convergence of
        the last call.

        Args:
            z: Noise sequences ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``.

        Returns:
            ``x`` of shape ``(B, N, D)``, equal to ``z`` at padded positions.

        Raises:
            InversionError: a fixed-point iteration did not converge.
        """
        z, mask = self._check_inputs(z, mask, name="z")
        x = z
        with torch.no_grad():
            for _, step in reversed(self._steps):
                if isinstance(step, ResidualTransform):
                    x, _ = step.inverse(x, mask=mask, logdet=_MAP_ONLY)
                else:
                    x, _ = step.inverse(x, mask=mask)
        return x

    @torch.no_grad()
    def sample(
        self,
        num: int,
        seq_len: int | None = None,
        lengths: Tensor | None = None,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
    ) -> tuple[Tensor, Tensor]:
        r"""Draw sequences: :math:`z_n \sim \mathcal N(0, T^2 I_D)` on real tokens, then invert.

        Args:
            num: Number of sequences.
            seq_len: Common length ``N`` of all samples (exclusive with ``lengths``).
            lengths: Per-sample lengths, integer tensor ``(num,)`` with values in
                ``[1, max_len]``; ``N = max(lengths)`` and shorter samples are padded.
            generator: Optional ``torch.Generator`` for the noise (on the model's device).
            temperature: Standard deviation :math:`T > 0` of the base noise (1 = the model).

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
        z = torch.randn(*mask.shape, self.features, generator=generator, device=reference.device,
                        dtype=reference.dtype) * temperature
        z = torch.where(mask.unsqueeze(-1), z, 0.0)
        return self.inverse(z, mask), mask

    def inverse_diagnostics(self) -> dict[str, Any]:
        """Convergence of the fixed-point inverses of the last :meth:`inverse` / :meth:`sample`.

        Returns:
            ``{"max_iterations": int, "max_residual": float, "converged": bool, "blocks":
            [{"name", "max_iterations", "max_residual", "converged"}, ...]}``: maxima over the
            batch per residual step, and over all steps.

        Raises:
            RuntimeError: no inverse has been computed yet.
        """
        blocks = []
        for name, step in self._residual_steps():
            stats = step.last_inverse_stats
            if stats is None:
                raise RuntimeError("no inverse has been computed yet (call inverse or sample)")
            blocks.append({
                "name": name,
                "max_iterations": int(stats.iterations.max()),
                "max_residual": float(stats.residual.max()),
                "converged": bool(stats.converged.all()),
            })
        return {
            "max_iterations": max(b["max_iterations"] for b in blocks),
            "max_residual": max(b["max_residual"] for b in blocks),
            "converged": all(b["converged"] for b in blocks),
            "blocks": blocks,
        }

    @torch.no_grad()
    def lipschitz_report(
        self,
        seq_len: int | None = None,
        *,
        n_inputs: int = 4,
        generator: torch.Generator | None = None,
    ) -> list[dict[str, Any]]:
        r"""Certified and observed Lipschitz constants of every residual branch.

        * ``"certified"``: the branch certificate :meth:`LipschitzBranch.lipschitz_constant`
          (``coeff`` for the normalised attention; the product of the exact layer norms for the
          MLP, at most ``coeff``).
        * ``"estimate"``: the largest *local* Lipschitz constant observed, i.e. the operator
          norm, in the certificate's norm (``"inf"``: max abs row sum; ``"2"``: largest
          singular value), of the exact branch Jacobian :math:`J_g(X)`
          (:func:`~iresflow.nn.diagnostics.jacobian_norm`) at ``n_inputs`` random standard
          normal sequences of length ``seq_len``. A lower bound of the true constant, so
          ``estimate <= certified``; the ratio shows how much of the certificate is used.
        * ``"raw_bound"``: for attention, the certified bound of the attention map *before*
          the normalisation by it (:math:`B(\theta, N)` of MATH.md C/F, at ``seq_len``), which
          measures how expansive the learned weights are; ``None`` for the MLP.

        The report always describes the evaluation-mode model (exact spectral norms, MATH.md
        G7): it runs in ``eval()`` mode and restores the previous mode afterwards, so it neither
        reports the power-iteration estimates of a training-mode forward nor advances them.

        Args:
            seq_len: Sequence length of the probe inputs and of ``"raw_bound"``; ``None`` uses
                ``min(max_len, 16)``.
            n_inputs: Number of random probe sequences.
            generator: Optional ``torch.Generator`` for the probe inputs.

        Returns:
            One dict per residual step, in order: ``name`` (e.g. ``"block0.attention"``),
            ``type`` (branch class), ``norm``, ``seq_len``, ``certified``, ``estimate`` and
            ``raw_bound``.
        """
        seq_len = min(self.max_len, 16) if seq_len is None else check_int(seq_len, "seq_len", 1)
        if seq_len > self.max_len:
            raise ValueError(f"seq_len must be <= max_len={self.max_len}, got {seq_len}")
        n_inputs = check_int(n_inputs, "n_inputs", 1)
        generator = check_generator(generator)
        reference = self._reference()
        x = torch.randn(n_inputs, seq_len, self.features, generator=generator,
                        device=reference.device, dtype=reference.dtype)
        was_training = self.training
        self.eval()
        try:
            report = []
            for name, step in self._residual_steps():
                branch = step.branch
                inner = branch.branch if isinstance(branch, PositionalBranch) else branch
                raw = getattr(inner, "raw_bound", None)
                with torch.enable_grad():
                    local = jacobian_norm(lambda t, g=branch: g(t), x, branch.norm)
                report.append({
                    "name": name,
                    "type": type(inner).__name__,
                    "norm": branch.norm,
                    "seq_len": seq_len,
                    "certified": float(branch.lipschitz_constant(seq_len)),
                    "estimate": float(local.max()),
                    "raw_bound": None if raw is None else float(raw(seq_len)),
                })
        finally:
            self.train(was_training)
        return report

    # ----------------------------------------------------------------------------------------
    # internals

    def _reference(self) -> Tensor:
        """A parameter of the model, giving its device and dtype."""
        return next(self.parameters())

    def _residual_steps(self) -> list[tuple[str, ResidualTransform]]:
        return [(n, s) for n, s in self._steps if isinstance(s, ResidualTransform)]

    def _check_inputs(
        self, x: Tensor, mask: Tensor | None, name: str = "x"
    ) -> tuple[Tensor, Tensor | None]:
        x = check_sequence(x, name, features=self.features, allow_2d=False, like=self._reference())
        mask = check_mask(mask, x)
        if x.shape[1] > self.max_len:
            raise ValueError(
                f"{name} has length {x.shape[1]} > max_len={self.max_len} (shape (B, N, D) "
                f"with N <= max_len)"
            )
        return x, mask

    def _exact_log_prob(self, x: Tensor, mask: Tensor | None, chunk_size: int | None) -> Tensor:
        """Exact log-density in chunks of sequences sorted by length, trailing padding cut."""
        batch, length, features = x.shape
        if self.training and not all(
            bool(step.initialized) for _, step in self._steps if isinstance(step, ActNorm)
        ):
            # Data-dependent ActNorm initialisation from the whole batch, not its first chunk.
            with torch.no_grad():
                self._cascade(x, mask, _MAP_ONLY)
        if mask is None:
            ends = [length] * batch
        else:
            positions = torch.arange(1, length + 1, device=x.device)
            ends = (mask * positions).amax(1).tolist()  # one past the last real token
        order = sorted(range(batch), key=ends.__getitem__)
        estimator = ExactLogDet(chunk_size=None)
        values, start = [], 0
        while start < batch:
            stop = start + 1
            if chunk_size is not None:
                stop = min(batch, start + chunk_size)
            else:
                while (stop < batch and (stop + 1 - start) * ends[order[stop]] * features
                       <= EXACT_COPIES_PER_CHUNK):
                    stop += 1
            index = torch.tensor(order[start:stop], device=x.device)
            n = ends[order[stop - 1]]
            xc = x[index, :n]
            mc = None if mask is None else mask[index, :n]
            z, logdet = self._cascade(xc, mc, estimator)
            values.append(_base_log_prob(z, mc) + logdet)
            start = stop
        inverse = torch.empty(batch, dtype=torch.long, device=x.device)
        inverse[torch.tensor(order, device=x.device)] = torch.arange(batch, device=x.device)
        return torch.cat(values)[inverse]

    def _cascade(
        self,
        x: Tensor,
        mask: Tensor | None,
        estimator: LogDetEstimator | None,
    ) -> tuple[Tensor, Tensor]:
        """Data to noise through every step; ``estimator`` overrides the configured ones."""
        total = x.new_zeros(x.shape[0])
        for _, step in self._steps:
            if isinstance(step, ResidualTransform) and estimator is not None:
                x, logdet = step(x, mask=mask, logdet=estimator)
            else:
                x, logdet = step(x, mask=mask)
            total = total + logdet
        return x, total


def sample_mask(
    num: int, seq_len: int | None, lengths: Tensor | None, max_len: int,
    device: torch.device | str | None = None,
) -> Tensor:
    """Padding mask for ``num`` sequences to sample, from a common length or per-sample lengths.

    Args:
        num: Number of sequences, ``>= 1``.
        seq_len: Common length in ``[1, max_len]``; exclusive with ``lengths``.
        lengths: Per-sample lengths, integer tensor ``(num,)`` with values in ``[1, max_len]``.
        max_len: Longest length the model accepts.
        device: Device of the returned mask.

    Returns:
        Boolean mask ``(num, N)`` (``True`` = real token), ``N = seq_len`` or ``max(lengths)``.

    Raises:
        ValueError: neither or both of ``seq_len`` and ``lengths``, or lengths out of range.
        TypeError: ``num`` or ``seq_len`` is not an int, or ``lengths`` is not an integer tensor.

    Example:
        >>> sample_mask(2, None, torch.tensor([1, 3]), 4).int().tolist()
        [[1, 0, 0], [1, 1, 1]]
    """
    num = check_int(num, "num", 1)
    if (seq_len is None) == (lengths is None):
        raise ValueError("give exactly one of seq_len and lengths")
    if lengths is None:
        seq_len = check_int(seq_len, "seq_len", 1)
        if seq_len > max_len:
            raise ValueError(f"seq_len must be <= max_len={max_len}, got {seq_len}")
        return torch.ones(num, seq_len, dtype=torch.bool, device=device)
    if not isinstance(lengths, Tensor) or lengths.dtype.is_floating_point or (
        lengths.dtype in (torch.bool, torch.complex64, torch.complex128)
    ):
        raise TypeError("lengths must be an integer torch.Tensor of shape (num,)")
    if lengths.shape != (num,):
        raise ValueError(f"lengths must have shape (num,) = ({num},), got {tuple(lengths.shape)}")
    if bool((lengths < 1).any()) or bool((lengths > max_len).any()):
        raise ValueError(f"lengths must lie in [1, max_len={max_len}]")
    lengths = lengths.to(device)
    return torch.arange(int(lengths.max()), device=lengths.device) < lengths.unsqueeze(1)


def _attention_branch(kind: str, features: int, heads: int, coeff: float) -> LipschitzBranch:
    if kind == "l2":
        return ContractiveL2MultiheadAttention(features, heads, coeff=coeff)
    return ContractiveLipschitzNormAttention(features, heads, coeff=coeff)


def _base_log_prob(z: Tensor, mask: Tensor | None) -> Tensor:
    r"""Standard normal log-density summed over real tokens, :math:`(B, N, D) \to (B,)`."""
    per_token = -0.5 * z.square().sum(-1) - 0.5 * z.shape[-1] * math.log(2 * math.pi)
    if mask is not None:
        per_token = torch.where(mask, per_token, 0.0)
    return per_token.sum(-1)
