r"""Truncated power-series log-determinant (docs/math.md#hutchinson, #truncation; checks H10,
H11 (docs/math.md#checks)).

.. math:: \log\det(I + J_g) \approx \sum_{k=1}^{n} \frac{(-1)^{k+1}}{k} \operatorname{tr}(J_g^k),

with Hutchinson traces (iRes Alg. 2) or exact traces. The truncation is biased: with exact traces
and :math:`\|J_g\| \le L < 1` the error is at most :math:`d \sum_{k > n} L^k / k`,
:math:`d = N D` (G3).
"""

from __future__ import annotations

import torch
from torch import Tensor

from iresflow._validation import check_generator, check_int
from iresflow.logdet._hutchinson import check_probe, hutchinson_logdet, sample_probes
from iresflow.logdet.base import LogDetEstimator
from iresflow.logdet.exact import jacobian_blocks
from iresflow.nn.base import LipschitzBranch

__all__ = ["SeriesLogDet"]


class SeriesLogDet(LogDetEstimator):
    r"""Truncated power series :math:`\sum_{k=1}^{n} \frac{(-1)^{k+1}}{k}\operatorname{tr}(J_g^k)`.

    Traces are Hutchinson estimates :math:`\operatorname{tr}(J^k) \approx \frac1P \sum_p
    v_p^\top J^k v_p` with the powers applied by repeated vector-Jacobian products (G2); all
    ``n_probes`` probes share one chain. Gradients backpropagate through the chain. With
    ``exact_trace=True`` the traces are exact, from the dense Jacobian (small problems, tests of
    the G3 bias bound).

    Args:
        n_terms: Number of series terms :math:`n \ge 1`.
        n_probes: Probes per sample :math:`P \ge 1`.
        probe: ``"rademacher"`` or ``"gaussian"``.
        exact_trace: Use exact traces instead of probes.
        generator: Optional ``torch.Generator`` for the probes.

    Example:
        >>> import torch
        >>> from iresflow.nn.base import LipschitzBranch
        >>> class Half(LipschitzBranch):  # g(x) = x / 2 on every token
        ...     position_wise, norm = True, "2"
        ...     def forward(self, x, mask=None): return x / 2
        ...     def lipschitz_constant(self, seq_len=None): return torch.tensor(0.5)
        >>> g, logdet = SeriesLogDet(n_terms=40)(Half(), torch.zeros(2, 3, 4))
        >>> torch.allclose(logdet, torch.full((2,), 12 * torch.tensor(1.5).log().item()))
        True
    """

    def __init__(
        self,
        n_terms: int = 10,
        n_probes: int = 1,
        probe: str = "rademacher",
        exact_trace: bool = False,
        generator: torch.Generator | None = None,
    ) -> None:
        self.n_terms = check_int(n_terms, "n_terms", 1)
        self.n_probes = check_int(n_probes, "n_probes", 1)
        self.probe = check_probe(probe)
        if not isinstance(exact_trace, bool):
            raise TypeError(f"exact_trace must be a bool, got {type(exact_trace).__name__}")
        self.exact_trace = exact_trace
        self.generator = check_generator(generator)

    @property
    def coefficients(self) -> list[float]:
        r"""Series weights :math:`(-1)^{k+1}/k`, :math:`k = 1, \dots, n`."""
        return [(-1) ** (k + 1) / k for k in range(1, self.n_terms + 1)]

    def estimate(
        self, branch: LipschitzBranch, x: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        if self.exact_trace:
            out, jac = jacobian_blocks(branch, x, mask)
            logdet = x.new_zeros(x.shape[0])
            power = jac
            for k, coeff in enumerate(self.coefficients, start=1):
                if k > 1:
                    power = power @ jac
                logdet = logdet + coeff * power.diagonal(dim1=-2, dim2=-1).sum((-2, -1))
            return out, logdet
        v = sample_probes(self.probe, self.n_probes, x, mask, self.generator)
        return hutchinson_logdet(branch, x, mask, v, self.coefficients)
