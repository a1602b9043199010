"""How long a model's runs take on this machine, measured on a short input: what the app says a long input will
take before it runs, beside what the run holds in memory (`MemoryModel.cost`)."""

from __future__ import annotations

import time
from collections.abc import Callable

from memviz.protocol import MemoryModel
from memviz.registry import holds_needle, reads_out
from memviz.tracing import trace

#: tokens a measurement runs over: long enough to span a few segments, short enough to take a second or two
MEASURED_TOKENS = 1024


def measured_ids(model: MemoryModel, n_tokens: int = MEASURED_TOKENS) -> list[int]:
    return [i % min(256, model.cfg.vocab_size) for i in range(n_tokens)]


def trace_tokens_per_second(model: MemoryModel) -> float:
    """Tokens a second of `memviz.trace` with the family's default hooks."""
    began = time.perf_counter()
    trace(model, measured_ids(model))
    return MEASURED_TOKENS / (time.perf_counter() - began)


def view_seconds_per_token(model: MemoryModel) -> dict[str, float]:
    """Seconds a token of each view drawn after a trace, where the family has it and the model gives it: the needle
    hold (inputs with evidence) and the read-out."""
    ids = measured_ids(model)
    views: dict[str, Callable[[], object]] = {}
    if (holder := holds_needle(model)) is not None:
        views["needle hold"] = lambda: holder.needle_hold(ids, (256, 272))
    if (reader := reads_out(model)) is not None:
        views["read-out"] = lambda: reader.memory_readout(ids, len(ids) - 1)
    seconds = {}
    for name, view in views.items():
        began = time.perf_counter()
        if view() is not None:
            seconds[name] = (time.perf_counter() - began) / len(ids)
    return seconds
