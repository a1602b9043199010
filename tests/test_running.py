"""What every model runs on (memviz.running): generate, a forward, a stream, hooks and needle spans refuse
arguments they cannot take, naming them, before the work."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import memviz
from tests.conftest import small_model


@pytest.mark.parametrize("which", ["byte", "bpe"])
@pytest.mark.parametrize(
    "prompt, error, named",
    [
        (None, TypeError, "prompt must be a str, got NoneType"),
        (b"hello", TypeError, "prompt must be a str, got bytes: decode it first"),
        ("a\ud800b", ValueError, r"lone surrogate \(U\+D800\) at character 1"),
    ],
)
def test_generate_names_a_prompt_that_is_not_text(which, prompt, error, named, request):
    model = request.getfixturevalue("bpe_model") if which == "bpe" else small_model("sliding_window", window=8)
    with pytest.raises(error, match=named):
        model.generate(prompt, max_new_tokens=2)


def test_generate_refuses_a_prompt_over_its_limit_before_tokenizing_it(monkeypatch):
    import memviz.running as running

    monkeypatch.setattr(running, "MAX_PROMPT_TOKENS", 100)
    with pytest.raises(ValueError, match="prompt has 400 tokens \\(one a UTF-8 byte\\), over the prompt limit of 100"):
        small_model("sliding_window", window=8).generate("\N{GRINNING FACE}" * 100)


@pytest.mark.parametrize(
    "family, memory",
    [("sliding_window", {}), ("longmem", {"chunk_size": 4, "topk_chunks": 3, "bank_size": 16, "side_layers": 2})],
)
def test_generate_refuses_a_progress_that_cannot_be_called_before_it_reads(family, memory):
    model = small_model(family, window=8, segment_len=8, memory=memory) if memory else small_model(family, window=8)
    with pytest.raises(TypeError, match="progress is called with .* got 5"):
        model.generate("a prompt long enough to pass the longmem side network's reach" * 3, progress=5)
    if memory:  # the backbone's pass alone, as training's bank of distractors runs it
        with pytest.raises(TypeError, match="progress is called with .* got 5"):
            model.backbone_prefill(list(range(40)), progress=5)


def test_generate_decodes_nothing_from_non_finite_logits():
    model = small_model("infini", segment_len=8)
    with torch.no_grad():
        model.blocks[1].mlp.W_down.weight[0, 0] = float("nan")  # the state and logits become NaN from the first token
    with pytest.raises(memviz.NonFiniteError, match=r"logits at the prompt's last token \(position 9\) are not finite"):
        model.generate("0123456789", max_new_tokens=4)


@pytest.mark.parametrize("family", ["infini", "lm2", "longmem", "gated_deltanet"])
def test_needle_hold_refuses_a_span_outside_the_input(family):
    from tests.conftest import FAMILY_CONFIGS, small_model

    model = small_model(family, **FAMILY_CONFIGS[family])
    ids = list(range(40))
    model.needle_hold(ids, (np.int64(3), 8))  # NumPy's integers are whole numbers too
    for span in [(10, 2), (-5, -1), (5, 10**6), (1.5, 3), (4, 4), 7]:
        with pytest.raises(ValueError, match=r"span .* inside the input's 40 tokens"):
            model.needle_hold(ids, span)


@pytest.mark.parametrize("chunk_len", [0, -4, 2.5, True])
def test_chunk_len_zero_or_nonsense_is_refused_not_taken_for_the_default(chunk_len):
    model = small_model("infini", segment_len=8)
    with pytest.raises(ValueError, match="chunk_len must be a positive number of tokens"):
        memviz.trace(model, "some text to trace", chunk_len=chunk_len)


CALL_CASES = {
    "trace with answer ids outside the vocabulary": (
        lambda m: memviz.trace(m, "hi", answer=[99_999]),
        ValueError,
        "99999",
    ),
    "trace of unknown hooks": (
        lambda m: memviz.trace(m, "hello", names=["blocks.9.hook_nothing"]),
        KeyError,
        "blocks.9.hook_nothing",
    ),
    "generate a negative count": (lambda m: m.generate("hi", max_new_tokens=-1), ValueError, "max_new_tokens"),
    "generate a trillion tokens": (lambda m: m.generate("hi", max_new_tokens=10**12), ValueError, "max_new_tokens"),
    "token ids outside the vocabulary": (
        lambda m: m(torch.tensor([[0, 999]])),
        ValueError,
        r"token ids must lie in \[0, 259\), got range \[0, 999\]",
    ),
    "a state that is no state": (lambda m: next(m.stream([1, 2, 3], 2, state="abc")), TypeError, "got str"),
    "another family's state": (
        lambda m: next(m.stream([1, 2, 3], 2, state=small_model("lm2", window=8).init_state())),
        ValueError,
        "the state was made by a model of lm2, and this model is of sliding_window",
    ),
    "a cache of a hook the model lacks": (
        lambda m: m.run_with_cache("hello", names_filter=["blocks.0.hook_resid_pots"]),
        KeyError,
        r"unknown hook names \['blocks.0.hook_resid_pots'\]; the nearest are \['blocks.0.hook_resid_post'",
    ),
    "a hook on a name the model lacks": (
        lambda m: m.run_with_hooks("hello", fwd_hooks=[("nope", lambda value, hook: value)]),
        KeyError,
        r"unknown hook names \['nope'\]",
    ),
}


@pytest.mark.parametrize("case", sorted(CALL_CASES))
def test_a_bad_call_is_one_error_naming_the_argument(case, model):
    call, error, named = CALL_CASES[case]
    with pytest.raises(error, match=named):
        call(model)
