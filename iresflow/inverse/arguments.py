"""Validation of the fixed-point solvers' arguments (:mod:`iresflow.inverse.fixed_point`,
:mod:`iresflow.inverse.causal`): a clear ``TypeError`` or ``ValueError`` naming the argument."""

from __future__ import annotations

from torch import Tensor

from iresflow._validation import check_finite

__all__ = ["check_arguments"]


def check_arguments(
    g: object,
    y: object,
    args: object,
    tol: object,
    max_iter: object,
    solver: object,
    memory: object,
    on_failure: object,
    x0: object,
    position_wise: object,
    jacobian: object = None,
) -> None:
    """``TypeError`` or ``ValueError`` for arguments of :func:`fixed_point_inverse` (the same
    names) that are not what it accepts."""
    if not callable(g):
        raise TypeError(f"g must be callable, got {type(g).__name__}")
    if not isinstance(y, Tensor) or not y.is_floating_point():
        raise TypeError(f"y must be a floating-point torch.Tensor, got {_describe(y)}")
    if y.dim() < 1 or y.shape[0] == 0 or y.numel() == 0:
        raise ValueError(
            f"y must have shape (B, ...) with B >= 1 and no empty dimension, got {tuple(y.shape)}"
        )
    check_finite(y, "y")
    if not isinstance(args, tuple) or not all(isinstance(a, Tensor) for a in args):
        raise TypeError("args must be a tuple of tensors")
    for i, a in enumerate(args):
        if a.dim() == 0 or a.shape[0] != y.shape[0]:
            raise ValueError(
                f"args[{i}] must have leading dimension B = {y.shape[0]}, got {tuple(a.shape)}"
            )
    if tol is not None and (
        isinstance(tol, bool) or not isinstance(tol, (int, float)) or not 0 < tol < float("inf")
    ):
        raise ValueError(f"tol must be a positive finite float or None, got {tol!r}")
    if isinstance(max_iter, bool) or not isinstance(max_iter, int) or max_iter < 1:
        raise ValueError(f"max_iter must be a positive int, got {max_iter!r}")
    if solver not in ("plain", "anderson"):
        raise ValueError(f"solver must be 'plain' or 'anderson', got {solver!r}")
    if isinstance(memory, bool) or not isinstance(memory, int) or memory < 1:
        raise ValueError(f"memory must be a positive int, got {memory!r}")
    if on_failure not in ("raise", "warn"):
        raise ValueError(f"on_failure must be 'raise' or 'warn', got {on_failure!r}")
    if not isinstance(position_wise, bool):
        raise TypeError(f"position_wise must be a bool, got {type(position_wise).__name__}")
    if jacobian is not None and (position_wise or not callable(jacobian)):
        raise ValueError("jacobian must be callable, and only without position_wise")
    if position_wise and y.dim() != 3:
        raise ValueError(f"position_wise needs y of shape (B, N, D), got {tuple(y.shape)}")
    for i, a in enumerate(args if position_wise else ()):
        if a.dim() < 2 or a.shape[1] != y.shape[1]:
            raise ValueError(f"with position_wise, args[{i}] must be per frame, (B, N, ...) with "
                             f"N = {y.shape[1]}, got {tuple(a.shape)}")
    if x0 is not None:
        if not isinstance(x0, Tensor) or x0.dtype != y.dtype:
            raise TypeError(f"x0 must be a tensor of dtype {y.dtype}, got {_describe(x0)}")
        if x0.device != y.device:
            raise ValueError(f"x0 must be on the device of y ({y.device}), got {x0.device}")
        if x0.shape != y.shape:
            raise ValueError(f"x0 must have the shape of y {tuple(y.shape)}, got {tuple(x0.shape)}")
        check_finite(x0, "x0")


def _describe(obj: object) -> str:
    """A tensor's dtype or another object's type, for messages."""
    return f"tensor of dtype {obj.dtype}" if isinstance(obj, Tensor) else type(obj).__name__
