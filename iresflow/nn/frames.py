r"""Convolutions over time on frames, channels last: ``(R, N, C)`` tensors, as the temporal
convolution branch (:class:`~iresflow.nn.conv.TemporalConvBranch`) and its linearization
(:class:`~iresflow.nn.layered.ConvStackLinearization`) apply them.
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["TapStack", "conv_frames", "conv_stack_jacobian", "tap_sum", "windows"]


def windows(h: Tensor, size: int, pad: tuple[int, int, int, int], dilation: int = 1) -> Tensor:
    """The windows of a convolution's input: ``out[r, t, c * size + j] = h[r, t + d j - left,
    c]``, zero outside the sequence.

    Built from slices, not ``unfold``, which has no batching rule under ``vmap`` (``jacrev`` of
    a branch would fall back to a loop).

    Args:
        h: Input ``(R, N, C)``.
        size: Taps per window ``k`` (1 returns ``h`` itself).
        pad: ``(0, 0, left, right)`` with ``left + right = d (k - 1)``.
        dilation: Spacing ``d`` of the taps over time.

    Returns:
        ``(R, N, C k)``.

    Example:
        >>> windows(torch.arange(3.0).view(1, 3, 1), 3, (0, 0, 1, 1))[0].tolist()
        [[0.0, 0.0, 1.0], [0.0, 1.0, 2.0], [1.0, 2.0, 0.0]]
    """
    if size == 1:
        return h
    padded, n = F.pad(h, pad), h.shape[1]
    taps = [padded[:, j * dilation:j * dilation + n] for j in range(size)]
    return torch.stack(taps, -1).reshape(*h.shape[:2], h.shape[2] * size)


def conv_frames(
    h: Tensor, weight: Tensor, bias: Tensor | None = None, *, causal: bool = False,
    dilation: int = 1,
) -> Tensor:
    r"""A convolution over time on frames, channels last: :math:`y_t = \sum_j W_j
    h_{t + d (j - p)} + b` with zero padding, :math:`p = (k - 1) / 2` ("same") or :math:`k - 1`
    (causal).

    The product is associated the cheaper way for the shapes: the input's windows times the
    tap matrix when the layer widens (``C_in <= C_out``), else all the taps at once times the
    input, the :math:`k` results shifted over time and summed, which never builds the windows of
    a wide input. That product is taken with the frames last (``(k C_out, R N)``): for a narrow
    output (the branch's last layer, ``C_out = D``) it is up to twice as fast as with the
    channels last.

    Args:
        h: Input ``(R, N, C_in)``.
        weight: Taps ``(C_out, C_in, k)`` (:func:`torch.nn.functional.conv1d` layout).
        bias: Optional ``(C_out,)``.
        causal: Whether frame ``t`` reads frames up to ``t`` only.
        dilation: Spacing :math:`d` of the taps over time.

    Returns:
        ``(R, N, C_out)``; equal to ``conv1d`` of ``h`` channels first, to rounding.

    Raises:
        ValueError: ``weight`` is not ``(C_out, C_in, k)`` or ``h`` not ``(R, N, C_in)``.

    Example:
        >>> h, w = torch.randn(2, 5, 3), torch.randn(4, 3, 3)
        >>> y = F.conv1d(h.transpose(1, 2), w, padding=1).transpose(1, 2)
        >>> bool(torch.allclose(conv_frames(h, w), y, atol=1e-5))
        True
    """
    if weight.dim() != 3 or h.dim() != 3 or h.shape[-1] != weight.shape[1]:
        raise ValueError(f"weight must be (C_out, C_in, k) and h (R, N, C_in), got weight "
                         f"{tuple(weight.shape)} and h {tuple(h.shape)}")
    out_channels, in_channels, k = weight.shape
    if k == 1:
        return F.linear(h, weight[..., 0], bias)
    span = dilation * (k - 1) + 1
    left = span - 1 if causal else span // 2
    pad, n = (0, 0, left, span - 1 - left), h.shape[1]
    if in_channels <= out_channels:
        return F.linear(windows(h, k, pad, dilation), weight.reshape(out_channels, -1), bias)
    # row j C_out + o of z is tap j's output channel o at every input frame, padded over time;
    # the taps are made contiguous, which their reshape is not for one output channel (a
    # strided matrix makes the product about three times slower)
    taps = weight.permute(2, 0, 1).reshape(k * out_channels, in_channels).contiguous()
    z = torch.mm(taps, h.reshape(-1, in_channels).T).view(k, out_channels, h.shape[0], n)
    z = F.pad(z, pad[2:])
    y = z[0, ..., :n] + z[1, ..., dilation:dilation + n]
    for j in range(2, k):
        y += z[j, ..., j * dilation:j * dilation + n]
    y = y.permute(1, 2, 0).contiguous()  # (R, n, C_out)
    return y if bias is None else y.add_(bias)


def tap_sum(z: Tensor, k: int, dilation: int, n: int) -> Tensor:
    """A convolution from the products of its padded input with all its taps at once: the
    ``k`` products shifted over time and summed, ``y[:, t] = sum_j z[:, t + d j, j C:(j + 1) C]``.

    Args:
        z: Products ``(R, n + d (k - 1), k C)``, tap ``j``'s in columns ``j C`` to
            ``(j + 1) C``.
        k: Taps, at least 2.
        dilation: Spacing ``d`` of the taps over time.
        n: Frames of the output.

    Returns:
        ``(R, n, C)``, a new tensor.

    Example:
        >>> tap_sum(torch.arange(8.0).view(1, 4, 2), 2, 1, 3)[0, :, 0].tolist()
        [3.0, 7.0, 11.0]
    """
    out = z.shape[-1] // k
    y = z[:, :n, :out] + z[:, dilation:dilation + n, out:2 * out]
    for j in range(2, k):
        y += z[:, j * dilation:j * dilation + n, j * out:(j + 1) * out]
    return y


class TapStack(Protocol):
    """A stack of convolutions over frames as its linearization holds it
    (:class:`~iresflow.nn.layered.ConvStackLinearization`): per layer the effective taps
    ``(C_out, C_in, k)``, their number, their spacing and the padding of the input windows."""

    weights: list[Tensor]
    taps: list[int]
    dilations: list[int]
    forward_pads: list[tuple[int, int, int, int]]


def conv_stack_jacobian(lin: TapStack, slopes: list[Tensor], keep: Tensor | None) -> Tensor:
    r"""The Jacobian of a convolution stack at a point, block by block over frames.

    For the temporal-convolution branch's stack of three layers, the middle one of one tap,
    :math:`g_t = \sum_b W^3_b\, \phi(W^2 \phi(\sum_a W^1_a x_{t + b + a}))` with taps at the
    offsets :math:`a`, :math:`b` of the first and last layers, the block of output frame
    :math:`t` and input frame :math:`s` is

    .. math:: \frac{\partial g_t}{\partial x_s} = \sum_{a + b = s - t} W^3_b
        \operatorname{diag}(\phi'_2(u)) W^2 \operatorname{diag}(\phi'_1(u)) W^1_a,
        \qquad u = t + b,

    formed with one product by the middle layer per tap of the first (and ``D`` columns each):
    about as much arithmetic as three evaluations of the branch on one feature. Padded frames
    (``keep`` false) have zero rows and columns, as the masked stack has.

    Args:
        lin: The stack's linearization (effective taps, their offsets over time).
        slopes: The LipSwish slopes :math:`\phi'_1, \phi'_2` at the point, ``(R, N, H)`` each,
            zero at padded frames.
        keep: Optional real-frame mask ``(R, N, 1)``.

    Returns:
        ``(R, N, N, D, D)``, block ``[r, t, s]`` the Jacobian of output frame ``t`` in input
        frame ``s`` (rows: output features).

    Raises:
        ValueError: The stack is not three layers with a middle one of one tap.
    """
    if len(lin.weights) != 3 or lin.taps[1] != 1:
        raise ValueError(f"conv_stack_jacobian needs three layers, the middle one of one tap; "
                         f"got taps {lin.taps}")
    first, middle, last = lin.weights
    (rows, n, _), features = slopes[0].shape, first.shape[1]
    offsets = [[lin.dilations[l] * j - lin.forward_pads[l][2] for j in range(lin.taps[l])]
               for l in (0, 2)]
    hidden, taps = middle.shape[0], len(offsets[1])
    last_taps = last.permute(0, 2, 1).reshape(-1, hidden)  # (D k, H): output e, tap i
    blocks = slopes[0].new_zeros(rows, n, n, features, features)
    for j, a in enumerate(offsets[0]):
        # at hidden frame u, column d: phi2'(u) * W2 (phi1'(u) * W1_a[:, d]), (R, N, D, H), then
        # times every tap of the last layer: single matrix products over all rows and frames
        column = (slopes[0].unsqueeze(2) * first[:, :, j].T).reshape(-1, hidden) @ middle[..., 0].T
        column = column.view(rows, n, features, hidden) * slopes[1].unsqueeze(2)
        products = F.linear(column, last_taps).view(rows, n, features, features, taps)
        for i, b in enumerate(offsets[1]):
            lo, hi = max(0, b, -a), min(n, n + b, n - a)  # u with t = u - b and s = u + a inside
            if hi > lo:
                diagonal = blocks.diagonal(offset=a + b, dim1=1, dim2=2)  # (R, D, D, n - |a + b|)
                start = lo - b if a + b >= 0 else lo + a  # its index of (t, s): t, or s below
                diagonal[..., start:start + hi - lo] += products[:, lo:hi, ..., i].permute(
                    0, 3, 2, 1)
    if keep is not None:
        real = keep[..., 0]
        blocks = blocks * (real[:, :, None] & real[:, None, :])[..., None, None]
    return blocks
