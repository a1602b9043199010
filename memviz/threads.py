"""Threads: how many torch threads a run may ask for, and which thread a model object belongs to while it runs.

A count is positive and at most `PER_CORE` a core: past the cores threads only wait on each other, and past a few
thousand torch's OpenMP crashes the process. A model object runs one input at a time (`running_alone`).
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from memviz.protocol import MemoryModel

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


class ModelBusyError(RuntimeError):
    """A thread asked a model object to run (a forward, a trace, a hooked run) while another thread's run of the
    same object was under way: hooks and train/eval mode belong to the object, so the two would mix."""


_run_owners: weakref.WeakKeyDictionary[MemoryModel, list] = (
    weakref.WeakKeyDictionary()
)  # model -> [thread, what, depth]
_run_owners_lock = threading.Lock()


def model_label(model: MemoryModel) -> str:
    """What a message calls a model: by its config's or card's name, else by its family or class."""
    name = model.cfg.name or model.card.get("name")
    return f"model {name!r}" if name else f"this {model.family or type(model).__name__} model"


@contextmanager
def running_alone(model: MemoryModel, what: str) -> Iterator[None]:
    """Hold `model` for the calling thread for the block; the same thread may enter again (a trace's forwards),
    another thread is refused with ModelBusyError naming the model and what holds it, instead of seeing this
    run's hooks or mode (or this run seeing its)."""
    me = threading.current_thread()
    with _run_owners_lock:
        owner = _run_owners.get(model)
        if owner is not None and owner[0] is not me:
            raise ModelBusyError(
                f"{model_label(model)} is already running {owner[1]} in thread {owner[0].name!r}; one model object "
                f"runs one input at a time (its hooks and train/eval mode are shared), so {what} here was refused: "
                "wait for that run, or give this thread its own copy (memviz.load again, or copy.deepcopy(model))"
            )
        if owner is None:
            owner = _run_owners[model] = [me, what, 0]
        owner[2] += 1
    try:
        yield
    finally:
        with _run_owners_lock:
            owner[2] -= 1
            if owner[2] == 0:
                _run_owners.pop(model, None)
