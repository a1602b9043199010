"""Sessions sharing one cached checkpoint, hammered at once from threads as a served app's
sessions would: each runs the app's own per-session copy (`app.common.session_copy`) and gets
exactly what it gets alone, while others trace, silence its memory layer and run probes."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

import memviz
from app import common
from memviz import interventions
from memviz_probes import passkey
from tests.conftest import scrambled, small_model

ROUNDS = 100
TEXT = "Mary went to the office. John took the apple there. " * 4
PROMPT, ANSWER = "The pass key is 31415. Remember it. What is the pass key? The pass key is", " 31415"


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    model = scrambled(
        small_model("memory_layer", window=8, memory={"n_keys": 8, "topk": 4, "heads": 2, "d_key": 8, "layers": [1]})
    )
    path = str(memviz.save(model, tmp_path_factory.mktemp("shared") / "memory_layer"))
    return path, common.weights_stamp(path)


def trace_job(model):
    return memviz.trace(model, TEXT, names=["blocks.1.mlp.hook_topk_indices", "blocks.1.mlp.hook_topk_weights"])


def silence_job(model):
    return interventions.answer_logprob(model, PROMPT, ANSWER, fwd_hooks=model.silence_hooks(1))


def clean_job(model):
    return interventions.answer_logprob(model, PROMPT, ANSWER)


def probe_job(model):
    return passkey.run(model, lengths=[256], depths=[0.5], n=1, seed=0)[["answer", "prediction", "correct"]]


JOBS = {"trace": trace_job, "silence": silence_job, "clean": clean_job, "probe": probe_job}


def same(a, b) -> bool:
    if isinstance(a, memviz.Trace):
        return a.names == b.names and all(np.array_equal(a[n], b[n], equal_nan=a[n].dtype.kind == "f") for n in a.names)
    if hasattr(a, "equals"):
        return a.equals(b)
    return a == b


def test_sessions_hammering_one_checkpoint_get_what_they_get_alone(checkpoint):
    alone = {name: job(common.session_copy(*checkpoint)) for name, job in JOBS.items()}
    assert alone["silence"]["logprob"] != alone["clean"]["logprob"]  # the silencing hooks do change a run
    sessions = [common.session_copy(*checkpoint) for _ in range(2 * len(JOBS))]
    work = [(name, session) for name, session in zip(list(JOBS) * 2, sessions)]
    with ThreadPoolExecutor(len(work)) as pool:
        for round_ in range(ROUNDS):
            results = list(pool.map(lambda item: (item[0], JOBS[item[0]](item[1])), work))
            differ = [name for name, result in results if not same(result, alone[name])]
            assert not differ, f"round {round_}: {differ} differ from the same runs alone"
    assert all(
        not model.hook_dict[name].fwd_hooks for model in sessions for name in model.hook_dict
    )  # none left behind
