r"""Autoregressive neural flows over frames: a GRU or a causal Transformer summarises the past,
a conditional MAF models the next frame.

The model a user would otherwise build for variable-length sequence densities:

.. math::

    \log p(X) = \sum_{t=1}^{T}\log p_{\rm MAF}\big(x_t \mid h_{t}\big),

where :math:`h_t` reads exactly the frames before :math:`t`: either the state of a GRU that
has read a learned start frame and :math:`x_1, \dots, x_{t-1}` (``encoder="gru"``), or the output
at :math:`t` of an unconstrained causal Transformer over the past frames (``encoder=
"transformer"``, :class:`~iresflow.nn.causal.CausalTransformer`; the TarFlow-style peer of
Zhai et al. 2024, sampled frame by frame). The conditional density of a frame is nflows' masked
affine autoregressive flow (MADE layers with reverse permutations between them) with
:math:`h_t` as its ``context``. Only the real frames of a sequence enter, in order: padding never
changes a density (``docs/math.md#masks``). Sampling is ancestral, one encoder step and one MAF
inversion per frame; the Transformer re-reads the whole prefix at every step.
"""

from __future__ import annotations

from typing import Any, Literal

import torch
from nflows.distributions.normal import StandardNormal
from nflows.flows.base import Flow
from nflows.transforms.autoregressive import MaskedAffineAutoregressiveTransform
from nflows.transforms.base import CompositeTransform
from nflows.transforms.permutations import ReversePermutation
from torch import Tensor, nn

from benchmarks.baselines.nflows_models import sample_flow
from iresflow.data.datasets import SequenceDataset
from iresflow.models.distributions import sample_mask
from iresflow.nn.causal import CausalTransformer
from iresflow.nn.recurrent import left_align
from iresflow.train.config import TrainConfig
from iresflow.train.fit import fit
from iresflow.train.likelihood import split_log_prob

__all__ = ["ENCODERS", "GRU_HIDDEN", "GRU_LR", "GRU_PATIENCE", "PEER_NAMES", "TRANSFORMER_DEPTH",
           "TRANSFORMER_HEADS", "RecurrentFlow", "train_recurrent_flow"]

#: The GRU + MAF of the small-data and long-range benchmarks: a fixed architecture (state and
#: MADE width), Adam's learning rate and the early-stopping patience in epochs; the Transformer +
#: MAF uses the same.
GRU_HIDDEN, GRU_LR, GRU_PATIENCE = 64, 3e-3, 20
#: Layers and attention heads of the Transformer + MAF's encoder (width: the state size).
TRANSFORMER_DEPTH, TRANSFORMER_HEADS = 2, 4
#: The encoders of the past a :class:`RecurrentFlow` takes.
ENCODERS = ("gru", "transformer")
#: The name of the peer each encoder makes, in tables.
PEER_NAMES = {"gru": "GRU + MAF", "transformer": "Transformer + MAF"}


class _GRUPast(nn.Module):
    """A GRU that has read a learned start frame, then the frames before ``t``."""

    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.start = nn.Parameter(torch.zeros(features))
        self.gru = nn.GRU(features, hidden, batch_first=True)

    def _read(self, x: Tensor) -> Tensor:
        start = self.start.to(x.dtype).expand(x.shape[0], 1, x.shape[-1])
        return self.gru(torch.cat([start, x], 1))[0]

    def forward(self, x: Tensor) -> Tensor:
        """States ``(B, N, H)`` of left-aligned ``x`` ``(B, N, D)``; row ``t`` read ``x[:, :t]``."""
        return self._read(x[:, :-1])

    def begin(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Any]:
        """The state after the first ``lengths[b]`` frames of left-aligned ``x``, and the memory
        :meth:`advance` continues from."""
        state = self._read(x)[torch.arange(len(x), device=x.device), lengths]
        return state, state[None].contiguous()

    def advance(self, memory: Any, frame: Tensor) -> tuple[Tensor, Any]:
        """The state after one more frame ``(B, D)``, and the new memory."""
        out, hidden = self.gru(frame[:, None], memory)
        return out[:, 0], hidden


