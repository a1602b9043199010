"""Comparing paths on a shared machine: run them in turn, round after round (A B A B ...), so that
load from other jobs falls on all of them alike, and report the median of the per-round ratios
with its range (a single best-of-n does not hold here: RESULTS.md's 1.19x and 1.05x over the peers
read 1.0x and 0.75x in four later runs)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def interleaved(
    paths: dict[str, Callable[[], object]], rounds: int, sync: Callable[[], None] = lambda: None, warmup: bool = True
) -> dict[str, list[float]]:
    """Each path's wall time in every round, the paths taking turns within a round; one untimed
    call of each first (`warmup`: caches, lazy builds, kernel compilation)."""
    if warmup:
        for fn in paths.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in paths}
    for _ in range(rounds):
        for name, fn in paths.items():
            sync()
            start = time.perf_counter()
            fn()
            sync()
            times[name].append(time.perf_counter() - start)
    return times


def ratio(times: dict[str, list[float]], slow: str, fast: str) -> tuple[float, float, float]:
    """(median, lowest, highest) of the per-round ratios slow / fast: above 1, `fast` is faster."""
    per_round = sorted(a / b for a, b in zip(times[slow], times[fast]))
    return statistics.median(per_round), per_round[0], per_round[-1]


def ratio_text(times: dict[str, list[float]], slow: str, fast: str) -> str:
    median, low, high = ratio(times, slow, fast)
    return f"{median:.2f}x ({low:.2f}-{high:.2f})"


def median_s(times: dict[str, list[float]], name: str) -> float:
    return statistics.median(times[name])
