"""Issue 48's reliability cases: two threads on one model, one run per output folder, non-finite values named
in traces, limits checked before the work, and values validated where they enter. Each refusal is one error
whose message names the field or the file."""
from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

import memviz
from memviz.model import ModelBusyError
from tests.conftest import small_model


# ----- two threads on one model object ------------------------------------------------------------
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
        repeatedly(lambda: model(tokens), 60))
    refusals = [o for o in hooked + plain if isinstance(o, ModelBusyError)]
    assert all(torch.equal(o, hooked_alone) for o in hooked if not isinstance(o, ModelBusyError))
    assert all(torch.equal(o, plain_alone) for o in plain if not isinstance(o, ModelBusyError))
    assert refusals, "the two threads' runs never met; the test proves nothing"
    assert any("a hooked run" in str(r) for r in refusals)
    assert all(str(r).startswith("this sliding_window model is already running") and "copy" in str(r) for r in refusals)


def test_two_threads_tracing_one_model_each_get_their_own_trace_or_a_refusal():
    model = small_model("infini", segment_len=8)
    text = "the quick brown fox jumps over the lazy dog " * 4
    alone = memviz.trace(model, text)
    results = run_in_threads(lambda: memviz.trace(model, text), lambda: memviz.trace(model, text))
    assert any(isinstance(r, memviz.Trace) for r in results)
    for result in results:
        if isinstance(result, Exception):
            assert isinstance(result, ModelBusyError), result
            continue
        for name in alone.names:
            np.testing.assert_array_equal(result[name], alone[name])


def test_the_same_thread_may_nest_runs_and_the_model_is_free_after_an_error():
    model = small_model("sliding_window", window=8)
    with model.evaluating(), model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda v, hook: v)]):
        model(torch.arange(1, 5)[None])
    with pytest.raises(ValueError):
        with model.evaluating():
            model(torch.tensor([[10**6]]))
    assert run_in_threads(lambda: model(torch.arange(1, 5)[None]).shape)[0] == (1, 4, 259)
