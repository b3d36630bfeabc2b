r"""nflows baselines: MAF and RealNVP on flattened sequences, MAF on i.i.d. frames.

* :func:`sequence_maf`, :func:`sequence_realnvp`: a flow on
  :math:`\mathrm{vec}(X)\in\mathbb R^{ND}` (fixed-length data). MAF samples sequentially
  (:math:`ND` network passes per layer); RealNVP (affine coupling) samples in parallel.
* :func:`frame_maf`: a MAF on :math:`\mathbb R^{D}` applied to every real frame independently,
  :math:`\log p(X)=\sum_{i\,:\,m_i=1}\log p_{\rm MAF}(x_i)` (works for variable-length data).

The flows are nflows' own :class:`~nflows.flows.autoregressive.MaskedAutoregressiveFlow` and
:class:`~nflows.flows.realnvp.SimpleRealNVP`; the wrappers only adapt shapes and masks.
"""

from __future__ import annotations

import torch
from nflows.flows.autoregressive import MaskedAutoregressiveFlow
from nflows.flows.base import Flow
from nflows.flows.realnvp import SimpleRealNVP
from torch import Tensor, nn

from iresflow.models.distributions import sample_mask

__all__ = [
    "FlattenedSequenceFlow", "FrameFlow", "frame_maf", "sample_flow", "sequence_maf",
    "sequence_realnvp",
]


def sample_flow(
    flow: Flow, num: int, features: int, like: Tensor, context: Tensor | None = None,
    generator: torch.Generator | None = None,
) -> Tensor:
    """``num`` draws of a flow with a standard normal base, in ``like``'s dtype and device.

    ``Flow.sample`` draws its noise in torch's default dtype, which fails for a float64 flow,
    and takes no generator; here the noise follows the parameters and is pushed through the
    flow's inverse transform.

    Args:
        flow: An nflows flow over vectors of size ``features``.
        num: Number of draws.
        features: Event size.
        like: Tensor giving the dtype and device.
        context: Optional context ``(num, C)``, one row per draw.
        generator: Optional generator of the noise.

    Returns:
        Draws ``(num, features)``.
    """
    noise = torch.randn(num, features, dtype=like.dtype, device=like.device, generator=generator)
    return flow._transform.inverse(noise, context)[0]


class FlattenedSequenceFlow(nn.Module):
    r"""An nflows :class:`~nflows.flows.base.Flow` on flattened fixed-length sequences.

    Args:
        flow: Flow over vectors of size ``seq_len * features``.
        seq_len: Fixed sequence length :math:`N`.
        features: Frame size :math:`D`.
    """

    def __init__(self, flow: Flow, seq_len: int, features: int) -> None:
        super().__init__()
        self.flow = flow
        self.seq_len = seq_len
        self.features = features

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Log-density (B,) of sequences ``x`` (B, N, D); ``mask`` must be all ``True``."""
        if x.shape[1:] != (self.seq_len, self.features):
            raise ValueError(
                f"x must have shape (B, {self.seq_len}, {self.features}), got {tuple(x.shape)}"
            )
        if mask is not None and not bool(mask.all()):
            raise ValueError("a flattened-sequence flow needs fixed-length data: mask all True")
        return self.flow.log_prob(x.reshape(x.shape[0], -1))

    @torch.no_grad()
    def sample(
        self, num: int, seq_len: int | None = None, lengths: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Draw ``num`` sequences of length ``seq_len = N``: ``(x (num, N, D), mask (num, N))``."""
        param = next(self.flow.parameters())
        mask = sample_mask(num, seq_len, lengths, self.seq_len, param.device)
        if mask.shape[1] != self.seq_len or not bool(mask.all()):
            raise ValueError(f"this flow only samples sequences of length {self.seq_len}")
        x = sample_flow(self.flow, num, self.seq_len * self.features, param)
        return x.reshape(num, self.seq_len, self.features), mask


