r"""Evaluating a flow: chunked exact densities, averaged estimates and diagnostics.

* :func:`exact_in_chunks`: the one place where exact (dense-Jacobian) log-densities are split
  into chunks, by sequence length, with the trailing padding of a chunk cut off;
* :func:`average_estimates`: the mean of independent stochastic estimates and its standard error;
* :func:`lipschitz_report` and :func:`inverse_diagnostics`: per-block certificates and solver
  statistics of the residual blocks of a chain.

:class:`~iresflow.models.flow.SequenceFlow` calls these; they take plain callables and blocks,
not a model, so they can serve any chain.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch import Tensor, nn

from iresflow.nn.base import BranchWrapper
from iresflow.nn.diagnostics import jacobian_norm
from iresflow.transforms.residual import ResidualTransform

__all__ = [
    "EXACT_COPIES_PER_CHUNK",
    "average_estimates",
    "exact_in_chunks",
    "inverse_diagnostics",
    "lipschitz_report",
]

#: Branch-input copies per chunk of the exact Jacobian when no ``chunk_size`` is given: a chunk
#: of ``c`` sequences of length ``N`` costs ``c * N * D`` (attention) or ``c * D`` (MLP) branch
#: evaluations, which keeps test sets with ``N D`` up to ~1000 within a few hundred MB under
#: ``torch.no_grad()``.
EXACT_COPIES_PER_CHUNK = 4096


def exact_in_chunks(
    log_prob: Callable[..., Tensor],
    x: Tensor,
    mask: Tensor | None,
    chunk_size: int | None = None,
    args: tuple[Tensor, ...] = (),
) -> Tensor:
    """Evaluate a per-sequence function on chunks of sequences of similar length.

    Sequences are sorted by the end of their last real frame; each chunk is cut to the longest
    of its sequences (a density never depends on padding). ``chunk_size=None`` grows every
    chunk while ``sequences * length * D <= EXACT_COPIES_PER_CHUNK``. (With grad mode on, the
    graphs of all chunks are kept for the backward pass.)

    Args:
        log_prob: Maps a chunk ``(c, n, D)`` and its mask ``(c, n)`` (or ``None``) to ``(c,)``.
        x: Sequences ``(B, N, D)``, already validated.
        mask: Optional boolean padding mask ``(B, N)``.
        chunk_size: Sequences per chunk, or ``None`` for the automatic size.
        args: Extra per-sequence tensors (leading dimension ``B``, e.g. a context), passed to
            ``log_prob`` after the mask, sliced to the rows of each chunk.

    Returns:
        The values of ``log_prob`` for every sequence, shape ``(B,)``, in the order of ``x``.

    Example:
        >>> x = torch.randn(3, 4, 2)
        >>> mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1], [1, 0, 0, 0]], dtype=torch.bool)
        >>> total = lambda xc, mc: (xc.sum(-1) * mc).sum(-1)
        >>> torch.allclose(exact_in_chunks(total, x, mask, 1), total(x, mask))
        True
    """
    batch, length, features = x.shape
    if mask is None:
        ends = [length] * batch
    else:
        positions = torch.arange(1, length + 1, device=x.device)
        ends = (mask * positions).amax(1).tolist()  # one past the last real frame
    order = sorted(range(batch), key=ends.__getitem__)
    values, start = [], 0
    while start < batch:
        stop = start + 1
        if chunk_size is not None:
            stop = min(batch, start + chunk_size)
        else:
            while (stop < batch and (stop + 1 - start) * ends[order[stop]] * features
                   <= EXACT_COPIES_PER_CHUNK):
                stop += 1
        index = torch.tensor(order[start:stop], device=x.device)
        n = ends[order[stop - 1]]
        values.append(log_prob(x[index, :n], None if mask is None else mask[index, :n],
                               *(a[index] for a in args)))
        start = stop
    inverse = torch.empty(batch, dtype=torch.long, device=x.device)
    inverse[torch.tensor(order, device=x.device)] = torch.arange(batch, device=x.device)
    return torch.cat(values)[inverse]


def average_estimates(estimate: Callable[[], Tensor], n_samples: int) -> tuple[Tensor, Tensor]:
    r"""Mean of ``n_samples`` independent estimates and its standard error.

    The standard error is the sample standard deviation over :math:`\sqrt{n}` (detached); zeros
    for a single estimate.

    Args:
        estimate: Draws one estimate, shape ``(B,)``.
        n_samples: Number of estimates, ``>= 1``.

    Returns:
        ``(mean, stderr)``, each of shape ``(B,)``.

    Example:
        >>> values = iter([torch.tensor([1.0]), torch.tensor([3.0])])
        >>> average_estimates(lambda: next(values), 2)
        (tensor([2.]), tensor([1.]))
    """
    if n_samples == 1:
        value = estimate()
        return value, torch.zeros_like(value)
    stacked = torch.stack([estimate() for _ in range(n_samples)])
    return stacked.mean(0), stacked.detach().std(0) / math.sqrt(n_samples)


def inverse_diagnostics(steps: Sequence[tuple[str, nn.Module]]) -> dict[str, Any]:
    """Convergence of the last fixed-point inverses of the steps of a chain.

    Args:
        steps: ``(name, step)`` pairs of steps with the ``last_inverse_stats``
            (:class:`~iresflow.inverse.fixed_point.InverseStats` or ``None``) of their last
            inverse: residual blocks and autoregressive steps.

    Returns:
        ``{"max_iterations": int, "max_residual": float, "converged": bool, "blocks":
        [{"name", "max_iterations", "max_residual", "converged"}, ...]}``: maxima over the
        batch per block, and over all blocks.

    Raises:
        RuntimeError: no inverse has been computed yet.
    """
    blocks = []
    for name, step in steps:
        stats = step.last_inverse_stats
        if stats is None:
            raise RuntimeError("no inverse has been computed yet (call inverse or sample)")
        blocks.append({
            "name": name,
            "max_iterations": int(stats.iterations.max()),
            "max_residual": float(stats.residual.max()),
            "converged": bool(stats.converged.all()),
        })
    return {
        "max_iterations": max(b["max_iterations"] for b in blocks),
        "max_residual": max(b["max_residual"] for b in blocks),
        "converged": all(b["converged"] for b in blocks),
        "blocks": blocks,
    }


@torch.no_grad()
def lipschitz_report(
    steps: Sequence[tuple[str, ResidualTransform]], x: Tensor
) -> list[dict[str, Any]]:
    r"""Certified and observed Lipschitz constants of the branches of residual blocks.

    * ``"certified"``: the branch certificate :meth:`LipschitzBranch.lipschitz_constant`.
    * ``"estimate"``: the largest *local* Lipschitz constant observed, i.e. the operator norm,
      in the certificate's norm (``"inf"``: max abs row sum; ``"2"``: largest singular value),
      of the exact branch Jacobian :math:`J_g(X)`
      (:func:`~iresflow.nn.diagnostics.jacobian_norm`) at the probe sequences ``x``. A lower
      bound of the true constant, so ``estimate <= certified``.
    * ``"raw_bound"``: for attention, the certified bound of the attention map *before* the
      normalisation by it (docs/math.md#l2-bounds, docs/math.md#lipschitznorm), at the probe
      length (causal attention: the largest of its frames' bounds,
      docs/math.md#causal-attention), which measures how expansive the learned weights are;
      ``None`` otherwise.

    A row names and bounds the innermost branch, seen through its wrappers (the positional shift
    of attention, the context shift of a conditional model, which keep its certificate), so the
    rows of a conditional model read like those of an unconditional one. Conditional branches
    are probed at the zero context (their certificate holds for every context). The branches
    are evaluated in their current mode; call it on an ``eval()`` model for the exact spectral
    norms (docs/math.md#spectral-norm).

    Args:
        steps: ``(name, block)`` pairs.
        x: Probe sequences ``(P, N, D)``.

    Returns:
        One dict per block, in order: ``name``, ``type`` (branch class), ``norm``, ``seq_len``,
        ``certified``, ``estimate`` and ``raw_bound``; ``type`` is the class of the innermost
        branch (e.g. ``ContractiveL2MultiheadAttention``, not its ``ConditionalBranch``).
    """
    seq_len = x.shape[1]
    report = []
    for name, step in steps:
        branch = inner = step.branch
        while isinstance(inner, BranchWrapper):
            inner = inner.branch
        raw = getattr(inner, "raw_bound", None)
        if step.context_features is None:
            def probe(t: Tensor, g: Any = branch) -> Tensor:
                return g(t)
        else:  # a conditional branch is probed at the zero context
            def probe(t: Tensor, g: Any = branch, c: int = step.context_features) -> Tensor:
                return g(t, context=t.new_zeros(t.shape[0], c))
        with torch.enable_grad():
            local = jacobian_norm(probe, x, branch.norm)
        report.append({
            "name": name,
            "type": type(inner).__name__,
            "norm": branch.norm,
            "seq_len": seq_len,
            "certified": float(branch.lipschitz_constant(seq_len)),
            "estimate": float(local.max()),
            "raw_bound": None if raw is None else float(raw(seq_len).max()),
        })
    return report
