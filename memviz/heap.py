"""The process's memory: what it can still allocate (`allocatable_bytes`, checked before a model is built), giving a
long stream's freed memory back to the system, and keeping a training run's.

glibc serves a stream's activations from its heap once a large block has been freed (its mmap
threshold then rises), and small arrays a stream keeps (a bank's growth; a trace keeps each hook
in one growing buffer, `trace.Rows`, for this reason) sit between them, so freed pages stay
resident until `malloc_trim(0)` returns every free page of the heap; off glibc this does nothing.

A training step is the opposite case: it frees and re-allocates the same activations (logits,
their log-softmax, gradients) every step, and each page glibc gave back costs a page fault when
it is touched again. `keep_freed_pages` has glibc serve every block from the heap (no mmap,
whose blocks go back to the system when freed) and stop trimming the heap's top, so a step
reuses the last one's pages (speed and peak memory in benchmarks/RESULTS.md).
"""

from __future__ import annotations

import ctypes

RELEASE_EVERY = 1 << 14  # tokens between two releases in a stream


def _glibc(name: str):
    try:
        return getattr(ctypes.CDLL("libc.so.6"), name)
    except (OSError, AttributeError):  # not glibc
        return None


_MALLOC_TRIM = _glibc("malloc_trim")
_MALLOPT = _glibc("mallopt")
M_TRIM_THRESHOLD, M_MMAP_MAX = -1, -4  # mallopt's parameters (malloc.h)
TRIM_THRESHOLD = 1 << 30  # free bytes at the heap's top before glibc gives them back


def release_free_heap() -> None:
    if _MALLOC_TRIM is not None:
        _MALLOC_TRIM(0)


def keep_freed_pages() -> bool:
    """Make this process keep and reuse freed heap pages (module docstring); False off glibc.
    Process-wide and for good: a `training.Trainer` calls it; streams still give pages
    back by `release_free_heap`, which works either way."""
    if _MALLOPT is None:
        return False
    return bool(_MALLOPT(M_MMAP_MAX, 0)) and bool(_MALLOPT(M_TRIM_THRESHOLD, TRIM_THRESHOLD))


def release_between(start: int, stop: int) -> None:
    """After a stream's tokens [start, stop): give the free heap back if they crossed a multiple of RELEASE_EVERY."""
    if start // RELEASE_EVERY != stop // RELEASE_EVERY:
        release_free_heap()


def allocatable_bytes() -> int | None:
    """What this process can still allocate: the machine's available memory, or less under an address-space
    limit (ulimit -v); None where the system does not say."""
    import resource

    limits = []
    try:
        with open("/proc/meminfo") as fh:
            fields = dict(line.split(":", 1) for line in fh)
        limits.append(int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm") as fh:
                used = int(fh.read().split()[0]) * resource.getpagesize()
            limits.append(soft - used)
        except (OSError, ValueError):
            pass
    return min(limits) if limits else None
