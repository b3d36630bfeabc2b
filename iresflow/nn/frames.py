r"""Convolutions over time on frames, channels last: ``(R, N, C)`` tensors, as the temporal
convolution branch (:class:`~iresflow.nn.conv.TemporalConvBranch`) and its linearization
(:class:`~iresflow.nn.layered.ConvStackLinearization`) apply them.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

__all__ = ["conv_frames", "tap_sum", "windows"]


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
