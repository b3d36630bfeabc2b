"""The single input-validation gate of iresflow.

Every public entry point that receives sequences validates them once, at the door, before doing
any work, so bad input fails early with a message naming the argument and the expected
shape/dtype: :func:`check_inputs` for a batch and its padding mask together (the entry points of
transforms, estimators and models), :func:`check_sequence` and :func:`check_mask` for the
building blocks.

Two kinds of checks: *structural* ones (type, rank, shape, dtype, device) read only metadata and
always run; *value* checks (NaN/Inf, sequences without a real token) read the data and cost a
host synchronisation. :func:`check_inputs` fuses all value checks of a call into one boolean
read. Inner layers trust their callers: an entry point runs its internals inside
``value_checks(False)``, so the branches and estimators it calls skip their value checks (and
the hot path has no ``bool(tensor)``). Value checks are also skipped under ``torch.func``
transforms, where values cannot be read, and on ``meta`` tensors, which carry none.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar

import torch
from torch import Tensor

__all__ = [
    "check_dtype_device",
    "check_finite",
    "check_float",
    "check_generator",
    "check_inputs",
    "check_int",
    "check_length",
    "check_logdet_dtype",
    "check_mask",
    "check_sequence",
    "is_transformed",
    "under_functorch_transform",
    "value_checks",
    "values_checked",
]

#: The dtypes the log-determinant engines compute in.
LOGDET_DTYPES = (torch.float32, torch.float64)

_VALUE_CHECKS: ContextVar[bool] = ContextVar("iresflow_value_checks", default=True)


@contextmanager
def value_checks(enabled: bool) -> Iterator[None]:
    """Switch the value checks (NaN/Inf, all-padding masks) on or off inside a block.

    The opt-out for callers that validate their data once (e.g. a training loop over a dataset
    that was checked on loading): inside ``value_checks(False)`` no iresflow entry point reads
    the values of its inputs, so a call makes no host synchronisation for validation; shapes,
    dtypes and devices are still checked. Non-finite inputs then propagate to non-finite
    outputs instead of raising. Entry points use the same switch for the layers they call.

    Args:
        enabled: Whether value checks run inside the block.

    Example:
        >>> with value_checks(False):
        ...     check_sequence(torch.full((1, 2, 3), float("nan"))).shape
        torch.Size([1, 2, 3])
    """
    if not isinstance(enabled, bool):
        raise TypeError(f"enabled must be a bool, got {type(enabled).__name__}")
    token = _VALUE_CHECKS.set(enabled)
    try:
        yield
    finally:
        _VALUE_CHECKS.reset(token)


def under_functorch_transform() -> bool:
    """Whether a ``torch.func`` transform (``vmap``, ``grad``, ``jacrev``, ...) is active."""
    return torch._C._functorch.peek_interpreter_stack() is not None


#: ``is_transformed(x)``: whether the tensor ``x`` is wrapped by a ``torch.func`` transform (its
#: values are hidden). torch's own predicate, bound here so that the layers that cache values
#: ask it without a Python call on the hot path.
is_transformed: Callable[[Tensor], bool] = torch._C._functorch.is_functorch_wrapped_tensor


def values_checked(x: Tensor) -> bool:
    """Whether the values of ``x`` are inspected now.

    False inside ``value_checks(False)``, under a ``torch.func`` transform (values cannot be
    read there) and for ``meta`` tensors.

    Args:
        x: The tensor about to be checked.

    Returns:
        Whether a value check of ``x`` should run.
    """
    return _VALUE_CHECKS.get() and not x.is_meta and not under_functorch_transform()


def check_inputs(
    x: object,
    mask: object,
    name: str = "inputs",
    *,
    features: int | None = None,
    allow_2d: bool = True,
    like: Tensor | None = None,
) -> tuple[Tensor, Tensor | None]:
    """Validate a batch and its padding mask with one host synchronisation.

    The structural checks of :func:`check_sequence` and :func:`check_mask`, then one fused
    value check (finite entries, a real token in every sequence) read with a single ``bool``.

    Args:
        x: Candidate batch, ``(B, N, D)`` (or ``(B, D)`` when ``allow_2d`` and no mask).
        mask: ``None`` or a boolean padding mask ``(B, N)``, ``True`` for real tokens.
        name: Name of the data argument in error messages.
        features: Required feature size ``D``, if known.
        allow_2d: Whether a ``(B, D)`` batch of vectors is accepted.
        like: Tensor whose dtype and device ``x`` must share.

    Returns:
        ``(x, mask)`` with the mask on ``x``'s device.

    Raises:
        TypeError: wrong types or dtypes, or a dtype/device different from ``like``'s.
        ValueError: wrong shapes, non-finite values or an all-padding sequence.

    Example:
        >>> x, mask = check_inputs(torch.zeros(2, 4, 3), torch.ones(2, 4, dtype=torch.bool))
        >>> x.shape, mask.shape
        (torch.Size([2, 4, 3]), torch.Size([2, 4]))
    """
    token = _VALUE_CHECKS.set(False)
    try:
        x = check_sequence(x, name, features=features, allow_2d=allow_2d, like=like)
        mask = check_mask(mask, x)
    finally:
        _VALUE_CHECKS.reset(token)
    if values_checked(x):
        bad = torch.isfinite(x).all().logical_not()
        if mask is not None:
            bad = torch.stack([bad, mask.any(dim=1).all().logical_not()])
        if bool(bad.any()):  # the one host synchronisation of the call
            check_finite(x, name)
            check_mask(mask, x)
    return x, mask


def check_sequence(
    x: object,
    name: str = "inputs",
    *,
    features: int | None = None,
    allow_2d: bool = True,
    like: Tensor | None = None,
) -> Tensor:
    """Validate a batch of sequences.

    Args:
        x: Candidate tensor, expected shape ``(B, N, D)`` (or ``(B, D)`` when ``allow_2d``).
        name: Argument name used in error messages.
        features: Required size ``D`` of the last dimension, if known.
        allow_2d: Whether a ``(B, D)`` batch of vectors is accepted.
        like: A tensor (typically a parameter of the module receiving ``x``) whose dtype and
            device ``x`` must share (see :func:`check_dtype_device`).

    Returns:
        ``x`` itself, unchanged.

    Raises:
        TypeError: ``x`` is not a floating-point tensor, or its dtype/device differ from
            ``like``'s.
        ValueError: wrong rank, wrong feature size, empty dimension or non-finite values.

    Example:
        >>> check_sequence(torch.zeros(2, 5, 3), features=3).shape
        torch.Size([2, 5, 3])
    """
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must have a floating-point dtype, got {x.dtype}")
    ranks = (2, 3) if allow_2d else (3,)
    if x.dim() not in ranks:
        expected = "(B, N, D) or (B, D)" if allow_2d else "(B, N, D)"
        raise ValueError(f"{name} must have shape {expected}, got {tuple(x.shape)}")
    if x.shape[0] == 0:
        raise ValueError(f"{name} is an empty batch (shape {tuple(x.shape)})")
    if 0 in x.shape[1:]:
        raise ValueError(f"{name} has an empty dimension (shape {tuple(x.shape)})")
    if features is not None and x.shape[-1] != features:
        raise ValueError(
            f"{name} must have {features} features in its last dimension, "
            f"got shape {tuple(x.shape)}"
        )
    if like is not None:
        check_dtype_device(x, like, name)
    check_finite(x, name)
    return x


def check_dtype_device(x: Tensor, like: Tensor, name: str) -> Tensor:
    """Raise ``TypeError`` unless ``x`` has the dtype and device of ``like``.

    Modules compute in the dtype of their parameters; an input of another dtype (e.g. float16
    into a float64 module) or on another device is rejected here rather than failing inside a
    matrix product or being silently promoted. Under :func:`torch.autocast` on ``x``'s device
    type only the device is checked, since autocast casts the operands of each operation.

    Args:
        x: Input tensor.
        like: Reference tensor, typically a parameter of the receiving module.
        name: Argument name used in the message.

    Returns:
        ``x`` itself.

    Example:
        >>> check_dtype_device(torch.zeros(2, 3), torch.ones(1), "x").dtype
        torch.float32
    """
    kind = x.device.type
    autocast = torch.amp.is_autocast_available(kind) and torch.is_autocast_enabled(kind)
    if x.device != like.device or (x.dtype != like.dtype and not autocast):
        raise TypeError(
            f"{name} must have the dtype and device of the module's parameters "
            f"({like.dtype}, {like.device}), got ({x.dtype}, {x.device})"
        )
    return x


def check_finite(x: Tensor, name: str) -> Tensor:
    """Raise ``ValueError`` if ``x`` contains NaN or Inf.

    Skipped where :func:`values_checked` is false: inside ``value_checks(False)``, under
    ``torch.func`` transforms and for ``meta`` tensors (a later dtype/device check or the
    computation itself reports those).

    Args:
        x: Any tensor.
        name: Argument name used in the message.

    Returns:
        ``x`` itself.

    Example:
        >>> check_finite(torch.ones(3), "x").sum().item()
        3.0
    """
    if values_checked(x) and not bool(torch.isfinite(x).all()):
        raise ValueError(f"{name} contains NaN or Inf values")
    return x


def check_mask(mask: object, x: Tensor, name: str = "mask") -> Tensor | None:
    """Validate a boolean padding mask for a ``(B, N, D)`` batch.

    The convention throughout iresflow: ``mask[b, n]`` is ``True`` for a real token and ``False``
    for padding. Every sequence must contain at least one real token (a value check, skipped
    where :func:`values_checked` is false).

    Args:
        mask: ``None`` or a ``torch.bool`` tensor of shape ``(B, N)``.
        x: The batch the mask belongs to, shape ``(B, N, D)``.
        name: Argument name used in error messages.

    Returns:
        The mask (on ``x``'s device) or ``None``.

    Raises:
        TypeError: mask is not a boolean tensor.
        ValueError: wrong shape, or a sequence with no real token.

    Example:
        >>> x = torch.zeros(2, 4, 3)
        >>> check_mask(torch.tensor([[1, 1, 0, 0], [1, 1, 1, 1]], dtype=torch.bool), x).sum().item()
        6
    """
    if mask is None:
        return None
    if not isinstance(mask, Tensor):
        raise TypeError(
            f"{name} must be a torch.Tensor of dtype torch.bool, got {type(mask).__name__}"
        )
    if mask.dtype != torch.bool:
        raise TypeError(f"{name} must have dtype torch.bool (True = real token), got {mask.dtype}")
    if x.dim() != 3:
        raise ValueError(f"{name} requires inputs of shape (B, N, D), got {tuple(x.shape)}")
    if mask.shape != x.shape[:2]:
        raise ValueError(
            f"{name} must have shape (B, N) = {tuple(x.shape[:2])}, got {tuple(mask.shape)}"
        )
    if values_checked(mask) and not bool(mask.any(dim=1).all()):
        raise ValueError(f"{name} has a sequence with no real token (all padding)")
    return mask.to(x.device)


def check_int(value: object, name: str, minimum: int) -> int:
    """Validate an integer hyper-parameter ``>= minimum`` (booleans are rejected).

    Args:
        value: Candidate value.
        name: Argument name used in the message.
        minimum: Smallest admissible value.

    Returns:
        ``value`` as an ``int``.

    Raises:
        TypeError: not an integer.
        ValueError: smaller than ``minimum``.
    """
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < minimum:
        kind = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {kind}, got {value}")
    return value


def check_float(value: object, name: str, low: float, high: float = math.inf) -> float:
    """Validate a real hyper-parameter in the open interval ``(low, high)``.

    Args:
        value: Candidate value (int or float, not bool).
        name: Argument name used in the message.
        low: Exclusive lower bound.
        high: Exclusive upper bound.

    Returns:
        ``value`` as a ``float``.

    Raises:
        TypeError: not a real number.
        ValueError: outside ``(low, high)`` or not finite.
    """
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}")
    if not (math.isfinite(value) and low < value < high):
        raise ValueError(f"{name} must lie in the open interval ({low}, {high}), got {value}")
    return float(value)


def check_generator(generator: object) -> torch.Generator | None:
    """Validate an optional ``torch.Generator``.

    Args:
        generator: ``None`` or a ``torch.Generator``.

    Returns:
        ``generator`` unchanged.

    Raises:
        TypeError: anything else.
    """
    if generator is not None and not isinstance(generator, torch.Generator):
        raise TypeError(
            f"generator must be a torch.Generator or None, got {type(generator).__name__}"
        )
    return generator


def check_length(seq_len: int, max_len: int | None, owner: str) -> None:
    """Reject a sequence longer than the ``max_len`` of a certificate.

    Args:
        seq_len: Sequence length ``N`` of an input (a Python int, read from its shape).
        max_len: Longest length the certificate holds for (``None``: any).
        owner: Name of the branch, for the message.

    Raises:
        ValueError: ``N > max_len``.

    Example:
        >>> check_length(4, 6, "TemporalConvBranch")
    """
    if max_len is not None and seq_len > max_len:
        raise ValueError(
            f"sequence length N={seq_len} exceeds max_len={max_len} of {owner}: its certified "
            f"Lipschitz bound holds for N <= max_len only"
        )


def check_logdet_dtype(x: Tensor, name: str) -> None:
    """Require a float32 or float64 ``x``: the log-determinant engines compute in those only.

    Args:
        x: The batch whose log-determinant is wanted.
        name: Argument name used in the message.

    Raises:
        TypeError: any other dtype.

    Example:
        >>> check_logdet_dtype(torch.zeros(2, 3), "x")
    """
    if x.dtype not in LOGDET_DTYPES:
        raise TypeError(f"{name} must have dtype torch.float32 or torch.float64, got {x.dtype}")
