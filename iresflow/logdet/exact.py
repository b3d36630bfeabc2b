r"""Exact log-determinant from the dense branch Jacobian (docs/math.md#change-of-variables,
checks H10 (docs/math.md#checks)).

The Jacobian rows are vector-Jacobian products with one-hot cotangents. All rows of a chunk of
samples come from a single forward and backward pass on a repeated batch: copy :math:`i` of sample
:math:`b` receives the cotangent :math:`e_i`, and since a branch acts on every sequence
independently, its input gradient is row :math:`i` of :math:`J_g(x_b)`.

For a position-wise branch the Jacobian is block diagonal with :math:`N` blocks of size
:math:`D \times D`; putting :math:`e_d` at every token at once yields row :math:`d` of every block,
so :math:`D` copies suffice and the log-determinant is a sum of :math:`N` small ``slogdet`` s over
the real tokens. This is exact for position-dependent branches too (e.g. a fixed positional table
added inside the branch), because the blocks are taken from the branch applied to the whole
sequence.

A position-mixing branch with a finite ``receptive_radius`` :math:`R` (output token :math:`t`
depends on input tokens :math:`|s - t| \le R` only) has a block-banded Jacobian. Copy
:math:`(r, d)` carries :math:`e_d` at every token :math:`t \equiv r \pmod{2R + 1}`; its input
gradient at token :math:`s` is :math:`\sum_{t \equiv r} J_{(t, d), (s, \cdot)}`, of which only
the one token :math:`t \equiv r` with :math:`|t - s| \le R` is non-zero (two such tokens are at
least :math:`2R + 1` apart). So :math:`(2R + 1) D` copies give every non-zero entry of the full
:math:`N D \times N D` Jacobian, instead of :math:`N D` copies. Its determinant comes from a
block LU over chunks of :math:`R` tokens (the matrix is block tridiagonal in those chunks), so
the exact log-det of such a branch costs time linear in :math:`N`, never an
:math:`N D \times N D` factorisation.

A causal branch (``branch.causal``: output token :math:`t` depends on input tokens
:math:`s \le t` only) has a block lower-triangular Jacobian, whose determinant is the product of
the determinants of its diagonal blocks :math:`\partial g_t / \partial x_t`
(docs/math.md#causal-steps). With a receptive radius :math:`R` (tokens :math:`t - R, \dots, t`),
the colouring has period :math:`R + 1`: at token :math:`s` the only coloured token
:math:`t \equiv r` that depends on it lies in :math:`s, \dots, s + R`, so the input gradient at
token :math:`t` of copy :math:`(t \bmod (R + 1), d)` is row :math:`d` of the diagonal block of
token :math:`t`. :math:`(R + 1) D` copies (:math:`N D` without a finite radius) give all
:math:`N` blocks, and the log-det is a sum of :math:`N` small ``slogdet`` s over the real
tokens, as for a position-wise branch.
"""

from __future__ import annotations

import torch
from torch import Tensor

from iresflow.logdet._hutchinson import needs_graph, repeat_rows, repeated_input
from iresflow.logdet.base import LogDetEstimator
from iresflow.nn.base import LipschitzBranch

__all__ = ["ExactLogDet", "frame_logdets", "jacobian_blocks", "splits_by_frames"]


#: Matrix size from which CPU batches are factorised one matrix at a time (see :func:`_slogdet`).
_CPU_BATCHED_LU_LIMIT = 32


def _slogdet(matrices: Tensor) -> tuple[Tensor, Tensor]:
    """``torch.linalg.slogdet`` of a batch ``(..., n, n)``, safe on multi-threaded CPUs.

    With several threads, the batched CPU LU of some MKL builds returns wrong factors for
    matrices of a few hundred rows (it reports "Parameter 6 was incorrect on entry to DLASWP");
    the log-determinants are then silently wrong. Large CPU matrices are therefore factorised one
    at a time, which is exact and costs little next to building the Jacobian.

    Args:
        matrices: Square matrices, shape ``(..., n, n)``.

    Returns:
        ``(sign, logabsdet)``, each of shape ``(...)``.
    """
    n = matrices.shape[-1]
    if matrices.device.type != "cpu" or n < _CPU_BATCHED_LU_LIMIT or matrices.dim() == 2:
        return torch.linalg.slogdet(matrices)
    flat = matrices.reshape(-1, n, n)
    signs, logs = zip(*(torch.linalg.slogdet(m) for m in flat), strict=True)
    batch = matrices.shape[:-2]
    return torch.stack(signs).reshape(batch), torch.stack(logs).reshape(batch)


