r"""Position-wise Lipschitz feed-forward branch (docs/math.md#conventions, #lipswish,
#spectral-norm)."""

from __future__ import annotations

from collections.abc import Sequence
from operator import methodcaller
from typing import Literal

import torch
from torch import Tensor, nn

from iresflow._validation import check_int, check_mask, check_sequence, is_transformed
from iresflow.nn.activations import LipSwish
from iresflow.nn.base import LipschitzBranch
from iresflow.nn.layered import LayerStackLinearization, stack_parameters
from iresflow.nn.linear import InfNormLinear, SpectralLinear, check_coefficient

__all__ = ["LipschitzMLP"]


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

    A per-sequence shift ``(B, h_1)`` (:attr:`shift_features`) enters after the first layer,
    :math:`\tilde W_1 x + b_1 + s` (docs/math.md#conditional-branches).

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
    solves_linearized = True

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
        coeff = check_coefficient(coeff, strict=True)
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
        self.shift_features = dims[1]

    def forward(
        self, x: Tensor, mask: Tensor | None = None, shift: Tensor | None = None
    ) -> Tensor:
        """Evaluate the branch token by token.

        Args:
            x: Sequences ``(B, N, D)`` or vectors ``(B, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens (only with
                ``(B, N, D)`` inputs).
            shift: Optional ``(B, h_1)``, added to every token after the first layer.

        Returns:
            ``g(x)`` with the shape of ``x``, exactly zero at padded positions.

        Raises:
            TypeError: ``x`` is not a floating-point tensor of the parameters' dtype and device,
                or ``mask`` is not boolean.
            ValueError: wrong shape, empty dimension, NaN/Inf, or an all-padding sequence.
        """
        if not isinstance(x, Tensor) or not is_transformed(x):
            check_sequence(x, "x", features=self.features, like=self.net[0].weight)
            mask = check_mask(mask, x)
            if shift is not None:
                self.check_shift(shift, x)
        if shift is None:
            out = self.net(x)
        else:
            out = self.net[0](x) + (shift.unsqueeze(1) if x.dim() == 3 else shift)
            for layer in list(self.net)[1:]:
                out = layer(out)
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

    def linearize(self, shift: Tensor | None = None) -> LayerStackLinearization:
        r"""The branch's map with hand-written Jacobian products (fast log-det path, G5).

        Counts as one forward: in training mode every
        :class:`~iresflow.nn.linear.SpectralLinear` advances its power iteration exactly once, as
        in :meth:`forward`. The effective parameters (weights :math:`\tilde W_l`, biases, LipSwish
        slopes :math:`\beta_l`) are built under the current grad mode, so their graphs reach
        ``weight`` and ``beta_raw``.

        Args:
            shift: Optional shift ``(B, h_1)`` after the first layer, as in :meth:`forward`.

        Returns:
            A linearization whose ``at(x, mask).output`` equals ``self(x, mask, shift)``.

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
        weights = stack_parameters(self.net, methodcaller("forward_weight"))
        return LayerStackLinearization(*weights, shift)
