"""Interventions: edits touch the memory only, at the right position, and change what they should."""

import numpy as np
import pytest
import torch

from memviz.interventions import ablate_at, ablation_sweep, answer_logprob, replace_at
from memviz.protocol import ModelState
from memviz.state import field_names, memory_fields, tensors_of
from tests.conftest import scrambled, small_model

SEG = 8


def infini():
    return scrambled(small_model("infini", segment_len=SEG), std=0.2)


def test_answer_logprob_matches_a_plain_forward():
    model = infini()
    prompt, answer = "abcdefghijklmnopqrstuvwxyz", "XYZ"
    ids = model.tokenizer.encode(prompt + answer)
    logp = torch.log_softmax(model(ids)[0], -1)
    expected = sum(logp[25 + i, ids[26 + i]].item() for i in range(3))
    assert answer_logprob(model, prompt, answer)["logprob"] == pytest.approx(expected, abs=1e-4)


def test_ablation_resets_memory_but_keeps_the_local_cache():
    model = infini()
    prompt, answer = "the pass key is 12345. " * 3, "12345"
    clean = answer_logprob(model, prompt, answer)
    late = answer_logprob(model, prompt, answer, [ablate_at(model, 7)])  # after every memory write so far
    assert late["logprob"] != pytest.approx(clean["logprob"], abs=1e-4)
    # ablating at segment 0 (before anything) changes nothing
    assert answer_logprob(model, prompt, answer, [ablate_at(model, 0)])["logprob"] == pytest.approx(
        clean["logprob"], abs=1e-6
    )
    # the sliding-window baseline has no memory to reset: one clear error, not a silent no-op
    with pytest.raises(ValueError, match="carries no memory state"):
        ablate_at(small_model("sliding_window", window=SEG), 4)


