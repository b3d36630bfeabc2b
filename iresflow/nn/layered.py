r"""Hand-written Jacobian products of a stack of linear layers and LipSwish activations.

The linearizations of the position-wise MLP branch (:class:`~iresflow.nn.mlp.LipschitzMLP`,
:class:`LayerStackLinearization`) and of the temporal-convolution branch
(:class:`~iresflow.nn.conv.TemporalConvBranch`, :class:`ConvStackLinearization`): the branch's
map with its effective parameters fixed, its vector-Jacobian products and the gradient of the
Neumann surrogate (docs/math.md#neumann-gradient, #lipswish), written once. A token-wise
layer is a convolution over time with one tap: every layer's adjoint is a product of the windows
of its cotangent (:func:`~iresflow.nn.frames.windows`, the cotangent itself for one tap) with a
matrix, or for a layer into fewer channels the products with all its taps shifted and summed
(:func:`~iresflow.nn.frames.tap_sum`), and the convolutional stack replaces only the forward
map and the weight gradient of a layer (:class:`ConvStackPoint`) and masks the inputs of its
hidden layers.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from iresflow._validation import check_length
from iresflow.nn.activations import LIPSWISH_SCALE, LipSwish, lipswish_second
from iresflow.nn.base import Linearization, LinearizedPoint
from iresflow.nn.frames import conv_frames, conv_stack_jacobian, tap_sum, windows

__all__ = [
    "ConvStackLinearization",
    "ConvStackPoint",
    "LayerStackLinearization",
    "LayerStackPoint",
    "as_rows",
    "stack_parameters",
]


def as_rows(t: Tensor) -> Tensor:
    """``(..., H)`` as a matrix ``(rows, H)`` (a view when the layout allows).

    Args:
        t: Any tensor with at least one dimension.

    Returns:
        ``t.reshape(-1, H)``.
    """
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
        weight: The effective weight of a layer (e.g. its normalised weight), for example
            ``operator.methodcaller("weight_normalized")``.

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


class LayerStackLinearization(Linearization):
    r"""A stack of linear layers and LipSwish activations with fixed effective parameters.

    Returned by :meth:`~iresflow.nn.mlp.LipschitzMLP.linearize` (a convolutional subclass by
    :meth:`~iresflow.nn.conv.TemporalConvBranch.linearize`). ``params`` lists the weights, the
    biases that exist, the LipSwish slopes, then the shift if there is one. The adjoint of
    layer ``l`` is ``windows(g, taps[l]) @ adjoints[l]`` (the windows padded by ``pads[l]``):
    here one tap and the weight itself;
    ``masks_hidden`` says whether padded frames are zeroed at the input of every hidden layer
    (not needed token by token).

    Args:
        weights: Effective weights of the layers, in order (with their graphs).
        biases: Their biases (``None`` where a layer has none).
        betas: The LipSwish slopes between the layers.
        shift: Optional per-sequence shift ``(B, H_1)`` added after the first layer
            (docs/math.md#conditional-branches); an input of ``R = k B`` rows gives row ``r`` the
            shift of sequence ``r mod B``.
    """

    masks_hidden = False

    def __init__(
        self,
        weights: list[Tensor],
        biases: list[Tensor | None],
        betas: list[Tensor],
        shift: Tensor | None = None,
    ) -> None:
        self.weights = list(map(Tensor.detach, weights))
        self.betas = list(map(Tensor.detach, betas))
        self.biases: list[Tensor | None] = []
        present: list[Tensor] = []  # the biases that exist, for ``params``
        for bias in biases:
            self.biases.append(None if bias is None else bias.detach())
            if bias is not None:
                present.append(bias)
        self.shift = None if shift is None else shift.detach()
        self.params = (*weights, *present, *betas, *(() if shift is None else (shift,)))
        self.taps = [1] * len(weights)
        #: The spacing of every layer's taps over time, and the frames its window spans.
        self.dilations, self.spans = [1] * len(weights), [1] * len(weights)
        self.pads = [(0, 0, 0, 0)] * len(weights)  # the "same" padding of every layer's windows
        self.adjoints = self.weights
        #: The tap matrices of a convolutional stack (``None``: token by token, ``F.linear``).
        self.forward_matrices: list[Tensor] | None = None
        self._folded: tuple[list[Tensor], list[Tensor | None], Tensor | None] | None = None

    def at(self, x: Tensor, mask: Tensor | None = None) -> LayerStackPoint:
        """The stack at ``x`` ``(R, N, D)`` with an optional padding mask ``(R, N)``."""
        return LayerStackPoint(self, x, mask)

    def evaluate(self, x: Tensor, mask: Tensor | None = None,
                 slopes: list[Tensor] | None = None) -> Tensor:
        r"""The stack's value at ``x`` ``(R, N, D)`` (optional mask ``(R, N)``), equal to
        ``at(x, mask).output`` to rounding, with every LipSwish folded into the layers around
        it: :math:`\phi_l(a) = \mathrm{silu}(\beta_l a) / (1.1 \beta_l)`, so layer :math:`l`
        multiplies by :math:`\beta_l \tilde W_l / (1.1 \beta_{l-1})`, adds :math:`\beta_l b_l`
        (the last layer: :math:`\tilde W_l / (1.1 \beta_{l-1})` and :math:`b_l`) and applies
        one SiLU in place: two passes over every hidden layer fewer than the module's forward.
        Appends the LipSwish slopes :math:`\phi_l'(a)` ``(R, N, H_l)`` (zero at padded frames)
        to ``slopes`` if given.
        """
        if self._folded is None:
            self._folded = self._fold()
        weights, biases, shift = self._folded
        keep = None if mask is None else mask.unsqueeze(-1)
        h, last = x, len(weights) - 1
        for i, (weight, bias) in enumerate(zip(weights, biases, strict=True)):
            if keep is not None and (i == 0 or self.masks_hidden):
                h = torch.where(keep, h, 0.0)
            h = self.apply_folded(i, h, weight, bias)
            if i == 0 and shift is not None:
                h = h + LayerStackPoint._shift_rows(shift, x.shape[0]).unsqueeze(1)
            if i < last and slopes is not None:  # at the folded pre-activation t = beta a
                sigmoid = torch.sigmoid(h)
                slope = torch.addcmul(sigmoid, h * sigmoid, torch.rsub(sigmoid, 1))
                slope = slope.mul_(LIPSWISH_SCALE)
                slopes.append(slope if keep is None else slope * keep)
            h = h if i == last else F.silu(h, inplace=True)
        return h if keep is None else torch.where(keep, h, 0.0)

    def apply_folded(self, l: int, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """Layer ``l`` with folded parameters (:meth:`evaluate`), token by token."""
        return F.linear(h, weight, bias)

    def _fold(self) -> tuple[list[Tensor], list[Tensor | None], Tensor | None]:
        """The weights, biases and shift of :meth:`evaluate`."""
        last = len(self.weights) - 1
        weights, biases = [], []
        for i, (weight, bias) in enumerate(zip(self.weights, self.biases, strict=True)):
            into = 1.0 if i == 0 else LIPSWISH_SCALE / self.betas[i - 1]
            out = 1.0 if i == last else self.betas[i]
            weights.append(weight * (into * out))
            biases.append(None if bias is None else bias * out)
        shift = self.shift
        if shift is not None and last > 0:
            shift = shift * self.betas[0]
        return weights, biases, shift


class LayerStackPoint(LinearizedPoint):
    r"""A :class:`LayerStackLinearization` evaluated at ``x``.

    Layers :math:`a_l = \tilde W_l h_l + b_l`, :math:`h_{l+1} = \phi_l(a_l)` (LipSwish),
    :math:`g = a_{L-1}`. Stores the layer inputs :math:`h_l`, pre-activations :math:`a_l`,
    sigmoids :math:`\sigma(\beta_l a_l)` and slopes :math:`\phi_l'(a_l)`, all ``(R, N, H_l)``.

    The products are written in terms of four layer operations: :meth:`apply_layer` (the
    linear map), :meth:`adjoint_layer` (its transpose), :meth:`layer_weight_grad` and
    :meth:`hidden_input` (what the map does to a hidden layer's input). They act token by token
    here (the MLP); the temporal-convolution branch replaces the linear map and the weight
    gradient with convolutions over time (:class:`ConvStackPoint`). The evaluation at ``x``
    and :meth:`vjp`, the product of the power series, apply the layers, their adjoints and the
    masks inline.

    Args:
        lin: The linearization.
        x: Sequences ``(R, N, D)``.
        mask: Optional boolean padding mask ``(R, N)``.
    """

    def __init__(self, lin: LayerStackLinearization, x: Tensor, mask: Tensor | None) -> None:
        self.lin = lin
        # Masking multiplies by the boolean mask (one kernel in the dtype of the product, no
        # scalar promotion); the products are finite, so padded entries become exactly 0.
        self.keep = None if mask is None else mask.unsqueeze(-1)
        #: The mask of the hidden layers' inputs (``None``: they are not masked).
        self.keep_hidden = self.keep if lin.masks_hidden else None
        keep = self.keep_hidden
        self.inputs: list[Tensor] = []
        self.pre: list[Tensor] = []
        self.sigmoids: list[Tensor] = []
        self.slopes: list[Tensor] = []
        # apply_layer written out (the forward of every estimate): F.linear token by token,
        # else the windows of the input times the tap matrix, as ConvStackPoint applies it
        matrices = lin.forward_matrices
        with torch.no_grad():
            h = x.detach() if keep is None else x.detach() * keep
            for i, bias in enumerate(lin.biases):
                if matrices is None:
                    a = F.linear(h, lin.weights[i], bias)
                else:
                    k, stacked = lin.taps[i], h
                    if k > 1:
                        stacked = F.pad(h, lin.forward_pads[i]).unfold(1, lin.spans[i], 1)[
                            ..., :: lin.dilations[i]].reshape(*h.shape[:2], h.shape[2] * k)
                    # one product over all frames, not a batch of products (bit for bit alike)
                    a = (stacked.flatten(0, 1) @ matrices[i]).view(*stacked.shape[:2], -1)
                    if bias is not None:
                        a = a.add_(bias)
                if i == 0 and lin.shift is not None:
                    a = a + self._shift_rows(lin.shift, x.shape[0]).unsqueeze(1)
                self.inputs.append(h)
                self.pre.append(a)
                if i < len(lin.betas):
                    # LipSwish at a with its slope: t = beta a, s = sigmoid(t), value a s / 1.1,
                    # slope (s + t s (1 - s)) / 1.1 (docs/math.md#lipswish).
                    t = lin.betas[i] * a
                    sigmoid = torch.sigmoid(t)
                    scaled = sigmoid * LIPSWISH_SCALE
                    h = a * scaled
                    slope = torch.addcmul(scaled, t.mul_(scaled), torch.rsub(sigmoid, 1))
                    if keep is not None:
                        h, slope = h * keep, slope * keep
                    self.slopes.append(slope)
                    self.sigmoids.append(sigmoid)
        self.output = a if self.keep is None else a * self.keep

    def apply_layer(self, l: int, h: Tensor, bias: Tensor | None = None) -> Tensor:
        r"""Layer ``l``'s linear map :math:`\tilde W_l h + b`, shape ``(R, N, H_{l+1})``."""
        return F.linear(h, self.lin.weights[l], bias)

    def adjoint_layer(self, l: int, g: Tensor) -> Tensor:
        r"""Its adjoint :math:`g \mapsto g \tilde W_l`, shape ``(R, N, H_l)``: into fewer
        channels, all taps at once and the products shifted and summed (no windows of the wide
        ``g``)."""
        lin = self.lin
        k, adjoint = lin.taps[l], lin.adjoints[l]
        if k > 1 and g.shape[2] > adjoint.shape[1]:
            return tap_sum(F.pad(g @ adjoint.view(g.shape[2], -1), lin.pads[l]), k,
                           lin.dilations[l], g.shape[1])
        return windows(g, k, lin.pads[l], lin.dilations[l]) @ adjoint

    def layer_weight_grad(self, l: int, g: Tensor, h: Tensor, k: Tensor, t: Tensor) -> Tensor:
        r""":math:`\partial/\partial\tilde W_l` of :math:`\langle g, \tilde W_l h\rangle +
        \langle k, \tilde W_l t\rangle`."""
        return torch.addmm(as_rows(g).T @ as_rows(h), as_rows(k).T, as_rows(t))

    def hidden_input(self, t: Tensor) -> Tensor:
        """A hidden layer's input ``(R, N, H_l)`` as the map sees it (masked where the stack
        masks its hidden layers, else unchanged)."""
        return t if self.keep_hidden is None else t * self.keep_hidden

    @staticmethod
    def _shift_rows(shift: Tensor, rows: int) -> Tensor:
        """The shift ``(B, H)`` of every row of an input of ``rows = k B`` rows, ``(rows, H)``."""
        return shift if rows == shift.shape[0] else shift.repeat(rows // shift.shape[0], 1)

    def _masked(self, w: Tensor) -> Tensor:
        return w if self.keep is None else w * self.keep

    def vjp(self, w: Tensor) -> Tensor:
        # adjoint_layer and hidden_input written out: this is the hot loop of the power series
        # windows written out too, with the paddings of the linearization
        lin = self.lin
        taps, pads, adjoints, spans, dilations = (lin.taps, lin.pads, lin.adjoints, lin.spans,
                                                  lin.dilations)
        g = w if self.keep is None else w * self.keep
        for l in range(len(adjoints) - 1, -1, -1):
            if l < len(self.slopes):
                g = g.mul_(self.slopes[l])  # g is a fresh product: scaled in place
            k = taps[l]
            if k > 1 and g.shape[2] > adjoints[l].shape[1]:  # into fewer channels
                g = tap_sum(F.pad(g @ adjoints[l].view(g.shape[2], -1), pads[l]), k,
                            dilations[l], g.shape[1])
                continue
            if k > 1:
                g = F.pad(g, pads[l]).unfold(1, spans[l], 1)[..., :: dilations[l]].reshape(
                    *g.shape[:2], g.shape[2] * k)
            g = g @ adjoints[l]
        return g if self.keep_hidden is None else g * self.keep_hidden

    def surrogate_backward(
        self, grad_out: Tensor, u: Tensor, v: Tensor
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        # Notation of docs/math.md#neumann-gradient in layer form: tangent tau_l (J v up to layer
        # l), alpha_l its pre-activation; kappa_l, rho_l cotangents of the tangent chain from u;
        # gamma_l cotangent of a_l in the primal chain, which receives rho * alpha * phi'' (the
        # dependence of the slopes on a_l).
        betas = self.lin.betas
        n = len(self.lin.weights)
        tau, alpha = [self.hidden_input(v)], []
        for l in range(n):
            alpha.append(self.apply_layer(l, tau[-1]))
            if l < n - 1:
                tau.append(self.slopes[l] * alpha[-1])
        kappa: list[Tensor] = [self._masked(u)]
        gamma: list[Tensor] = [self._masked(grad_out)]
        grad_betas = []
        for l in range(n - 2, -1, -1):
            rho = self.hidden_input(self.adjoint_layer(l + 1, kappa[0]))
            eta = self.hidden_input(self.adjoint_layer(l + 1, gamma[0]))
            z = self.pre[l]
            q, d = lipswish_second(betas[l], z, self.sigmoids[l])
            extra = (rho * alpha[l]).mul_(q)
            kappa.insert(0, self.slopes[l] * rho)
            gamma.insert(0, torch.addcmul(self.slopes[l] * eta, extra, betas[l]))
            # d/d beta: sum(eta * z^2 d) + sum(extra * z), as one inner product with z.
            grad_betas.insert(0, _dot(z, torch.addcmul(extra, eta * z, d)))
        grad_weights, grad_biases = [], []
        for l in range(n):
            grad_weights.append(
                self.layer_weight_grad(l, gamma[l], self.inputs[l], kappa[l], tau[l])
            )
            if self.lin.biases[l] is not None:
                grad_biases.append(as_rows(gamma[l]).sum(0))
        grad_shift = []
        if self.lin.shift is not None:  # the shift of sequence b enters rows b, b + B, ...
            grad_shift.append(gamma[0].sum(1).view(-1, *self.lin.shift.shape).sum(0))
        grad_x = self.hidden_input(self.adjoint_layer(0, gamma[0]))
        return grad_x, (*grad_weights, *grad_biases, *grad_betas, *grad_shift)


class ConvStackLinearization(LayerStackLinearization):
    """A stack of "same"-padded (or causal) convolutions over time and LipSwish activations with
    fixed effective taps (:meth:`~iresflow.nn.conv.TemporalConvBranch.linearize`).

    ``params`` lists the taps, the biases, then the LipSwish slopes. Each convolution is applied
    as a matrix product with the windows of its input (small channel counts make that cheaper
    than a convolution call); ``forward_matrices[l]`` (``(C_in k, C_out)``) and
    ``adjoints[l]`` (``(C_out k, C_in)``, the flipped taps) are those of layer ``l``, and
    padded frames are zeroed at the input of every layer. :meth:`at` rejects sequences longer
    than the branch's ``max_len``.

    Args:
        weights: Effective taps ``(C_out, C_in, k)`` of the layers, in order.
        biases: Their biases (``None`` where a layer has none).
        betas: The LipSwish slopes between the layers.
        shift: Optional per-sequence shift ``(B, H_1)`` after the first convolution (on every
            frame), as for :class:`LayerStackLinearization`.
        max_len: Longest sequence the branch's certificate holds for (``None``: any).
        causal: Whether the convolutions are causal (zero padding of ``k - 1`` frames on the
            left, :class:`~iresflow.nn.conv.SpectralConv1d`); their adjoints then pad
            on the right.
        dilation: Spacing of the taps over time of the layers with more than one tap.
    """

    masks_hidden = True
    frame_jacobians = True

    def __init__(
        self,
        weights: list[Tensor],
        biases: list[Tensor | None],
        betas: list[Tensor],
        *,
        shift: Tensor | None = None,
        max_len: int | None = None,
        causal: bool = False,
        dilation: int = 1,
    ) -> None:
        super().__init__(weights, biases, betas, shift)
        self.max_len, self.causal = max_len, causal
        self.taps, self.pads, self.forward_matrices, self.adjoints = [], [], [], []
        self.dilations, self.spans = [], []
        #: The padding of every layer's input windows (``pads``: of its adjoint's).
        self.forward_pads: list[tuple[int, int, int, int]] = []
        for w in self.weights:
            k = w.shape[-1]
            d = dilation if k > 1 else 1
            span = d * (k - 1) + 1
            self.taps.append(k)
            self.dilations.append(d)
            self.spans.append(span)
            same = (0, 0, span // 2, span // 2)  # symmetric: the forward's and the adjoint's
            self.forward_pads.append((0, 0, span - 1, 0) if causal else same)
            self.pads.append((0, 0, 0, span - 1) if causal else same)
            self.forward_matrices.append(w.reshape(w.shape[0], -1).T)
            self.adjoints.append(w.flip(-1).transpose(1, 2).reshape(-1, w.shape[1]))

    def at(self, x: Tensor, mask: Tensor | None = None) -> ConvStackPoint:
        """The stack at ``x`` ``(R, N, D)``, ``N <= max_len``, with an optional mask ``(R, N)``."""
        check_length(x.shape[1], self.max_len, "TemporalConvBranch")
        return ConvStackPoint(self, x, mask)

    def evaluate(self, x: Tensor, mask: Tensor | None = None,
                 slopes: list[Tensor] | None = None) -> Tensor:
        """:meth:`LayerStackLinearization.evaluate`, for ``N <= max_len`` only."""
        check_length(x.shape[1], self.max_len, "TemporalConvBranch")
        return super().evaluate(x, mask, slopes)

    def frame_jacobian(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        """:meth:`evaluate` at ``x`` with its LipSwish slopes, and from them
        :func:`~iresflow.nn.frames.conv_stack_jacobian`."""
        slopes: list[Tensor] = []
        value = self.evaluate(x, mask, slopes)
        return value, conv_stack_jacobian(self, slopes, None if mask is None else mask[..., None])

    def apply_folded(self, l: int, h: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        """Layer ``l``'s convolution with folded parameters (:meth:`evaluate`)."""
        return conv_frames(h, weight, bias, causal=self.causal, dilation=self.dilations[l])


class ConvStackPoint(LayerStackPoint):
    r"""A :class:`ConvStackLinearization` at ``x``: the products of :class:`LayerStackPoint`
    with "same"-padded (or causal) convolutions over time (tensors stay ``(R, N, C)``) and
    padded frames zeroed at every layer input.

    With taps :math:`W_j` dilated by :math:`d` and :math:`p = (k - 1) / 2` (causal:
    :math:`p = k - 1`), the convolution is :math:`y_t = \sum_j W_j x_{t + d (j - p)}` and its
    adjoint :math:`\bar x_s = \sum_j W_{k - 1 - j}^\top \bar y_{s + d (j - (k - 1 - p))}`: both
    are products of input windows with a tap matrix."""

    lin: ConvStackLinearization

    def apply_layer(self, l: int, h: Tensor, bias: Tensor | None = None) -> Tensor:
        lin = self.lin
        stacked = windows(h, lin.taps[l], lin.forward_pads[l], lin.dilations[l])
        out = stacked @ lin.forward_matrices[l]
        return out if bias is None else out.add_(bias)

    def layer_weight_grad(self, l: int, g: Tensor, h: Tensor, k: Tensor, t: Tensor) -> Tensor:
        weight = self.lin.weights[l]
        # Both terms in one product of the stacked output cotangents with the input windows.
        stacked = windows(torch.cat([h, t]), weight.shape[-1], self.lin.forward_pads[l],
                          self.lin.dilations[l])
        return (as_rows(torch.cat([g, k])).T @ as_rows(stacked)).view(weight.shape)
