r"""Position-wise Lipschitz feed-forward branch (docs/math.md#conventions, #lipswish,
#spectral-norm)."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Literal

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from iresflow._validation import check_int, check_mask, check_sequence
from iresflow.nn.activations import LipSwish
from iresflow.nn.base import Linearization, LinearizedPoint, LipschitzBranch
from iresflow.nn.linear import (
    InfNormLinear,
    SpectralLinear,
    _check_coefficient,
)

__all__ = ["LipschitzMLP", "stack_parameters"]


class LipschitzMLP(LipschitzBranch):
    r"""Token-wise MLP with a certified Lipschitz constant below 1.

    .. math:: g = \tilde W_L \circ \mathrm{LipSwish} \circ \cdots \circ \mathrm{LipSwish}
        \circ \tilde W_1,

    applied to every token independently (``position_wise = True``). Each linear layer is a
    :class:`~iresflow.nn.linear.SpectralLinear` (``norm="2"``) or an
    :class:`~iresflow.nn.linear.InfNormLinear` (``norm="inf"``) with bound ``coeff``, and LipSwish
    is 1-Lipschitz in every :math:`p`-norm (elementwise), so by composition (Kim Cor. 2.1)

    .. math:: \mathrm{lip}_p(g) \le \prod_{l=1}^{L} \|\tilde W_l\|_p \le c^L < 1.

    On sequences the norm is the entrywise one of docs/math.md#conventions, for which a token-wise
    map has the same constant as on a single token.

    The instance attribute ``norm`` records the constructor's choice and shadows the class
    default ``"2"``, so engines reading ``branch.norm`` see the norm of this instance.

    Input validation (:func:`~iresflow._validation.check_sequence`,
    :func:`~iresflow._validation.check_mask`) runs when ``x`` is an ordinary tensor. Under a
    ``torch.func`` transform (``vmap(jacrev(...))`` in the exact log-det engine) ``x`` is a
    wrapped per-example view whose values cannot be inspected, so validation is skipped there:
    the caller of the transform validates the full batch.

    Args:
        dims: Layer widths ``(D, h_1, ..., h_{L-1}, D)``; at least two positive ints, first equal
            to last.
        coeff: Per-layer bound :math:`c \in (0, 1)`.
        n_power_iterations: Power-iteration steps per training forward of each
            :class:`~iresflow.nn.linear.SpectralLinear` (unused for ``norm="inf"``).
        norm: ``"2"`` (spectral normalisation) or ``"inf"`` (max-row-sum normalisation).
        sigma: How :class:`~iresflow.nn.linear.SpectralLinear` gets the spectral norm in
            training mode: ``"exact"`` (SVD, the default: the certificate :math:`c^L` holds in
            every forward) or ``"power"`` (power iteration: cheaper for wide layers, but after a
            large weight change the estimate lags and the branch can exceed :math:`c^L`, so a
            standalone block may stop being invertible in training mode).

    Example:
        >>> mlp = LipschitzMLP((3, 16, 3), coeff=0.9)
        >>> mlp(torch.randn(2, 5, 3)).shape
        torch.Size([2, 5, 3])
        >>> bool(mlp.lipschitz_constant() <= 0.9**2 + 1e-6)
        True
    """

    position_wise = True
    norm = "2"

    def __init__(
        self,
        dims: Sequence[int],
        coeff: float = 0.97,
        n_power_iterations: int = 1,
        norm: Literal["2", "inf"] = "2",
        sigma: Literal["power", "exact"] = "exact",
    ) -> None:
        super().__init__()
        if isinstance(dims, str) or not isinstance(dims, Sequence):
            raise TypeError(f"dims must be a sequence of ints, got {type(dims).__name__}")
        if len(dims) < 2:
            raise ValueError(f"dims must contain at least 2 sizes (D, ..., D), got {list(dims)}")
        dims = [check_int(d, "every entry of dims", 1) for d in dims]
        if dims[0] != dims[-1]:
            raise ValueError(f"dims must start and end with the same size D, got {dims}")
        coeff = _check_coefficient(coeff, strict=True)
        if norm not in ("2", "inf"):
            raise ValueError(f'norm must be "2" or "inf", got {norm!r}')
        self.norm = norm  # type: ignore[misc]  # per-instance choice shadows the class default

        layers: list[nn.Module] = []
        for i, (d_in, d_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            if i > 0:
                layers.append(LipSwish())
            if norm == "2":
                layers.append(SpectralLinear(d_in, d_out, coeff, n_power_iterations, sigma=sigma))
            else:
                layers.append(InfNormLinear(d_in, d_out, coeff))
        self.net = nn.Sequential(*layers)
        self.features = dims[0]

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Evaluate the branch token by token.

        Args:
            x: Sequences ``(B, N, D)`` or vectors ``(B, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens (only with
                ``(B, N, D)`` inputs).

        Returns:
            ``g(x)`` with the shape of ``x``, exactly zero at padded positions.

        Raises:
            TypeError: ``x`` is not a floating-point tensor of the parameters' dtype and device,
                or ``mask`` is not boolean.
            ValueError: wrong shape, empty dimension, NaN/Inf, or an all-padding sequence.
        """
        if not (isinstance(x, Tensor) and torch._C._functorch.is_functorch_wrapped_tensor(x)):
            check_sequence(x, "x", features=self.features, like=self.net[0].weight)
            mask = check_mask(mask, x)
        out = self.net(x)
        if mask is not None:
            # Padded outputs are exactly 0 and carry no gradient back to padded inputs.
            out = torch.where(mask.unsqueeze(-1), out, 0.0)
        return out

    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        """Certified Lipschitz bound: the product of the linear layers' exact constants.

        Each factor is the layer's exact operator norm (in ``self.norm``); LipSwish counts as 1.

        Args:
            seq_len: Ignored (the branch is position-wise).

        Returns:
            0-dim tensor, differentiable w.r.t. the weights.
        """
        constants = [
            layer.lipschitz_constant()
            for layer in self.net
            if isinstance(layer, SpectralLinear | InfNormLinear)
        ]
        return torch.stack(constants).prod()

    def linearize(self) -> _MLPLinearization:
        r"""The branch's map with hand-written Jacobian products (fast log-det path, G5).

        Counts as one forward: in training mode every
        :class:`~iresflow.nn.linear.SpectralLinear` advances its power iteration exactly once, as
        in :meth:`forward`. The effective parameters (weights :math:`\tilde W_l`, biases, LipSwish
        slopes :math:`\beta_l`) are built under the current grad mode, so their graphs reach
        ``weight`` and ``beta_raw``.

        Returns:
            A linearization whose ``at(x, mask).output`` equals ``self(x, mask)``.

        Example:
            >>> mlp = LipschitzMLP((2, 8, 2), coeff=0.9).double()
            >>> x, w = torch.randn(3, 4, 2).double(), torch.randn(3, 4, 2).double()
            >>> point = mlp.linearize().at(x)
            >>> bool(torch.allclose(point.output, mlp(x)))
            True
            >>> _, pullback = torch.func.vjp(mlp, x)
            >>> ref = pullback(w)[0]
            >>> bool(torch.allclose(point.vjp(w), ref, atol=1e-12))
            True
        """
        return _MLPLinearization(*stack_parameters(self.net, lambda layer: layer.forward_weight()))