def test_replacing_memory_with_its_own_run_is_a_no_op_and_a_donor_changes_it():
    model = infini()
    prompt, answer = "Mary went to the kitchen. John went to the garden. Where is Mary?", "kitchen"
    clean = answer_logprob(model, prompt, answer)["logprob"]
    same = answer_logprob(model, prompt, answer, [replace_at(model, 4, prompt)])["logprob"]
    assert same == pytest.approx(clean, abs=1e-5)
    donor = "Sandra moved to the office. Daniel went back to the hallway. " * 2
    other = answer_logprob(model, prompt, answer, [replace_at(model, 4, donor)])["logprob"]
    assert other != pytest.approx(clean, abs=1e-4)
    with pytest.raises(ValueError, match="donor text has"):
        replace_at(model, 40, "short")
    assert ablate_at(model, np.int64(4))[0] == ablate_at(model, 4)[0] == 4 * SEG  # a DataFrame's segment number
    for bad in (-1, 1.5, True):
        for edit in (lambda: ablate_at(model, bad), lambda: replace_at(model, bad, donor)):
            with pytest.raises(ValueError, match=f"segment must be a whole number >= 0, got {bad!r}"):
                edit()
    n = len(model.tokenizer.encode(prompt))
    with pytest.raises(ValueError, match=f"an edit at token {n // SEG * SEG + SEG} lies past the prompt's {n} tokens"):
        answer_logprob(model, prompt, answer, [ablate_at(model, n // SEG + 1)])


def test_sweep_covers_every_segment_boundary_and_equals_each_ablation_run_alone():
    """The sweep reuses one clean pass and runs only each suffix, so it must give what a whole
    run with `ablate_at` gives at each boundary; past `points` boundaries it keeps evenly spaced
    ones from the first to the last; progress counts tokens up to the total."""
    model = infini()
    prompt = "Mary went to the kitchen. John took the apple there. " * 2
    n_prompt = len(model.tokenizer.encode(prompt))
    n_boundaries = -(-n_prompt // SEG) - 1
    calls = []
    rows = ablation_sweep(model, prompt, " apple", progress=lambda done, total: calls.append((done, total)))
    assert [r.segment for r in rows] == list(range(1, n_boundaries + 1)) and [r.position for r in rows] == [
        SEG * s for s in range(1, n_boundaries + 1)
    ]
    clean = answer_logprob(model, prompt, " apple")["logprob"]
    for r in rows:
        alone = answer_logprob(model, prompt, " apple", [ablate_at(model, r.segment)])
        assert r.logprob == pytest.approx(alone["logprob"], abs=1e-5) and r.greedy == alone["greedy"]
        assert r.delta == pytest.approx(alone["logprob"] - clean, abs=1e-5)
    assert len({round(r.delta, 4) for r in rows}) > 1  # the resets do differ
    assert calls[-1][0] == calls[-1][1] and [d for d, _ in calls] == sorted(d for d, _ in calls)
    few = ablation_sweep(model, prompt, " apple", points=3)
    assert [r.segment for r in few] == [1, round((1 + n_boundaries) / 2), n_boundaries]
    assert [(r.segment, r.delta) for r in few] == [
        (r.segment, r.delta) for r in rows if r.segment in {f.segment for f in few}
    ]
    with pytest.raises(ValueError, match="points must be a positive"):
        ablation_sweep(model, prompt, " apple", points=0)


def test_topk_ablation_zeroes_a_memory_layers_read():
    model = scrambled(
        small_model("memory_layer", window=8, memory={"n_keys": 8, "topk": 4, "heads": 2, "d_key": 8, "layers": [1]}),
        std=0.2,
    )
    ids = torch.arange(20)[None]
    with model.hooks(fwd_hooks=model.silence_hooks(1)):
        _, ablated = model.run_with_cache(ids)
    assert ablated["blocks.1.mlp.hook_read"].abs().max() == 0
    _, clean = model.run_with_cache(ids)
    target = int(clean["blocks.1.mlp.hook_topk_indices"][0, 0, 0, 0])
    with model.hooks(fwd_hooks=model.silence_hooks(1, [target])):
        _, partial = model.run_with_cache(ids)
    w = partial["blocks.1.mlp.hook_topk_weights"]
    hit = partial["blocks.1.mlp.hook_topk_indices"] == target
    assert hit.any() and w[hit].abs().max() == 0 and w[~hit].abs().min() > 0
    assert answer_logprob(model, "abcdef", "g", fwd_hooks=model.silence_hooks(1))["logprob"] != pytest.approx(
        answer_logprob(model, "abcdef", "g")["logprob"], abs=1e-5
    )
    with pytest.raises(ValueError, match=r"layer 0 has no memory layer; the memory layers are \[1\]"):
        model.silence_hooks(0)
    with pytest.raises(ValueError, match=r"it offers \['silence'\]"):  # parametric: nothing to reset
        ablate_at(model, 1)


STATEFUL = [
    ("infini", {"segment_len": SEG}),
    ("titans", {"segment_len": 8, "memory": {"variant": "mac"}}),
    ("lm2", {"window": 8, "segment_len": 8, "memory": {"slots": 4, "update": "slots"}}),
    ("longmem", {"window": 8, "segment_len": 8, "memory": {"chunk_size": 4, "topk_chunks": 2, "bank_size": 16}}),
]


def memory_and_kept(part, memory: list, kept: list) -> None:
    """Sort a state's parts into the `Memory` fields (whole) and every other leaf (caches), in order."""
    names = field_names(part)
    if names:
        marked = memory_fields(type(part))
        for name in names:
            (memory.append if name in marked else lambda p: memory_and_kept(p, memory, kept))(getattr(part, name))
    elif isinstance(part, (list, tuple)):
        for p in part:
            memory_and_kept(p, memory, kept)
    elif isinstance(part, dict):
        for p in part.values():
            memory_and_kept(p, memory, kept)
    elif part is not None:
        kept.append(part)


def parts_of(state: ModelState) -> tuple[list, list]:
    memory: list = []
    kept: list = []
    memory_and_kept([state.layers, state.shared], memory, kept)
    return memory, kept


@pytest.mark.parametrize("family, config", STATEFUL)
def test_an_edit_swaps_every_memory_field_whole_and_keeps_every_cache_object(family, config):
    """On a state mid-prompt, ablation puts in init_state's memory and a patch the donor run's, each
    field the very object; the local caches stay the state's own objects, and the position too."""
    model = scrambled(small_model(family, **config), std=0.2)
    ids = model.tokenizer.encode("the pass key is 12345. " * 3)
    _, state = model(ids[:20], state=model.init_state(1), return_state=True)
    memory, kept = parts_of(state)
    assert memory and kept  # both kinds exist, so each assertion below can fail
    donor = "Sandra moved to the office. " * 3
    _, donor_state = model(model.tokenizer.encode(donor)[: 2 * 8], state=model.init_state(1), return_state=True)
    for edit, expected in (
        (ablate_at(model, 2)[1], model.init_state(1)),
        (replace_at(model, 2, donor)[1], donor_state),
    ):
        edited = edit(state)
        edited_memory, edited_kept = parts_of(edited)
        assert edited.pos == state.pos
        assert len(edited_kept) == len(kept) and all(a is b for a, b in zip(edited_kept, kept))
        assert not any(a is b for a, b in zip(edited_memory, memory) if a is not None)
        for a, b in zip(edited_memory, parts_of(expected)[0], strict=True):
            assert type(a) is type(b)
            for x, y in zip(tensors_of(a), tensors_of(b), strict=True):
                torch.testing.assert_close(x, y, rtol=0, atol=1e-6)


@pytest.mark.parametrize("family, config", STATEFUL[1:])
def test_every_stateful_family_resets_and_patches(family, config):
    """A reset before anything was written and a patch with the model's own text change nothing;
    a late reset does (Titans' fresh weights are held as None, LongMem's bank in the shared state)."""
    model = scrambled(small_model(family, **config), std=0.2)
    prompt, answer = "the pass key is 12345. " * 3, "12345"
    clean = answer_logprob(model, prompt, answer)["logprob"]
    assert answer_logprob(model, prompt, answer, [ablate_at(model, 0)])["logprob"] == pytest.approx(clean, abs=1e-6)
    assert answer_logprob(model, prompt, answer, [replace_at(model, 8, prompt)])["logprob"] == pytest.approx(
        clean, abs=1e-5
    )
    assert answer_logprob(model, prompt, answer, [ablate_at(model, 8)])["logprob"] != pytest.approx(clean, abs=1e-4)