class _TransformerPast(nn.Module):
    """A causal Transformer whose output at ``t`` reads the frames before ``t``."""

    def __init__(self, features: int, hidden: int) -> None:
        super().__init__()
        self.net = CausalTransformer(features, hidden, width=hidden, depth=TRANSFORMER_DEPTH,
                                     heads=TRANSFORMER_HEADS)

    def forward(self, x: Tensor) -> Tensor:
        """Outputs ``(B, N, H)`` of left-aligned ``x`` ``(B, N, D)``; row ``t`` read
        ``x[:, :t]``."""
        return self.net(x)

    def begin(self, x: Tensor, lengths: Tensor) -> tuple[Tensor, Any]:
        """The output after the first ``lengths[b]`` frames of left-aligned ``x``, and the memory
        (the frames and their count) :meth:`advance` continues from."""
        room = torch.cat([x, x.new_zeros(len(x), 1, x.shape[-1])], 1)
        rows = torch.arange(len(x), device=x.device)
        return self.net(room)[rows, lengths], (room, lengths)

    def advance(self, memory: Any, frame: Tensor) -> tuple[Tensor, Any]:
        """The output after one more frame ``(B, D)`` (the whole prefix re-read), and the new
        memory."""
        frames, lengths = memory  # frames has room for one more: lengths < its length
        frames = frames.clone()
        frames[torch.arange(len(frames), device=frames.device), lengths] = frame
        return self.begin(frames, lengths + 1)


