"""Timing helpers of the speed benchmarks: a device clock, the median and the fastest of repeated
calls, and a sweep over sequence lengths with its log-log slope."""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch


def device_clock(device: torch.device) -> float:
    """CPU seconds of this process, or wall seconds after a synchronisation on CUDA."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        return time.perf_counter()
    return time.process_time()


def measure(step: Callable[[], object], calls: int = 1) -> tuple[float, float]:
    """Wall seconds and process CPU seconds (summed over threads) per call of ``step``, over
    ``calls`` consecutive calls."""
    start_wall, start_cpu = time.perf_counter(), time.process_time()
    for _ in range(calls):
        step()
    return (time.perf_counter() - start_wall) / calls, (time.process_time() - start_cpu) / calls


def median_seconds(call: Callable[[], object], repeats: int = 3) -> float:
    """The median wall seconds of ``call()`` over ``repeats`` calls after one warm-up call."""
    call()
    seconds = []
    for _ in range(repeats):
        start = time.perf_counter()
        call()
        seconds.append(time.perf_counter() - start)
    return statistics.median(seconds)


def fastest(call: Callable[[], object], repeats: int, device: torch.device) -> float:
    """Fastest of ``repeats`` calls of ``call``, in seconds (:func:`device_clock`)."""
    best = math.inf
    for _ in range(repeats):
        start = device_clock(device)
        call()
        best = min(best, device_clock(device) - start)
    return best


def slope(lengths: Sequence[int], values: Sequence[float]) -> float:
    """Least-squares slope of ``log(value)`` against ``log(N)`` (NaN below two points).

    Example:
        >>> round(slope([16, 32, 64], [1.0, 4.0, 16.0]), 6)
        2.0
    """
    if len(lengths) < 2:
        return math.nan
    return float(np.polyfit(np.log(lengths), np.log(values), 1)[0])


def length_sweep(methods: Sequence[str], cost: Callable[[str, int], dict[str, float]],
                 max_length: int, max_step: float, label: str = ""
                 ) -> dict[str, dict[str, list[float]]]:
    """Costs of every method at lengths ``N = 16, 32, ...`` up to ``max_length``, printed.

    A method stops growing ``N`` after the first step slower than ``max_step`` seconds. Each
    row prints the method, ``label``, ``N``, the costs and the time as a ratio to the first
    method's at the same ``N``; the log-log slopes of every cost close the table.

    Args:
        methods: Method names; the first is the reference of the ratios.
        cost: ``(method, N) -> {"seconds": ..., other costs}``.
        max_length: Largest ``N``.
        max_step: Seconds per step before a method stops.
        label: Printed after the method (e.g. the batch size).

    Returns:
        ``{method: {"N": lengths, cost name: values}}``.
    """
    results: dict[str, dict[str, list[float]]] = {}
    for method in methods:
        rows: dict[str, list[float]] = {"N": []}
        length = 16
        while length <= max_length:
            costs = cost(method, length)
            rows["N"].append(length)
            for name, value in costs.items():
                rows.setdefault(name, []).append(value)
            first = results.get(methods[0], {"N": []})
            ratio = ""
            if method != methods[0] and length in first["N"]:
                reference = first["seconds"][first["N"].index(length)]
                ratio = f"  x{costs['seconds'] / reference:.2f} of {methods[0]}"
            print(f"{method:<10}{label:>8} N={length:<5}"
                  + "".join(f" {name} {value:.4g}" for name, value in costs.items()) + ratio,
                  flush=True)
            if costs["seconds"] > max_step:
                break
            length *= 2
        results[method] = rows
    print(f"log-log slopes against N ({label}):")
    for method, rows in results.items():
        slopes = ", ".join(f"{name} {slope(rows['N'], values):.2f}"
                           for name, values in rows.items() if name != "N")
        print(f"  {method:<10} {slopes}   (N = {rows['N'][0]}..{rows['N'][-1]})")
    return results
