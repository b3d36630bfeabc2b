r"""Hutchinson probes and the vector-Jacobian power chain (docs/math.md#hutchinson, #roulette,
#neumann-gradient).

For probes :math:`v` (``E v = 0``, ``Cov v = I``) the chain :math:`w_0 = v`,
:math:`w_k^\top = w_{k-1}^\top J_g` gives :math:`\operatorname{tr}(J_g^k) = \mathbb E[w_k^\top v]`.
Several probes per sample are evaluated in one chain by repeating the batch: copy ``p`` of sample
``b`` sits in row ``p * B + b``. Branches act on every sequence independently, so one
vector-Jacobian product of the repeated batch applies every sample's own Jacobian to its probes.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import overload

import torch
from torch import Tensor

from iresflow.nn.base import LipschitzBranch

PROBES = ("rademacher", "gaussian")


def check_probe(probe: object) -> str:
    """Validate a probe distribution name.

    Args:
        probe: ``"rademacher"`` or ``"gaussian"``.

    Returns:
        ``probe`` unchanged.

    Raises:
        ValueError: unknown name.
    """
    if probe not in PROBES:
        raise ValueError(f"probe must be one of {PROBES}, got {probe!r}")
    return probe  # type: ignore[return-value]


def sample_probes(
    probe: str,
    n_probes: int,
    x: Tensor,
    mask: Tensor | None,
    generator: torch.Generator | None,
) -> Tensor:
    """Draw ``n_probes`` Hutchinson probes per sample, zero at padded positions.

    Args:
        probe: ``"rademacher"`` (entries :math:`\\pm 1`) or ``"gaussian"`` (standard normal).
        n_probes: Probes per sample ``P``.
        x: Sequences ``(B, N, D)``; probes take its dtype and device.
        mask: Optional padding mask ``(B, N)``.
        generator: Optional generator; draws happen on its device and are moved to ``x``'s.

    Returns:
        Probes of shape ``(P * B, N, D)``, copy ``p`` of sample ``b`` in row ``p * B + b``.
    """
    shape = (n_probes * x.shape[0], *x.shape[1:])
    device = generator.device if generator is not None else x.device
    if probe == "rademacher":
        v = torch.randint(0, 2, shape, generator=generator, device=device, dtype=x.dtype)
        v = 2 * v - 1
    else:
        v = torch.randn(shape, generator=generator, device=device, dtype=x.dtype)
    v = v.to(x.device)
    if mask is not None:  # copy p of row b is zeroed where sequence b is padded
        v = (v.view(n_probes, *x.shape) * mask.unsqueeze(-1).to(x.dtype)).view(shape)
    return v


def needs_graph(branch: LipschitzBranch, x: Tensor) -> bool:
    """Whether the result must carry an autograd graph (grad mode on and something to train)."""
    return torch.is_grad_enabled() and (
        x.requires_grad or any(p.requires_grad for p in branch.parameters())
    )


def repeated_input(x: Tensor, copies: int, keep_graph: bool) -> Tensor:
    """Repeat ``x`` along the batch and make it a tensor vector-Jacobian products can target.

    Args:
        x: Sequences ``(B, N, D)``.
        copies: Number of copies ``P``; the result has shape ``(P * B, N, D)``.
        keep_graph: Keep the autograd connection to ``x`` (when ``x`` requires grad).

    Returns:
        The repeated batch, requiring grad.
    """
    if keep_graph and x.requires_grad:
        return repeat_rows(x, copies)
    return repeat_rows(x.detach(), copies).requires_grad_(True)


def vjp(y: Tensor, x: Tensor, w: Tensor, create_graph: bool) -> Tensor:
    r"""One vector-Jacobian product :math:`w^\top J`, zeros where ``y`` does not depend on ``x``."""
    (out,) = torch.autograd.grad(
        y, x, w, retain_graph=True, create_graph=create_graph, materialize_grads=True
    )
    return out


def power_series(
    product: Callable[[Tensor], Tensor],
    v: Tensor,
    coeffs: Sequence[float],
    *,
    neumann_coeffs: Sequence[float] | None = None,
) -> tuple[Tensor, Tensor | None]:
    r"""Weighted Hutchinson power series and, optionally, the Neumann vector.

    With :math:`K` = ``len(coeffs)`` vector-Jacobian products :math:`w_k^\top = w_{k-1}^\top J`,
    :math:`w_0 = v`, computes per row

    .. math:: e = \sum_{k=1}^{K} a_k\, w_k^\top v, \qquad
              u = \sum_{k=0}^{K} b_k\, w_k \quad (\text{if } b \text{ is given}),

    where :math:`a` = ``coeffs`` and :math:`b` = ``neumann_coeffs`` (length :math:`K + 1`).

    Args:
        product: :math:`w \mapsto w^\top J`, row by row, on ``(R, N, D)`` tensors (autograd
            :func:`vjp` or :meth:`~iresflow.nn.base.LinearizedPoint.vjp`).
        v: Probes, shape ``(R, N, D)``.
        coeffs: :math:`a_1, \dots, a_K` (plain Python floats: data-independent).
        neumann_coeffs: :math:`b_0, \dots, b_K`, or ``None``.

    Returns:
        ``(e, u)``: ``e`` of shape ``(R,)``, ``u`` of shape ``(R, N, D)`` or ``None``.
    """
    if neumann_coeffs is not None and len(neumann_coeffs) != len(coeffs) + 1:
        raise ValueError(
            f"neumann_coeffs needs {len(coeffs) + 1} entries, got {len(neumann_coeffs)}"
        )
    u = None if neumann_coeffs is None else neumann_coeffs[0] * v
    weighted = torch.zeros_like(v)  # sum_k a_k w_k: one inner product with v at the end
    w = v
    for k, a_k in enumerate(coeffs, start=1):
        w = product(w)
        weighted = torch.add(weighted, w, alpha=a_k)
        if neumann_coeffs is not None:
            u = torch.add(u, w, alpha=neumann_coeffs[k])
    return (weighted * v).flatten(1).sum(1), u


def hutchinson_logdet(
    branch: LipschitzBranch,
    x: Tensor,
    mask: Tensor | None,
    v: Tensor,
    coeffs: Sequence[float],
) -> tuple[Tensor, Tensor]:
    r"""Stochastic power series :math:`\frac1P\sum_p \sum_k a_k\, v_p^\top J^k v_p`, backpropagated.

    The estimate carries the graph of the whole chain when a graph is needed (its gradient is the
    gradient of the estimate itself). Without a graph, the chain uses the branch's
    :meth:`~iresflow.nn.base.LipschitzBranch.linearize` when it has one.

    Args:
        branch: The branch.
        x: Sequences ``(B, N, D)``.
        mask: Optional padding mask ``(B, N)``.
        v: Probes ``(P * B, N, D)`` from :func:`sample_probes`.
        coeffs: Series weights :math:`a_1, \dots, a_K`.

    Returns:
        ``(g(x), logdet)`` with shapes ``(B, N, D)`` and ``(B,)``.
    """
    batch = x.shape[0]
    copies = v.shape[0] // batch
    graph = needs_graph(branch, x)
    mask_rep = repeat_rows(mask, copies)
    x_rep = repeated_input(x, copies, graph)
    if not graph:
        with torch.no_grad():
            lin = branch.linearize()
            if lin is not None:
                point = lin.at(x_rep.detach(), mask_rep)
                estimate, _ = power_series(point.vjp, v, coeffs)
                return point.output[:batch], estimate.view(copies, batch).mean(0)
    with torch.enable_grad():
        y = branch(x_rep, mask_rep)
        estimate, _ = power_series(lambda w: vjp(y, x_rep, w, graph), v, coeffs)
    logdet = estimate.view(copies, batch).mean(0)
    out = y[:batch]
    if not graph:
        out, logdet = out.detach(), logdet.detach()
    return out, logdet


@overload
def repeat_rows(t: Tensor, copies: int) -> Tensor: ...


@overload
def repeat_rows(t: None, copies: int) -> None: ...


def repeat_rows(t: Tensor | None, copies: int) -> Tensor | None:
    """``t`` repeated ``copies`` times along dim 0; ``t`` itself (no copy) for one copy, and
    ``None`` for ``None`` (a batch without a mask).

    The row layout of the repeated batches the engines evaluate a branch on: row ``r`` belongs
    to sequence ``r mod B``, so a per-sequence tensor (a mask, a context) repeated the same way
    follows its rows.

    Args:
        t: Per-sequence tensor with leading dimension ``B``, or ``None``.
        copies: Number of copies, ``>= 1``.

    Returns:
        Shape ``(copies * B, ...)`` (``None`` for ``None``).

    Example:
        >>> repeat_rows(torch.tensor([1, 2]), 3).tolist()
        [1, 2, 1, 2, 1, 2]
    """
    return t if copies == 1 or t is None else t.repeat(copies, *[1] * (t.dim() - 1))

