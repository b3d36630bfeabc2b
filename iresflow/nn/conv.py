r"""Temporal convolution branch with a certified 2-norm bound on the whole conv operator.

A 1-D convolution with taps :math:`W_0, \dots, W_{k-1}` (``out x in`` each, odd :math:`k`,
:math:`r = (k - 1) / 2`) and "same" zero padding maps a sequence of length :math:`N` to

.. math:: y_t = \sum_{j=0}^{k-1} W_j x_{t + j - r}, \qquad x_s = 0 \text{ for } s \notin [0, N).

For :math:`N \le` ``max_len`` this linear operator is a compression (a block of rows and
columns) of the circular convolution of period :math:`P = \text{max\_len} + k - 1` applied to
the sequence embedded with zeros: no index wraps around onto a real frame. A block-circulant
matrix is block-diagonalised by the discrete Fourier transform, so (docs/math.md#temporal-conv)

.. math:: \|\mathrm{conv}\|_2 \le \|\mathrm{circ}_P(W)\|_2
    = \max_{m = 0, \dots, P-1} \sigma_{\max}\big(\hat W(2\pi m / P)\big), \qquad
    \hat W(\omega) = \sum_{j} W_j e^{-i \omega j},

one FFT of the taps over :math:`P` points and a batch of small SVDs (real taps: the spectrum is
conjugate-symmetric, so :math:`m \le P / 2` suffices). This bounds the whole operator, not each
tap separately, and is exact for the circular operator.

A *causal* convolution reads the current and past frames only, :math:`y_t = \sum_{j=0}^{k-1}
W_j x_{t + j - (k - 1)}` (zero padding on the left, any :math:`k`). Its indices wrap, in the
circular convolution of the same period, onto frames :math:`\ge P - k + 1 \ge N`, which hold
zeros, so it is a compression of that operator too: the same bound (docs/math.md#causal-steps).

Dilated by :math:`d`, the taps read frames :math:`d` apart: the convolution with the
:math:`d (k - 1) + 1` taps :math:`W_0, 0, \dots, 0, W_1, \dots`, so all of the above holds with
:math:`P = \text{max\_len} + d (k - 1)` and :math:`\hat W(\omega) = \sum_j W_j e^{-i\omega d j}`.
"""

from __future__ import annotations

import math
from operator import methodcaller

import torch
from torch import Tensor, nn

from iresflow._validation import (
    check_int,
    check_mask,
    check_sequence,
    is_transformed,
    under_functorch_transform,
)
from iresflow.nn.activations import LipSwish
from iresflow.nn.base import LipschitzBranch
from iresflow.nn.frames import conv_frames
from iresflow.nn.layered import ConvStackLinearization, stack_parameters
from iresflow.nn.linear import check_coefficient, kept_without_graph, top_singular_vectors

__all__ = ["SpectralConv1d", "TemporalConvBranch", "circular_conv_norm"]


def circular_conv_norm(weight: Tensor, period: int, dilation: int = 1) -> Tensor:
    r"""Exact 2-norm of the circular convolution of period ``period`` with taps ``weight``.

    :math:`\max_m \sigma_{\max}(\hat W(2\pi m / P))` with
    :math:`\hat W(\omega) = \sum_j W_j e^{-i\omega d j}` for the taps dilated by :math:`d`
    (docs/math.md#temporal-conv). It bounds the zero-padded convolution of every length
    :math:`N \le P - d (k - 1)`. Differentiable w.r.t. ``weight`` (through the singular values).

    Args:
        weight: Taps in :func:`torch.nn.functional.conv1d` layout, shape ``(out, in, k)``.
        period: Period :math:`P \ge d (k - 1) + 1`.
        dilation: Spacing :math:`d \ge 1` of the taps over time.

    Returns:
        0-dim tensor.

    Example:
        >>> taps = torch.tensor([[[1.0, 1.0]]])  # y_t = x_t + x_{t+1}: gain 2 at frequency 0
        >>> circular_conv_norm(taps, 4)
        tensor(2.)
    """
    if not isinstance(weight, Tensor) or not weight.is_floating_point() or weight.dim() != 3:
        raise TypeError(
            f"weight must be a floating-point tensor of shape (out, in, k), got "
            f"{tuple(weight.shape) if isinstance(weight, Tensor) else type(weight).__name__}"
        )
    check_int(dilation, "dilation", 1)
    check_int(period, "period", dilation * (weight.shape[-1] - 1) + 1)
    return torch.linalg.matrix_norm(_spectrum(weight, period, dilation), ord=2).amax()


