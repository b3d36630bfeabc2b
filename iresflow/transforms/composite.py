r"""The chain of sequence transforms, with the causal chain's trace and pinned inverse.

:class:`SequenceCompositeTransform` is nflows' ``CompositeTransform`` for
:class:`~iresflow.transforms.base.SequenceTransform` members: it passes ``mask=`` and ``logdet=``
through and sums the members' log-determinants. For a causal chain it also records the state
after every member (:meth:`~SequenceCompositeTransform.forward_trace`) and inverts with some
frames held at those states (:meth:`~SequenceCompositeTransform.inverse_given`), which is how a
causal flow forecasts (docs/forecasting.md#pinned-inverse).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

import torch
from nflows.transforms.base import Transform
from torch import Tensor, nn

from iresflow.transforms.base import FRAMES, LogDetRequest, SequenceTransform

__all__ = ["SequenceCompositeTransform", "Trace"]


@dataclass(frozen=True)
class Trace:
    """What :meth:`SequenceCompositeTransform.forward_trace` records of a chain's forward.

    Attributes:
        states: ``K + 1`` tensors ``(B, N, D)`` for ``K`` members: the input of member ``k`` at
            index ``k``, the output of the chain last.
        memory: Per member, what its :meth:`~iresflow.transforms.base.SequenceTransform.
            forward_with_memory` kept for its pinned inverse (batch first), or ``None``.
    """

    states: list[Tensor]
    memory: list[Tensor | None]

    def repeat(self, count: int) -> Trace:
        """Every tensor repeated ``count`` times along the batch (copy ``i`` of sequence ``b``
        at row ``i B + b``), as a forecast repeats its sequences, one copy per draw."""

        def rows(value: Tensor) -> Tensor:
            return value.repeat((count,) + (1,) * (value.dim() - 1))

        return Trace([rows(state) for state in self.states],
                     [None if kept is None else rows(kept) for kept in self.memory])


class SequenceCompositeTransform(SequenceTransform):
    r"""Chain of transforms, applied in the given order, passing ``mask=`` and ``logdet=`` on.

    .. math:: f = f_K \circ \cdots \circ f_1, \qquad
        \log|\det J_f(x)| = \sum_{k=1}^K \log|\det J_{f_k}(x_{k-1})| .

    Any nflows ``Transform`` may be part of the chain; with a ``mask`` every member must be a
    :class:`SequenceTransform`, since only those honour the padding contract. The context is
    passed on to every member. The members are :attr:`steps` (an ``nn.ModuleList``), with
    names from :meth:`named_steps`. The chain validates a call at its door and then runs the
    unchecked ``_forward`` / ``_inverse`` of its :class:`SequenceTransform` members directly.

    Args:
        transforms: Iterable of nflows ``Transform`` objects.
        names: Optional names of the members, one each (default: their indices).

    Example:
        >>> import torch
        >>> from nflows.transforms import IdentityTransform
        >>> chain = SequenceCompositeTransform([IdentityTransform(), IdentityTransform()])
        >>> y, logabsdet = chain(torch.randn(2, 5, 3))
        >>> y.shape, logabsdet.shape, len(chain.steps)
        (torch.Size([2, 5, 3]), torch.Size([2]), 2)
        >>> chain(torch.randn(2, 5, 3), logdet=False)[1] is None
        True
    """

    def __init__(
        self, transforms: Iterable[Transform], names: Sequence[str] | None = None
    ) -> None:
        super().__init__()
        transforms = list(transforms)
        for i, t in enumerate(transforms):
            if not isinstance(t, Transform):
                raise TypeError(
                    f"transforms[{i}] must be an nflows Transform, got {type(t).__name__}"
                )
        if names is None:
            names = [str(i) for i in range(len(transforms))]
        names = list(names)
        if len(names) != len(transforms) or not all(isinstance(n, str) for n in names):
            raise ValueError(
                f"names must hold one string per transform ({len(transforms)}), got {names!r}"
            )
        if len(set(names)) != len(names):
            raise ValueError(f"names must be unique, got {names!r}")
        self.steps = nn.ModuleList(transforms)
        self.step_names: tuple[str, ...] = tuple(names)

    @property
    def features(self) -> int | None:  # type: ignore[override]
        """Feature size ``D`` of the first member that requires one (``None`` if none does)."""
        return next(
            (t.features for t in self.steps if getattr(t, "features", None) is not None), None
        )

    @property
    def causal(self) -> bool:  # type: ignore[override]
        """Whether every member is a causal :class:`SequenceTransform`."""
        return all(isinstance(t, SequenceTransform) and t.causal for t in self.steps)

    def named_steps(self) -> Iterator[tuple[str, Transform]]:
        """Iterate over ``(name, member)`` pairs, in order of application.

        Example:
            >>> from nflows.transforms import IdentityTransform
            >>> chain = SequenceCompositeTransform([IdentityTransform()], names=["id"])
            >>> next(chain.named_steps())[0]
            'id'
        """
        return zip(self.step_names, self.steps, strict=True)

    def _check_options(self, inputs: Tensor, context: Tensor | None, logdet: object) -> None:
        for t in self.steps:  # members without checks of their own are skipped
            if (isinstance(t, SequenceTransform)
                    and type(t)._check_options is not SequenceTransform._check_options):
                t._check_options(inputs, context, logdet)

    def check_options(
        self,
        inputs: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
        logdet: object = True,
    ) -> None:
        """See :meth:`SequenceTransform.check_options`; a mask needs
        :class:`SequenceTransform` members."""
        if mask is not None:
            for t in self.steps:
                if not isinstance(t, SequenceTransform):
                    raise TypeError(
                        f"a mask needs every member to be a SequenceTransform, got "
                        f"{type(t).__name__}"
                    )
        super().check_options(inputs, context, mask=mask, logdet=logdet)

    def forward_trace(
        self, inputs: Tensor, context: Tensor | None = None, *, mask: Tensor | None = None
    ) -> Trace:
        """The input of every member and the output of the chain, from data to noise, and what
        each member keeps of its forward for its pinned inverse.

        The unchecked map (no log-determinant) of validated inputs, for
        :meth:`inverse_given`; every member must be a :class:`SequenceTransform`.

        Args:
            inputs: Sequences ``(B, N, D)``.
            context: Conditioning input (``None`` for unconditional transforms).
            mask: Optional boolean padding mask ``(B, N)``.

        Returns:
            The :class:`Trace`: ``K + 1`` states ``(B, N, D)`` for ``K`` members (the noise
            last) and each member's memory.
        """
        states, memory = [inputs], []
        for t in self.steps:
            outputs, kept = t.forward_with_memory(states[-1], context, mask)
            states.append(outputs)
            memory.append(kept)
        return Trace(states, memory)

    def inverse_given(
        self,
        inputs: Tensor,
        trace: Trace,
        known: Tensor,
        context: Tensor | None = None,
        *,
        mask: Tensor | None = None,
    ) -> Tensor:
        r"""Map noise to data on the new frames, holding every member's input and output on
        the known frames at their values in ``trace`` (docs/forecasting.md#pinned-inverse).

        For a :attr:`causal` chain the known frames, when they precede the new ones, map to the
        same states whatever the new frames are, so each member is inverted with its known
        inputs held at their states (:meth:`~iresflow.transforms.base.SequenceTransform.
        inverse_pinned`): the fixed-point engine solves for the new frames with the past held
        fixed. Unchecked: the caller validated the batch.

        Args:
            inputs: Noise ``(B, N, D)``; its known frames are replaced by the trace's last
                state.
            trace: :meth:`forward_trace` of data that hold the known frames, with ``known`` as
                its mask (a member that kept a memory gets it).
            known: Boolean mask ``(B, N)`` of the known frames.
            context: Conditioning input (``None`` for unconditional transforms).
            mask: Boolean mask ``(B, N)`` of all real frames (known and new).

        Returns:
            Data ``(B, N, D)``: ``trace[0]`` on the known frames.
        """
        outputs = torch.where(known.unsqueeze(-1), trace.states[-1], inputs)
        members = zip(self.steps, trace.states[:-1], trace.memory, strict=True)
        for t, state, kept in reversed(list(members)):
            outputs = (t.inverse_pinned(outputs, state, known, context, mask) if kept is None
                       else t.inverse_pinned(outputs, state, known, context, mask, kept))
        return outputs

    def _initialization_pass(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None
    ) -> Tensor:
        outputs = inputs
        for t in self.steps:
            if isinstance(t, SequenceTransform):
                outputs = t._initialization_pass(outputs, context, mask)
            else:
                outputs = t(outputs, context)[0]
        return outputs

    def _forward(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        return self._cascade(inputs, context, mask, logdet, inverse=False)

    def _inverse(
        self, inputs: Tensor, context: Tensor | None, mask: Tensor | None, logdet: LogDetRequest
    ) -> tuple[Tensor, Tensor | None]:
        return self._cascade(inputs, context, mask, logdet, inverse=True)

    def _cascade(
        self,
        inputs: Tensor,
        context: Tensor | None,
        mask: Tensor | None,
        logdet: LogDetRequest,
        *,
        inverse: bool,
    ) -> tuple[Tensor, Tensor | None]:
        members = list(self.steps)[::-1] if inverse else list(self.steps)
        outputs = inputs
        total = None if logdet is False else inputs.new_zeros(
            inputs.shape[:2] if logdet == FRAMES else inputs.shape[:1])
        for t in members:
            if isinstance(t, SequenceTransform):  # validated at the chain's door: unchecked
                call = t._inverse if inverse else t._forward
                outputs, logabsdet = call(outputs, context, mask, logdet)
            else:  # a plain nflows transform (mask is None here): its own public call
                outputs, logabsdet = (t.inverse if inverse else t)(outputs, context)
            if total is not None:
                total = total + logabsdet
        return outputs, total
