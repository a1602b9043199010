"""LongMem's chunk bank lives in its family's folder (`memviz.models.longmem.bank`); this module keeps
the import path `memviz.bank` working for code written against it."""

from memviz.models.longmem.bank import (  # noqa: F401  (re-exported)
    CANDIDATES_PER_QUERY,
    EXACT_SCORES,
    SEARCHES,
    ChunkBank,
    blocked_topk,
)
