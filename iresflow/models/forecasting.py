r"""The causal methods of a sequence flow: per-frame scores, forecasts, densities given a past.

A flow whose chain is causal over frames (every step's output frame :math:`t` reads its input
frames :math:`\le t` only) has a block lower-triangular Jacobian and a noise whose prefix is
determined by the data's prefix. :class:`CausalMethods` gives
:class:`~iresflow.models.flow.SequenceFlow` what follows from that: the exact log-density of
every frame given the earlier ones (:meth:`~CausalMethods.frame_log_prob`), draws of the next
frames given the observed ones (:meth:`~CausalMethods.forecast`) and the density of later
frames given earlier ones (``log_prob(..., given=...)``); docs/forecasting.md.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from iresflow._validation import (
    check_float,
    check_generator,
    check_int,
    check_mask,
    value_checks,
)
from iresflow.transforms.base import FRAMES

if TYPE_CHECKING:
    from iresflow.models.distributions import SequenceBase
    from iresflow.transforms.composite import SequenceCompositeTransform

__all__ = ["FORECAST_NOISE", "CausalMethods"]

#: Where a forecast draws the new frames' noise from: the base given the observed noise, or the
#: base's own density of the new frames (:meth:`CausalMethods.forecast`).
FORECAST_NOISE = ("given", "prior")


class CausalMethods:
    """The methods of a flow that need a causal chain (mixed into
    :class:`~iresflow.models.flow.SequenceFlow`).

    The host sets :attr:`transform` (the chain), :attr:`base` and :attr:`max_len` and has the
    validation ``_check`` of its door; a method called on a flow whose chain is not causal
    raises ``ValueError`` naming the steps that read later frames.
    """

    transform: SequenceCompositeTransform
    base: SequenceBase
    max_len: int | None

    def frame_log_prob(
        self, x: Tensor, mask: Tensor | None = None, *, context: Tensor | None = None
    ) -> Tensor:
        r"""Log-density of every real frame given the earlier ones, :math:`\log p(x_t \mid
        x_{<t})`, in nats (docs/forecasting.md#frame-scores).

        Exact, in one pass, for a :attr:`causal` flow: the chain's log-determinant frame by frame
        (the diagonal blocks of its block lower-triangular Jacobian) plus the base's per-frame
        conditional density of the noise. The frames of a sequence sum to its exact
        :meth:`log_prob`, and the sum over its first :math:`t` real frames is the log-density
        of that prefix. Missing frames (gaps in the mask) are skipped: frame :math:`t` is then
        conditioned on the earlier real frames. Negated, these are the scores of monitoring:
        a frame the model finds surprising given its past scores high. Differentiable when
        grad mode is on; in training mode an uninitialised chain is first initialised from
        ``x``.

        Args:
            x: Sequences ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``.
            context: Conditioning input of a conditional flow (see :meth:`log_prob`).

        Returns:
            Shape ``(B, N)``, zero at padded frames.

        Raises:
            ValueError: the flow is not causal, or invalid inputs.
        """
        self._require_causal("scores frames")
        x, mask, c = self._check(x, mask, "x", FRAMES, context, initialize=True)
        with value_checks(False):
            z, logabsdet = self.transform(x, c, mask=mask, logdet=FRAMES, check=False)
            return self.base.frame_log_prob(z, mask, c) + logabsdet

    @torch.no_grad()
    def forecast(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        horizon: int,
        num_samples: int = 1,
        generator: torch.Generator | None = None,
        temperature: float = 1.0,
        context: Tensor | None = None,
        noise: str = "given",
    ) -> Tensor:
        r"""Draw the next ``horizon`` frames of every sequence given its observed frames
        (docs/forecasting.md).

        For a :attr:`causal` flow, the noise of the observed frames is a function of them alone;
        the noise of the new frames is drawn from the base (``noise``), and every step of the
        chain is inverted with the observed frames held at their states (the chain's
        ``inverse_given``): the fixed-point engine solves for all new frames at once. The new
        frames of a sequence follow its last real frame; missing frames before it stay missing.
        :meth:`inverse_diagnostics` reports the convergence. Only ``generator`` is drawn from.

        Args:
            x: Observed sequences ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)`` of the observed frames.
            horizon: Number ``H >= 1`` of frames to draw after each sequence's last real frame;
                that frame's position plus ``H`` must not exceed ``max_len``.
            num_samples: Number ``S >= 1`` of draws per sequence.
            generator: Optional ``torch.Generator`` (on the model's device).
            temperature: Scale :math:`T > 0` of the new frames' noise (1 = the model).
            context: Conditioning input of a conditional flow, one per sequence (:meth:`log_prob`).
            noise: ``"given"``: the new noise from the base given the observed noise (its
                ``sample_given``, the model's forecast); ``"prior"``: from the base alone (its
                ``sample_new``: no widening by a surprising past; docs/forecasting.md).

        Returns:
            Samples ``(S, B, H, D)``.

        Raises:
            ValueError: the flow is not causal, or invalid inputs or options.
            InversionError: a fixed-point iteration did not converge.

        Example:
            >>> from iresflow.models import ResidualSequenceFlow
            >>> flow = ResidualSequenceFlow(features=2, max_len=8, n_blocks=1, hidden=8,
            ...                             causal=True).double().eval()
            >>> past = torch.randn(3, 5, 2, dtype=torch.float64)
            >>> flow.forecast(past, horizon=3, num_samples=4).shape
            torch.Size([4, 3, 3, 2])
        """
        self._require_causal("forecasts")
        horizon = check_int(horizon, "horizon", 1)
        num_samples = check_int(num_samples, "num_samples", 1)
        temperature = check_float(temperature, "temperature", 0.0)
        draw = _noise_draw(self.base, noise)
        generator = check_generator(generator)
        x, mask, c = self._check(x, mask, "x", False, context)
        batch, length, features = x.shape
        observed = torch.ones(batch, length, dtype=torch.bool, device=x.device) \
            if mask is None else mask
        ends = (observed * torch.arange(1, length + 1, device=x.device)).amax(1)  # (B,)
        total = int(ends.max()) + horizon
        if self.max_len is not None and total > self.max_len:
            raise ValueError(f"horizon={horizon} after the last observed frame (position "
                             f"{total - horizon}) exceeds max_len={self.max_len}")
        positions = torch.arange(total, device=x.device)
        new = (positions >= ends[:, None]) & (positions < ends[:, None] + horizon)  # (B, T)
        known = torch.nn.functional.pad(observed, (0, total - length))
        data = torch.nn.functional.pad(x, (0, 0, 0, total - length))
        with value_checks(False):
            trace = self.transform.forward_trace(data, c, mask=known).repeat(num_samples)
            known, new = known.repeat(num_samples, 1), new.repeat(num_samples, 1)
            c = None if c is None else c.repeat(num_samples, 1)
            z = draw(trace.states[-1], known, known | new, generator, temperature, context=c)
            out = self.transform.inverse_given(z, trace, known, c, mask=known | new)
        index = (ends[:, None] + torch.arange(horizon, device=x.device)).repeat(num_samples, 1)
        future = torch.gather(out, 1, index[..., None].expand(-1, -1, features))
        return future.reshape(num_samples, batch, horizon, features)

    @property
    def causal(self) -> bool:
        r"""Whether the chain is causal over frames (every step's output frame :math:`t` reads
        its input frames :math:`\le t` only), so that the flow forecasts and scores frames."""
        return self.transform.causal

    def _require_causal(self, what: str) -> None:
        """Refuse a method that needs a causal chain on a flow that is not."""
        if not self.causal:
            steps = [name for name, t in self.transform.named_steps()
                     if not getattr(t, "causal", False)]
            raise ValueError(
                f"only a causal flow {what} (model setting causal = true): the steps "
                f"{', '.join(steps)} read later frames"
            )

    def _log_prob_given(
        self, x: Tensor, mask: Tensor | None, given: Tensor, method: str | None,
        n_samples: int, return_stderr: bool, context: Tensor | None,
    ) -> Tensor | tuple[Tensor, Tensor]:
        """:meth:`log_prob` with ``given``: the sum of the later frames' exact
        :meth:`frame_log_prob`."""
        if method not in (None, "exact") or n_samples != 1:
            raise ValueError(f"the density given observed frames is exact: method must be None "
                             f"or 'exact' and n_samples 1, got {method!r} and {n_samples}")
        self._require_causal("has densities given observed frames")
        if not isinstance(x, Tensor):
            raise TypeError(f"x must be a torch.Tensor of shape (B, N, D), got "
                            f"{type(x).__name__}")
        given = check_mask(given, x, "given")
        real = torch.ones_like(given) if mask is None else check_mask(mask, x)
        positions = torch.arange(x.shape[1], device=given.device)
        last_given = torch.where(given, positions, -1).amax(-1)
        first_new = torch.where(real & ~given, positions, x.shape[1]).amin(-1)
        if bool((given & ~real).any()) or bool((last_given >= first_new).any()):
            raise ValueError("given must mark real frames of mask that all come before the "
                             "other real frames of their sequence")
        per_frame = self.frame_log_prob(x, mask, context=context)
        value = torch.where(given, 0.0, per_frame).sum(-1)
        return (value, torch.zeros_like(value)) if return_stderr else value


def _noise_draw(base: SequenceBase, noise: str) -> Callable[..., Tensor]:
    """The base's draw of the new frames' noise for a forecast's ``noise`` setting."""
    if noise not in FORECAST_NOISE:
        raise ValueError(f"noise must be one of {', '.join(FORECAST_NOISE)}, got {noise!r}")
    return base.sample_given if noise == "given" else base.sample_new
