r"""A masked MLP over the features of one frame: output :math:`d` reads the features before
:math:`d` (in a fixed order) and a per-frame context (docs/math.md#autoregressive-step).

The masks are those of MADE (Germain et al. 2015): every unit has a degree, input feature
:math:`i` the degree :math:`m_i \in \{1, \dots, D\}` (its place in the order), hidden units the
degrees :math:`0, 1, \dots, D - 1` in turn; a hidden unit reads the inputs and hidden units of
degree at most its own, an output of feature :math:`d` the hidden units of degree below
:math:`m_d`. Units of degree 0 read the context only, so output :math:`d` is a function of the
context and of the features of degree below :math:`m_d`, whatever the weights.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor, nn
from torch.nn import functional

from iresflow._validation import check_int

__all__ = ["MaskedFrameNet"]


class MaskedFrameNet(nn.Module):
    r"""An MLP from a frame :math:`x \in \mathbb{R}^D` and a context :math:`h` to ``outputs``
    values per feature, the values of feature :math:`d` reading :math:`h` and the features
    before :math:`d` only.

    .. math::
        u_1 = \mathrm{gelu}\big((M_1 \odot W_1) x + V h + b_1\big), \quad
        u_2 = \mathrm{gelu}\big((M_2 \odot W_2) u_1 + b_2\big), \quad
        o = (M_3 \odot W_3) u_2 + b_3,

    with the MADE masks :math:`M_k` of the order (``1, ..., D``, or ``D, ..., 1`` with
    ``reverse``). The output layer starts at zero, so the network outputs zeros until training
    moves it. A frame's features before feature :math:`d` are those of lower degree: with
    ``reverse`` the features after it in the frame.

    Args:
        features: Frame size ``D``.
        context_features: Size ``H`` of the per-frame context.
        hidden: Width of both hidden layers.
        outputs: Values per feature (2: a shift and a log-scale).
        reverse: Order the features ``D, ..., 1`` instead of ``1, ..., D``.

    Example:
        >>> net = MaskedFrameNet(3, 4, hidden=8)
        >>> _ = torch.nn.init.normal_(net.output.weight)
        >>> x, h = torch.randn(5, 3), torch.randn(5, 4)
        >>> moved = x.clone()
        >>> moved[:, 2] += 1.0  # the last feature is read by no output
        >>> torch.equal(net(x, h), net(moved, h)), net(x, h).shape
        (True, torch.Size([5, 6]))
    """

    def __init__(self, features: int, context_features: int, *, hidden: int = 64,
                 outputs: int = 2, reverse: bool = False) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        self.context_features = check_int(context_features, "context_features", 1)
        self.hidden = check_int(hidden, "hidden", 1)
        self.outputs = check_int(outputs, "outputs", 1)
        self.reverse = bool(reverse)
        degrees = torch.arange(1, features + 1)
        if self.reverse:
            degrees = degrees.flip(0)
        units = torch.arange(hidden) % features  # 0, 1, ..., D - 1 in turn
        out_degrees = degrees.repeat(outputs)  # output k * D + d is value k of feature d
        self.register_buffer("mask_in", (units[:, None] >= degrees[None]).float(),
                             persistent=False)
        self.register_buffer("mask_hidden", (units[:, None] >= units[None]).float(),
                             persistent=False)
        self.register_buffer("mask_out", (out_degrees[:, None] > units[None]).float(),
                             persistent=False)
        self.input = nn.Linear(features, hidden)
        self.context = nn.Linear(context_features, hidden, bias=False)
        self.middle = nn.Linear(hidden, hidden)
        self.output = nn.Linear(hidden, outputs * features)
        nn.init.zeros_(self.output.weight)
        nn.init.zeros_(self.output.bias)

    def forward(self, x: Tensor, context: Tensor) -> Tensor:
        """Values of every feature from the features before it and the context.

        Args:
            x: Frames ``(..., D)``.
            context: Per-frame context ``(..., H)``, the same leading shape.

        Returns:
            ``(..., outputs * D)``: value ``k`` of feature ``d`` at ``k * D + d``, a function of
            ``context`` and of the features before ``d`` only.
        """
        return self.given(context)(x)

    def given(self, context: Tensor) -> Callable[[Tensor], Tensor]:
        """The network as a function of the frames for a fixed ``context`` ``(..., H)``, with
        the context's term and the masked weights computed once: what an inverse that passes
        over the same frames ``D`` times calls.

        Returns:
            ``net(x)``: :meth:`forward` of frames ``x`` ``(..., D)`` and ``context``.
        """
        term = self.context(context)  # the masks follow the module's dtype, as buffers
        w_in, w_mid, w_out = (self.input.weight * self.mask_in,
                              self.middle.weight * self.mask_hidden,
                              self.output.weight * self.mask_out)

        def net(x: Tensor) -> Tensor:
            u = functional.gelu(functional.linear(x, w_in, self.input.bias) + term)
            u = functional.gelu(functional.linear(u, w_mid, self.middle.bias))
            return functional.linear(u, w_out, self.output.bias)

        return net

    def extra_repr(self) -> str:
        return (f"features={self.features}, context_features={self.context_features}, "
                f"hidden={self.hidden}, outputs={self.outputs}, reverse={self.reverse}")
