r"""Dataset splits: padded sequences in model space, and likelihoods in the data's units.

A :class:`SequenceDataset` holds train/validation/test splits of padded sequences in *model
space* (preprocessed, float32) with padding masks and the per-sequence log-Jacobian of the
preprocessing, so that negative log-likelihoods are reported in the original units of the data:

.. math::

    \mathrm{NLL} = -\frac{\sum_b \left(\log p_{\mathrm{model}}(x_b) + \log|\det J_b|\right)}
    {\sum_b u_b},

where :math:`u_b` counts the frames (``"nats/frame"``) or the dimensions (``"bits/dim"``, then
divided by :math:`\ln 2`) of sequence :math:`b`. :func:`~iresflow.data.datasets.load_dataset`
builds them, holding out :func:`~iresflow.data.partition.default_val_fraction` of the sequences
for validation unless told otherwise (:mod:`iresflow.data.partition`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

from iresflow._validation import check_finite, check_mask, check_sequence
from iresflow.data.preprocessing import Preprocessing
from iresflow.data.store import StoredSplit

__all__ = ["SequenceDataset", "SequenceSplit"]

_UNITS = ("nats/frame", "bits/dim")

@dataclass
class SequenceSplit:
    """One split of a dataset, in model space.

    Attributes:
        x: Preprocessed sequences, shape ``(B, N, D)``, float32, zero at padded and missing
            frames.
        mask: Boolean ``(B, N)``, ``True`` for real (observed) frames: a prefix of each row,
            except for user data with missing frames.
        log_jacobian: Per-sequence :math:`\\log|\\det \\partial x / \\partial r|` of the
            preprocessing from the raw data :math:`r`, shape ``(B,)``, float64, so that
            :math:`\\log p_{\\mathrm{raw}}(r) = \\log p_{\\mathrm{model}}(x) +` ``log_jacobian``.
        labels: Optional class index of every sequence, int64 ``(B,)`` in
            ``[0, len(SequenceDataset.classes))`` (the context of a class-conditional flow);
            ``None`` for unlabelled data.
        covariates: Optional per-sequence covariates, float ``(B, C)`` (the context of a
            covariate-conditional flow); ``None`` if the data have none.

    Example:
        >>> split = SequenceSplit(torch.zeros(2, 3, 1), torch.ones(2, 3, dtype=torch.bool),
        ...                       torch.zeros(2, dtype=torch.float64))
        >>> len(split)
        2
    """

    x: Tensor
    mask: Tensor
    log_jacobian: Tensor
    labels: Tensor | None = None
    covariates: Tensor | None = None

    def __post_init__(self) -> None:
        check_sequence(self.x, "x", allow_2d=False)
        check_mask(self.mask, self.x)
        if not isinstance(self.log_jacobian, Tensor) or not self.log_jacobian.is_floating_point():
            raise TypeError("log_jacobian must be a floating-point torch.Tensor")
        if self.log_jacobian.shape != self.x.shape[:1]:
            raise ValueError(
                f"log_jacobian must have shape (B,) = ({self.x.shape[0]},), "
                f"got {tuple(self.log_jacobian.shape)}"
            )
        check_finite(self.log_jacobian, "log_jacobian")
        if self.labels is not None:
            if not isinstance(self.labels, Tensor) or self.labels.dtype != torch.int64:
                raise TypeError("labels must be an int64 torch.Tensor of shape (B,)")
            if self.labels.shape != self.x.shape[:1]:
                raise ValueError(f"labels must have shape (B,) = ({self.x.shape[0]},), got "
                                 f"{tuple(self.labels.shape)}")
            if bool((self.labels < 0).any()):
                raise ValueError("labels must be class indices >= 0")
        if self.covariates is not None:
            if not isinstance(self.covariates, Tensor) or not self.covariates.is_floating_point():
                raise TypeError("covariates must be a floating-point torch.Tensor (B, C)")
            if self.covariates.dim() != 2 or self.covariates.shape[0] != self.x.shape[0]:
                raise ValueError(f"covariates must have shape (B, C) with B = {self.x.shape[0]}, "
                                 f"got {tuple(self.covariates.shape)}")
            check_finite(self.covariates, "covariates")
        if bool((self.x[~self.mask.to(self.x.device)] != 0).any()):
            raise ValueError("x must be zero at padded frames (mask False)")

    def __len__(self) -> int:
        return self.x.shape[0]

    @property
    def frames(self) -> Tensor:
        """Real frames of every sequence, ``(B,)``, int64."""
        return self.mask.sum(dim=1)

    def batch_mask(self, index: Tensor) -> Tensor:
        """The padding mask of the sequences ``index``, ``(b, N)``."""
        return self.mask[index]

    def subset(self, index: Tensor) -> SequenceSplit:
        """The sequences ``index`` (positions or a boolean mask over the split) as a split."""
        labels = None if self.labels is None else self.labels[index]
        covariates = None if self.covariates is None else self.covariates[index]
        return SequenceSplit(self.x[index], self.mask[index], self.log_jacobian[index], labels,
                             covariates)


@dataclass
class SequenceDataset:
    r"""Train/validation/test splits with the metadata to report likelihoods in original units.

    Attributes:
        name: Dataset name (the file name for user data).
        features: Number of features ``D`` per frame.
        max_len: Padded length ``N``.
        unit: ``"nats/frame"`` or ``"bits/dim"``, the unit of :meth:`nll`.
        train: Training split (in memory, or a :class:`~iresflow.data.store.StoredSplit` of a
            sequence store read from disk).
        val: Validation split.
        test: Test split.
        preprocessing: The map from raw to model space, inverted by :meth:`to_raw`; ``None``
            when the data are stored in raw space.
        classes: Names of the classes that the splits' ``labels`` index (e.g. the nine
            speakers ``"1"`` to ``"9"`` of Japanese Vowels); ``None`` for unlabelled data.
        val_fraction: The fraction of the sequences held out for validation that made the
            splits (the automatic one resolved, see :func:`default_val_fraction`); ``None`` if
            not recorded.

    Example:
        >>> from iresflow.data.datasets import load_dataset
        >>> ds = load_dataset("japanese_vowels")
        >>> ds.features, ds.max_len, len(ds.test), ds.unit
        (12, 29, 370, 'nats/frame')
    """

    name: str
    features: int
    max_len: int
    unit: str
    train: SequenceSplit | StoredSplit
    val: SequenceSplit | StoredSplit
    test: SequenceSplit | StoredSplit
    preprocessing: Preprocessing | None = None
    classes: tuple[str, ...] | None = None
    val_fraction: float | None = None

    def __post_init__(self) -> None:
        if self.unit not in _UNITS:
            raise ValueError(f"unit must be one of {_UNITS}, got {self.unit!r}")
        for label, split in (("train", self.train), ("val", self.val), ("test", self.test)):
            if isinstance(split, StoredSplit):
                if split.store.features != self.features or split.store.max_len > self.max_len:
                    raise ValueError(
                        f"{label} must hold sequences of at most {self.max_len} frames of "
                        f"{self.features} features"
                    )
            elif split.x.shape[1:] != (self.max_len, self.features):
                raise ValueError(
                    f"{label}.x must have shape (B, {self.max_len}, {self.features}), "
                    f"got {tuple(split.x.shape)}"
                )

    def units(self, mask: Tensor) -> Tensor:
        """Number of units per sequence: frames (``nats/frame``) or frames times ``D``.

        Args:
            mask: Padding mask ``(B, N)``, bool.

        Returns:
            Counts of shape ``(B,)``, int64.

        Example:
            >>> from iresflow.data.datasets import load_dataset
        >>> ds = load_dataset("japanese_vowels")
            >>> ds.units(torch.tensor([[True, True, False]])).tolist()
            [2]
        """
        if not isinstance(mask, Tensor) or mask.dtype != torch.bool or mask.dim() != 2:
            raise TypeError("mask must be a torch.bool tensor of shape (B, N)")
        frames = mask.sum(dim=1)
        return frames * self.features if self.unit == "bits/dim" else frames

    def unit_scale(self) -> float:
        """Nats per frame of one unit of :meth:`nll`: ``D ln 2`` for bits/dim, 1 for nats/frame."""
        return self.features * math.log(2.0) if self.unit == "bits/dim" else 1.0

    def _scale(self, split: SequenceSplit | StoredSplit) -> float:
        return float(split.frames.sum()) * self.unit_scale()

    def _check_per_sequence(
        self, values: Tensor, split: SequenceSplit | StoredSplit, name: str
    ) -> Tensor:
        if not isinstance(values, Tensor) or not values.is_floating_point():
            raise TypeError(f"{name} must be a floating-point torch.Tensor")
        if values.shape != (len(split),):
            raise ValueError(
                f"{name} must have shape (B,) = ({len(split)},), got {tuple(values.shape)}"
            )
        return check_finite(values, name)

    def nll(self, log_prob: Tensor, split: SequenceSplit | StoredSplit) -> float:
        r"""Negative log-likelihood of a split in the dataset's unit, in original units.

        .. math:: -\frac{\sum_b (\log p_b + \log|\det J_b|)}{\sum_b u_b}
            \quad (\text{divided by } \ln 2 \text{ for bits/dim}).

        Args:
            log_prob: Model log-densities of ``split.x``, one per sequence, shape ``(B,)``.
            split: The split they belong to.

        Returns:
            The NLL as a Python float.

        Example:
            >>> from iresflow.data.datasets import load_dataset
        >>> ds = load_dataset("japanese_vowels")
            >>> log_prob = torch.zeros(len(ds.test))  # a model with density 1 in model space
            >>> frames = ds.test.mask.sum().item()
            >>> ds.nll(log_prob, ds.test) == -ds.test.log_jacobian.sum().item() / frames
            True
        """
        log_prob = self._check_per_sequence(log_prob, split, "log_prob")
        total = (log_prob.to(torch.float64) + split.log_jacobian.to(log_prob.device)).sum()
        return -float(total) / self._scale(split)

    def sequence_nll(self, log_prob: Tensor, split: SequenceSplit | StoredSplit) -> Tensor:
        r"""Negative log-likelihood of every sequence of a split in the dataset's unit, in
        original units: :math:`-(\log p_b + \log|\det J_b|) / u_b` (divided by
        :math:`\ln 2` for bits/dim); :meth:`nll` is their average weighted by :math:`u_b`.

        Args:
            log_prob: Model log-densities of ``split.x``, one per sequence, shape ``(B,)``.
            split: The split they belong to.

        Returns:
            Per-sequence NLLs, shape ``(B,)``, float64, on ``log_prob``'s device.

        Example:
            >>> from iresflow.data.datasets import load_dataset
            >>> ds = load_dataset("japanese_vowels")
            >>> log_prob = torch.zeros(len(ds.test))
            >>> nll, frames = ds.sequence_nll(log_prob, ds.test), ds.test.frames
            >>> mean = float((nll * frames).sum() / frames.sum())
            >>> abs(mean - ds.nll(log_prob, ds.test)) < 1e-9
            True
        """
        log_prob = self._check_per_sequence(log_prob, split, "log_prob")
        total = log_prob.to(torch.float64) + split.log_jacobian.to(log_prob.device)
        units = split.frames.to(device=log_prob.device, dtype=torch.float64)
        return -total / (units * self.unit_scale())

    def frame_nll(self, frame_log_prob: Tensor, x: Tensor, mask: Tensor) -> Tensor:
        r"""Negative log-likelihood of every frame in the dataset's unit, in original units:
        :math:`-(\log p(x_t \mid x_{<t}) + \log|\det J_t|)` per frame (per dimension and in
        bits for bits/dim), :math:`J_t` the preprocessing's Jacobian at frame :math:`t`; the
        frames of a sequence sum to its :meth:`sequence_nll` times its units.

        Args:
            frame_log_prob: Model-space log-densities of every frame ``(B, N)``.
            x: The model-space sequences ``(B, N, D)`` they score.
            mask: Their padding mask ``(B, N)``.

        Returns:
            Shape ``(B, N)``, float64, ``nan`` at padding.
        """
        check_sequence(x, "x", features=self.features, allow_2d=False)
        mask = check_mask(mask, x)
        assert mask is not None
        if frame_log_prob.shape != mask.shape:
            raise ValueError(f"frame_log_prob must have shape (B, N) = {tuple(mask.shape)}, got "
                             f"{tuple(frame_log_prob.shape)}")
        total = frame_log_prob.to(torch.float64)
        if self.preprocessing is not None:  # frame by frame: each real frame a sequence of one
            raw = self.to_raw(x, mask)[mask][:, None]  # (F, 1, D)
            real = torch.ones(raw.shape[:2], dtype=torch.bool, device=raw.device)
            jacobian = self.preprocessing.forward(raw, real)[1].to(total.device)
            total = total.masked_scatter(mask.to(total.device), jacobian + total[mask])
        nll = -total / self.unit_scale()
        return torch.where(mask, nll, torch.nan)

    def nll_stderr(
        self, log_prob_stderr: Tensor, split: SequenceSplit | StoredSplit
    ) -> float:
        r"""Standard error of :meth:`nll` from independent per-sequence standard errors.

        .. math:: \frac{\sqrt{\sum_b s_b^2}}{\sum_b u_b}
            \quad (\text{divided by } \ln 2 \text{ for bits/dim}).

        Args:
            log_prob_stderr: Standard errors :math:`s_b \ge 0` of the per-sequence log-density
                estimates, shape ``(B,)``.
            split: The split they belong to.

        Returns:
            The standard error as a Python float.

        Example:
            >>> from iresflow.data.datasets import load_dataset
        >>> ds = load_dataset("japanese_vowels")
            >>> ds.nll_stderr(torch.zeros(len(ds.test)), ds.test)
            0.0
        """
        se = self._check_per_sequence(log_prob_stderr, split, "log_prob_stderr")
        if bool((se < 0).any()):
            raise ValueError("log_prob_stderr must be non-negative")
        return float(se.to(torch.float64).square().sum().sqrt()) / self._scale(split)

    def to_raw(self, x: Tensor, mask: Tensor) -> Tensor:
        """Invert the preprocessing: model space to original units (zero at padding).

        Args:
            x: Model-space sequences, shape ``(B, N', D)`` (any length ``N'``).
            mask: Padding mask ``(B, N')``, bool.

        Returns:
            Raw sequences, shape ``(B, N', D)``, in ``x``'s dtype and device.

        Example:
            >>> from iresflow.data.datasets import load_dataset
        >>> ds = load_dataset("japanese_vowels")
            >>> raw = ds.to_raw(ds.test.x[:1], ds.test.mask[:1])
            >>> round(raw[0, 0, 0].item(), 4)  # first value of the first test case
            1.6355
        """
        check_sequence(x, "x", features=self.features, allow_2d=False)
        checked = check_mask(mask, x)
        assert checked is not None
        if self.preprocessing is None:
            return torch.where(checked.unsqueeze(-1), x, 0.0)
        return self.preprocessing.inverse(x, checked)

    def sample_lengths(self, num: int, generator: torch.Generator | None = None) -> Tensor:
        """Draw sequence lengths from the empirical length distribution of the training split.

        The length of a training sequence is one past its last real frame (its time extent, which
        counts the missing frames inside it for user data with gaps).

        Args:
            num: Number of lengths to draw (positive).
            generator: Optional ``torch.Generator``; the result lives on its device.

        Returns:
            Lengths of shape ``(num,)``, int64, each in ``[1, max_len]``.

        Example:
            >>> from iresflow.data.datasets import load_dataset
        >>> ds = load_dataset("japanese_vowels")
            >>> lengths = ds.sample_lengths(100, torch.Generator().manual_seed(0))
            >>> bool((lengths >= 7).all() and (lengths <= 29).all())
            True
        """
        if isinstance(num, bool) or not isinstance(num, int) or num < 1:
            raise ValueError(f"num must be a positive int, got {num!r}")
        device = generator.device if generator is not None else torch.device("cpu")
        mask = self.train.mask
        positions = torch.arange(1, mask.shape[1] + 1, device=mask.device)
        lengths = (mask * positions).amax(dim=1).to(device)
        index = torch.randint(len(lengths), (num,), generator=generator, device=device)
        return lengths[index]
