r"""Linear maps with a built-in Lipschitz certificate (docs/math.md#conventions and #spectral-norm).

Both layers keep an unconstrained parameter :math:`W` (PyTorch orientation, ``out x in``) and use
the softly rescaled weight

.. math:: \tilde W = \frac{W}{\max(1, \|W\| / c)},

so that :math:`\|\tilde W\| \le c` in the chosen operator norm while :math:`\tilde W = W` whenever
:math:`W` already satisfies the constraint. The rescaling happens inside every forward, from the
parameters, so the certificate never depends on the user calling an update function.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from iresflow._validation import (
    check_dtype_device,
    check_int,
    is_transformed,
    under_functorch_transform,
)

__all__ = ["InfNormLinear", "SpectralLinear", "check_coefficient", "kept_without_graph",
           "top_singular_vectors"]


def kept_without_graph(layer: nn.Module, compute: Callable[[], Tensor]) -> Tensor:
    """The effective weight ``compute()`` of a normalised ``layer`` in evaluation mode without a
    graph (sampling, forecasting, validation; the caller checks, so that training pays no call
    for it), kept between calls while its raw ``weight`` and ``coeff`` are unchanged, compared
    by value: one comparison per call instead of the normalisation's products, the same tensor
    to the last bit. Computed afresh under a ``torch.func`` transform.

    Args:
        layer: A module with a ``weight`` parameter and a ``coeff``.
        compute: Its effective weight from the current ``weight``.

    Returns:
        The effective weight, of the shape ``compute`` gives.
    """
    weight = layer.weight
    if is_transformed(weight):
        return compute()
    kept = getattr(layer, "_kept", None)
    if (kept is None or kept[1] != layer.coeff or kept[0].dtype != weight.dtype
            or kept[0].device != weight.device or not torch.equal(kept[0], weight)):
        kept = (weight.detach().clone(), layer.coeff, compute())
        layer._kept = kept
    return kept[2]


def check_coefficient(coeff: object, *, strict: bool = False) -> float:
    """Validate a Lipschitz coefficient: ``0 < coeff <= 1`` (``< 1`` when ``strict``).

    Args:
        coeff: Candidate coefficient (int or float, not bool).
        strict: Require ``coeff < 1`` (a contractive branch) instead of ``coeff <= 1``.

    Returns:
        ``coeff`` as a ``float``.

    Raises:
        TypeError: not a real number.
        ValueError: outside the interval.

    Example:
        >>> check_coefficient(0.9, strict=True)
        0.9
    """
    if isinstance(coeff, bool) or not isinstance(coeff, int | float):
        raise TypeError(f"coeff must be a real number, got {type(coeff).__name__}")
    upper_ok = coeff < 1 if strict else coeff <= 1
    if not (coeff > 0 and upper_ok):
        interval = "(0, 1)" if strict else "(0, 1]"
        raise ValueError(f"coeff must lie in {interval}, got {coeff}")
    return float(coeff)


def _normalize_or_keep(vector: Tensor, previous: Tensor) -> Tensor:
    """``vector / ||vector||``, or ``previous`` where that norm is 0 (so W = 0 is survived)."""
    norm = torch.linalg.vector_norm(vector)
    return torch.where(norm > 0, vector / norm, previous)


class _NormalizedLinear(nn.Module, ABC):
    r"""Shared body of the normalised linear maps: :math:`x \mapsto \tilde W x + b`.

    Subclasses define the exact operator norm of ``weight`` (:meth:`_norm`) and, if the
    rescaling divides by another norm, the divisor :meth:`_scale`.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        coeff: float,
        bias: bool,
        device: torch.device | str | None,
        dtype: torch.dtype | None,
    ) -> None:
        super().__init__()
        self.in_features = check_int(in_features, "in_features", 1)
        self.out_features = check_int(out_features, "out_features", 1)
        self.coeff = check_coefficient(coeff)
        factory = {"device": device, "dtype": dtype}
        self.weight = nn.Parameter(torch.empty(out_features, in_features, **factory))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features, **factory))
        else:
            self.register_parameter("bias", None)

    def reset_parameters(self) -> None:
        """Initialise ``weight`` and ``bias`` exactly as :class:`torch.nn.Linear` does."""
        nn.Linear.reset_parameters(self)  # type: ignore[arg-type]  # uses only weight and bias

    @abstractmethod
    def _norm(self) -> Tensor:
        """Exact operator norm of ``weight`` (0-dim, differentiable)."""

    def _scale(self) -> Tensor:
        """The divisor :math:`\\max(1, \\|W\\| / c)` of the effective weight (0-dim)."""
        return torch.clamp(self._norm() / self.coeff, min=1.0)

    def weight_normalized(self) -> Tensor:
        r"""The effective weight :math:`\tilde W = W / \max(1, \|W\| / c)`.

        Returns:
            Tensor of shape ``(out_features, in_features)``, differentiable w.r.t. ``weight``.
        """
        return self.weight / self._scale()

    def forward_weight(self) -> Tensor:
        r"""The effective weight of one forward, with that forward's side effects.

        :meth:`forward` is ``F.linear(x, self.forward_weight(), self.bias)``; engines that apply
        the layer by hand (:meth:`~iresflow.nn.mlp.LipschitzMLP.linearize`) call this instead, so
        that the buffers advance exactly as in a forward. Here it equals
        :meth:`weight_normalized`; :class:`SpectralLinear` first advances its power iteration in
        training mode.

        Returns:
            Tensor of shape ``(out_features, in_features)``, differentiable w.r.t. ``weight``.
        """
        return self.weight_normalized()

    def lipschitz_constant(self) -> Tensor:
        r"""Exact Lipschitz constant of the layer, :math:`\|\tilde W\|` (0-dim tensor).

        Computed as the exact :math:`\|W\|` divided by the scale the forward uses, so it equals
        :math:`\min(\|W\|, c)` whenever that scale uses the exact norm (always for
        :class:`InfNormLinear`, in evaluation mode for :class:`SpectralLinear`). Differentiable
        w.r.t. ``weight``.
        """
        return self._norm() / self._scale()

    def forward(self, x: Tensor) -> Tensor:
        """Apply :math:`x \\mapsto \\tilde W x + b` to the last dimension.

        Args:
            x: Input of shape ``(..., in_features)``.

        Returns:
            Output of shape ``(..., out_features)``.

        Raises:
            TypeError: ``x`` is not a floating-point tensor of the dtype and device of
                ``weight``.
            ValueError: the last dimension of ``x`` is not ``in_features``.
        """
        if not isinstance(x, Tensor) or not x.is_floating_point():
            raise TypeError(
                f"x must be a floating-point torch.Tensor, got "
                f"{x.dtype if isinstance(x, Tensor) else type(x).__name__}"
            )
        if x.dim() == 0 or x.shape[-1] != self.in_features:
            raise ValueError(f"x must have shape (..., {self.in_features}), got {tuple(x.shape)}")
        check_dtype_device(x, self.weight, "x")
        return F.linear(x, self.forward_weight(), self.bias)

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"coeff={self.coeff}, bias={self.bias is not None}"
        )