class FrameFlow(nn.Module):
    r"""An nflows flow over frames, applied i.i.d. to the real frames of each sequence.

    Args:
        flow: Flow over vectors of size ``features``.
        features: Frame size :math:`D`.
        max_len: Longest sequence :meth:`sample` may produce.
    """

    def __init__(self, flow: Flow, features: int, max_len: int) -> None:
        super().__init__()
        self.flow = flow
        self.features = features
        self.max_len = max_len

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Log-density (B,) of sequences ``x`` (B, N, D), summed over real frames."""
        b, n, d = x.shape
        if mask is None:
            return self.flow.log_prob(x.reshape(b * n, d)).reshape(b, n).sum(-1)
        per_frame = x.new_zeros(b, n)
        per_frame[mask] = self.flow.log_prob(x[mask])
        return per_frame.sum(-1)

    @torch.no_grad()
    def sample(
        self, num: int, seq_len: int | None = None, lengths: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        """Draw ``num`` sequences: ``(x (num, N, D), mask (num, N))``, ``x`` zero at padding.

        Exactly one of ``seq_len`` (common length) and ``lengths`` (``(num,)`` integers).
        """
        param = next(self.flow.parameters())
        mask = sample_mask(num, seq_len, lengths, self.max_len, param.device)
        x = param.new_zeros(*mask.shape, self.features)
        x[mask] = sample_flow(self.flow, int(mask.sum()), self.features, param)
        return x, mask


def sequence_maf(
    seq_len: int, features: int, hidden: int = 64, n_layers: int = 4, n_blocks: int = 2
) -> FlattenedSequenceFlow:
    r"""nflows MAF on :math:`\mathrm{vec}(X)` (reverse permutations between layers).

    Args:
        seq_len: Fixed sequence length :math:`N`.
        features: Frame size :math:`D`.
        hidden: Hidden width of each MADE.
        n_layers: Number of autoregressive layers.
        n_blocks: Residual blocks per MADE.

    Returns:
        The wrapped flow.

    Example:
        >>> model = sequence_maf(3, 2, hidden=8, n_layers=1)
        >>> model.log_prob(torch.randn(5, 3, 2)).shape
        torch.Size([5])
    """
    flow = MaskedAutoregressiveFlow(
        features=seq_len * features, hidden_features=hidden, num_layers=n_layers,
        num_blocks_per_layer=n_blocks,
    )
    return FlattenedSequenceFlow(flow, seq_len, features)


def sequence_realnvp(
    seq_len: int, features: int, hidden: int = 64, n_layers: int = 4, n_blocks: int = 2
) -> FlattenedSequenceFlow:
    r"""nflows RealNVP (affine coupling, alternating masks) on :math:`\mathrm{vec}(X)`.

    Args:
        seq_len: Fixed sequence length :math:`N`.
        features: Frame size :math:`D`.
        hidden: Hidden width of each coupling network.
        n_layers: Number of coupling layers.
        n_blocks: Residual blocks per coupling network.

    Returns:
        The wrapped flow.

    Example:
        >>> model = sequence_realnvp(3, 2, hidden=8, n_layers=2)
        >>> model.sample(4, seq_len=3)[0].shape
        torch.Size([4, 3, 2])
    """
    if seq_len * features < 2:
        raise ValueError("RealNVP needs at least 2 dimensions (seq_len * features >= 2)")
    flow = SimpleRealNVP(
        features=seq_len * features, hidden_features=hidden, num_layers=n_layers,
        num_blocks_per_layer=n_blocks,
    )
    return FlattenedSequenceFlow(flow, seq_len, features)


def frame_maf(
    features: int, max_len: int, hidden: int = 64, n_layers: int = 4, n_blocks: int = 2
) -> FrameFlow:
    r"""nflows MAF on single frames, frames i.i.d. within a sequence.

    Args:
        features: Frame size :math:`D`.
        max_len: Longest sequence the model samples.
        hidden: Hidden width of each MADE.
        n_layers: Number of autoregressive layers.
        n_blocks: Residual blocks per MADE.

    Returns:
        The wrapped flow.

    Example:
        >>> model = frame_maf(2, max_len=4, hidden=8, n_layers=1)
        >>> mask = torch.tensor([[True, True, False, False]])
        >>> model.log_prob(torch.randn(1, 4, 2), mask).shape
        torch.Size([1])
    """
    flow = MaskedAutoregressiveFlow(
        features=features, hidden_features=hidden, num_layers=n_layers,
        num_blocks_per_layer=n_blocks,
    )
    return FrameFlow(flow, features, max_len)
