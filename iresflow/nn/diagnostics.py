r"""Empirical lower bounds on Lipschitz constants by maximising Jacobian norms
(docs/math.md#experiments (E1)).

For a differentiable map, :math:`\mathrm{lip}_p(f) = \sup_X \|J_f(X)\|_p`
(docs/math.md#conventions), so every evaluated :math:`\|J_f(X)\|_p` is a lower bound and gradient
ascent over :math:`X` tightens it (Kim Fig. 2 / App. H). Maps act on a batch whose samples are
independent (e.g. ``(B, N, D) -> (B, N', D')`` attention over each sequence); the batch holds
independent starting points of the search, and a padding mask can be closed over by ``f``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Literal, NamedTuple

import torch
from torch import Tensor

from iresflow._validation import check_int, check_sequence
from iresflow.nn._heads import relative_scores
from iresflow.nn.attention import ContractiveL2MultiheadAttention, L2MultiheadAttention
from iresflow.nn.bounds import check_norm
from iresflow.nn.positional import PositionalBranch

__all__ = ["LipschitzEstimate", "attention_weights", "empirical_lipschitz", "jacobian_norm"]


class LipschitzEstimate(NamedTuple):
    """Result of :func:`empirical_lipschitz`.

    Attributes:
        value: Largest Jacobian norm found, a lower bound on the Lipschitz constant (0-dim).
        per_sample: Largest norm found from each starting point, shape ``(B,)``.
        inputs: The input at which each per-sample value was found, shape of ``x``.
    """

    value: Tensor
    per_sample: Tensor
    inputs: Tensor


def jacobian_norm(f: Callable[[Tensor], Tensor], x: Tensor, p: Literal["inf", "2"]) -> Tensor:
    r"""Exact induced norm of the dense per-sample Jacobian :math:`\|J_f(x_b)\|_p`.

    The Jacobian of sample ``b`` is the ``(M, K)`` matrix of its flattened output (``M``
    entries) w.r.t. its flattened input (``K`` entries); ``p="inf"`` gives the max abs row sum,
    ``p="2"`` the largest singular value. Built with ``torch.func.jacrev`` (``M`` backward passes),
    so meant for small inputs; differentiable w.r.t. ``x``.

    Args:
        f: Map acting independently on each sample, ``(B, ...) -> (B, ...)``.
        x: Inputs, shape ``(B, D)`` or ``(B, N, D)``.
        p: ``"inf"`` or ``"2"``.

    Returns:
        The norms, shape ``(B,)``.

    Example:
        >>> w = torch.tensor([[1.0, -2.0], [0.5, 1.0]])
        >>> jacobian_norm(lambda x: x @ w, torch.zeros(1, 3, 2), "inf")  # ||W^T||_inf
        tensor([3.])
    """
    p = check_norm(p)
    check_sequence(x, "x")
    jac = _per_sample_jacobian(f, x)
    if p == "inf":
        return jac.abs().sum(dim=-1).amax(dim=-1)
    return torch.linalg.matrix_norm(jac, ord=2)


def empirical_lipschitz(
    f: Callable[[Tensor], Tensor],
    x: Tensor,
    p: Literal["inf", "2"] = "inf",
    *,
    steps: int = 100,
    lr: float = 0.1,
    power_iterations: int = 2,
    generator: torch.Generator | None = None,
) -> LipschitzEstimate:
    r"""Lower bound on :math:`\mathrm{lip}_p(f)` by gradient ascent of :math:`\|J_f(X)\|_p` in X.

    Starting from each sample of ``x``, Adam (learning rate ``lr``) maximises

    * ``p="inf"``: the exact :math:`\|J_f(X)\|_\infty` of the dense Jacobian (small inputs);
    * ``p="2"``: :math:`\|J_f(X) v\|_2` with a unit vector :math:`v` kept near the top right
      singular vector by ``power_iterations`` warm-started steps
      :math:`v \leftarrow J^\top J v / \|J^\top J v\|` per Adam step (JVP + VJP, no dense
      Jacobian), so every value is :math:`\le \|J_f(X)\|_2`.

    Every evaluated value is a valid lower bound; the largest per sample is kept.

    Args:
        f: Map acting independently on each sample, ``(B, ...) -> (B, ...)``.
        x: Starting points, shape ``(B, D)`` or ``(B, N, D)``.
        p: ``"inf"`` or ``"2"``.
        steps: Number of Adam steps (``0`` evaluates at ``x`` only).
        lr: Adam learning rate.
        power_iterations: Power-iteration steps per Adam step (``p="2"`` only).
        generator: Random generator for the initial power-iteration vector.

    Returns:
        A :class:`LipschitzEstimate`.

    Example:
        >>> w = torch.tensor([[3.0, 0.0], [0.0, 1.0]])
        >>> est = empirical_lipschitz(lambda x: torch.tanh(x) @ w, torch.ones(2, 2), "2", steps=50)
        >>> 2.9 < float(est.value) <= 3.0
        True
    """
    p = check_norm(p)
    check_sequence(x, "x")
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise ValueError(f"steps must be a non-negative int, got {steps!r}")
    check_int(power_iterations, "power_iterations", 1)
    if not isinstance(lr, (int, float)) or not lr > 0:
        raise ValueError(f"lr must be a positive float, got {lr!r}")

    point = x.detach().clone().requires_grad_(True)
    optimizer = torch.optim.Adam([point], lr=lr)  # Adam maximises via the negated norm
    best = torch.full(x.shape[:1], -torch.inf, dtype=x.dtype, device=x.device)
    best_inputs = x.detach().clone()
    if p == "2":
        v = torch.randn(x.shape, generator=generator, dtype=x.dtype, device=x.device)
        v = _normalize(v)
    for step in range(steps + 1):
        if p == "inf":
            norm = jacobian_norm(f, point, "inf")
        else:
            v = _power_iteration(f, point.detach(), v, power_iterations)
            _, jv = torch.func.jvp(f, (point,), (v,))
            norm = torch.linalg.vector_norm(jv.flatten(1), dim=1)
        found = norm.detach()
        better = found > best
        best = torch.where(better, found, best)
        best_inputs = torch.where(_expand(better, x), point.detach(), best_inputs)
        if step == steps:
            break
        if norm.requires_grad:  # False when J does not depend on X (affine f)
            # Gradient w.r.t. the input only: parameters of f are left untouched.
            (point.grad,) = torch.autograd.grad(-norm.sum(), point)
            optimizer.step()
    return LipschitzEstimate(best.max(), best, best_inputs)


def _per_sample_jacobian(f: Callable[[Tensor], Tensor], x: Tensor) -> Tensor:
    """Dense per-sample Jacobians ``(B, M, K)`` of a sample-wise independent map.

    Sample ``b``'s output depends only on sample ``b``'s input, so differentiating the sum of the
    outputs over the batch yields every per-sample Jacobian at once (no cross terms), and a mask
    closed over by ``f`` keeps its batch shape.
    """
    batch = x.shape[0]
    out_shape = f(x).shape
    if out_shape[0] != batch:
        raise ValueError(f"f must keep the batch size {batch}, got output shape {tuple(out_shape)}")
    jac = torch.func.jacrev(lambda z: f(z).sum(dim=0))(x)  # (*out_sample, B, *in_sample)
    return jac.reshape(-1, batch, x[0].numel()).transpose(0, 1)


def _power_iteration(f: Callable[[Tensor], Tensor], x: Tensor, v: Tensor, steps: int) -> Tensor:
    """``steps`` power-iteration steps ``v <- J^T J v / ||J^T J v||`` per sample."""
    with torch.no_grad():  # no graph to the parameters of f
        _, vjp_fn = torch.func.vjp(f, x)
        for _ in range(steps):
            _, jv = torch.func.jvp(f, (x,), (v,))
            (jtjv,) = vjp_fn(jv)
            v = _normalize(jtjv, fallback=v)
    return v


def _normalize(v: Tensor, fallback: Tensor | None = None) -> Tensor:
    """Scale each sample of ``v`` to unit 2-norm (``fallback`` where ``v`` vanishes)."""
    norms = _expand(torch.linalg.vector_norm(v.flatten(1), dim=1), v)
    if fallback is None:
        return v / norms
    return torch.where(norms > 0, v / torch.where(norms > 0, norms, 1.0), fallback)


def _expand(per_sample: Tensor, like: Tensor) -> Tensor:
    """Reshape a ``(B,)`` tensor to broadcast against ``like`` ``(B, ...)``."""
    return per_sample.reshape((-1,) + (1,) * (like.dim() - 1))


def attention_weights(
    attention: L2MultiheadAttention | ContractiveL2MultiheadAttention | PositionalBranch,
    x: Tensor,
    mask: Tensor | None = None,
) -> Tensor:
    r"""What every head of an L2 attention looks at: its weights
    :math:`P^h_{ij} = \mathrm{softmax}_j(-\|q_i - q_j\|^2 / \sqrt{d_h} + b_h(j - i))`
    (docs/math.md#l2-attention, #relative-bias) at the inputs ``x``.

    Args:
        attention: An :class:`~iresflow.nn.attention.L2MultiheadAttention`, a contractive branch
            around one, or a :class:`~iresflow.nn.positional.PositionalBranch` around that (its
            positional table is added to ``x`` first, as in the branch).
        x: Sequences ``(B, N, D)``.
        mask: Optional boolean padding mask ``(B, N)``, ``True`` for real tokens.

    Returns:
        Weights ``(B, H, N, N)`` (query row, key column); rows sum to one over the real keys,
        padded keys get zero and padded query rows are zero.

    Example:
        >>> attn = L2MultiheadAttention(dim=4, heads=2)
        >>> attention_weights(attn, torch.randn(3, 5, 4)).sum(-1).allclose(torch.ones(3, 2, 5))
        True
    """
    if isinstance(attention, PositionalBranch):
        x = x + attention.encoding(x)
        attention = attention.branch
    if isinstance(attention, ContractiveL2MultiheadAttention):
        attention = attention.attention
    if not isinstance(attention, L2MultiheadAttention):
        raise TypeError(f"attention must be an L2 attention module, got {type(attention).__name__}")
    check_sequence(x, "x", features=attention.dim, allow_2d=False)
    b, n, d = x.shape
    d_head = d // attention.heads
    q = (x @ attention.w_query).reshape(b, n, attention.heads, d_head).transpose(1, 2)
    logits = -torch.cdist(q, q).square() / d_head**0.5
    if attention.relative_bias is not None:
        logits = logits + relative_scores(attention.relative_bias, n).to(logits)
    if mask is not None:
        logits = logits.masked_fill(~mask[:, None, None, :], -torch.inf)
        return torch.softmax(logits, -1) * mask[:, None, :, None]
    return torch.softmax(logits, -1)
