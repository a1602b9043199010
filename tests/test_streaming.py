"""A streamed run carries the state from chunk to chunk and must equal a one-pass run."""

import pytest
import torch

from tests.conftest import random_ids, scrambled, small_model

BASELINES = [("transformer", {}), ("sliding_window", {"window": 12})]


def streamed_logits(model, ids, chunk_len):
    return torch.cat([logits for _, logits, _ in model.stream(ids, chunk_len)], dim=1)


@pytest.mark.parametrize("family, extra", BASELINES)
@pytest.mark.parametrize("chunk_len", [1, 7, 16])
def test_streamed_run_equals_one_pass(family, extra, chunk_len):
    """In float64, so the tolerance catches a wrong cache, not float32's matrix-vector rounding."""
    model = scrambled(small_model(family, **extra)).double()
    ids = random_ids(64)
    with torch.no_grad():
        one_pass = model(ids)
        streamed = streamed_logits(model, ids, chunk_len)
    assert streamed.shape == one_pass.shape and 64 // chunk_len >= 4
    torch.testing.assert_close(streamed, one_pass, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("family, extra", BASELINES)
def test_dropping_the_state_changes_the_logits(family, extra):
    """The equality above is not vacuous: forgetting the carried cache changes the answer."""
    model = scrambled(small_model(family, **extra))
    ids = random_ids(48)
    with torch.no_grad():
        one_pass = model(ids)
        stateless = torch.cat([model(ids[:, s : s + 8]) for s in range(0, 48, 8)], dim=1)
    assert (stateless[:, 8:] - one_pass[:, 8:]).abs().max() > 1e-2


def test_sliding_window_state_is_bounded_and_full_attention_grows():
    window = small_model("sliding_window", window=12)
    full = small_model("transformer")
    ids = random_ids(200)
    sizes = {}
    for name, model in (("window", window), ("full", full)):
        sizes[name] = [state.nbytes() for _, _, state in model.stream(ids, 20)]
    assert len(set(sizes["window"][1:])) == 1  # constant once the window is full
    assert sizes["full"] == sorted(sizes["full"]) and sizes["full"][-1] == 10 * sizes["full"][0]


def test_sliding_window_masks_beyond_the_window():
    """A token more than `window` back has no effect at depth 1 (one layer)."""
    model = scrambled(small_model("sliding_window", window=5, n_layers=1))
    ids = random_ids(20)
    changed = ids.clone()
    changed[0, 3] = (changed[0, 3] + 1) % 256
    with torch.no_grad():
        a, b = model(ids), model(changed)
    diff = (a - b).abs().amax(-1)[0]
    assert diff[3:8].min() > 1e-3  # positions 3..7 see position 3
    assert diff[8:].max() == 0  # position 8 and later do not
    assert diff[:3].max() == 0


def test_generate_is_greedy_and_streams_long_prompts():
    model = scrambled(small_model("sliding_window", window=16))
    prompt = "The pass key is 12345. " * 60  # > one 1024-token chunk
    out = model.generate(prompt, max_new_tokens=5)
    ids = model.tokenizer.encode(prompt)
    with torch.no_grad():
        expected = []
        for _ in range(5):
            logits = model(ids + expected)[0, -1]
            logits[[model.tokenizer.pad_id, model.tokenizer.bos_id]] = -float("inf")
            nxt = int(logits.argmax())
            if nxt == model.tokenizer.eos_id:
                break
            expected.append(nxt)
    assert out == model.tokenizer.decode(expected)
    with pytest.raises(ValueError, match="empty prompt"):
        model.generate("", 3)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate("hi", -1)


def test_bad_token_input_is_rejected():
    model = small_model()
    with pytest.raises(ValueError, match="token ids must lie in"):
        model(torch.tensor([[1, 999]]))
    with pytest.raises(ValueError, match="empty input"):
        model(torch.zeros(1, 0, dtype=torch.long))
    with pytest.raises(ValueError, match="integer ids"):
        model(torch.zeros(1, 3))


@pytest.mark.parametrize(
    "family, extra, run, every, n",
    [
        ("sliding_window", {"window": 12}, lambda model, ids: list(model.stream(ids, 16)), 64, 200),
        (
            "longmem",
            {"window": 8, "segment_len": 8, "memory": {"chunk_size": 4, "bank_size": 64}},
            lambda model, ids: model.backbone_prefill(ids),
            1024,
            3500,
        ),  # chunks of 1,024 tokens
    ],
)
def test_a_long_stream_gives_its_free_heap_back_at_every_multiple_of_the_interval(
    family, extra, run, every, n, monkeypatch
):
    from memviz import heap

    releases = []
    monkeypatch.setattr(heap, "RELEASE_EVERY", every)
    monkeypatch.setattr(heap, "release_free_heap", lambda: releases.append(1))
    with torch.no_grad():
        run(small_model(family, **extra), random_ids(n))
    assert len(releases) == 3  # after 1, 2 and 3 intervals