def jacobian_blocks(
    branch: LipschitzBranch, x: Tensor, mask: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    r"""Branch output and the diagonal blocks of its Jacobian.

    For a position-wise branch (``branch.position_wise``) the blocks are the per-token Jacobians
    :math:`\partial g(X)_n / \partial x_n` (``T = N`` blocks of size ``D``; blocks at padded tokens
    are zero); so for a causal branch (``branch.causal``), whose Jacobian is block
    lower-triangular with these diagonal blocks. Otherwise there is one block, the full Jacobian
    of :math:`\mathrm{vec}(X) \mapsto \mathrm{vec}(g(X))` in row-major ``(N, D)`` order
    (``T = 1``, size ``N D``), whose rows and columns at padded tokens are zero by the branch
    contract.

    The result is differentiable with respect to ``x`` and the branch parameters when grad mode is
    on. The whole batch is evaluated at once (one forward of the branch on the repeated batch);
    a flow bounds the memory by evaluating its exact log-density in chunks of sequences
    (:func:`~iresflow.models.evaluation.exact_in_chunks`).

    Args:
        branch: The branch.
        x: Sequences ``(B, N, D)``.
        mask: Optional padding mask ``(B, N)``.

    Returns:
        ``(g(x), blocks)``: shapes ``(B, N, D)`` and ``(B, T, d, d)`` with ``(T, d) = (N, D)``
        for position-wise and causal branches and ``(1, N D)`` otherwise.

    Example:
        >>> import torch
        >>> from iresflow.nn.base import LipschitzBranch
        >>> class Half(LipschitzBranch):  # g(x) = x / 2 on every token
        ...     position_wise, norm = True, "2"
        ...     def forward(self, x, mask=None): return x / 2
        ...     def lipschitz_constant(self, seq_len=None): return torch.tensor(0.5)
        >>> _, blocks = jacobian_blocks(Half(), torch.zeros(2, 3, 4))
        >>> blocks.shape, bool((blocks == torch.eye(4) / 2).all())
        (torch.Size([2, 3, 4, 4]), True)
    """
    out, jac, banded = _jacobian(branch, x, mask)
    return out, _banded_jacobian(jac).unsqueeze(1) if banded else jac


def _jacobian(
    branch: LipschitzBranch, x: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor, bool]:
    """:func:`jacobian_blocks`, with the band (:func:`_band`) of a finite-radius branch in place
    of its dense Jacobian; the flag says which."""
    batch, length, features = x.shape
    radius = getattr(branch, "receptive_radius", None)
    causal = not branch.position_wise and getattr(branch, "causal", False)
    if causal:  # one-sided band: period R + 1, or one copy per row without a finite radius
        period = radius + 1 if radius is not None and radius + 1 < length else length
    else:  # colouring pays once the band is narrower than the sequence
        period = 2 * radius + 1 if radius is not None and 2 * radius + 1 < length else None
    graph = needs_graph(branch, x)
    with torch.enable_grad():
        if branch.position_wise:
            copies = features
            # copy d carries e_d at every token -> row d of every token's block
            eye = torch.eye(features, dtype=x.dtype, device=x.device)
            cot = eye[:, None, None, :].expand(copies, batch, length, features)
        elif period is not None:
            copies = period * features
            cot = _colored_cotangents(period, length, features, x).unsqueeze(1)
            cot = cot.expand(copies, batch, length, features)
        else:
            copies = length * features
            eye = torch.eye(copies, dtype=x.dtype, device=x.device)
            cot = eye[:, None, :].expand(copies, batch, copies)
        cot = cot.reshape(copies * batch, length, features)
        x_rep = repeated_input(x, copies, graph)
        y = branch(x_rep, repeat_rows(mask, copies))
        (rows,) = torch.autograd.grad(y, x_rep, cot, create_graph=graph, materialize_grads=True)
        if branch.position_wise:
            # rows: (d_out, b, n, d_in) -> (b, n, d_out, d_in), one contiguous copy for the
            # factorisations
            jac = rows.reshape(copies, -1, length, features).permute(1, 2, 0, 3).contiguous()
        elif causal:
            jac = _diagonal_blocks(rows.reshape(period, features, -1, length, features))
        elif period is not None:
            jac = _band(rows.reshape(period, features, -1, length, features), radius)
        else:
            # rows: (i_out, b, i_in) -> (b, 1, i_out, i_in), contiguous as above
            jac = rows.reshape(copies, -1, copies).permute(1, 0, 2).unsqueeze(1).contiguous()
    out = y[:batch]
    if not graph:
        out, jac = out.detach(), jac.detach()
    return out, jac, period is not None and not causal


def _colored_cotangents(period: int, length: int, features: int, like: Tensor) -> Tensor:
    """Copy ``(r, d)`` holds ``e_d`` at every token ``t = r (mod period)``: ``(P D, N, D)``."""
    phase = torch.arange(length, device=like.device) % period  # (N,)
    on = phase[None, :] == torch.arange(period, device=like.device)[:, None]  # (P, N)
    eye = torch.eye(features, dtype=like.dtype, device=like.device)
    cot = on.to(like.dtype)[:, None, :, None] * eye[None, :, None, :]  # (P, D, N, D)
    return cot.reshape(period * features, length, features)


def _diagonal_blocks(rows: Tensor) -> Tensor:
    r"""The diagonal blocks of a causal branch's Jacobian from its coloured products.

    Args:
        rows: ``rows[r, d, b, s, e]`` = :math:`\sum_{t \equiv r} J_b[(t, d), (s, e)]` with a
            period :math:`P` larger than the receptive radius, shape ``(P, D, B, N, D)``.

    Returns:
        ``blocks[b, t, d, e]`` = :math:`J_b[(t, d), (t, e)]`, shape ``(B, N, D, D)``.
    """
    period, _, _, length, _ = rows.shape
    t = torch.arange(length, device=rows.device)
    # entries (t, d, b, e) = rows[t mod P, d, b, t, e]
    return rows[t % period, :, :, t, :].permute(2, 0, 1, 3).contiguous()


def _band(rows: Tensor, radius: int) -> Tensor:
    r"""The band of the Jacobian from the colored products of a branch of receptive radius ``R``.

    Args:
        rows: ``rows[r, d, b, s, e]`` = :math:`\sum_{t \equiv r} J_b[(t, d), (s, e)]` with
            period :math:`P = 2R + 1`, shape ``(P, D, B, N, D)``.
        radius: :math:`R`.

    Returns:
        ``band[b, t, d, R + o, e]`` = :math:`J_b[(t, d), (t + o, e)]` for
        :math:`|o| \le R` (zero where :math:`t + o` lies outside the sequence), shape
        ``(B, N, D, 2R + 1, D)``.
    """
    period, features, batch, length, _ = rows.shape
    band = rows.new_zeros(batch, length, features, 2 * radius + 1, features)
    target = torch.arange(length, device=rows.device)
    for k, offset in enumerate(range(-radius, radius + 1)):
        t = target[(target + offset >= 0) & (target + offset < length)]
        # entries (b, t, d, e) = rows[t mod P, d, b, t + o, e]
        band[:, t, :, k, :] = rows[t % period, :, :, t + offset, :].permute(2, 0, 1, 3)
    return band


def _banded_jacobian(band: Tensor) -> Tensor:
    r"""The full Jacobian ``(B, N D, N D)`` in row-major ``(N, D)`` order from :func:`_band`."""
    batch, length, features, width, _ = band.shape
    radius = (width - 1) // 2
    jac = band.new_zeros(batch, length, features, length, features)
    target = torch.arange(length, device=band.device)
    for k, offset in enumerate(range(-radius, radius + 1)):
        t = target[(target + offset >= 0) & (target + offset < length)]
        jac[:, t, :, t + offset, :] = band[:, t, :, k, :].transpose(0, 1)
    return jac.reshape(batch, length * features, length * features)


def _block_tridiagonal(band: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    r""":math:`I + J` as a block-tridiagonal matrix with blocks of :math:`R` tokens.

    A token interacts only with tokens at most :math:`R` away, so with the sequence cut into
    chunks of :math:`R` consecutive tokens (the last one padded with identity rows), chunk
    :math:`i` couples only to chunks :math:`i - 1, i, i + 1` (docs/math.md#temporal-conv).

    Args:
        band: :func:`_band` output ``(B, N, D, 2R + 1, D)``.

    Returns:
        ``(diagonal, upper, lower)``, each ``(C, B, R D, R D)`` with ``C`` = ceil(N / R) chunks:
        :math:`I + J` restricted to the rows of chunk :math:`i` and the columns of chunk
        :math:`i`, :math:`i + 1` and :math:`i - 1` (``upper[C - 1]`` and ``lower[0]`` are zero).
    """
    batch, length, features, width, _ = band.shape
    radius = (width - 1) // 2
    span = max(radius, 1)  # tokens per chunk (radius 0: block diagonal, one token per chunk)
    chunks = -(-length // span)
    # Pad the tokens to C R and add an all-zero offset slot (index 2R + 1) for pairs out of band.
    band = torch.nn.functional.pad(band, (0, 0, 0, 1, 0, 0, 0, chunks * span - length))
    band = band.view(batch, chunks, span, features, width + 1, features)
    a = torch.arange(span, device=band.device)
    rel = a[None, :] - a[:, None]  # rel[a, c] = c - a
    tables = []
    for step in (0, 1, -1):  # column chunk i + step
        offset = step * span + rel
        tables.append(torch.where(offset.abs() <= radius, offset + radius, width))
    # (3, R, R) indices: blocks[s, a, c, b, i, d, e] = band[b, i, a, d, k[s, a, c], e]
    index = torch.stack(tables)
    blocks = band[:, :, a[None, :, None], :, index, :]  # (3, R, R, B, C, D, D)
    size = span * features
    blocks = blocks.permute(0, 4, 3, 1, 5, 2, 6).reshape(3, chunks, batch, size, size)
    eye = torch.eye(size, dtype=band.dtype, device=band.device)
    return blocks[0] + eye, blocks[1], blocks[2]


def _banded_slogdet(band: Tensor) -> tuple[Tensor, Tensor]:
    r"""``slogdet`` of :math:`I + J` from its band by block LU, cost :math:`O(B N R^2 D^3)`.

    The Schur complements :math:`S_0 = A_0`, :math:`S_i = A_i - L_i S_{i-1}^{-1} U_{i-1}` of the
    block-tridiagonal form (:func:`_block_tridiagonal`) give
    :math:`\det(I + J) = \prod_i \det S_i`. No block pivoting is needed for a contractive
    branch: :math:`I + J` then has a positive-definite symmetric part (:math:`\|J\|_2 < 1`),
    which every leading block and every Schur complement inherits, so all :math:`S_i` are
    invertible.

    Returns:
        ``(sign, logabsdet)``, each ``(B, 1)`` (one block per sample, as the dense Jacobian).
    """
    diagonal, upper, lower = _block_tridiagonal(band)
    schur = [diagonal[0]]
    for i in range(1, diagonal.shape[0]):
        schur.append(diagonal[i] - lower[i] @ torch.linalg.solve(schur[-1], upper[i - 1]))
    sign, logabsdet = _slogdet(torch.stack(schur))
    return sign.prod(0)[:, None], logabsdet.sum(0)[:, None]


class ExactLogDet(LogDetEstimator):
    r"""Exact :math:`\log\det(I + J_g(x))` by ``slogdet`` of the dense Jacobian
    (docs/math.md#change-of-variables).

    Position-wise and causal branches use per-token :math:`D \times D` (diagonal) blocks summed
    over real tokens (cost :math:`O(B N D^3)`, docs/math.md#causal-steps); branches of finite
    receptive radius :math:`R` shorter than the sequence use the block-tridiagonal LU of their
    banded Jacobian (blocks of :math:`R` tokens, cost :math:`O(B N R^2 D^3)`, linear in
    :math:`N`); other position-mixing branches use the full :math:`ND \times ND` Jacobian per
    sample (cost :math:`O(B (ND)^3)`). The choice is automatic from ``branch.position_wise``,
    ``branch.causal`` and ``branch.receptive_radius`` (see :func:`jacobian_blocks`). The result
    is differentiable with respect to ``x`` and the branch parameters, for exact-likelihood
    training of small models.

    For a contractive branch :math:`\det(I + J_g) > 0` always (G1); a non-positive determinant
    means the branch is not contractive and raises ``ValueError``.

    The whole batch is evaluated at once; a flow evaluates its exact log-density in
    length-sorted chunks of sequences (:func:`~iresflow.models.evaluation.exact_in_chunks`,
    the ``chunk_size`` of :meth:`~iresflow.models.flow.SequenceFlow.log_prob`), which bounds
    the memory.

    Example:
        >>> import torch
        >>> from iresflow.nn.base import LipschitzBranch
        >>> class Half(LipschitzBranch):  # g(x) = x / 2 on every token
        ...     position_wise, norm = True, "2"
        ...     def forward(self, x, mask=None): return x / 2
        ...     def lipschitz_constant(self, seq_len=None): return torch.tensor(0.5)
        >>> g, logdet = ExactLogDet()(Half(), torch.zeros(2, 3, 4))
        >>> torch.allclose(logdet, torch.full((2,), 12 * torch.tensor(1.5).log().item()))
        True
    """

    def estimate(
        self, branch: LipschitzBranch, x: Tensor, mask: Tensor | None
    ) -> tuple[Tensor, Tensor]:
        out, logabsdet = _block_logdets(branch, x, mask)
        return out, logabsdet.sum(-1)


def frame_logdets(
    branch: LipschitzBranch, x: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    r"""The log-determinants of the diagonal blocks of a position-wise or causal branch,
    frame by frame: :math:`\log\det(I_D + \partial g_t / \partial x_t)` (docs/math.md#causal-steps).

    They sum to :meth:`ExactLogDet.estimate`; for a causal flow, frame :math:`t`'s share of the
    log-determinant (docs/forecasting.md#frame-scores).

    Args:
        branch: A branch with ``position_wise`` or ``causal`` set.
        x: Sequences ``(B, N, D)``.
        mask: Optional padding mask ``(B, N)``.

    Returns:
        ``(g(x), logdets)``: shapes ``(B, N, D)`` and ``(B, N)``, zero at padded frames.

    Raises:
        ValueError: the branch is neither position-wise nor causal (its log-determinant has no
            share per frame), or a diagonal block has a non-positive determinant.
    """
    if not splits_by_frames(branch):
        raise ValueError(f"{type(branch).__name__} is neither position-wise nor causal: its "
                         f"log-determinant has no share per frame")
    return _block_logdets(branch, x, mask)


def _block_logdets(
    branch: LipschitzBranch, x: Tensor, mask: Tensor | None
) -> tuple[Tensor, Tensor]:
    """``(g(x), log-determinants of the blocks of the Jacobian)``: ``(B, N)`` (zero at padding)
    for position-wise and causal branches, ``(B, 1)`` otherwise; every determinant checked to be
    positive."""
    out, jac, banded = _jacobian(branch, x, mask)
    if banded:
        sign, logabsdet = _banded_slogdet(jac)
    else:
        eye = torch.eye(jac.shape[-1], dtype=x.dtype, device=x.device)
        sign, logabsdet = _slogdet(eye + jac)
    if splits_by_frames(branch) and mask is not None:
        logabsdet = logabsdet * mask
        sign = sign.masked_fill(~mask, 1.0)
    if not bool((sign > 0).all()):
        bad = torch.nonzero((sign <= 0).any(-1)).flatten().tolist()
        raise ValueError(
            f"det(I + J_g) <= 0 for samples {bad}: the branch is not contractive "
            "(its Lipschitz constant must be < 1)"
        )
    return out, logabsdet


def splits_by_frames(branch: LipschitzBranch) -> bool:
    """Whether the branch is position-wise or causal (a branch that does not declare
    ``causal`` is not), so that the log-determinant of its step is a sum over frames of the
    log-determinants of the ``D x D`` diagonal blocks of its Jacobian (:func:`frame_logdets`).

    Example:
        >>> from iresflow.nn.mlp import LipschitzMLP
        >>> splits_by_frames(LipschitzMLP((2, 8, 2)))
        True
    """
    return bool(branch.position_wise or getattr(branch, "causal", False))
