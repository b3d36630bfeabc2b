r"""The invertible residual block :math:`x \mapsto x + g(x)` (docs/math.md#contractive-attention,
#change-of-variables, #fixed-point-inverse; check H9 (docs/math.md#checks))."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Literal

import torch
from torch import Tensor

from iresflow._validation import check_length, check_logdet_dtype
from iresflow.inverse.fixed_point import InverseStats, fixed_point_inverse
from iresflow.inverse.scalar import TABLE_POINTS, scalar_start
from iresflow.logdet.base import LogDetEstimator
from iresflow.logdet.exact import frame_logdets
from iresflow.logdet.factory import make_logdet
from iresflow.nn.base import Linearization, LipschitzBranch
from iresflow.nn.conditional import check_context
from iresflow.transforms.base import FRAMES, LogDetRequest, SequenceTransform

__all__ = ["ResidualTransform"]


class ResidualTransform(SequenceTransform):
    r"""Invertible residual block :math:`f(x) = x + g(x)` with a contractive branch :math:`g`.

    Since the branch certifies :math:`\mathrm{lip}(g) \le L < 1`
    (docs/math.md#contractive-attention), :math:`f` is invertible, :math:`\det(I + J_g) > 0`, and
    (docs/math.md#change-of-variables)

    .. math:: \log|\det J_f(x)| = \log\det(I + J_g(x))
        = \sum_{k \ge 1} \frac{(-1)^{k+1}}{k} \mathrm{tr}\big(J_g(x)^k\big),

    evaluated by the configured :class:`~iresflow.logdet.base.LogDetEstimator` (exact, truncated
    series or unbiased Russian roulette; with roulette the training gradient is the Neumann
    surrogate of docs/math.md#neumann-gradient). The inverse solves :math:`x + g(x) = y` per sample
    with :func:`~iresflow.inverse.fixed_point.fixed_point_inverse`
    (docs/math.md#fixed-point-inverse) and returns :math:`-\log\det(I + J_g(x))` at the solution.

    Sequences ``(B, N, D)`` and vectors ``(B, D)`` (treated as ``N = 1``) are accepted. With a
    padding mask, padded positions pass through unchanged (the branch is exactly 0 there) and add
    nothing to ``logabsdet``. A :class:`~iresflow.nn.conditional.ConditionalBranch` (a branch
    with a ``context_features`` attribute and ``bind``) makes the block conditional:
    ``context`` ``(B, C)`` is then required and passed to the branch, :math:`g(x, c)`, in the
    log-determinant (with respect to :math:`x` only) and in the inverse, which solves
    :math:`x + g(x, c) = y` for fixed :math:`c`. Otherwise ``context`` must be ``None`` (the
    argument exists for nflows compatibility).

    Sequences longer than the branch's ``max_len`` (where its certificate no longer holds,
    e.g. a temporal convolution) are rejected at the door of :meth:`forward` and
    :meth:`inverse`, and so of every chain and model built on the block.

    ``forward`` and ``inverse`` are those of :class:`~iresflow.transforms.base.SequenceTransform`:
    ``logdet=False`` evaluates the map only (no estimator, no random draws), and an estimator
    (instance or name, or this block's entry of a mapping from blocks to estimators) replaces
    the configured one for the call.

    ``inverse`` is meant for sampling and evaluation: it runs without gradient tracking and its
    outputs are detached. The diagnostics of the last call are kept in
    :attr:`last_inverse_stats`. Invert in evaluation mode (``.eval()``): in training mode a
    branch may update buffers in every evaluation (the power iteration of
    :class:`~iresflow.nn.linear.SpectralLinear`), so the map would drift slightly, by the
    power-iteration lag, during the fixed-point iteration.

    Args:
        branch: The residual branch; its certificate :meth:`~LipschitzBranch.lipschitz_constant`
            must be below 1.
        logdet: Log-determinant method (name accepted by
            :func:`~iresflow.logdet.factory.make_logdet`, e.g. ``"exact"``, ``"series"``,
            ``"roulette"``) or an estimator instance.
        inverse_tol: Max-abs step tolerance of the inverse; ``None`` uses the dtype default of
            :func:`~iresflow.inverse.fixed_point.default_tolerance`.
        inverse_max_iter: Maximum branch evaluations per sample in the inverse.
        inverse_solver: ``"anderson"`` (accelerated, the default: several times fewer
            evaluations near :math:`L = 1`, see ``benchmarks/inverse.py``) or ``"plain"``.
        on_failure: ``"raise"`` or ``"warn"`` when the inverse does not converge.

    Raises:
        TypeError: ``branch`` is not a :class:`~iresflow.nn.base.LipschitzBranch`.
        ValueError: the branch certificate is not below 1, or an invalid option.

    Example:
        >>> from iresflow.nn.mlp import LipschitzMLP
        >>> block = ResidualTransform(LipschitzMLP((3, 8, 3), coeff=0.9), logdet="exact").double()
        >>> x = torch.randn(2, 4, 3, dtype=torch.float64)
        >>> y, logabsdet = block(x)
        >>> x_rec, inverse_logabsdet = block.inverse(y)
        >>> torch.allclose(x_rec, x, atol=1e-9), torch.allclose(logabsdet, -inverse_logabsdet)
        (True, True)
    """

    last_inverse_stats: InverseStats | None

    def __init__(
        self,
        branch: LipschitzBranch,
        logdet: str | LogDetEstimator = "roulette",
        *,
        inverse_tol: float | None = None,
        inverse_max_iter: int = 1000,
        inverse_solver: Literal["plain", "anderson"] = "anderson",
        on_failure: Literal["raise", "warn"] = "raise",
    ) -> None:
        super().__init__()
        if not isinstance(branch, LipschitzBranch):
            raise TypeError(f"branch must be a LipschitzBranch, got {type(branch).__name__}")
        with torch.no_grad():
            certificate = float(branch.lipschitz_constant())
        if not certificate < 1:
            raise ValueError(
                f"branch must be contractive (certified Lipschitz constant < 1) for the block "
                f"to be invertible, got {certificate:.6g}"
            )
        if inverse_tol is not None and (
            isinstance(inverse_tol, bool)
            or not isinstance(inverse_tol, (int, float))
            or not 0 < inverse_tol < float("inf")
        ):
            raise ValueError(f"inverse_tol must be a positive float or None, got {inverse_tol!r}")
        if (
            isinstance(inverse_max_iter, bool)
            or not isinstance(inverse_max_iter, int)
            or inverse_max_iter < 1
        ):
            raise ValueError(f"inverse_max_iter must be a positive int, got {inverse_max_iter!r}")
        if inverse_solver not in ("plain", "anderson"):
            raise ValueError(
                f"inverse_solver must be 'plain' or 'anderson', got {inverse_solver!r}"
            )
        if on_failure not in ("raise", "warn"):
            raise ValueError(f"on_failure must be 'raise' or 'warn', got {on_failure!r}")
        self.branch = branch
        self.logdet = make_logdet(logdet)
        self.inverse_tol = inverse_tol
        self.inverse_max_iter = inverse_max_iter
        self.inverse_solver = inverse_solver
        self.on_failure = on_failure
        self.last_inverse_stats = None

    @property
    def features(self) -> int | None:
        """Feature size ``D`` the branch requires, if it declares one."""
        return getattr(self.branch, "features", None)

    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        """Certified Lipschitz constant of the branch :math:`g` (0-dim tensor, ``< 1``).

        Args:
            seq_len: Sequence length ``N``, for branches whose bound depends on it.
        """
        return self.branch.lipschitz_constant(seq_len)

    @property
    def causal(self) -> bool:  # type: ignore[override]
        """Whether the branch is position-wise or causal over frames (then so is the block and,
        by forward substitution, its inverse)."""
        return bool(self.branch.position_wise or self.branch.causal)

    @property
    def context_features(self) -> int | None:
        """Context size ``C`` of a conditional branch (``None``: unconditional)."""
        return getattr(self.branch, "context_features", None)

    def _check_options(self, inputs: Tensor, context: Tensor | None, logdet: object) -> None:
        branch = self.branch
        check_length(1 if inputs.dim() == 2 else inputs.shape[1], branch.max_len,
                     type(branch).__name__)
        context_features = getattr(branch, "context_features", None)
        if context_features is None:
            if context is not None:
                raise ValueError("ResidualTransform is unconditional: context must be None")
        else:
            if context is None:
                raise ValueError(
                    f"the branch is conditional: context of shape (B, {context_features}) "
                    f"is required"
                )
            check_context(context, inputs.shape[0], context_features, inputs)
        if logdet is not False:
            check_logdet_dtype(inputs, "inputs")

    def _estimator(self, logdet: LogDetRequest) -> LogDetEstimator:
        """The estimator of a call: the configured one (``logdet=True``), the override, or this
        block's entry of a per-block mapping (the configured one if it has none)."""
        if logdet is True:
            return self.logdet
        if isinstance(logdet, Mapping):
            return logdet.get(self, self.logdet)
        return make_logdet(logdet)

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r""":math:`y = x + g(x)` and, unless ``logdet=False``, :math:`\log\det(I + J_g(x))`."""
        vector = inputs.dim() == 2
        x = inputs.unsqueeze(1) if vector else inputs
        branch = self.branch if context is None else self.branch.bind(context)
        if logdet is False:
            g, logabsdet = branch(x, mask), None
        elif logdet == FRAMES:
            g, logabsdet = frame_logdets(branch, x, mask)
        else:
            g, logabsdet = self._estimator(logdet).estimate(branch, x, mask)
        outputs = x + g
        return (outputs.squeeze(1) if vector else outputs), logabsdet

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        r"""Solve :math:`x + g(x) = y`; unless ``logdet=False``, :math:`-\log\det(I + J_g(x))`."""
        vector = inputs.dim() == 2
        y = inputs.unsqueeze(1) if vector else inputs
        estimator = None if logdet is False else self._estimator(logdet)
        with torch.no_grad():
            # Padded entries are solved as zeros: the default tolerance scales with the largest
            # entry of each sample, which padding must not loosen. The branch is 0 there, so the
            # padded outputs are the padded inputs, put back afterwards.
            real = None if mask is None else mask[..., None]
            args: tuple[Tensor, ...] = () if mask is None else (mask,)
            right = y if real is None else torch.where(real, y, 0.0)
            start = jacobian = None
            if context is None:
                chord = _chord_linearization(self.branch, y.shape[-1])
                branch = self.branch.solve_map(chord)
                start = _scalar_start(self.branch, branch, right, mask)
                jacobian = None if chord is None else _chord_jacobian(chord, pinned=False)
            else:  # the context rows follow the solver's active rows (or frames)
                args = (*args, _solver_context(self.branch, context, y.shape[1]))
                branch = _with_context(self.branch, mask is not None)
            x, stats = fixed_point_inverse(
                branch,
                right,
                args=args,
                tol=self.inverse_tol,
                max_iter=self.inverse_max_iter,
                solver=self.inverse_solver,
                on_failure=self.on_failure,
                x0=start,
                position_wise=self.branch.position_wise,
                jacobian=jacobian,
            )
            if real is not None:
                x = torch.where(real, x, y)
            self.last_inverse_stats = stats
            logabsdet = None
            if estimator is not None:
                bound = self.branch if context is None else self.branch.bind(context)
                logabsdet = -estimator.estimate(bound, x, mask)[1]
        return (x.squeeze(1) if vector else x), logabsdet

    def inverse_pinned(
        self, inputs: Tensor, state: Tensor, known: Tensor, context: Tensor | None,
        mask: Tensor | None,
    ) -> Tensor:
        r"""Solve :math:`x + g(x) = y` for the new frames alone, the known frames of :math:`x`
        held at ``state`` (docs/forecasting.md#pinned-inverse).

        A causal branch whose output frame :math:`t` reads the input frames :math:`t - R,
        \dots, t` (its ``receptive_radius`` :math:`R`; 0 for a position-wise branch) is solved
        on every sequence's window that starts :math:`R` frames before its first new frame
        (the windows of a batch shifted to start together), with every known frame in it
        pinned: the map :math:`x \mapsto y - g(x_{\rm known},
        x_{\rm new})` is still a contraction, its fixed point on the new frames is the full
        inverse's, and the frames before the window are never evaluated. Any other branch is
        inverted whole (:meth:`SequenceTransform.inverse_pinned`).
        """
        branch = self.branch
        reach = 0 if branch.position_wise else branch.receptive_radius
        if reach is None or not self.causal or inputs.dim() != 3:
            return super().inverse_pinned(inputs, state, known, context, mask)
        real = known if mask is None else mask
        length = inputs.shape[1]
        positions = torch.arange(length, device=inputs.device)
        last = torch.where(real, positions + 1, 0).amax(1)  # one past each last real frame
        first_new = torch.where(real & ~known, positions, length).amin(1)
        begin = torch.minimum(first_new - reach, last - 1).clamp(min=0)  # (B,)
        width = int((last - begin).amax())
        spots = (begin[:, None] + torch.arange(width, device=inputs.device))[..., None]

        def window(values: Tensor) -> Tensor:  # each row's frames from its begin on
            padded = torch.nn.functional.pad(values, (0, 0, 0, width))
            return torch.gather(padded, 1, spots.expand(-1, -1, values.shape[-1]))

        y, truth = window(inputs), window(state)
        held = window(known[..., None].to(inputs.dtype)) > 0
        inside = window(real[..., None].to(inputs.dtype)) > 0
        whole = bool(inside.all())  # no padding in the windows: the branch needs no mask
        args = (held, truth, *(() if whole else (inside[..., 0],)),
                *(() if context is None else (_solver_context(branch, context, width),)))

        chord = None if context is not None else _chord_linearization(branch, inputs.shape[-1])
        solve = branch.solve_map(chord) if context is None else _with_context(branch, True)

        def pinned(x: Tensor, held: Tensor, truth: Tensor, *rest: Tensor) -> Tensor:
            x, rows = torch.where(held, truth, x), None if whole else rest[0]
            return solve(x, rows) if context is None else solve(x, rows, rest[-1])

        with torch.no_grad():
            right = torch.where(inside, y, 0.0)
            start = jacobian = None
            if context is None:
                start = _scalar_start(branch, solve, right, inside[..., 0] & ~held[..., 0])
                jacobian = None if chord is None else _chord_jacobian(chord, pinned=True)
            x, self.last_inverse_stats = fixed_point_inverse(
                pinned, right, args=args, tol=self.inverse_tol, max_iter=self.inverse_max_iter,
                solver=self.inverse_solver, on_failure=self.on_failure,
                x0=torch.where(held, truth, right if start is None else start),
                position_wise=branch.position_wise, jacobian=jacobian,
            )
            x = torch.where(held, truth, torch.where(inside, x, y))
        outputs = torch.where(known[..., None], state, inputs)
        outputs = torch.nn.functional.pad(outputs, (0, 0, 0, width))
        outputs = outputs.scatter(1, spots.expand(-1, -1, inputs.shape[-1]), x)
        return outputs[:, :length]

    def extra_repr(self) -> str:
        return (
            f"logdet={type(self.logdet).__name__}, inverse_solver={self.inverse_solver!r}, "
            f"inverse_tol={self.inverse_tol}, inverse_max_iter={self.inverse_max_iter}"
        )


def _scalar_start(branch: LipschitzBranch, g: Callable[[Tensor], Tensor], y: Tensor,
                  frames: Tensor | None) -> Tensor | None:
    """The solver's start ``(B, N, 1)`` for a per-frame ``branch`` on one feature, its map ``g``:
    :func:`~iresflow.inverse.scalar.scalar_start` of the right-hand sides ``y`` ``(B, N, 1)`` at
    ``frames`` ``(B, N)`` (all if ``None``; 0 elsewhere) when they outnumber the table's points;
    ``None`` (start at ``y``) for any other branch or fewer frames."""
    if not branch.position_wise or y.shape[-1] != 1:
        return None
    values = y[..., 0] if frames is None else y[..., 0][frames]
    if values.numel() <= TABLE_POINTS:
        return None
    start = scalar_start(g, values.reshape(-1))
    if frames is None:
        return start.view_as(y)
    out = torch.zeros_like(y)
    out[..., 0][frames] = start
    return out


def _chord_linearization(branch: LipschitzBranch, features: int) -> Linearization | None:
    """The linearization of a causal, position-mixing ``branch`` on one feature that forms its
    Jacobian by frames (the temporal convolutions), for the solve's map and its chord steps;
    ``None`` for any other branch."""
    if branch.position_wise or not branch.causal or features != 1:
        return None
    linearization = branch.linearize()
    return linearization if linearization is not None and linearization.frame_jacobians else None


def _chord_jacobian(linearization: Linearization, pinned: bool
                    ) -> Callable[..., tuple[Tensor, Tensor]]:
    """The solver's ``jacobian`` (chord steps, :class:`~iresflow.inverse.chord.ChordSteps`) from
    ``linearization`` (:func:`_chord_linearization`). Its arguments are the solve's: the mask if
    there is one, or pinned, ``(held, truth)`` and the window's mask if there is one; the pinned
    frames' columns of :math:`I + J_g` are those of the identity."""

    def jacobian(x: Tensor, *args: Tensor) -> tuple[Tensor, Tensor]:
        free = None
        if pinned:
            held, truth, *rest = args
            x, free = torch.where(held, truth, x), ~held[..., 0]
        else:
            rest = list(args)
        value, blocks = linearization.frame_jacobian(x, rest[0] if rest else None)
        blocks = blocks[..., 0, 0]  # (b, N, N), lower triangular
        if free is not None:
            blocks = blocks * free[:, None, :]
        return value, blocks + torch.eye(x.shape[1], dtype=x.dtype, device=x.device)

    return jacobian


def _solver_context(branch: LipschitzBranch, context: Tensor, length: int) -> Tensor:
    """The context ``(B, C)`` as the fixed-point solver's argument: ``(B, N, C)``, every frame's
    row, for a position-wise branch (whose frames the solver may evaluate on their own), else
    as it is."""
    return context[:, None].expand(-1, length, -1) if branch.position_wise else context


def _with_context(branch: LipschitzBranch, masked: bool) -> Callable[..., Tensor]:
    """``branch`` as ``g(x, mask, context)`` or ``g(x, context)``, for the fixed-point solver,
    its context as :func:`_solver_context` gives it."""
    def bound(x: Tensor, mask: Tensor | None, context: Tensor) -> Tensor:
        return branch(x, mask, context=context[:, 0] if branch.position_wise else context)

    if masked:
        return bound
    return lambda x, context: bound(x, None, context)