_SCALE = 1 / 1.1  # the LipSwish normalisation


def _lipswish_slope(beta: Tensor, z: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r""":class:`~iresflow.nn.activations.LipSwish` at ``z`` with its slope.

    With :math:`t = \beta z`, :math:`s = \sigma(t)`: returns the value :math:`\phi = z s / 1.1`,
    the slope :math:`\phi' = (s + t s (1 - s)) / 1.1` and :math:`s`, all of the shape of ``z``.
    """
    t = beta * z
    s = torch.sigmoid(t)
    scaled = s * _SCALE
    return z * scaled, torch.addcmul(scaled, t.mul_(scaled), torch.rsub(s, 1)), s


def _lipswish_second(beta: Tensor, z: Tensor, s: Tensor) -> tuple[Tensor, Tensor]:
    r"""Second-order LipSwish factors at ``z``, given :math:`s = \sigma(\beta z)`.

    Returns :math:`q = s (1 - s)(2 + t (1 - 2 s)) / 1.1` (so that :math:`\phi'' = \beta q` and
    :math:`\partial\phi'/\partial\beta = z q`) and :math:`d = s (1 - s) / 1.1` (so that
    :math:`\partial\phi/\partial\beta = z^2 d`).
    """
    d = torch.rsub(s, 1).mul_(s).mul_(_SCALE)
    return (beta * z).mul_(torch.rsub(s, 1, alpha=2)).add_(2).mul_(d), d


def _rows(t: Tensor) -> Tensor:
    """``(..., H)`` as a matrix ``(rows, H)``."""
    return t.reshape(-1, t.shape[-1])


def _dot(a: Tensor, b: Tensor) -> Tensor:
    """Sum of the elementwise product of two tensors of equal shape (0-dim)."""
    return torch.dot(a.reshape(-1), b.reshape(-1))


def stack_parameters(
    net: nn.Sequential, weight: Callable[[nn.Module], Tensor]
) -> tuple[list[Tensor], list[Tensor | None], list[Tensor]]:
    """Effective weights, biases and LipSwish slopes of an alternating layer/LipSwish stack.

    Args:
        net: Layers (with ``bias``) alternating with :class:`~iresflow.nn.activations.LipSwish`.
        weight: The effective weight of a layer (e.g. its normalised weight).

    Returns:
        ``(weights, biases, betas)``, in the order of the stack.
    """
    weights: list[Tensor] = []
    biases: list[Tensor | None] = []
    betas: list[Tensor] = []
    for layer in net:
        if isinstance(layer, LipSwish):
            betas.append(layer.beta)
        else:
            weights.append(weight(layer))
            biases.append(layer.bias)
    return weights, biases, betas


class _MLPLinearization(Linearization):
    r"""A :class:`LipschitzMLP` with fixed effective parameters (:meth:`LipschitzMLP.linearize`).

    ``params`` lists the weights, the biases that exist, then the LipSwish slopes.
    """

    def __init__(
        self, weights: list[Tensor], biases: list[Tensor | None], betas: list[Tensor]
    ) -> None:
        self.params = (*weights, *[b for b in biases if b is not None], *betas)
        self.weights = [w.detach() for w in weights]
        self.biases = [None if b is None else b.detach() for b in biases]
        self.betas = [b.detach() for b in betas]

    def at(self, x: Tensor, mask: Tensor | None = None) -> _MLPPoint:
        return _MLPPoint(self, x, mask)


class _MLPPoint(LinearizedPoint):
    r"""A :class:`LipschitzMLP` map at ``x``.

    Layers :math:`a_l = \tilde W_l h_l + b_l`, :math:`h_{l+1} = \phi_l(a_l)` (LipSwish),
    :math:`g = a_{L-1}`. Stores the layer inputs :math:`h_l`, pre-activations :math:`a_l`,
    sigmoids :math:`\sigma(\beta_l a_l)` and slopes :math:`\phi_l'(a_l)`, all ``(R, N, H_l)``.

    The products are written in terms of the layer operations ``_apply`` (the linear map),
    ``_adjoint`` (its transpose), ``_weight_grad`` and ``_hidden`` (what the map does to a hidden
    layer's input), so the temporal-convolution branch reuses them with convolutions
    (:class:`~iresflow.nn.conv.TemporalConvBranch`).
    """

    def __init__(self, lin: _MLPLinearization, x: Tensor, mask: Tensor | None) -> None:
        self.lin = lin
        # Masking multiplies by the boolean mask (one kernel in the dtype of the product, no
        # scalar promotion); the products are finite, so padded entries become exactly 0.
        self.keep = None if mask is None else mask.unsqueeze(-1)
        self.inputs: list[Tensor] = []
        self.pre: list[Tensor] = []
        self.sigmoids: list[Tensor] = []
        self.slopes: list[Tensor] = []
        with torch.no_grad():
            h = self._hidden(x.detach())
            for i, bias in enumerate(lin.biases):
                a = self._apply(i, h, bias)
                self.inputs.append(h)
                self.pre.append(a)
                if i < len(lin.betas):
                    h, slope, sigmoid = _lipswish_slope(lin.betas[i], a)
                    h, slope = self._hidden(h), self._hidden(slope)
                    self.slopes.append(slope)
                    self.sigmoids.append(sigmoid)
        self.output = self._masked(a)

    # The layer operations; a convolutional subclass replaces them (iresflow.nn.conv).
    def _apply(self, l: int, h: Tensor, bias: Tensor | None = None) -> Tensor:
        r"""Layer ``l``'s linear map :math:`\tilde W_l h + b`, shape ``(R, N, H_{l+1})``."""
        return F.linear(h, self.lin.weights[l], bias)

    def _adjoint(self, l: int, g: Tensor) -> Tensor:
        r"""Its adjoint :math:`g \mapsto g \tilde W_l`, shape ``(R, N, H_l)``."""
        return g @ self.lin.weights[l]

    def _weight_grad(self, l: int, g: Tensor, h: Tensor, k: Tensor, t: Tensor) -> Tensor:
        r""":math:`\partial/\partial\tilde W_l` of :math:`\langle g, \tilde W_l h\rangle +
        \langle k, \tilde W_l t\rangle`."""
        return torch.addmm(_rows(g).T @ _rows(h), _rows(k).T, _rows(t))

    def _hidden(self, t: Tensor) -> Tensor:
        """A hidden layer's input as the map sees it (token-wise: unchanged)."""
        return t

    def _masked(self, w: Tensor) -> Tensor:
        return w if self.keep is None else w * self.keep

    def vjp(self, w: Tensor) -> Tensor:
        n = len(self.lin.weights)
        g = self._adjoint(n - 1, self._masked(w))
        for l in range(n - 2, -1, -1):
            g = self._adjoint(l, g.mul_(self.slopes[l]))  # g is a fresh product: scaled in place
        return self._hidden(g)

    def surrogate_backward(
        self, grad_out: Tensor, u: Tensor, v: Tensor
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        # Notation of docs/math.md#neumann-gradient in layer form: tangent tau_l (J v up to layer
        # l), alpha_l its pre-activation; kappa_l, rho_l cotangents of the tangent chain from u;
        # gamma_l cotangent of a_l in the primal chain, which receives rho * alpha * phi'' (the
        # dependence of the slopes on a_l).
        betas = self.lin.betas
        n = len(self.lin.weights)
        tau, alpha = [self._hidden(v)], []
        for l in range(n):
            alpha.append(self._apply(l, tau[-1]))
            if l < n - 1:
                tau.append(self.slopes[l] * alpha[-1])
        kappa: list[Tensor] = [self._masked(u)]
        gamma: list[Tensor] = [self._masked(grad_out)]
        grad_betas = []
        for l in range(n - 2, -1, -1):
            rho = self._hidden(self._adjoint(l + 1, kappa[0]))
            eta = self._hidden(self._adjoint(l + 1, gamma[0]))
            z = self.pre[l]
            q, d = _lipswish_second(betas[l], z, self.sigmoids[l])
            extra = (rho * alpha[l]).mul_(q)
            kappa.insert(0, self.slopes[l] * rho)
            gamma.insert(0, torch.addcmul(self.slopes[l] * eta, extra, betas[l]))
            # d/d beta: sum(eta * z^2 d) + sum(extra * z), as one inner product with z.
            grad_betas.insert(0, _dot(z, torch.addcmul(extra, eta * z, d)))
        grad_weights, grad_biases = [], []
        for l in range(n):
            grad_weights.append(self._weight_grad(l, gamma[l], self.inputs[l], kappa[l], tau[l]))
            if self.lin.biases[l] is not None:
                grad_biases.append(_rows(gamma[l]).sum(0))
        grad_x = self._hidden(self._adjoint(0, gamma[0]))
        return grad_x, (*grad_weights, *grad_biases, *grad_betas)
