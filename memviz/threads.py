"""How many torch threads a run may ask for: a positive count, at most `PER_CORE` a core. Past the
cores threads only wait on each other, and past a few thousand torch's OpenMP crashes the process."""

from __future__ import annotations

import os

PER_CORE = 8


def check_threads(threads: object, what: str = "threads") -> int:
    """`threads` if it is a whole number from 1 to PER_CORE x this machine's cores; ValueError naming `what`."""
    most = PER_CORE * (os.cpu_count() or 1)
    if not isinstance(threads, int) or isinstance(threads, bool) or not 1 <= threads <= most:
        raise ValueError(f"{what} must be a whole number from 1 to {most} ({PER_CORE} a core), got {threads!r}")
    return threads


def thread_count(text: str) -> int:
    """An argparse `type` for a --threads option: `check_threads` of the number, an argparse error naming it."""
    import argparse

    try:
        return check_threads(int(text) if text.strip().lstrip("+-").isdigit() else text, "--threads")
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix("--threads ")) from exc
