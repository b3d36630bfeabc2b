r"""Neumann-series gradient of the log-determinant (docs/math.md#neumann-gradient, checks H13,
H14 (docs/math.md#checks)).

**Surrogate.** Differentiating :math:`\log\det(I + J) = \sum_{k\ge1}\frac{(-1)^{k+1}}{k}
\operatorname{tr}(J^k)` term by term gives, for any variable :math:`\theta` (a parameter or the
input :math:`x`),

.. math:: \frac{\partial}{\partial\theta}\log\det(I + J)
          = \sum_{k \ge 0} (-1)^k \operatorname{tr}\Big(J^k \frac{\partial J}{\partial\theta}\Big)
          = \mathbb E_{n, v}\Big[u^\top \frac{\partial J}{\partial\theta} v\Big],
   \qquad u^\top = \sum_{k=0}^{K} (-1)^k c_k\, v^\top J^k,

where the Russian-roulette weights :math:`c_k` and the number of terms :math:`K` come from
:class:`~iresflow.logdet.roulette.RouletteLogDet` (G4). Computing :math:`u` *without* a graph and
then the surrogate :math:`s = u^\top J v` *with* one gives
:math:`\nabla_\theta s = u^\top (\partial_\theta J) v`, an unbiased estimate of the log-det
gradient. The value of :math:`s` is not a log-determinant, so the returned log-det has the value of
the roulette estimate :math:`\hat\ell` and the gradient of :math:`s`:
:math:`\hat\ell + (s - \operatorname{stop\_grad}(s))`.

**Per-sample upstream gradients.** Every sample :math:`b` has its own :math:`s_b`, and the
gradient of a loss :math:`\mathcal L` is
:math:`\sum_b \frac{\partial\mathcal L}{\partial \hat\ell_b} \nabla s_b`, exact for any upstream
weights (per-sample weights, masks), not a rescaling of one sample's gradient.

**Memory-efficient backward** (:class:`NeumannLogDetFunction`). The forward pass evaluates
:math:`g(x)`, the roulette estimate and :math:`u` inside a graph that is freed before returning;
it keeps only :math:`x`, :math:`u` and the probes :math:`v`. Given upstream gradients
:math:`\bar g` (for :math:`g(x)`, shape ``(B, N, D)``) and :math:`\bar\ell` (for the log-det,
shape ``(B,)``), the backward pass re-evaluates :math:`g` with a graph and returns the
vector-Jacobian product of

.. math:: \Phi(x, \theta) = \sum_{b,n,d} g(x)_{bnd}\,\bar g_{bnd}
          + \sum_b \bar\ell_b\, u_b^\top J_g(x_b)\, v_b

with respect to :math:`x` and the parameters :math:`\theta` (:math:`u, v` constant), a double
backward through :math:`g`. Branch buffers are restored to their pre-forward state for the
re-evaluation (:mod:`iresflow.logdet._state`), so branches that update buffers in a training
forward give the same gradients as the plain path.

**Fast path.** When the branch returns a :class:`~iresflow.nn.base.Linearization` from
:meth:`~iresflow.nn.base.LipschitzBranch.linearize`, its effective parameters (the normalised
weights of this forward, with their small graphs to the module's parameters) are the Function's
tensor inputs in place of the parameters. The forward computes the power chain with the
hand-written vector-Jacobian products, the backward re-evaluates the map at :math:`x` and returns
:meth:`~iresflow.nn.base.LinearizedPoint.surrogate_backward`, the gradient of :math:`\Phi`
without a double backward, for those inputs; autograd carries it on to the parameters in the
same backward pass. Between forward and backward the Function keeps only the parameter-sized
linearization, so the recomputation uses the forward's weights without touching the module's
buffers. Values and gradients are those of the autograd path; the plain path and branches
without a linearization use autograd throughout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import Tensor
from torch.autograd.function import FunctionCtx, once_differentiable

from iresflow._validation import value_checks
from iresflow.logdet._hutchinson import power_series, repeat_rows, repeated_input, vjp
from iresflow.logdet._state import buffer_snapshot, call_with_buffers
from iresflow.nn.base import Linearization, LinearizedPoint, LipschitzBranch

__all__ = ["NeumannLogDetFunction", "neumann_logdet"]


def _surrogate(y: Tensor, x: Tensor, u: Tensor, v: Tensor, batch: int) -> Tensor:
    r"""Per-sample surrogate :math:`s_b = \frac1P \sum_p u_{pb}^\top J v_{pb}`, with graph."""
    uj = vjp(y, x, u, create_graph=True)
    return (uj * v).flatten(1).sum(1).view(-1, batch).mean(0)


class NeumannLogDetFunction(torch.autograd.Function):
    r"""Memory-efficient :math:`(g(x), \hat\ell)` with the Neumann gradient (see module docs).

    ``apply(branch, lin, mask, coeffs, neumann_coeffs, x, v, *params)``:

    * ``branch``: the :class:`~iresflow.nn.base.LipschitzBranch` (not a tensor input);
    * ``lin``: its :class:`~iresflow.nn.base.Linearization`, or ``None`` for the autograd path;
    * ``mask``: padding mask ``(B, N)`` or ``None``;
    * ``coeffs``: log-det weights :math:`a_k = \frac{(-1)^{k+1}}{k} c_k`, :math:`k = 1..K`;
    * ``neumann_coeffs``: Neumann weights :math:`(-1)^k c_k`, :math:`k = 0..K`;
    * ``x``: sequences ``(B, N, D)``;
    * ``v``: probes ``(P B, N, D)`` (copy ``p`` of sample ``b`` in row ``p B + b``);
    * ``params``: ``lin.params``, or without ``lin`` the branch parameters that should receive
      gradients (tensors, so that autograd routes their gradients through this Function).

    Returns ``g(x)`` of shape ``(B, N, D)`` and the estimate :math:`\hat\ell` of shape ``(B,)``.
    No autograd graph is kept between forward and backward.
    """

    @staticmethod
    def forward(  # type: ignore[override]
        ctx: FunctionCtx,
        branch: LipschitzBranch,
        lin: Linearization | None,
        mask: Tensor | None,
        coeffs: Sequence[float],
        neumann_coeffs: Sequence[float],
        x: Tensor,
        v: Tensor,
        *params: Tensor,
    ) -> tuple[Tensor, Tensor]:
        batch = x.shape[0]
        copies = v.shape[0] // batch
        # One probe per sample (the default) evaluates the batch itself: nothing to repeat.
        mask_rep = mask if copies == 1 else repeat_rows(mask, copies)
        ctx.branch, ctx.lin, ctx.mask, ctx.params = branch, lin, mask, params
        # The backward re-evaluates the branch under the forward's autocast state (as
        # torch.amp.custom_bwd does), so mixed-precision products see matching dtypes.
        device_type = x.device.type
        ctx.autocast = (
            device_type,
            torch.get_autocast_dtype(device_type),
            torch.is_autocast_enabled(device_type),
        )
        if lin is not None:
            point = lin.at(x if copies == 1 else repeat_rows(x, copies), mask_rep)
            y = point.output
            estimate, u = power_series(point.vjp, v, coeffs, neumann_coeffs=neumann_coeffs)
        else:
            ctx.snapshot = buffer_snapshot(branch)
            with torch.enable_grad():
                x_rep = repeated_input(x, copies, keep_graph=False)
                y = branch(x_rep, mask_rep)
                estimate, u = power_series(
                    lambda w: vjp(y, x_rep, w, False), v, coeffs, neumann_coeffs=neumann_coeffs
                )
        ctx.save_for_backward(x, u, v)
        return y[:batch].detach(), estimate.view(copies, batch).mean(0).detach()

    @staticmethod
    @once_differentiable
    def backward(ctx: Any, grad_out: Tensor, grad_logdet: Tensor) -> tuple[Tensor | None, ...]:
        x, u, v = ctx.saved_tensors
        batch = x.shape[0]
        copies = v.shape[0] // batch
        need_params = ctx.needs_input_grad[7:]
        device_type, autocast_dtype, autocast_enabled = ctx.autocast
        # The forward's inputs were validated: the re-evaluation reads no values either.
        with (
            torch.autocast(device_type, dtype=autocast_dtype, enabled=autocast_enabled),
            value_checks(False),
        ):
            if ctx.lin is not None:
                point = ctx.lin.at(repeat_rows(x, copies), repeat_rows(ctx.mask, copies))
                grad_x, grads = _fast_backward(point, grad_out, grad_logdet, u, v)
                grad_params = [
                    g if need else None for g, need in zip(grads, need_params, strict=True)
                ]
            else:
                wanted = [p for p, need in zip(ctx.params, need_params, strict=True) if need]
                grad_x, *grads = _autograd_backward(ctx, wanted, grad_out, grad_logdet, x, u, v)
                it = iter(grads)
                grad_params = [next(it) if need else None for need in need_params]
        grad_x = grad_x.view(copies, *x.shape).sum(0) if ctx.needs_input_grad[5] else None
        return (None, None, None, None, None, grad_x, None, *grad_params)


def _weights(grad_logdet: Tensor, copies: int, like: Tensor) -> Tensor:
    r"""Per-row weights :math:`\bar\ell_b / P` of the repeated batch, broadcastable to ``like``."""
    weights = (grad_logdet / copies).repeat(copies)
    return weights.view(-1, *([1] * (like.dim() - 1)))


def _autograd_backward(
    ctx: Any,
    wanted: list[Tensor],
    grad_out: Tensor,
    grad_logdet: Tensor,
    x: Tensor,
    u: Tensor,
    v: Tensor,
) -> tuple[Tensor, ...]:
    r"""Gradients of :math:`\Phi` w.r.t. the repeated input and ``wanted``, by double backward."""
    batch = x.shape[0]
    copies = v.shape[0] // batch
    with torch.enable_grad():
        x_rep = repeated_input(x, copies, keep_graph=False)
        y = call_with_buffers(ctx.branch, ctx.snapshot, x_rep, repeat_rows(ctx.mask, copies))
        s = _surrogate(y, x_rep, u, v, batch)
        total = (y[:batch] * grad_out).sum() + (s * grad_logdet).sum()
        return torch.autograd.grad(total, [x_rep, *wanted], materialize_grads=True)


def _fast_backward(
    point: LinearizedPoint,
    grad_out: Tensor,
    grad_logdet: Tensor,
    u: Tensor,
    v: Tensor,
) -> tuple[Tensor, tuple[Tensor, ...]]:
    r"""Gradients of :math:`\Phi` w.r.t. the repeated input and the effective parameters."""
    copies = v.shape[0] // grad_out.shape[0]
    if copies > 1:
        padding = grad_out.new_zeros((copies - 1) * grad_out.shape[0], *grad_out.shape[1:])
        grad_out = torch.cat([grad_out, padding])
    return point.surrogate_backward(grad_out, u * _weights(grad_logdet, copies, u), v)


def neumann_logdet(
    branch: LipschitzBranch,
    x: Tensor,
    mask: Tensor | None,
    v: Tensor,
    coeffs: Sequence[float],
    neumann_coeffs: Sequence[float],
    *,
    memory_efficient: bool = True,
) -> tuple[Tensor, Tensor]:
    r"""Roulette log-det value with the Neumann-surrogate gradient (docs/math.md#neumann-gradient).

    Args:
        branch: The branch :math:`g`.
        x: Sequences ``(B, N, D)``.
        mask: Optional padding mask ``(B, N)``.
        v: Probes ``(P B, N, D)``, zero at padded positions.
        coeffs: Log-det weights :math:`a_k = \frac{(-1)^{k+1}}{k} c_k`, :math:`k = 1..K`.
        neumann_coeffs: Neumann weights :math:`(-1)^k c_k`, :math:`k = 0..K`.
        memory_efficient: Use :class:`NeumannLogDetFunction` (no graph kept between forward and
            backward; :math:`g` is re-evaluated in backward) instead of keeping the graph of the
            surrogate.

    Returns:
        ``(g(x), logdet)`` with shapes ``(B, N, D)`` and ``(B,)``: the logdet value is
        :math:`\frac1P\sum_p\sum_{k=1}^K a_k v_p^\top J^k v_p`, its gradient that of the surrogate.

    Example:
        >>> import torch
        >>> from iresflow.nn.base import LipschitzBranch
        >>> class Scale(LipschitzBranch):  # g(x) = w x on every token
        ...     position_wise, norm = True, "2"
        ...     def __init__(self):
        ...         super().__init__()
        ...         self.w = torch.nn.Parameter(torch.tensor(0.5))
        ...     def forward(self, x, mask=None): return self.w * x
        ...     def lipschitz_constant(self, seq_len=None): return self.w.abs().detach()
        >>> branch, v = Scale(), torch.ones(1, 1, 1)
        >>> c = [1.0] * 31  # all weights 1: the series truncated after 30 terms
        >>> a = [(-1) ** (k + 1) / k for k in range(1, 31)]
        >>> b = [(-1) ** k * c[k] for k in range(31)]
        >>> g, logdet = neumann_logdet(branch, torch.zeros(1, 1, 1), None, v, a, b)
        >>> logdet.backward()  # d/dw log(1 + w) = 1 / (1 + w)
        >>> round(logdet.item(), 6), round(branch.w.grad.item(), 6)
        (0.405465, 0.666667)
    """
    if memory_efficient:
        lin = branch.linearize()
        if lin is not None:
            params = lin.params
        else:
            params = tuple(p for p in branch.parameters() if p.requires_grad)
        return NeumannLogDetFunction.apply(
            branch, lin, mask, tuple(coeffs), tuple(neumann_coeffs), x, v, *params
        )
    batch = x.shape[0]
    copies = v.shape[0] // batch
    graph = torch.is_grad_enabled()
    with torch.enable_grad():
        x_rep = repeated_input(x, copies, keep_graph=graph)
        y = branch(x_rep, repeat_rows(mask, copies))
        estimate, u = power_series(
            lambda w: vjp(y, x_rep, w, False), v, coeffs, neumann_coeffs=neumann_coeffs
        )
        s = _surrogate(y, x_rep, u, v, batch)
    logdet = estimate.view(copies, batch).mean(0) + (s - s.detach())
    if not graph:
        return y[:batch].detach(), logdet.detach()
    return y[:batch], logdet
