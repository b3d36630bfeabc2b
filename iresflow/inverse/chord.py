r"""Chord steps for a causal map: the fixed-point solve with a frozen Jacobian
(docs/math.md#fixed-point-inverse, docs/guide.md#inversion).

For :math:`x + g(x) = y` with residual :math:`r(x) = x + g(x) - y`, Newton's step is
:math:`x - (I + J_g(x))^{-1} r(x)`; the chord method keeps the matrix of one point,
:math:`M = I + J_g(x^1)`, for every later step,

.. math:: x^{k+1} = x^k - M^{-1} r(x^k),

whose error contracts by :math:`\|M^{-1}(J_g(x^1) - J_g(x))\|`: fast near :math:`x^1`, where
the plain step :math:`y - g(x^k) = x^k - r(x^k)` contracts by :math:`\mathrm{lip}(g)` only. For
a map that is causal over frames on one feature :math:`M` is lower triangular, so a step costs one
substitution. The convergence of the chord steps is not certified as the plain step's is: a
row whose residual does not fall takes plain steps from then on, which contract.
"""

from __future__ import annotations

import torch
from torch import Tensor

__all__ = ["ChordSteps"]


class ChordSteps:
    r"""Chord steps for a batch of independent problems, one lower-triangular matrix per row.

    Rows are positional, as for :class:`~iresflow.inverse.anderson.AndersonMixer`: :meth:`step`
    takes one row per problem still running, :meth:`keep` drops the rows of problems that
    stopped.

    Args:
        matrix: :math:`M = I + J_g(x^1)` per row, ``(b, n, n)``, lower triangular.

    Raises:
        TypeError: ``matrix`` is not a floating-point tensor.
        ValueError: ``matrix`` is not ``(b, n, n)``.

    Example:
        >>> m = torch.tensor([[[1.0, 0.0], [0.5, 1.0]]], dtype=torch.float64)
        >>> steps = ChordSteps(m)  # g(x) = (0, x_0 / 2): x + g(x) = y is linear
        >>> y, x = torch.tensor([[1.0, 1.0]], dtype=torch.float64), torch.zeros(1, 2).double()
        >>> image = y - torch.stack([torch.zeros(1).double(), x[:, 0] / 2], 1)
        >>> steps.step(x, image, (image - x).abs().amax(1)).tolist()  # exact in one step
        [[1.0, 0.5]]
    """

    def __init__(self, matrix: Tensor) -> None:
        if not isinstance(matrix, Tensor) or not matrix.is_floating_point():
            raise TypeError(f"matrix must be a floating-point tensor, got "
                            f"{type(matrix).__name__}")
        if matrix.dim() != 3 or matrix.shape[1] != matrix.shape[2]:
            raise ValueError(f"matrix must have shape (b, n, n), got {tuple(matrix.shape)}")
        # half precision has no triangular solve: its matrices are solved in float32
        self.matrix = matrix.to(torch.promote_types(matrix.dtype, torch.float32))
        #: Rows still taking chord steps; all of them count as mixing for the solver.
        self.engaged = torch.ones(matrix.shape[0], dtype=torch.bool, device=matrix.device)
        self.chord = self.engaged.clone()
        self.previous_step = torch.full((matrix.shape[0],), float("inf"), dtype=matrix.dtype,
                                        device=matrix.device)

    def keep(self, rows: Tensor) -> None:
        """Keep only the given rows of the state (boolean mask ``(b,)``)."""
        self.matrix, self.engaged = self.matrix[rows], self.engaged[rows]
        self.chord, self.previous_step = self.chord[rows], self.previous_step[rows]

    def step(self, x: Tensor, image: Tensor, step: Tensor, engage: Tensor | None = None) -> Tensor:
        r"""The next iterates: :math:`x - M^{-1}(x - T(x))` where the chord steps still lower the
        residual, the plain step :math:`T(x) = y - g(x)` elsewhere.

        Args:
            x: Current iterates, shape ``(b, n)``.
            image: :math:`T(x^k)`, shape ``(b, n)``.
            step: Max-abs residual :math:`\|T(x^k) - x^k\|_\infty`, shape ``(b,)``.
            engage: Unused (every row is engaged from the start); accepted for the solver's
                mixer interface.

        Returns:
            Next iterates, shape ``(b, n)``.
        """
        self.chord = self.chord & (step < self.previous_step)
        self.previous_step = step
        correction = torch.linalg.solve_triangular(
            self.matrix, (x - image).to(self.matrix.dtype).unsqueeze(-1), upper=False)
        return torch.where(self.chord[:, None], x - correction.squeeze(-1).to(x.dtype), image)
