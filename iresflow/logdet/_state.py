"""Re-evaluating a branch with the buffer state of an earlier call.

Some branches update buffers in their training forward (e.g. the power-iteration vectors of a
spectral normalisation). When an engine evaluates a branch more than once for the same estimate
(the recomputation in the memory-efficient backward of :mod:`iresflow.logdet.neumann`), the
repeated evaluations must see the buffers as they were before the first one, and must leave the
module's buffers as the first evaluation left them. Repeated evaluations therefore run through
:func:`torch.func.functional_call` on clones of a snapshot taken before the first evaluation.
"""

from __future__ import annotations

import torch
from torch import Tensor

from iresflow.nn.base import LipschitzBranch


def buffer_snapshot(branch: LipschitzBranch) -> dict[str, Tensor]:
    """Copy all buffers of ``branch``.

    Args:
        branch: The branch.

    Returns:
        A dict from buffer names to detached clones (empty if the branch has no buffers).
    """
    return {name: buf.detach().clone() for name, buf in branch.named_buffers()}


def call_with_buffers(
    branch: LipschitzBranch, snapshot: dict[str, Tensor], x: Tensor, mask: Tensor | None
) -> Tensor:
    """Evaluate ``branch(x, mask)`` starting from the buffer state ``snapshot``.

    The module's own buffers are left untouched and ``snapshot`` is not modified, so it can be
    reused for further evaluations. Parameters are the module's own (gradients reach them).

    Args:
        branch: The branch.
        snapshot: Result of :func:`buffer_snapshot`.
        x: Sequences, shape ``(B, N, D)``.
        mask: Optional padding mask ``(B, N)``.

    Returns:
        ``g(x)``, shape ``(B, N, D)``.
    """
    if not snapshot:
        return branch(x, mask)
    buffers = {name: buf.clone() for name, buf in snapshot.items()}
    return torch.func.functional_call(branch, buffers, (x, mask))