class SpectralLinear(_NormalizedLinear):
    r"""Linear map with spectral norm at most ``coeff`` (docs/math.md#spectral-norm, check H16
    (docs/math.md#checks)).

    The effective weight is :math:`\tilde W = W / \max(1, \sigma / c)`. Which :math:`\sigma`:

    * **Training mode, ``sigma="exact"`` (the default)**: the exact :math:`\sigma = \|W\|_2`
      as in evaluation mode (one SVD per weight update, about 1.5 ms for a 128 x 128 weight on
      one CPU core), so :math:`\|\tilde W\|_2 \le c` holds to rounding in every forward, also
      right after a large weight change.
    * **Training mode, ``sigma="power"``**: the power-iteration estimate
      :math:`\hat\sigma = u^\top W v` (iResNet / Residual Flows). The persistent buffers ``u``
      (``out``) and ``v`` (``in``) are warm-started (initialised from the SVD) and advanced by
      ``n_power_iterations`` steps :math:`v \leftarrow W^\top u / \|W^\top u\|`,
      :math:`u \leftarrow W v / \|W v\|` under ``torch.no_grad()`` at the start of every training
      forward; the gradient flows through :math:`W` in :math:`\hat\sigma` with :math:`u, v` held
      fixed. Because :math:`\hat\sigma \le \sigma`, the training-mode constant can exceed ``c``
      by the power-iteration lag: negligible while the top singular value is well separated and
      the weights move slowly, but unbounded after a large weight change that makes another
      singular value overtake the tracked one (a singular pair is a fixed point of the
      iteration; a single layer was seen at 1.47 ``c``). Cheaper for wide layers; use it only
      inside a model that tolerates the lag, never where invertibility in training mode matters.
      :meth:`lipschitz_constant` always reports the exact value of the weight in use.
    * **Evaluation mode**: the exact :math:`\sigma = \|W\|_2`, so :math:`\|\tilde W\|_2 \le c`
      holds to rounding. The top singular pair :math:`(u_1, v_1)` of :math:`W` is cached for the
      current weight *values* and :math:`\sigma = u_1^\top W v_1` is rebuilt from ``weight`` in
      every call: this is the exact value with the exact gradient :math:`u_1 v_1^\top` of
      :math:`\|W\|_2`, and the SVD is redone only when the weight changes (fixed-point
      inversion evaluates the branch many times). The cache compares values rather than
      ``weight._version`` because writes through ``weight.data`` (``gradcheck``, older code) do
      not bump the version counter; loading a ``state_dict``, optimiser steps and ``.to()``
      therefore invalidate it automatically. Second derivatives of :math:`\sigma` w.r.t.
      ``weight`` are not provided.

    ``torch.func`` compatibility: transforms forbid mutating captured tensors, so the buffer
    update is skipped while a transform (``vmap``, ``jacrev``, ...) is active; the forward then
    uses the current ``u``, ``v`` and so agrees exactly with the plain forward that preceded it
    (an engine evaluating :math:`g(x)` outside a transform and its Jacobian inside one sees a
    single map; the buffers advance only in plain training forwards). The
    normalised weight depends only on the parameters and is computed once per forward, before
    it meets the (possibly batched) input.

    Args:
        in_features: Size ``D_in`` of the input's last dimension.
        out_features: Size ``D_out`` of the output's last dimension.
        coeff: Bound :math:`c \in (0, 1]` on the spectral norm. A residual flow needs the
            product of its branch's layer constants to be ``< 1``.
        n_power_iterations: Power-iteration steps per training forward (``>= 1``).
        bias: Whether to learn an additive bias.
        sigma: ``"exact"`` (exact spectral norm in every mode, the default) or ``"power"``
            (warm-started power iteration in training mode, which can lag the weights).
        device: Device of the parameters.
        dtype: Floating-point dtype of the parameters.

    Example:
        >>> layer = SpectralLinear(4, 3, coeff=0.9)
        >>> layer(torch.randn(2, 5, 4)).shape
        torch.Size([2, 5, 3])
        >>> bool(torch.linalg.matrix_norm(layer.eval().weight_normalized(), 2) <= 0.9 + 1e-6)
        True
    """

    u: Tensor
    v: Tensor

    def __init__(
        self,
        in_features: int,
        out_features: int,
        coeff: float = 0.97,
        n_power_iterations: int = 1,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
        sigma: Literal["power", "exact"] = "exact",
    ) -> None:
        super().__init__(in_features, out_features, coeff, bias, device, dtype)
        self.n_power_iterations = check_int(n_power_iterations, "n_power_iterations", 1)
        if sigma not in ("power", "exact"):
            raise ValueError(f'sigma must be "power" or "exact", got {sigma!r}')
        self.sigma = sigma
        self.register_buffer("u", torch.empty(out_features, device=device, dtype=dtype))
        self.register_buffer("v", torch.empty(in_features, device=device, dtype=dtype))
        self._svd_cache: tuple[Tensor, Tensor, Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Re-initialise like :class:`torch.nn.Linear` and warm-start ``u``, ``v`` from the SVD."""
        super().reset_parameters()
        with torch.no_grad():
            _, u1, v1 = self._top_singular_pair(self.weight)
            self.u.copy_(u1)
            self.v.copy_(v1)

    @staticmethod
    def _top_singular_pair(weight: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """Detached snapshot of ``weight`` with its top left/right singular vectors."""
        snapshot = weight.detach().clone()
        work = snapshot.to(torch.promote_types(snapshot.dtype, torch.float32))
        left, right = top_singular_vectors(work)
        return snapshot, left.to(snapshot.dtype), right.to(snapshot.dtype)

    def _norm(self) -> Tensor:
        """Exact :math:`\\|W\\|_2` with gradient, from the value-keyed SVD cache."""
        weight = self.weight
        if is_transformed(weight):
            # Parameters passed through a transform (e.g. per-sample gradients): no caching.
            return torch.linalg.matrix_norm(weight, 2)
        cache = self._svd_cache
        if (
            cache is None
            or cache[0].shape != weight.shape
            or cache[0].dtype != weight.dtype
            or cache[0].device != weight.device
            or not torch.equal(cache[0], weight.detach())
        ):
            with torch.no_grad():
                cache = self._top_singular_pair(weight)
            self._svd_cache = cache
        _, u1, v1 = cache
        return torch.dot(u1, torch.mv(weight, v1))

    def _power_iteration(self) -> None:
        with torch.no_grad():
            weight, u, v = self.weight, self.u, self.v
            for _ in range(self.n_power_iterations):
                v = _normalize_or_keep(torch.mv(weight.t(), u), v)
                u = _normalize_or_keep(torch.mv(weight, v), u)
            self.u.copy_(u)
            self.v.copy_(v)

    def _scale(self) -> Tensor:
        """As for every normalised layer, with the power-iteration estimate in training mode
        when ``sigma="power"``."""
        if self.training and self.sigma == "power":
            # Clones: a later forward's in-place update must not alter tensors saved for backward.
            sigma = torch.dot(self.u.clone(), torch.mv(self.weight, self.v.clone()))
        else:
            sigma = self._norm()
        return torch.clamp(sigma / self.coeff, min=1.0)

    def forward_weight(self) -> Tensor:
        """The effective weight of one forward; in training mode first advance ``u``, ``v``.

        Returns:
            Tensor of shape ``(out_features, in_features)``, differentiable w.r.t. ``weight``.
        """
        if self.training and self.sigma == "power":
            if not under_functorch_transform():
                self._power_iteration()
            return self.weight / self._scale()
        # the exact norm: _scale written out, one call fewer per layer and training forward
        if self.training or torch.is_grad_enabled():
            return self.weight / torch.clamp(self._norm() / self.coeff, min=1.0)
        return kept_without_graph(
            self, lambda: self.weight / torch.clamp(self._norm() / self.coeff, min=1.0))

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, n_power_iterations={self.n_power_iterations}, "
            f"sigma={self.sigma!r}"
        )


class InfNormLinear(_NormalizedLinear):
    r"""Linear map with :math:`\infty\to\infty` operator norm at most ``coeff``
    (docs/math.md#conventions, #spectral-norm).

    For :math:`x \mapsto W x` the induced :math:`\infty`-norm is the maximum absolute row sum of
    ``weight`` (``out x in``), :math:`\|W\|_\infty = \max_i \sum_j |W_{ij}|`. It is exact and
    cheap, so the effective weight :math:`\tilde W = W / \max(1, \|W\|_\infty / c)` is the same
    in training and evaluation mode and needs no iteration. Position-wise, this is also the
    Lipschitz constant on sequences in the entrywise :math:`\infty`-norm of
    docs/math.md#conventions.

    Args:
        in_features: Size ``D_in`` of the input's last dimension.
        out_features: Size ``D_out`` of the output's last dimension.
        coeff: Bound :math:`c \in (0, 1]` on the :math:`\infty`-norm. A residual flow needs the
            product of its branch's layer constants to be ``< 1``.
        bias: Whether to learn an additive bias.
        device: Device of the parameters.
        dtype: Floating-point dtype of the parameters.

    Example:
        >>> layer = InfNormLinear(4, 3, coeff=0.5)
        >>> layer(torch.randn(2, 4)).shape
        torch.Size([2, 3])
        >>> bool(layer.weight_normalized().abs().sum(1).max() <= 0.5 + 1e-6)
        True
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        coeff: float = 0.97,
        bias: bool = True,
        device: torch.device | str | None = None,
        dtype: torch.dtype | None = None,
    ) -> None:
        super().__init__(in_features, out_features, coeff, bias, device, dtype)
        self.reset_parameters()

    def _norm(self) -> Tensor:
        return self.weight.abs().sum(dim=1).amax()


def top_singular_vectors(matrix: Tensor) -> tuple[Tensor, Tensor]:
    r"""Top left and right singular vectors :math:`(u, v)` of a (batch of) real or complex
    matrices, with :math:`\sigma_{\max} = u^{\mathsf H} M v`.

    From the eigendecomposition of the smaller Gram matrix (:math:`M^{\mathsf H}M` or
    :math:`MM^{\mathsf H}`, Hermitian): its top eigenvector is one singular vector and the other
    is :math:`Mv / \lVert Mv\rVert` (or :math:`M^{\mathsf H}u / \lVert M^{\mathsf H}u\rVert`).
    About half the cost of a full SVD on the CPU for the square hidden layers, and backward
    stable, so :math:`u^{\mathsf H} M v` matches :math:`\sigma_{\max}` to working precision.

    Args:
        matrix: ``(..., m, n)``, no gradient needed (call under ``torch.no_grad``).

    Returns:
        ``(u, v)`` of shapes ``(..., m)`` and ``(..., n)``, unit vectors (zero for a zero matrix).

    Example:
        >>> m = torch.tensor([[3.0, 0.0], [0.0, -5.0], [0.0, 0.0]])
        >>> u, v = top_singular_vectors(m)
        >>> float(u @ m @ v)
        5.0
    """
    if matrix.shape[-1] <= matrix.shape[-2]:
        right = torch.linalg.eigh(matrix.mH @ matrix)[1][..., -1]
        left = F.normalize((matrix @ right.unsqueeze(-1)).squeeze(-1), dim=-1)
    else:
        left = torch.linalg.eigh(matrix @ matrix.mH)[1][..., -1]
        right = F.normalize((matrix.mH @ left.unsqueeze(-1)).squeeze(-1), dim=-1)
    return left, right
