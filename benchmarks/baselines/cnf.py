r"""A continuous normalizing flow (FFJORD-style) on sequences, built on torchdiffeq.

The flow maps data to noise by integrating :math:`\dot z = v_\theta(t, z)` from :math:`t=0`
(data) to :math:`t=1` (noise). With the accumulated divergence
:math:`\ell(t) = \int_0^t \operatorname{tr}\partial_z v_\theta(s, z(s))\,ds`,

.. math:: \log p_x(x) = \log \mathcal N\big(z(1); 0, I\big) + \ell(1).

The vector field :class:`AttentionVectorField` is a small time-conditioned self-attention network
over positions. The divergence is either exact (trace of the dense :math:`ND\times ND` Jacobian,
one batched vector-Jacobian product per dimension) or Hutchinson's unbiased estimator
:math:`\varepsilon^\top (\partial_z v)\,\varepsilon` with one Rademacher probe per sequence,
fixed along the trajectory. As in FFJORD, training uses Hutchinson's estimator (the exact trace
costs :math:`ND` backward passes per function evaluation, twice differentiated); likelihoods in
evaluation mode use the exact trace when :math:`ND` is small. Padded positions have zero
velocity, so they stay where they are, add nothing to the divergence and never influence real
positions.
Training integrates with :func:`torchdiffeq.odeint_adjoint` (constant memory).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import Tensor, nn
from torchdiffeq import odeint, odeint_adjoint

from iresflow.models.distributions import sample_mask

__all__ = [
    "CNF",
    "AttentionVectorField",
    "FixedProbeValidation",
    "exact_divergence",
    "hutchinson_divergence",
]


def exact_divergence(v: Tensor, x: Tensor, create_graph: bool = False) -> Tensor:
    r"""Exact divergence :math:`\operatorname{tr}\,\partial v/\partial x` per sequence.

    Sequences in the batch must not interact (``v[b]`` depends on ``x[b]`` only); then one
    vector-Jacobian product with the basis vector :math:`e_k` broadcast over the batch yields row
    :math:`k` of every sequence's Jacobian. The :math:`ND` products are batched.

    Args:
        v: Velocities, shape ``(B, N, D)``, computed from ``x`` with autograd enabled.
        x: Positions, shape ``(B, N, D)``, ``requires_grad=True``.
        create_graph: Keep the graph of the result (needed to train through it).

    Returns:
        Divergences, shape ``(B,)``.

    Example:
        >>> x = torch.randn(2, 3, 2, requires_grad=True)
        >>> exact_divergence(3.0 * x, x).tolist()
        [18.0, 18.0]
    """
    b, n, d = x.shape
    nd = n * d
    basis = torch.eye(nd, dtype=x.dtype, device=x.device).reshape(nd, 1, n, d).expand(nd, b, n, d)
    (rows,) = torch.autograd.grad(
        v, x, basis, create_graph=create_graph, is_grads_batched=True
    )
    return rows.reshape(nd, b, nd).diagonal(dim1=0, dim2=2).sum(-1)


def hutchinson_divergence(
    v: Tensor, x: Tensor, probe: Tensor, create_graph: bool = False
) -> Tensor:
    r"""Hutchinson estimate :math:`\varepsilon^\top (\partial v/\partial x)\,\varepsilon`.

    Unbiased for the divergence when :math:`\mathbb E\varepsilon=0`,
    :math:`\mathrm{Cov}\,\varepsilon = I` (docs/math.md#hutchinson).

    Args:
        v: Velocities, shape ``(B, N, D)``, computed from ``x`` with autograd enabled.
        x: Positions, shape ``(B, N, D)``, ``requires_grad=True``.
        probe: :math:`\varepsilon`, shape ``(B, N, D)``.
        create_graph: Keep the graph of the result.

    Returns:
        Estimates, shape ``(B,)``.

    Example:
        >>> x = torch.randn(2, 3, 2, requires_grad=True)
        >>> hutchinson_divergence(3.0 * x, x, torch.ones(2, 3, 2)).tolist()
        [18.0, 18.0]
    """
    (vjp,) = torch.autograd.grad(v, x, probe, create_graph=create_graph)
    return (vjp * probe).flatten(1).sum(-1)


class AttentionVectorField(nn.Module):
    r"""Time-conditioned self-attention velocity :math:`v_\theta(t, X)`, shape ``(B, N, D)``.

    :math:`h = \tanh(W_{\rm in}[x_i, t]) + p_i` (learned position table :math:`p`), one
    multi-head softmax self-attention residual over the real positions, a time-conditioned
    tanh MLP residual, and a zero-initialised output layer (the flow starts at the identity).
    The output is zero at padded positions. Smooth activations only: training differentiates
    the divergence, a second derivative of the network.

    Args:
        features: Frame size :math:`D`.
        max_len: Longest sequence (size of the position table).
        hidden: Width :math:`H` of the hidden tokens.
        heads: Attention heads (must divide ``hidden``).

    Example:
        >>> field = AttentionVectorField(2, max_len=4, hidden=8, heads=2)
        >>> field(torch.tensor(0.5), torch.randn(3, 4, 2)).shape
        torch.Size([3, 4, 2])
    """

    def __init__(self, features: int, max_len: int, hidden: int = 32, heads: int = 2) -> None:
        super().__init__()
        if hidden % heads != 0:
            raise ValueError(f"heads ({heads}) must divide hidden ({hidden})")
        self.features, self.max_len, self.heads = features, max_len, heads
        self.inp = nn.Linear(features + 1, hidden)
        self.position = nn.Parameter(0.1 * torch.randn(max_len, hidden))
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ff1 = nn.Linear(hidden + 1, hidden)
        self.ff2 = nn.Linear(hidden, hidden)
        self.out = nn.Linear(hidden, features)
        nn.init.zeros_(self.out.weight)
        nn.init.zeros_(self.out.bias)

    def _attention(self, h: Tensor, mask: Tensor | None) -> Tensor:
        b, n, width = h.shape
        dh = width // self.heads
        q, k, v = self.qkv(h).reshape(b, n, 3, self.heads, dh).permute(2, 0, 3, 1, 4)
        logits = q @ k.transpose(-1, -2) / math.sqrt(dh)  # (B, H, N, N)
        if mask is not None:
            logits = logits.masked_fill(~mask[:, None, None, :], float("-inf"))
        out = torch.softmax(logits, dim=-1) @ v  # (B, H, N, dh)
        return self.proj(out.transpose(1, 2).reshape(b, n, width))

    def forward(self, t: Tensor, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Velocity at time ``t`` (0-dim) for positions ``x`` (B, N, D); mask (B, N) or None."""
        time = t.to(x).expand(*x.shape[:2], 1)
        h = torch.tanh(self.inp(torch.cat([x, time], -1))) + self.position[: x.shape[1]].to(x)
        h = h + self._attention(h, mask)
        h = h + self.ff2(torch.tanh(self.ff1(torch.cat([h, time], -1))))
        v = self.out(torch.tanh(h))
        if mask is not None:
            v = v * mask[..., None].to(v.dtype)
        return v


class _Dynamics(nn.Module):
    """Augmented dynamics :math:`(\\dot z, \\dot\\ell) = (v, \\operatorname{tr}\\partial_z v)`."""

    def __init__(
        self, field: AttentionVectorField, mask: Tensor | None, probe: Tensor | None
    ) -> None:
        super().__init__()
        self.field = field
        self.mask = mask
        self.probe = probe  # None: exact divergence

    def forward(self, t: Tensor, state: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
        x = state[0]
        create_graph = torch.is_grad_enabled()
        with torch.enable_grad():
            if not x.requires_grad:
                x = x.detach().requires_grad_(True)
            v = self.field(t, x, self.mask)
            if self.probe is None:
                div = exact_divergence(v, x, create_graph)
            else:
                div = hutchinson_divergence(v, x, self.probe, create_graph)
        if not create_graph:
            v, div = v.detach(), div.detach()
        return v, div


class CNF(nn.Module):
    r"""FFJORD-style continuous normalizing flow over sequences with an attention vector field.

    Args:
        features: Frame size :math:`D`.
        max_len: Longest sequence :math:`N`.
        hidden: Width of the vector field.
        heads: Attention heads of the vector field.
        divergence: ``"exact"``, ``"hutchinson"`` or ``"auto"`` (Hutchinson in training mode;
            in evaluation mode exact iff :math:`ND\le` ``exact_max_dim``).
        exact_max_dim: Threshold of ``"auto"``.
        train_tol: ``rtol = atol`` of the dopri5 solver in training mode.
        eval_tol: ``rtol = atol`` in evaluation mode (likelihoods and sampling).

    Example:
        >>> cnf = CNF(2, max_len=3, hidden=8).eval()
        >>> x, mask = torch.randn(4, 3, 2), torch.tensor([[True, True, False]] * 4)
        >>> cnf.log_prob(x, mask).shape, cnf.sample(2, seq_len=3)[0].shape
        (torch.Size([4]), torch.Size([2, 3, 2]))
    """

    def __init__(
        self,
        features: int,
        max_len: int,
        hidden: int = 32,
        heads: int = 2,
        divergence: Literal["auto", "exact", "hutchinson"] = "auto",
        exact_max_dim: int = 64,
        train_tol: float = 1e-3,
        eval_tol: float = 1e-5,
    ) -> None:
        super().__init__()
        if divergence not in ("auto", "exact", "hutchinson"):
            raise ValueError(
                f"divergence must be 'auto', 'exact' or 'hutchinson', got {divergence!r}"
            )
        self.features, self.max_len = features, max_len
        self.divergence, self.exact_max_dim = divergence, exact_max_dim
        self.train_tol, self.eval_tol = train_tol, eval_tol
        self.field = AttentionVectorField(features, max_len, hidden, heads)

    def uses_exact_divergence(self, seq_len: int) -> bool:
        """Whether sequences of length ``seq_len`` get the exact divergence (in this mode)."""
        if self.divergence == "auto":
            return not self.training and seq_len * self.features <= self.exact_max_dim
        return self.divergence == "exact"

    def _tol(self) -> float:
        return self.train_tol if self.training else self.eval_tol

    def log_prob(
        self,
        x: Tensor,
        mask: Tensor | None = None,
        *,
        exact: bool | None = None,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Log-density (B,) of sequences ``x`` (B, N, D) with optional mask (B, N).

        Args:
            x: Sequences ``(B, N, D)``.
            mask: Optional boolean padding mask ``(B, N)``.
            exact: Divergence: exact trace (``True``), Hutchinson (``False``) or as configured
                for the current mode (``None``, see :meth:`uses_exact_divergence`).
            generator: Generator of the Rademacher probes (Hutchinson only).

        Returns:
            Log-densities ``(B,)``; an unbiased estimate with the Hutchinson divergence.
        """
        if x.shape[1] > self.max_len:
            raise ValueError(f"x has length {x.shape[1]} > max_len = {self.max_len}")
        if exact is None:
            exact = self.uses_exact_divergence(x.shape[1])
        probe = None
        if not exact:
            bits = torch.randint(0, 2, x.shape, generator=generator, device=x.device)
            probe = 2.0 * bits.to(x.dtype) - 1.0
            if mask is not None:
                probe = probe * mask[..., None].to(x.dtype)
        # The adjoint backward calls the dynamics again, so mask and probe live in this object.
        dyn = _Dynamics(self.field, mask, probe)
        state = (x, x.new_zeros(x.shape[0]))
        times = torch.tensor([0.0, 1.0], dtype=x.dtype, device=x.device)
        tol = self._tol()
        if torch.is_grad_enabled():
            z, div = odeint_adjoint(
                dyn, state, times, rtol=tol, atol=tol, method="dopri5",
                adjoint_params=tuple(self.field.parameters()),
                adjoint_options={"norm": "seminorm"},  # step control on the state, not the grads
            )
        else:
            z, div = odeint(dyn, state, times, rtol=tol, atol=tol, method="dopri5")
        base = torch.distributions.Normal(0.0, 1.0).log_prob(z[-1]).sum(-1)  # (B, N)
        if mask is not None:
            base = torch.where(mask, base, 0.0)
        return base.sum(-1) + div[-1]

    @torch.no_grad()
    def sample(
        self,
        num: int,
        seq_len: int | None = None,
        lengths: Tensor | None = None,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor]:
        """Draw ``num`` sequences by integrating noise from t=1 back to t=0.

        Exactly one of ``seq_len`` (common length) and ``lengths`` (``(num,)`` integers).

        Returns:
            ``(x (num, N, D), mask (num, N))``, ``x`` zero at padding.
        """
        param = self.field.out.weight
        mask = sample_mask(num, seq_len, lengths, self.max_len, param.device)
        z = torch.randn(
            *mask.shape, self.features, generator=generator, dtype=param.dtype, device=param.device
        )
        z = z * mask[..., None].to(z.dtype)
        times = torch.tensor([1.0, 0.0], dtype=z.dtype, device=z.device)
        tol = self._tol()

        def velocity(t: Tensor, x: Tensor) -> Tensor:
            return self.field(t, x, mask)

        return odeint(velocity, z, times, rtol=tol, atol=tol, method="dopri5")[-1], mask


class FixedProbeValidation(nn.Module):
    """A CNF whose ``eval()``-mode density is Hutchinson's estimate with the same probes in every
    call: the validation estimate of the results table, comparable from epoch to epoch.

    In training mode :meth:`log_prob` is the CNF's own; the trainer validates in ``eval()``
    mode, and a test uses :attr:`cnf` itself (its exact divergence where it applies).

    Args:
        cnf: The flow.
        seed: Seed of the probes.

    Example:
        >>> model = FixedProbeValidation(CNF(2, max_len=3, hidden=8)).eval()
        >>> x = torch.randn(4, 3, 2)
        >>> torch.equal(model.log_prob(x), model.log_prob(x))
        True
    """

    def __init__(self, cnf: CNF, seed: int = 0) -> None:
        super().__init__()
        self.cnf, self.seed = cnf, seed

    def log_prob(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        """Log-densities ``(B,)`` of ``x`` ``(B, N, D)`` (fixed probes in ``eval()`` mode)."""
        if self.training:
            return self.cnf.log_prob(x, mask)
        probes = torch.Generator(x.device).manual_seed(self.seed)
        return self.cnf.log_prob(x, mask, exact=False, generator=probes)
