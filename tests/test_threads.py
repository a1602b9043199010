"""One model object runs one input at a time (memviz.threads): a second thread's run gets ModelBusyError or the
answer it gets alone, never another's hooks; the same thread may nest its runs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import memviz
from memviz import ModelBusyError
from tests.conftest import small_model


def run_in_threads(*jobs):
    """Run each job on its own thread, started together; what each returned or raised, in order."""
    results: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def work(i, job):
        start.wait()
        try:
            results[i] = job()
        except Exception as exc:  # noqa: BLE001 - the test sorts what came back
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def slow_zero(value, hook):
    time.sleep(0.01)  # keeps the hooks on long enough for the other thread to run into them
    return torch.zeros_like(value)


def test_a_second_thread_gets_the_same_answer_or_one_refusal_never_another_runs_hooks():
    model = small_model("sliding_window", window=8)
    tokens = torch.arange(1, 40)[None]
    plain_alone = model(tokens)
    hooked_alone = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", slow_zero)])
    assert not torch.equal(plain_alone, hooked_alone)

    def repeatedly(run, times):
        def runs():
            outcomes = []
            for _ in range(times):
                try:
                    outcomes.append(run())
                except ModelBusyError as exc:
                    outcomes.append(exc)
                time.sleep(0.001)
            return outcomes

        return runs

    hooked, plain = run_in_threads(
        repeatedly(lambda: model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", slow_zero)]), 10),
        repeatedly(lambda: model(tokens), 60),
    )
    refusals = [o for o in hooked + plain if isinstance(o, ModelBusyError)]
    assert all(torch.equal(o, hooked_alone) for o in hooked if not isinstance(o, ModelBusyError))
    assert all(torch.equal(o, plain_alone) for o in plain if not isinstance(o, ModelBusyError))
    assert refusals, "the two threads' runs never met; the test proves nothing"
    assert any("a hooked run" in str(r) for r in refusals)
    assert all(str(r).startswith("this sliding_window model is already running") and "copy" in str(r) for r in refusals)


def test_two_threads_tracing_one_model_each_get_their_own_trace_or_a_refusal():
    """The first thread's trace is held inside its forward until the second has tried: the second is
    refused, and the first's trace is the one it gets alone."""
    model = small_model("infini", segment_len=8)
    text = "the quick brown fox jumps over the lazy dog " * 4
    alone = memviz.trace(model, text)
    inside, tried = threading.Event(), threading.Event()
    first = []

    def hold(value, hook):
        if threading.current_thread() is first[0]:
            inside.set()
            tried.wait(30)

    def second():
        assert inside.wait(30), "the first trace never started"
        try:
            return memviz.trace(model, text)
        finally:
            tried.set()

    model.add_hook("blocks.0.hook_resid_post", hold)
    try:
        first_result, second_result = run_in_threads(
            lambda: (first.append(threading.current_thread()), memviz.trace(model, text))[1], second
        )
    finally:
        model.reset_hooks(including_permanent=True)
    assert isinstance(second_result, ModelBusyError), second_result
    assert isinstance(first_result, memviz.Trace), first_result
    for name in alone.names:
        np.testing.assert_array_equal(first_result[name], alone[name])


def test_the_same_thread_may_nest_runs_and_the_model_is_free_after_an_error():
    model = small_model("sliding_window", window=8)
    with model.evaluating(), model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda v, hook: v)]):
        model(torch.arange(1, 5)[None])
    with pytest.raises(ValueError):
        with model.evaluating():
            model(torch.tensor([[10**6]]))
    assert run_in_threads(lambda: model(torch.arange(1, 5)[None]).shape)[0] == (1, 4, 259)