class RecurrentFlow(nn.Module):
    r"""An encoder of the past frames whose output conditions an nflows MAF over the next frame.

    Args:
        features: Frame size :math:`D`.
        max_len: Longest sequence :meth:`sample` may produce.
        hidden: Encoder output size (the MAF's context size) and hidden width of every MADE.
        n_layers: Autoregressive layers of the MAF.
        n_blocks: Residual blocks per MADE.
        encoder: ``"gru"`` or ``"transformer"`` (a causal Transformer of
            :data:`TRANSFORMER_DEPTH` layers, width ``hidden``).

    Example:
        >>> model = RecurrentFlow(2, max_len=5, hidden=8, n_layers=2)
        >>> mask = torch.tensor([[True] * 5, [True, True, False, False, False]])
        >>> model.log_prob(torch.randn(2, 5, 2), mask).shape
        torch.Size([2])
        >>> x, mask = model.sample(2, lengths=torch.tensor([3, 1]))
        >>> x.shape, x[1, 1:].abs().sum().item()
        (torch.Size([2, 3, 2]), 0.0)
    """

    def __init__(
        self, features: int, max_len: int, hidden: int = 64, n_layers: int = 4, n_blocks: int = 2,
        encoder: Literal["gru", "transformer"] = "gru",
    ) -> None:
        super().__init__()
        for name, value in (("features", features), ("max_len", max_len), ("hidden", hidden),
                            ("n_layers", n_layers), ("n_blocks", n_blocks)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive int, got {value!r}")
        if encoder not in ENCODERS:
            raise ValueError(f"encoder must be one of {ENCODERS}, got {encoder!r}")
        self.features = features
        self.max_len = max_len
        self.past = (_GRUPast if encoder == "gru" else _TransformerPast)(features, hidden)
        layers: list[nn.Module] = []
        for i in range(n_layers):
            if i > 0:
                layers.append(ReversePermutation(features))
            layers.append(MaskedAffineAutoregressiveTransform(
                features=features, hidden_features=hidden, context_features=hidden,
                num_blocks=n_blocks))
        self.flow = Flow(CompositeTransform(layers), StandardNormal([features]))

    def _aligned(self, x: Tensor, mask: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
        x, mask = left_align(x, mask)
        return x, mask, self.past(x)

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Log-density ``(B,)`` of sequences ``x`` ``(B, N, D)``, summed over real frames."""
        x, mask, context = self._aligned(x, mask)
        per_frame = x.new_zeros(mask.shape)
        per_frame[mask] = self.flow.log_prob(x[mask], context=context[mask])
        return per_frame.sum(-1)

    def transform_to_noise(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """The MAF's noise of every real frame given its past, ``(B, N, D)`` (``x`` at padding).

        Args:
            x: Sequences ``(B, N, D)``.
            mask: Padding mask ``(B, N)`` or ``None``.
        """
        aligned, aligned_mask, context = self._aligned(x, mask)
        z = self.flow._transform(aligned[aligned_mask], context=context[aligned_mask])[0]
        out = x.clone()
        out[torch.ones_like(aligned_mask) if mask is None else mask] = z
        return out

    def _draw(self, x: Tensor, lengths: Tensor, steps: int,
              generator: torch.Generator | None) -> Tensor:
        """``steps`` frames ``(B, steps, D)`` drawn one after another after the first
        ``lengths[b]`` frames of left-aligned ``x`` ``(B, N, D)``."""
        context, memory = self.past.begin(x, lengths)
        frames = []
        for step in range(steps):
            frame = sample_flow(self.flow, len(x), self.features, x, context, generator)
            frames.append(frame)
            if step + 1 < steps:
                context, memory = self.past.advance(memory, frame)
        return torch.stack(frames, 1)

    @torch.no_grad()
    def sample(
        self,
        num: int,
        seq_len: int | None = None,
        lengths: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Ancestral sampling: ``(x (num, N, D), mask (num, N))``, ``x`` zero at padding.

        Exactly one of ``seq_len`` (common length) and ``lengths`` (``(num,)`` integers).
        """
        like = next(self.parameters())
        mask = sample_mask(num, seq_len, lengths, self.max_len, like.device)
        empty = like.new_zeros(num, 0, self.features)
        x = self._draw(empty, mask.new_zeros(num, dtype=torch.long), mask.shape[1], generator)
        return torch.where(mask.unsqueeze(-1), x, 0.0), mask

    @torch.no_grad()
    def forecast(
        self, x: Tensor, mask: Tensor | None, horizon: int, num_samples: int,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Draws of the ``horizon`` frames after every sequence's real frames, one frame after
        another: the encoder reads the observed frames, then every drawn frame.

        Args:
            x: Observed sequences ``(B, N, D)``.
            mask: Their real frames ``(B, N)`` or ``None``.
            horizon: Frames to draw ``H >= 1``.
            num_samples: Draws ``S`` per sequence.
            generator: Optional generator of the noise.

        Returns:
            ``(S, B, H, D)``.
        """
        aligned, aligned_mask = left_align(x, mask)
        lengths = aligned_mask.sum(1).repeat(num_samples)
        frames = self._draw(aligned.repeat(num_samples, 1, 1), lengths, horizon, generator)
        return frames.reshape(num_samples, len(x), horizon, self.features)


def train_recurrent_flow(config: TrainConfig, dataset: SequenceDataset,
                         hidden: int = GRU_HIDDEN,
                         encoder: Literal["gru", "transformer"] = "gru") -> dict[str, Any]:
    """Train a :class:`RecurrentFlow` by :func:`~iresflow.train.fit.fit` (the loop of
    ``iresflow train``) and score its best-validation state on the test split.

    Args:
        config: Training settings (seed, learning rate, epoch and time budget, patience).
        dataset: The splits, ``dataset.test`` scored.
        hidden: Encoder output size and MADE width.
        encoder: The encoder of the past, one of :data:`ENCODERS`.

    Returns:
        ``test_nll`` (in the dataset's unit), ``epochs``, ``best_epoch``, ``stopped`` (why
        training ended), ``train_seconds`` (optimisation seconds), ``history`` (the metrics
        of every epoch, as in :attr:`~iresflow.train.fit.FitResult.history`) and ``model`` (the
        trained model in its best-validation state).
    """
    torch.manual_seed(config.seed)
    model = RecurrentFlow(dataset.features, dataset.max_len, hidden=hidden, encoder=encoder)
    result = fit(config, dataset, model)
    log_prob = split_log_prob(result.model, dataset.test)[0]
    return {"test_nll": dataset.nll(log_prob, dataset.test), "epochs": len(result.history),
            "best_epoch": result.best_epoch, "stopped": result.stopped,
            "train_seconds": result.train_seconds, "history": result.history,
            "model": result.model}
