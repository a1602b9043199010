"""Giving a long stream's freed memory back to the system.

glibc serves a stream's activations from its heap once a large block has been freed (its mmap
threshold then rises), and the small arrays a stream keeps (a trace's reduced hooks, a bank's
growth) sit between them, so freed pages stay resident: a 131k-token LongMem trace peaked at
1.5 GB, 1.0 GB with the free pages given back every 16k tokens, in the same time.
`malloc_trim(0)` returns every free page of the heap; off glibc this does nothing.
"""
from __future__ import annotations

import ctypes

RELEASE_EVERY = 1 << 14  # tokens between two releases in a stream


def _malloc_trim():
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _malloc_trim()


def release_free_heap() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def release_between(start: int, stop: int) -> None:
    """After a stream's tokens [start, stop): give the free heap back if they crossed a multiple of RELEASE_EVERY."""
    if start // RELEASE_EVERY != stop // RELEASE_EVERY:
        release_free_heap()
