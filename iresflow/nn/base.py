"""The abstract residual branch: what the log-det and inverse engines need to know."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import ClassVar, Literal

from torch import Tensor, nn

from iresflow._validation import check_length

__all__ = [
    "BranchWrapper",
    "LinearizedPoint",
    "LipschitzBranch",
    "Linearization",
]


class Linearization(ABC):
    r"""A branch's map with its effective parameters fixed, for hand-written Jacobian products.

    Returned by :meth:`LipschitzBranch.linearize` for branches that can apply their Jacobian
    :math:`J = \partial g / \partial x` without autograd (docs/math.md#neumann-gradient). It holds
    only parameter-sized state: the *effective parameters* ``params`` of one forward (for example
    the normalised weights), computed from the module's parameters under the grad mode in which
    :meth:`~LipschitzBranch.linearize` ran, so they carry a graph back to the parameters. Engines
    pass ``params`` to their custom autograd Functions as inputs and return the gradients of
    :meth:`LinearizedPoint.surrogate_backward` for them; autograd carries them on to the
    module's parameters in the same backward pass.

    Attributes:
        params: The effective parameters, a tuple of tensors.
        frame_jacobians: Whether it forms its Jacobian block by block over frames
            (:meth:`frame_jacobian`).
    """

    params: tuple[Tensor, ...]
    frame_jacobians = False

    def frame_jacobian(self, x: Tensor, mask: Tensor | None = None) -> tuple[Tensor, Tensor]:
        r"""The map at ``x`` ``(R, N, D)`` and its Jacobian block by block over frames,
        ``(R, N, N, D, D)`` (block ``[r, t, s]``: :math:`\partial g_t / \partial x_s` of row
        ``r``), where :attr:`frame_jacobians` says the linearization forms it.

        Raises:
            NotImplementedError: It does not.
        """
        raise NotImplementedError(f"{type(self).__name__} forms no frame Jacobian")

    @abstractmethod
    def at(self, x: Tensor, mask: Tensor | None = None) -> LinearizedPoint:
        """Evaluate the map at ``x`` (calls no module, updates no buffer).

        Args:
            x: Sequences ``(R, N, D)``.
            mask: Optional boolean padding mask ``(R, N)``.

        Returns:
            The map at ``x``, with its Jacobian products.
        """

    @abstractmethod
    def evaluate(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """The map's value alone at ``x``: ``at(x, mask).output`` to rounding, without the
        Jacobian's factors (what a fixed-point solve evaluates, no graph).

        Args:
            x: Sequences ``(R, N, D)``.
            mask: Optional boolean padding mask ``(R, N)``.

        Returns:
            :math:`g(x)`, shape ``(R, N, D)``, zero at padded positions.
        """


class LinearizedPoint(ABC):
    r"""A :class:`Linearization` evaluated at a batch ``x``, with its Jacobian products.

    Rows (sequences) are independent: row ``r`` of every product uses the Jacobian of row ``r``
    of ``x``. Nothing here records an autograd graph.

    Attributes:
        output: :math:`g(x)`, shape ``(R, N, D)``, zero at padded positions.
    """

    output: Tensor

    @abstractmethod
    def vjp(self, w: Tensor) -> Tensor:
        r"""The vector-Jacobian product :math:`w^\top J`, row by row.

        Args:
            w: Cotangents ``(R, N, D)``.

        Returns:
            :math:`w^\top J`, shape ``(R, N, D)``.
        """

    @abstractmethod
    def surrogate_backward(
        self, grad_out: Tensor, u: Tensor, v: Tensor
    ) -> tuple[Tensor, tuple[Tensor, ...]]:
        r"""Gradient of :math:`\Phi = \sum g(x) \odot \bar g + \sum_r u_r^\top J_r v_r`.

        :math:`\bar g` (``grad_out``), :math:`u` and :math:`v` are constants; this is the
        vector-Jacobian product of the memory-efficient Neumann backward
        (:mod:`iresflow.logdet.neumann`).

        Args:
            grad_out: :math:`\bar g`, shape ``(R, N, D)``.
            u: Left vectors ``(R, N, D)`` (already weighted per row).
            v: Right vectors ``(R, N, D)``.

        Returns:
            ``(grad_x, grad_params)``: :math:`\partial\Phi/\partial x` of shape ``(R, N, D)``
            and :math:`\partial\Phi/\partial p` for every effective parameter ``p`` of
            :attr:`Linearization.params`, in that order and with those shapes.
        """


class LipschitzBranch(nn.Module, ABC):
    r"""A residual branch :math:`g` with a certified Lipschitz constant.

    A branch maps a batch of sequences ``(B, N, D)`` to ``(B, N, D)`` and declares

    * ``position_wise``: ``True`` if :math:`g` acts on every token independently (its Jacobian is
      block diagonal with ``N`` blocks of ``D x D``); the exact log-det engine then sums ``N``
      small ``slogdet`` s instead of one ``(N D) x (N D)`` determinant.
    * ``receptive_radius``: for a position-mixing branch whose output token :math:`t` depends
      only on the input tokens :math:`t - R, \dots, t + R`, the radius :math:`R` (an ``int``
      attribute); ``None`` (the default) when any token may influence any other (attention).
      The exact log-det engine then reads the banded Jacobian from :math:`(2R + 1) D`
      vector-Jacobian products instead of :math:`N D`.
    * ``causal``: ``True`` if output token :math:`t` depends on the input tokens
      :math:`s \le t` only (``False``, the default, if it may read later ones). The Jacobian is
      then block lower-triangular and the exact log-det engine needs only its :math:`N` diagonal
      :math:`D \times D` blocks (docs/math.md#causal-steps); with a finite
      ``receptive_radius`` :math:`R` (tokens :math:`t - R, \dots, t`), from :math:`(R + 1) D`
      vector-Jacobian products.
    * ``norm``: the vector norm (``"inf"`` or ``"2"``, on :math:`\mathrm{vec}(X)`) in which its
      certificate holds. Any induced norm bounds the spectral radius, so either suffices for the
      log-det series and the fixed-point inverse of :math:`x + g(x)`.
    * :meth:`lipschitz_constant`: the certified bound, which a contractive branch keeps ``< 1``
      structurally, in every forward, without any update call.
    * ``features``: the token dimension ``D`` it requires, an ``int`` attribute or property
      (``None`` or absent if any ``D`` is accepted);
      :class:`~iresflow.transforms.residual.ResidualTransform` and the log-det estimators check
      the input's last dimension against it before evaluating the branch, so a wrong ``D`` is
      reported on the caller's argument.
    * ``max_len``: the longest sequence for which :meth:`lipschitz_constant` holds (``None``,
      the default: every length). :meth:`check_length` rejects longer inputs; the residual
      transforms, the log-det estimators and the branch's :class:`Linearization` call it at their
      entry, on the input's shape only.
    * ``shift_features``: the width ``H`` of a *shift* the branch accepts after its first layer,
      ``None`` (the default) if it accepts none. Such a branch takes ``forward(x, mask,
      shift=s)`` with ``s`` of shape ``(B, H)``, one vector per sequence that does not depend on
      ``x``, added where it leaves the certificate in ``x`` unchanged (the MLP and convolution
      branches; docs/math.md#conditional-branches).
      :class:`~iresflow.nn.conditional.ConditionalBranch` composes a network of a context into
      that point, or translates the input of a branch without one (attention).

    Contract for masks: with a boolean ``mask`` of shape ``(B, N)`` (``True`` = real token), the
    output at padded positions is exactly zero and padded inputs never influence real outputs.
    """

    position_wise: ClassVar[bool]
    norm: ClassVar[Literal["inf", "2"]]
    receptive_radius: int | None = None
    causal: bool = False
    max_len: int | None = None
    shift_features: int | None = None
    #: Whether fixed-point solves evaluate :meth:`linearize` in place of the branch
    #: (:meth:`solve_map`).
    solves_linearized: ClassVar[bool] = False

    @abstractmethod
    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Evaluate the branch.

        Args:
            x: Sequences, shape ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.

        Returns:
            ``g(x)``, shape ``(B, N, D)``, zero at padded positions.
        """

    @abstractmethod
    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        """Certified upper bound on the Lipschitz constant of the branch (0-dim tensor).

        Args:
            seq_len: Sequence length ``N`` for branches whose bound depends on it (attention);
                position-wise branches ignore it.
        """

    def check_length(self, seq_len: int) -> None:
        """Reject a sequence length beyond :attr:`max_len` (a Python int: no host read).

        Args:
            seq_len: Sequence length ``N`` of an input.

        Raises:
            ValueError: ``N > max_len``, where the certificate no longer holds.
        """
        check_length(seq_len, self.max_len, type(self).__name__)

    def check_shift(self, shift: Tensor, x: Tensor) -> None:
        """Check the shape of a shift ``(B, H)`` for inputs ``x`` (reads no values).

        Args:
            shift: The shift, one row per sequence of ``x``.
            x: The branch input ``(B, N, D)`` (or ``(B, D)``).

        Raises:
            ValueError: the branch takes no shift, or ``shift`` is not ``(B, shift_features)``.
        """
        if self.shift_features is None:
            raise ValueError(f"{type(self).__name__} takes no shift")
        if shift.shape != (x.shape[0], self.shift_features):
            raise ValueError(
                f"shift must have shape (B, H) = ({x.shape[0]}, {self.shift_features}), got "
                f"{tuple(shift.shape)}"
            )

    def solve_map(self, linearization: Linearization | None = None) -> Callable[..., Tensor]:
        """The map ``g(x, mask)`` a fixed-point solve evaluates (no graph, sub-batches of rows):
        the branch, or with ``solves_linearized`` its :meth:`linearize`'s
        :meth:`Linearization.evaluate`, equal to rounding and cheaper: the effective parameters
        are computed once per solve and the iterates, which the solver checks, are not checked
        again at every evaluation. A ``linearization`` the solve already formed (for its
        Jacobian) is evaluated instead of a new one."""
        if linearization is None and self.solves_linearized:
            linearization = self.linearize()
        return self if linearization is None else linearization.evaluate

    def linearize(self, shift: Tensor | None = None) -> Linearization | None:
        """Optional fast path: the branch's map with hand-written Jacobian products.

        A call counts as one forward (buffers a training forward updates are updated the same
        way); returning ``None`` has no side effects. Engines use the result in place of
        autograd when it is not ``None`` and must obtain identical values and gradients either
        way.

        Args:
            shift: Optional shift ``(B, shift_features)`` of the map (see ``shift_features``);
                a linearization with a shift lists it last among its ``params``. A branch that
                cannot linearize with a shift returns ``None`` for one.

        Returns:
            A :class:`Linearization`, or ``None`` (the default) when the branch has none.
        """
        return None



class BranchWrapper(LipschitzBranch):
    """A branch built around another one, with the wrapped branch's structure and certificate.

    ``position_wise``, ``norm``, ``receptive_radius``, ``causal``, ``max_len``, ``features`` and
    :meth:`lipschitz_constant` are those of :attr:`branch`; subclasses implement
    :meth:`forward` by calling it on inputs changed in a way that keeps them (a translation,
    a shift at the branch's shift point).

    Args:
        branch: The wrapped branch.

    Raises:
        TypeError: ``branch`` is not a :class:`LipschitzBranch`.
    """

    def __init__(self, branch: LipschitzBranch) -> None:
        super().__init__()
        if not isinstance(branch, LipschitzBranch):
            raise TypeError(f"branch must be a LipschitzBranch, got {type(branch).__name__}")
        self.branch = branch

    @property  # type: ignore[override]
    def position_wise(self) -> bool:
        """Whether the wrapped branch acts on every token independently."""
        return self.branch.position_wise

    @property  # type: ignore[override]
    def norm(self) -> Literal["inf", "2"]:
        """Norm in which the wrapped branch's certificate holds."""
        return self.branch.norm

    @property  # type: ignore[override]
    def receptive_radius(self) -> int | None:
        """Receptive radius of the wrapped branch."""
        return self.branch.receptive_radius

    @property  # type: ignore[override]
    def causal(self) -> bool:
        """Whether the wrapped branch is causal over tokens."""
        return self.branch.causal

    @property  # type: ignore[override]
    def max_len(self) -> int | None:
        """Longest sequence the wrapped branch's certificate holds for."""
        return self.branch.max_len

    @property
    def features(self) -> int | None:
        """Token dimension ``D`` the wrapped branch requires, if it declares one."""
        return getattr(self.branch, "features", None)

    def lipschitz_constant(self, seq_len: int | None = None) -> Tensor:
        """Certified bound of the wrapped branch (0-dim tensor).

        Args:
            seq_len: Sequence length, passed on to the wrapped branch.
        """
        return self.branch.lipschitz_constant(seq_len)
