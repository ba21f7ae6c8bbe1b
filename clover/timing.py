"""Median timing of device work, shared by the cost model's calibration (:mod:`clover.adaptive`), the attention
choice and the device steps' timing at load (:mod:`clover.backends`)."""

from __future__ import annotations

import statistics
import time
from typing import Callable

import torch


def synchronize(device) -> None:
    """Drain a CUDA device's queue (a CPU's work is done when the call returns)."""
    if str(device).startswith("cuda"):
        torch.cuda.synchronize()


def median_seconds(jobs: dict, repeats: int, device) -> dict:
    """Median seconds of each job (a callable) over ``repeats`` rounds, after one warm-up call each
    (allocations, kernel selection), the device drained after each call. Every round runs every job once, in an
    order rotated per round, so a burst of load on a shared machine costs many points a little instead of one
    point all its repeats: timed point by point, such a burst once rated 8 target tokens dearer than 16
    (docs/results/defaults/README.md)."""
    keys = list(jobs)
    for key in keys:
        jobs[key]()
    synchronize(device)
    times: dict = {key: [] for key in keys}
    for round_ in range(repeats):
        shift = round_ % len(keys)
        for key in keys[shift:] + keys[:shift]:
            start = time.perf_counter()
            jobs[key]()
            synchronize(device)
            times[key].append(time.perf_counter() - start)
    return {key: statistics.median(values) for key, values in times.items()}


def median_seconds_of(run: Callable[[], object], repeats: int, device) -> float:
    """:func:`median_seconds` of one job."""
    return median_seconds({"run": run}, repeats, device)["run"]