def _spectrum(weight: Tensor, period: int, dilation: int) -> Tensor:
    r""":math:`\hat W(2\pi m / P)` for :math:`0 \le m \le P/2`, shape ``(M, out, in)``: the FFT
    of the taps with :math:`d - 1` zeros between them."""
    if dilation > 1:
        spaced = weight.new_zeros(*weight.shape[:-1], dilation * (weight.shape[-1] - 1) + 1)
        spaced[..., ::dilation] = weight
        weight = spaced
    return torch.fft.rfft(weight, n=period, dim=-1).permute(2, 0, 1)


class SpectralConv1d(nn.Module):
    r"""1-D convolution over time whose whole operator has 2-norm at most ``coeff``.

    The effective taps are :math:`\tilde W = W / \max(1, \|\mathrm{circ}_P(W)\|_2 / c)` with the
    exact circular-embedding norm of :func:`circular_conv_norm` for :math:`P =` ``max_len`` +
    ``span`` - 1, recomputed from the parameters in every forward (training and
    evaluation), so :math:`\|\mathrm{conv}_{\tilde W}\|_2 \le c` holds to rounding on every
    sequence of length :math:`\le` ``max_len``. As for
    :class:`~iresflow.nn.linear.SpectralLinear` with ``sigma="exact"``, the frequency
    :math:`\omega^*` and the top singular pair :math:`(u, v)` of :math:`\hat W(\omega^*)` are
    cached for the current weight *values* (the SVDs are redone only when the weight changes),
    and the norm is rebuilt with its gradient as :math:`\mathrm{Re}\,u^H \hat W(\omega^*) v`, the
    exact value with the exact gradient of the maximum. Inside a ``torch.func`` transform that
    wraps the weight, the norm is computed directly, without the cache.

    Inputs are channels-first like :class:`torch.nn.Conv1d`; "same" zero padding keeps the
    length, or with ``causal=True`` zero padding of :math:`k - 1` frames on the left only, so
    output frame :math:`t` reads input frames :math:`t - k + 1, \dots, t` (the bound is the
    same, docs/math.md#causal-steps). With ``dilation`` :math:`d` the taps read frames :math:`d`
    apart, :attr:`span` :math:`= d (k - 1) + 1` frames in all.

    Args:
        in_channels: Input channels ``C_in``.
        out_channels: Output channels ``C_out``.
        kernel_size: Number of taps ``k``, odd unless ``causal``.
        coeff: Bound :math:`c \in (0, 1]` on the operator 2-norm.
        max_len: Longest sequence the bound must hold for.
        bias: Whether to learn an additive bias.
        causal: Whether the taps read the current and past frames only.
        dilation: Spacing :math:`d` of the taps over time.

    Example:
        >>> conv = SpectralConv1d(2, 3, kernel_size=3, coeff=0.9, max_len=6)
        >>> conv(torch.randn(4, 2, 6)).shape
        torch.Size([4, 3, 6])
        >>> bool(conv.lipschitz_constant() <= 0.9 + 1e-6)
        True
        >>> SpectralConv1d(2, 3, kernel_size=3, coeff=0.9, max_len=6, dilation=2).span
        5
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        coeff: float,
        *,
        max_len: int,
        bias: bool = True,
        causal: bool = False,
        dilation: int = 1,
    ) -> None:
        super().__init__()
        self.in_channels = check_int(in_channels, "in_channels", 1)
        self.out_channels = check_int(out_channels, "out_channels", 1)
        self.causal = bool(causal)
        self.kernel_size = check_int(kernel_size, "kernel_size", 1)
        if self.kernel_size % 2 == 0 and not self.causal:  # "same" padding is symmetric
            raise ValueError(f"kernel_size must be odd, got {self.kernel_size}")
        self.coeff = check_coefficient(coeff)
        self.max_len = check_int(max_len, "max_len", 1)
        self.dilation = check_int(dilation, "dilation", 1)
        self.span = self.dilation * (self.kernel_size - 1) + 1
        # A single tap has no frequency dependence: its norm is the matrix norm (period 1).
        self.period = self.max_len + self.span - 1 if self.kernel_size > 1 else 1
        self.weight = nn.Parameter(torch.empty(out_channels, in_channels, kernel_size))
        if bias:
            self.bias = nn.Parameter(torch.empty(out_channels))
        else:
            self.register_parameter("bias", None)
        self._cache: tuple[Tensor, Tensor, Tensor, Tensor] | None = None
        self.reset_parameters()

    def reset_parameters(self) -> None:
        """Initialise ``weight`` and ``bias`` exactly as :class:`torch.nn.Conv1d` does."""
        nn.Conv1d.reset_parameters(self)  # type: ignore[arg-type]  # uses only weight and bias

    def operator_norm(self) -> Tensor:
        r"""Exact :math:`\|\mathrm{circ}_P(W)\|_2` of the raw taps (0-dim, differentiable)."""
        return self._normalization()[0]

    def _normalization(self) -> tuple[Tensor, Tensor]:
        r"""The exact norm :math:`\|\mathrm{circ}_P(W)\|_2` of the raw taps and the divisor
        :math:`\max(1, \|\cdot\| / c)` of the effective taps, both 0-dim and differentiable: the
        one definition of the normalisation (one call per forward)."""
        weight = self.weight
        if is_transformed(weight):  # a torch.func transform hides its values: no cache
            norm = circular_conv_norm(weight, self.period, self.dilation)
        else:
            cache = self._cache
            if (cache is None or cache[0].dtype != weight.dtype or cache[0].device != weight.device
                    or not torch.equal(cache[0], weight.detach())):
                cache = self._top_singular_pair(weight)
                self._cache = cache
            _, phase, u, v = cache
            response = (weight.to(phase.dtype) * phase).sum(dim=-1)  # W_hat(omega*), (out, in)
            norm = torch.real(torch.vdot(u, response @ v))
        return norm, torch.clamp(norm / self.coeff, min=1.0)

    @torch.no_grad()
    def _top_singular_pair(self, weight: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """Snapshot of ``weight``, the phases ``exp(-i omega* j)`` and the top singular pair."""
        snapshot = weight.detach().clone()
        work = snapshot.to(torch.promote_types(snapshot.dtype, torch.float32))
        if self.period == 1:  # a single tap: its real matrix, frequency 0
            m = torch.zeros(1, dtype=torch.long, device=weight.device)
            matrix = work.permute(2, 0, 1)
        else:
            spectrum = _spectrum(work, self.period, self.dilation)
            # The maximising frequency from the top eigenvalues of the smaller Gram matrices,
            # sigma_max^2 (a batch of small Hermitian eigenvalue problems), then singular vectors
            # at that frequency only: a fraction of the cost of a batched SVD.
            gram = (spectrum.mH @ spectrum if spectrum.shape[-1] <= spectrum.shape[-2]
                    else spectrum @ spectrum.mH)
            m = torch.linalg.eigvalsh(gram)[:, -1:].argmax(dim=0)  # (1,): no host read
            matrix = spectrum.index_select(0, m)
        left, right = top_singular_vectors(matrix)
        taps = self.dilation * torch.arange(self.kernel_size, device=weight.device,
                                            dtype=work.dtype)
        phase = torch.polar(torch.ones_like(taps), -2 * math.pi * m.to(work.dtype) * taps
                            / self.period)
        complex_dtype = torch.promote_types(snapshot.dtype, torch.complex64)
        return (
            snapshot,
            phase.to(complex_dtype),
            left[0].to(complex_dtype),
            right[0].to(complex_dtype),
        )

    def weight_normalized(self) -> Tensor:
        r"""The effective taps :math:`\tilde W`, shape ``(out, in, k)``, differentiable."""
        if self.training or torch.is_grad_enabled():  # written out: no call more in training
            return self.weight / self._normalization()[1]
        return kept_without_graph(self, lambda: self.weight / self._normalization()[1])

    def lipschitz_constant(self) -> Tensor:
        r"""Certified 2-norm of the layer on lengths up to ``max_len``, :math:`\min(\|W\|, c)`.

        Returns:
            0-dim tensor, differentiable w.r.t. ``weight``.
        """
        norm, scale = self._normalization()
        return norm / scale

    def forward(self, x: Tensor) -> Tensor:
        """Convolve over the last (time) dimension with "same" (or causal) zero padding.

        Args:
            x: Input ``(B, C_in, N)`` with ``N <= max_len``.

        Returns:
            Output ``(B, C_out, N)``.

        Raises:
            ValueError: wrong shape or ``N > max_len``.
        """
        if x.dim() != 3 or x.shape[1] != self.in_channels:
            raise ValueError(f"x must have shape (B, {self.in_channels}, N), got {tuple(x.shape)}")
        return self.forward_frames(x.transpose(1, 2)).transpose(1, 2)

    def forward_frames(self, h: Tensor) -> Tensor:
        """:meth:`forward` on frames, channels last: ``(B, N, C_in)`` to ``(B, N, C_out)``
        (:func:`~iresflow.nn.frames.conv_frames`); ``ValueError`` for ``N > max_len``."""
        if h.dim() == 3 and h.shape[1] > self.max_len:
            raise ValueError(f"x has length {h.shape[1]} > max_len={self.max_len}, for which the "
                             f"certified bound does not hold")
        return conv_frames(h, self.weight_normalized(), self.bias, causal=self.causal,
                           dilation=self.dilation)

    def extra_repr(self) -> str:
        return (
            f"in_channels={self.in_channels}, out_channels={self.out_channels}, "
            f"kernel_size={self.kernel_size}, coeff={self.coeff}, max_len={self.max_len}, "
            f"bias={self.bias is not None}" + (", causal=True" if self.causal else "")
            + (f", dilation={self.dilation}" if self.dilation > 1 else "")
        )


class TemporalConvBranch(LipschitzBranch):
    r"""Residual branch of 1-D convolutions over time, contractive in the 2-norm.

    .. math:: g = \mathrm{conv}_3 \circ \mathrm{LipSwish} \circ \mathrm{conv}_2 \circ
        \mathrm{LipSwish} \circ \mathrm{conv}_1

    with channels ``D -> hidden -> hidden -> D`` and kernel sizes ``(k, 1, k)`` (the layout of
    the convolutional branches of Residual Flows: the middle layer mixes channels per frame),
    each a :class:`SpectralConv1d` whose whole operator has 2-norm at most :math:`c^{1/3}`, so
    (LipSwish is 1-Lipschitz, masking a projection)

    .. math:: \mathrm{lip}_2(g) \le \prod_{l=1}^{3} \|\mathrm{conv}_l\|_2 \le c < 1

    on :math:`\mathrm{vec}(X)` for every sequence of length :math:`\le` ``max_len``
    (docs/math.md#temporal-conv). The sequence analogue of the convolutional branches of
    Residual Flows: every output frame sees the :math:`k - 1` frames on either side of it
    (:attr:`receptive_radius`). With ``causal=True`` the first and last convolutions are causal
    (:class:`SpectralConv1d`), so output frame :math:`t` sees the frames
    :math:`t - 2(k - 1), \dots, t` only: the branch is causal over frames (:attr:`causal`) and
    its Jacobian is block lower-triangular (docs/math.md#causal-steps). With ``dilation``
    :math:`d` the first and last convolutions read frames :math:`d` apart: :math:`d` times the
    reach at the same cost and certificate (blocks dilated 1, 2, 4, ... reach exponentially far
    in their depth). With a mask, padded frames are set to zero before every convolution and
    at the output (at every layer, also inside a sequence), so they never influence real outputs.

    Input validation runs outside ``torch.func`` transforms (the caller of a transform
    validates the batch); the length check ``N <= max_len`` always runs. A per-sequence shift
    ``(B, hidden)`` (:attr:`shift_features`) enters after the first convolution
    (docs/math.md#conditional-branches).

    Args:
        features: Token dimension ``D``.
        hidden: Hidden channels.
        kernel_size: Kernel size ``k`` of the first and last convolutions, odd unless
            ``causal``.
        coeff: Certified Lipschitz constant :math:`c \in (0, 1)` of the branch.
        max_len: Longest sequence the certificate must hold for; longer inputs are rejected.
        causal: Whether every output frame reads the current and past frames only.
        dilation: Spacing :math:`d` of the taps of the first and last convolutions.

    Example:
        >>> branch = TemporalConvBranch(2, 8, kernel_size=3, coeff=0.9, max_len=10)
        >>> branch(torch.randn(4, 10, 2)).shape
        torch.Size([4, 10, 2])
        >>> bool(branch.lipschitz_constant() <= 0.9 + 1e-6)
        True
    """

    position_wise = False
    norm = "2"
    solves_linearized = True

    def __init__(
        self,
        features: int,
        hidden: int,
        kernel_size: int = 3,
        coeff: float = 0.9,
        *,
        max_len: int,
        causal: bool = False,
        dilation: int = 1,
    ) -> None:
        super().__init__()
        self.features = check_int(features, "features", 1)
        check_int(hidden, "hidden", 1)
        self.coeff = check_coefficient(coeff, strict=True)
        self.max_len = check_int(max_len, "max_len", 1)
        self.dilation = check_int(dilation, "dilation", 1)
        per_layer = self.coeff ** (1 / 3)
        dims = (features, hidden, hidden, features)
        layers: list[nn.Module] = []
        for i, (c_in, c_out) in enumerate(zip(dims[:-1], dims[1:], strict=True)):
            if i > 0:
                layers.append(LipSwish())
            k = 1 if i == 1 else kernel_size
            layers.append(SpectralConv1d(c_in, c_out, k, per_layer, max_len=max_len,
                                         causal=causal, dilation=1 if k == 1 else dilation))
        self.net = nn.Sequential(*layers)
        self.causal = bool(causal)
        #: Output frame ``t`` depends on input frames ``t - radius .. t + radius`` only (causal:
        #: ``t - radius .. t``).
        reach = self.dilation * (kernel_size - 1)
        self.receptive_radius = 2 * reach if self.causal else reach
        self.shift_features = hidden

    def forward(
        self, x: Tensor, mask: Tensor | None = None, shift: Tensor | None = None
    ) -> Tensor:
        """Evaluate the branch.

        Args:
            x: Sequences ``(B, N, D)`` with ``N <= max_len``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real frames.
            shift: Optional ``(B, hidden)``, added to every frame after the first convolution.

        Returns:
            ``g(x)``, shape ``(B, N, D)``, exactly zero at padded frames.

        Raises:
            TypeError: ``x`` is not a floating-point tensor of the parameters' dtype and device,
                or ``mask`` is not boolean.
            ValueError: wrong shape, ``N > max_len``, NaN/Inf, or an all-padding sequence.
        """
        if not under_functorch_transform():
            check_sequence(x, "x", features=self.features, allow_2d=False, like=self.net[0].weight)
            mask = check_mask(mask, x)
            if shift is not None:
                self.check_shift(shift, x)
        self.check_length(x.shape[1])
        keep = None if mask is None else mask.unsqueeze(-1)  # (B, N, 1)
        h = x
        for i, layer in enumerate(self.net):
            if isinstance(layer, SpectralConv1d):
                h = layer.forward_frames(h if keep is None else torch.where(keep, h, 0.0))
            else:
                h = layer(h)
            if i == 0 and shift is not None:
                h = h + shift.unsqueeze(1)
        return h if keep is None else torch.where(keep, h, 0.0)

    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        """Certified 2-norm Lipschitz bound: the product of the three layer bounds (``<= coeff``).

        Args:
            seq_len: Optional sequence length; must not exceed ``max_len`` (the bound is the same
                for every length up to it).

        Returns:
            0-dim tensor, differentiable w.r.t. the weights.

        Raises:
            ValueError: ``seq_len > max_len``.
        """
        if seq_len is not None and check_int(seq_len, "seq_len", 1) > self.max_len:
            raise ValueError(f"seq_len={seq_len} exceeds max_len={self.max_len}; the bound does "
                             f"not hold")
        constants = [
            layer.lipschitz_constant() for layer in self.net if isinstance(layer, SpectralConv1d)
        ]
        return torch.stack(constants).prod()

    def linearize(self, shift: Tensor | None = None) -> ConvStackLinearization:
        r"""The branch's map with hand-written Jacobian products (fast log-det path).

        The effective taps :math:`\tilde W_l` of this forward, the biases and the LipSwish slopes,
        built under the current grad mode (their graphs reach the parameters); the products are
        convolutions with the taps and their adjoints (transposed convolutions), with the mask
        applied at every layer input as in :meth:`forward`.

        Args:
            shift: Optional shift ``(B, hidden)`` after the first convolution, as in
                :meth:`forward`.

        Returns:
            A linearization whose ``at(x, mask).output`` equals ``self(x, mask, shift)``.

        Example:
            >>> branch = TemporalConvBranch(2, 8, kernel_size=3, coeff=0.9, max_len=6).double()
            >>> x, w = torch.randn(3, 6, 2).double(), torch.randn(3, 6, 2).double()
            >>> point = branch.linearize().at(x)
            >>> bool(torch.allclose(point.output, branch(x), atol=1e-12))
            True
            >>> _, pullback = torch.func.vjp(branch, x)
            >>> bool(torch.allclose(point.vjp(w), pullback(w)[0], atol=1e-12))
            True
        """
        weights = stack_parameters(self.net, methodcaller("weight_normalized"))
        return ConvStackLinearization(*weights, shift=shift, max_len=self.max_len,
                                      causal=self.causal, dilation=self.dilation)

    def extra_repr(self) -> str:
        return (f"coeff={self.coeff}, max_len={self.max_len}"
                + (", causal=True" if self.causal else "")
                + (f", dilation={self.dilation}" if self.dilation > 1 else ""))

