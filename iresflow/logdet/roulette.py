r"""Unbiased Russian-roulette log-determinant (docs/math.md#roulette, #neumann-gradient;
checks H12-H14 (docs/math.md#checks)).

With a random count :math:`n \sim p(N)`, ``m`` = ``n_exact_terms`` and :math:`K = n + m`,

.. math:: \hat\ell = \sum_{k=1}^{K} \frac{(-1)^{k+1}}{k}\, c_k\, v^\top J_g^k v, \qquad
          c_k = \begin{cases} 1 & k \le m \\ 1 / \mathbb P(N \ge k - m) & k > m \end{cases}

is an unbiased estimate of :math:`\log\det(I + J_g)`: term :math:`k > m` is present with
probability :math:`\mathbb P(N \ge k - m)` and re-weighted by its inverse. Counts follow

* ``"geometric"`` (support :math:`\{1, 2, \dots\}`): :math:`\mathbb P(N \ge j) = (1-p)^{j-1}`;
* ``"poisson"`` (support :math:`\{0, 1, \dots\}`):
  :math:`\mathbb P(N \ge j) = 1 - e^{-\lambda}\sum_{i<j} \lambda^i / i!`.

One count is drawn per call and shared by the batch and the probes (the residual-flows
convention); each sample's estimate is unbiased, and repeated calls give independent draws, from
which a caller obtains per-sample means and standard errors.

A count is a Python integer (it sets the number of terms), so drawing it reads a tensor on the
host. A caller may draw it and pass it in (``count=`` of :meth:`RouletteLogDet.estimate`, or a
:class:`RouletteCall`): :func:`draw_pass_counts` draws the counts of all calls of one pass
through a flow at once, one host read per generator instead of one per residual block. The
estimator itself holds no state between calls.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import torch
from torch import Tensor

from iresflow._validation import check_float, check_generator, check_int
from iresflow.logdet._hutchinson import (
    check_probe,
    hutchinson_logdet,
    needs_graph,
    sample_probes,
)
from iresflow.logdet.base import LogDetEstimator
from iresflow.logdet.neumann import neumann_logdet
from iresflow.nn.base import LipschitzBranch

__all__ = ["RouletteCall", "RouletteLogDet", "draw_pass_counts"]

DISTRIBUTIONS = ("geometric", "poisson")


class RouletteLogDet(LogDetEstimator):
    r"""Unbiased Russian-roulette estimator of :math:`\log\det(I + J_g)` (docs/math.md#roulette).

    In training mode (``branch.training``) the first ``n_exact_terms`` terms always have weight
    1; in evaluation mode ``eval_exact_terms`` do (more exact terms, lower variance). Traces are
    Hutchinson estimates averaged over ``n_probes`` probes per sample that share one
    vector-Jacobian chain; probes are zero at padded positions.

    Gradients (when grad mode is on and ``x`` or a branch parameter requires grad):

    * ``neumann_gradient=True``: the log-det *value* is the roulette estimate and its *gradient*
      is that of the Neumann surrogate (G5, :mod:`iresflow.logdet.neumann`), exact for arbitrary
      per-sample upstream gradients. ``memory_efficient=True`` uses the custom autograd Function
      that keeps no graph between forward and backward.
    * ``neumann_gradient=False``: backpropagation through the whole estimator.

    The term count is drawn from ``generator`` (on its device; the default CPU generator when
    ``None``) before the probes, so a seeded generator reproduces an estimate exactly.

    Args:
        distribution: ``"geometric"`` or ``"poisson"``.
        p: Success probability of the geometric distribution, in :math:`(0, 1)`.
        lam: Rate :math:`\lambda > 0` of the Poisson distribution.
        n_exact_terms: Terms with weight 1 in training mode, :math:`m \ge 0`.
        eval_exact_terms: Terms with weight 1 in evaluation mode.
        n_probes: Probes per sample :math:`P \ge 1`.
        probe: ``"rademacher"`` or ``"gaussian"``.
        neumann_gradient: Use the Neumann-surrogate gradient.
        memory_efficient: With the Neumann gradient, keep no graph between forward and backward.
        generator: Optional ``torch.Generator`` for counts and probes.

    Example:
        >>> import torch
        >>> from iresflow.nn.base import LipschitzBranch
        >>> class Half(LipschitzBranch):  # g(x) = x / 2 on every token
        ...     position_wise, norm = True, "2"
        ...     def forward(self, x, mask=None): return x / 2
        ...     def lipschitz_constant(self, seq_len=None): return torch.tensor(0.5)
        >>> gen = torch.Generator().manual_seed(0)
        >>> estimator = RouletteLogDet("poisson", lam=2.0, generator=gen)
        >>> g, logdet = estimator(Half(), torch.zeros(3, 2, 2))
        >>> logdet.shape
        torch.Size([3])
    """

    def __init__(
        self,
        distribution: str = "geometric",
        p: float = 0.5,
        lam: float = 2.0,
        n_exact_terms: int = 2,
        eval_exact_terms: int = 20,
        n_probes: int = 1,
        probe: str = "rademacher",
        neumann_gradient: bool = True,
        memory_efficient: bool = True,
        generator: torch.Generator | None = None,
    ) -> None:
        if distribution not in DISTRIBUTIONS:
            raise ValueError(f"distribution must be one of {DISTRIBUTIONS}, got {distribution!r}")
        self.distribution = distribution
        self.p = check_float(p, "p", 0.0, 1.0)
        self.lam = check_float(lam, "lam", 0.0)
        self.n_exact_terms = check_int(n_exact_terms, "n_exact_terms", 0)
        self.eval_exact_terms = check_int(eval_exact_terms, "eval_exact_terms", 0)
        self.n_probes = check_int(n_probes, "n_probes", 1)
        self.probe = check_probe(probe)
        for name, flag in (
            ("neumann_gradient", neumann_gradient),
            ("memory_efficient", memory_efficient),
        ):
            if not isinstance(flag, bool):
                raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
        self.neumann_gradient = neumann_gradient
        self.memory_efficient = memory_efficient
        self.generator = check_generator(generator)

    def tail_probability(self, j: int) -> float:
        r""":math:`\mathbb P(N \ge j)` of the count distribution (see :meth:`tail_probabilities`).

        Args:
            j: Integer threshold.

        Returns:
            The probability (1 for ``j`` at or below the smallest support point).

        Example:
            >>> RouletteLogDet("geometric", p=0.5).tail_probability(3)
            0.25
        """
        return 1.0 if j <= 0 else self.tail_probabilities(j)[-1]

    def tail_probabilities(self, n: int) -> list[float]:
        r""":math:`\mathbb P(N \ge j)` for :math:`j = 1, \dots, n`, in one loop.

        Geometric tails are :math:`(1-p)^{j-1}`. Each Poisson tail is summed upwards,
        :math:`\sum_{i \ge j} e^{-\lambda}\lambda^i/i!`, which equals
        :math:`1 - e^{-\lambda}\sum_{i<j}\lambda^i/i!` without its cancellation.

        Args:
            n: Largest threshold, ``>= 0``.

        Returns:
            A list of ``n`` floats.

        Example:
            >>> RouletteLogDet("geometric", p=0.5).tail_probabilities(3)
            [1.0, 0.5, 0.25]
        """
        return list(_tails(self.distribution, self.p, self.lam, n))

    def weights(self, n: int, m: int) -> list[float]:
        r"""Roulette weights :math:`c_0, \dots, c_{n+m}`: 1 up to :math:`m`, then
        :math:`1/\mathbb P(N \ge k - m)`.

        Args:
            n: Drawn count.
            m: Number of exact terms.

        Returns:
            A list of ``n + m + 1`` floats.

        Example:
            >>> RouletteLogDet("geometric", p=0.5).weights(3, 2)
            [1.0, 1.0, 1.0, 1.0, 2.0, 4.0]
        """
        return list(_weights(self.distribution, self.p, self.lam, n, m))

    def sample_count(self) -> int:
        """Draw one roulette count :math:`n` from ``generator`` (on its device).

        Returns:
            A non-negative integer (at least 1 for the geometric distribution).
        """
        return self.draw_counts(1)[0]

    def draw_counts(self, num: int) -> list[int]:
        """Draw ``num`` independent counts from ``generator`` (on its device), one host read.

        Args:
            num: Number of counts, ``>= 1``.

        Returns:
            ``num`` non-negative integers (at least 1 for the geometric distribution).

        Example:
            >>> gen = torch.Generator().manual_seed(0)
            >>> counts = RouletteLogDet(generator=gen).draw_counts(3)
            >>> len(counts), min(counts) >= 1
            (3, True)
        """
        num = check_int(num, "num", 1)
        device = self.generator.device if self.generator is not None else torch.device("cpu")
        if self.distribution == "geometric":
            draw = torch.empty(num, dtype=torch.float64, device=device)
            draw.geometric_(self.p, generator=self.generator)
        else:
            rate = torch.full((num,), self.lam, dtype=torch.float64, device=device)
            draw = torch.poisson(rate, generator=self.generator)
        return list(map(int, draw.tolist()))

    def estimate(
        self, branch: LipschitzBranch, x: Tensor, mask: Tensor | None, count: int | None = None
    ) -> tuple[Tensor, Tensor]:
        """See :meth:`LogDetEstimator.estimate`.

        Args:
            branch: The residual branch :math:`g`.
            x: Sequences ``(B, N, D)``, already validated by the caller.
            mask: Optional boolean padding mask ``(B, N)`` on ``x``'s device, or ``None``.
            count: The roulette count :math:`n` of this call, drawn by the caller (e.g. with
                :func:`draw_pass_counts`); ``None`` draws it here (:meth:`sample_count`). The
                probes are drawn here, after the count.

        Returns:
            ``(g(x), logdet)`` with shapes ``(B, N, D)`` and ``(B,)``.
        """
        return RouletteCall(self, self.sample_count() if count is None else count).estimate(
            branch, x, mask
        )


@dataclass(frozen=True)
class RouletteCall(LogDetEstimator):
    """One call of a :class:`RouletteLogDet` whose count the caller drew already.

    What a flow hands each residual block for one pass (see
    :meth:`~iresflow.logdet.policy.LogDetPolicy.pass_request`): an immutable pairing of the
    block's estimator with its count from :func:`draw_pass_counts`.

    Attributes:
        estimator: The roulette estimator (probes, weights and generator).
        count: The roulette count :math:`n` of the call.

    Example:
        >>> call = RouletteCall(RouletteLogDet("poisson"), 3)
        >>> call.count, call.estimator.distribution
        (3, 'poisson')
    """

    estimator: RouletteLogDet
    count: int

    def estimate(
        self, branch: LipschitzBranch, x: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        """The estimate of :meth:`RouletteLogDet.estimate` with this call's count."""
        roulette = self.estimator
        m = roulette.n_exact_terms if branch.training else roulette.eval_exact_terms
        coeffs, neumann_coeffs = _series(roulette.distribution, roulette.p, roulette.lam,
                                         self.count, m)
        v = sample_probes(roulette.probe, roulette.n_probes, x, mask, roulette.generator)
        if roulette.neumann_gradient and needs_graph(branch, x):
            return neumann_logdet(branch, x, mask, v, coeffs, neumann_coeffs,
                                  memory_efficient=roulette.memory_efficient)
        return hutchinson_logdet(branch, x, mask, v, coeffs)


def draw_pass_counts(calls: Sequence[RouletteLogDet]) -> list[int]:
    """Draw the counts of several upcoming estimator calls at once.

    ``calls`` lists the estimator of every upcoming call in call order (an estimator used by
    ``k`` blocks appears ``k`` times). Estimators with the same generator and count
    distribution get their counts from one draw (:meth:`RouletteLogDet.draw_counts`), so a pass
    through a flow reads the host once per generator; within a draw the counts go to the calls
    in order. Every count is an independent draw from the estimator's distribution, so each
    call stays unbiased.

    Args:
        calls: The estimators of the upcoming calls.

    Returns:
        One count per entry of ``calls``, in the same order.

    Raises:
        TypeError: an entry is not a :class:`RouletteLogDet`.

    Example:
        >>> gen = torch.Generator().manual_seed(0)
        >>> a, b = RouletteLogDet(generator=gen), RouletteLogDet(generator=gen)
        >>> counts = draw_pass_counts([a, b, a])
        >>> counts == RouletteLogDet(generator=torch.Generator().manual_seed(0)).draw_counts(3)
        True
    """
    groups: dict[tuple[object, ...], list[int]] = {}
    for i, estimator in enumerate(calls):
        if not isinstance(estimator, RouletteLogDet):
            raise TypeError(
                f"calls must hold RouletteLogDet estimators, got {type(estimator).__name__}"
            )
        key = (id(estimator.generator), estimator.distribution, estimator.p, estimator.lam)
        groups.setdefault(key, []).append(i)
    counts = [0] * len(calls)
    for positions in groups.values():
        drawn = calls[positions[0]].draw_counts(len(positions))
        for i, count in zip(positions, drawn, strict=True):
            counts[i] = count
    return counts


# The weights are pure functions of the distribution, the count and the exact terms, cached so
# that the per-call work of an estimate is the branch's alone (counts repeat: a geometric count
# with p = 1/2 exceeds 10 once in a thousand draws).


@lru_cache(maxsize=1024)
def _tails(distribution: str, p: float, lam: float, n: int) -> tuple[float, ...]:
    r""":math:`\mathbb P(N \ge j)` for :math:`j = 1, \dots, n`
    (:meth:`RouletteLogDet.tail_probabilities`)."""
    tails: list[float] = []
    for j in range(1, n + 1):
        if distribution == "geometric":
            tails.append((1.0 - p) ** (j - 1))
            continue
        tail, i = 0.0, j
        term = math.exp(-lam + j * math.log(lam) - math.lgamma(j + 1))
        while term > 0.0 and (i <= lam or term > 1e-17 * tail):
            tail += term
            i += 1
            term *= lam / i
        tails.append(tail)
    return tuple(tails)


@lru_cache(maxsize=1024)
def _weights(distribution: str, p: float, lam: float, n: int, m: int) -> tuple[float, ...]:
    r"""The roulette weights :math:`c_0, \dots, c_{n+m}` (:meth:`RouletteLogDet.weights`)."""
    weights = [1.0] * (m + 1)
    for tail in _tails(distribution, p, lam, n):
        weights.append(1.0 / tail)
    return tuple(weights)


@lru_cache(maxsize=1024)
def _series(
    distribution: str, p: float, lam: float, n: int, m: int
) -> tuple[tuple[float, ...], tuple[float, ...]]:
    r"""The power-series weights of one estimate, :math:`a_k = \frac{(-1)^{k+1}}{k} c_k`
    (:math:`k = 1..K`), and the Neumann weights :math:`(-1)^k c_k` (:math:`k = 0..K`)."""
    c = _weights(distribution, p, lam, n, m)
    coeffs, neumann_coeffs = [], [c[0]]
    for k in range(1, len(c)):
        coeffs.append((-1) ** (k + 1) / k * c[k])
        neumann_coeffs.append((-1) ** k * c[k])
    return tuple(coeffs), tuple(neumann_coeffs)
