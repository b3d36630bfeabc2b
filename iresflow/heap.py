r"""Keeping freed memory in the process, so that large tensors are not faulted in afresh
(docs/guide.md#heap).

On Linux with glibc, PyTorch's CPU tensors come from ``malloc``. By default ``malloc`` serves a
large request with a fresh ``mmap`` and gives it back to the kernel when it is freed, and it
trims the top of its heap once more than a little memory there is free. A loop that creates and
drops tensors of a few megabytes, as every fixed-point iteration of a sampling or forecasting
solve does (a branch of width 64 on 100 sequences of 150 frames holds about 4 MB per layer),
then pays a page fault for every 4 KB page of every new tensor. :func:`keep_freed_memory`
raises both thresholds, so that freed memory stays in the heap and is reused (its effect on
sampling: docs/small_data.md#sampling).

The ``iresflow`` command and ``python -m benchmarks`` call it when they start; a program that
uses the Python API calls it once itself. It changes the allocator of the whole process, and
memory freed after a peak is not given back to the kernel below the trim threshold.
"""

from __future__ import annotations

import ctypes
import platform
import sys

__all__ = ["MMAP_THRESHOLD", "TRIM_THRESHOLD", "keep_freed_memory"]

# glibc's mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD = -1
_M_MMAP_THRESHOLD = -3

#: Requests up to this many bytes come from the heap instead of a fresh mapping.
MMAP_THRESHOLD = 64 * 2**20
#: Free memory at the top of the heap is given back to the kernel only beyond this many bytes.
TRIM_THRESHOLD = 256 * 2**20


def keep_freed_memory() -> bool:
    """Let ``malloc`` keep freed memory for reuse (glibc only; elsewhere nothing changes).

    Sets glibc's ``M_MMAP_THRESHOLD`` to :data:`MMAP_THRESHOLD` and ``M_TRIM_THRESHOLD`` to
    :data:`TRIM_THRESHOLD`. Calling it again changes nothing more. Values and results of every
    computation are unchanged; only where their memory comes from differs.

    Returns:
        Whether both settings were applied: ``False`` on a platform without glibc.

    Example:
        >>> keep_freed_memory() in (True, False)
        True
    """
    if not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc":
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
        mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD)
    )
