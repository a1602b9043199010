"""LongMem (NeurIPS 2023): exhaustive retrieval, the FIFO bank, the frozen backbone, streaming."""

import pytest
import torch

import memviz
from memviz.config import ConfigError
from memviz.models.longmem import retrieve_chunks
from tests.conftest import random_ids, scrambled, small_model

OPTIONS = {"chunk_size": 4, "topk_chunks": 3, "bank_size": 16, "side_layers": 2}


def longmem(**options):
    return scrambled(small_model("longmem", window=8, segment_len=8, memory={**OPTIONS, **options}), std=0.2)


def test_retrieval_equals_exhaustive_topk_over_the_bank():
    g = torch.Generator().manual_seed(0)
    B, T, H, d, cs, C = 2, 5, 3, 4, 4, 9
    q = torch.randn(B, T, H, d, dtype=torch.float64, generator=g)
    bank = torch.randn(B, C * cs, H, d, dtype=torch.float64, generator=g)
    visible = torch.rand(T, C, generator=g) > 0.3
    scores, chunks = retrieve_chunks(q, bank, cs, 4, visible)
    for b in range(B):
        for t in range(T):
            for h in range(H):
                brute = []
                for c in range(C):
                    if visible[t, c]:
                        key = sum(bank[b, c * cs + i, h] for i in range(cs)) / cs
                        brute.append((float(q[b, t, h] @ key), c))
                brute.sort(reverse=True)
                n = min(4, len(brute))
                assert chunks[b, t, h, :n].tolist() == [c for _, c in brute[:n]]
                torch.testing.assert_close(
                    scores[b, t, h, :n], torch.tensor([s for s, _ in brute[:n]], dtype=torch.float64)
                )
                assert torch.isinf(scores[b, t, h, n:]).all()


def test_tokens_read_only_earlier_segments_within_the_fifo_bank():
    model = longmem()
    _, cache = model.run_with_cache(random_ids(48))
    positions = cache["side_blocks.1.attn.hook_retrieved_pos"][0]  # [pos, head, topk]
    for t in range(48):
        start = t - t % 8
        got = positions[t][positions[t] >= 0]
        assert ((got < start) & (got >= start - 16)).all(), (t, got)
        expected = min(3, min(start, 16) // 4)  # chunks available to read
        assert (positions[t] >= 0).sum(-1).eq(expected).all(), (t, positions[t])
    _, state = model(random_ids(48), return_state=True)
    bank = state.shared.bank
    assert bank.keys.shape[1] == 16 and bank.positions.tolist() == list(range(32, 48))


def test_memory_attention_is_gated_with_local_attention():
    model = longmem()
    _, cache = model.run_with_cache(random_ids(30))
    g = cache["side_blocks.1.attn.hook_gate"]
    torch.testing.assert_close(g[0, 0], torch.sigmoid(model.side_blocks[1].attn.gate))
    mixed = (
        g[..., None] * cache["side_blocks.1.attn.hook_mem_out"]
        + (1 - g[..., None]) * cache["side_blocks.1.attn.hook_local_out"]
    )
    torch.testing.assert_close(cache["side_blocks.1.attn.hook_z"], mixed)
    assert torch.equal(cache["side_blocks.1.attn.hook_mem_out"][:, :8], torch.zeros(1, 8, 2, 16))  # empty bank


@pytest.mark.parametrize("chunk_len", [1, 5, 13])
def test_streamed_run_equals_one_pass_and_state_is_bounded(chunk_len):
    model = longmem()
    ids = random_ids(70)
    with torch.no_grad():
        one_pass = model(ids)
        streamed = torch.cat([lg for _, lg, _ in model.stream(ids, chunk_len)], dim=1)
        sizes = [state.nbytes() for _, _, state in model.stream(ids[:, :64], 8)]
    torch.testing.assert_close(streamed, one_pass, atol=1e-5, rtol=1e-5)
    assert len(set(sizes[2:])) == 1  # bank full (16 tokens) from the third segment on


@pytest.mark.parametrize("search", ["exact", "hnsw"])
@pytest.mark.parametrize("length", [5, 16, 43, 70])
def test_prefill_runs_the_side_network_only_where_it_reaches_the_end_and_equals_a_stream(length, search):
    model = longmem(search=search, exact_below=1, recent_queries=6).double()
    ids = random_ids(length + 4, seed=length)
    seen, read = [], []
    with torch.no_grad():
        *_, (_, streamed, stream_state) = model.stream(ids[:, :length], 7)
        with model.hooks(fwd_hooks=[("side_blocks.0.hook_resid_pre", lambda x, hook: seen.append(x.shape[1]))]):
            last, state = model.prefill(ids[:, :length], progress=lambda *c: read.append(c))
        torch.testing.assert_close(last, streamed[:, -1:], atol=1e-12, rtol=0)
        # the state carries on as the stream's does: the bank, the backbone's and the side caches
        torch.testing.assert_close(
            model(ids[:, length:], state=state), model(ids[:, length:], state=stream_state), atol=1e-12, rtol=0
        )
    reach = 2 * 8 + (6 if search == "hnsw" else 0)  # side_layers x window (and the queries a query reads the finds of)
    assert sum(seen) == min(length, reach)
    # progress over the whole prompt (in one chunk of 1,024 tokens): the backbone's part, then the full model's
    assert read == [(head, length) for head in (length - reach,) if head > 0] + [(length, length)]
    if search == "hnsw":
        assert torch.equal(state.shared.recent, stream_state.shared.recent)
        assert state.shared.recent.shape[2] == min(6, max(0, length - 8))  # tokens past the first segment search
    assert state.pos == length and len(state.shared.bank) == len(stream_state.shared.bank)


def test_prefill_reports_each_chunk_of_the_backbone_and_then_of_the_full_model():
    model, read = longmem(), []
    model.prefill(random_ids(2500), progress=lambda *c: read.append(c))
    head = 2500 - 2 * 8  # side_layers x window before the end: the backbone alone, in chunks of 1,024
    assert read == [(1024, 2500), (2048, 2500), (head, 2500), (2500, 2500)]


def test_the_bank_carries_information_past_every_window():
    model = longmem()
    ids = random_ids(40)
    changed = ids.clone()
    changed[0, 1] = (changed[0, 1] + 3) % 256
    with torch.no_grad():
        diff = (model(ids) - model(changed)).abs().amax(-1)[0]
    # windows of 8 over 2 backbone + 2 side layers reach 1 + 4 * 7 = 29 at most; the bank, which
    # holds keys of positions 8-15 that the backbone computed from token 1, reaches further
    assert diff[30:32].min() > 1e-5
    assert diff[32:].max() == 0  # from segment 32 on, the FIFO bank (16 tokens) holds 16-31 only


def test_backbone_is_frozen_and_loaded_from_a_baseline(tmp_path):
    base = scrambled(small_model("sliding_window", window=8))
    path = memviz.save(base, tmp_path / "base")
    model = small_model("longmem", window=8, segment_len=8, memory=OPTIONS)
    model.warm_start(memviz.load(path))
    assert all(not p.requires_grad for n, p in model.named_parameters() if n.startswith(("embed", "blocks", "unembed")))
    assert all(p.requires_grad for n, p in model.named_parameters() if n.startswith(("side_blocks", "ln_final")))
    torch.testing.assert_close(model.blocks[1].attn.W_Q.weight, base.blocks[1].attn.W_Q.weight)
    torch.testing.assert_close(model.side_blocks[1].attn.W_Q.weight, base.blocks[model.taps()[1]].attn.W_Q.weight)
    assert model.side_blocks[1].attn.gate.abs().max() == 0
    with pytest.raises(ConfigError, match="same"):
        small_model("longmem", window=8, segment_len=8, d_mlp=96, memory=OPTIONS).warm_start(memviz.load(path))
    with pytest.raises(ConfigError, match="embed_scale"):  # the backbone would see its embeddings at another scale
        small_model("longmem", window=8, segment_len=8, embed_scale=4.0, memory=OPTIONS).warm_start(memviz.load(path))


def test_a_second_stage_starts_from_a_longmem_checkpoint_with_a_larger_bank(tmp_path):
    first = longmem()
    path = memviz.save(first, tmp_path / "stage1")
    second = small_model("longmem", window=8, segment_len=8, memory={**OPTIONS, "bank_size": 64})
    second.warm_start(memviz.load(path))
    for name, tensor in first.state_dict().items():
        assert torch.equal(second.state_dict()[name], tensor), name
    assert all(
        not p.requires_grad for n, p in second.named_parameters() if n.startswith(("embed", "blocks", "unembed"))
    )
    assert all(p.requires_grad for n, p in second.named_parameters() if n.startswith(("side_blocks", "ln_final")))
    ids = random_ids(60)
    with torch.no_grad():  # the larger bank reads further back: the same up to 16 + 8 tokens, then not
        diff = (first(ids) - second(ids)).abs().amax(-1)[0]
    assert diff[:24].max() == 0 and diff[24:].max() > 1e-4
    with pytest.raises(ConfigError, match="weights of the same shapes"):
        small_model("longmem", window=8, segment_len=8, memory={**OPTIONS, "side_layers": 1}).warm_start(
            memviz.load(path)
        )


def test_config_errors():
    with pytest.raises(memviz.ConfigError, match="needs config.segment_len"):
        small_model("longmem", window=8, memory=OPTIONS)
    with pytest.raises(memviz.ConfigError, match="multiple of chunk_size"):
        small_model("longmem", window=8, segment_len=6, memory=OPTIONS)
    with pytest.raises(memviz.ConfigError, match="bank_size"):
        small_model("longmem", window=8, segment_len=8, memory={**OPTIONS, "bank_size": 10})


def test_ablating_the_bank_at_a_segment_empties_it_and_keeps_the_local_caches():
    from memviz.interventions import ablate_at, answer_logprob

    model = longmem()
    prompt = "the pass key is 12345. " * 3
    position, edit = ablate_at(model, 8)  # token 64: the answer (tokens 69-73) would read bank 48-63
    _, state = model(model.tokenizer.encode(prompt)[:position], return_state=True)
    edited = edit(state)
    assert len(edited.shared.bank) == 0 and edited.shared.bank.positions.numel() == 0
    assert torch.equal(edited.layers[0].k, state.layers[0].k)
    clean = answer_logprob(model, prompt, "12345")["logprob"]
    assert answer_logprob(model, prompt, "12345", [(position, edit)])["logprob"] != pytest.approx(clean, abs=1e-5)


def test_needle_hold_counts_the_heads_that_retrieve_a_chunk_of_the_span():
    model = longmem(bank_size=64)
    ids, span = random_ids(60), (10, 13)
    hold = next(iter(model.needle_hold(ids, span).values()))
    _, cache = model.run_with_cache(ids)
    first = cache["side_blocks.1.attn.hook_retrieved_pos"][0]  # [pos, head, topk]
    brute = [
        sum(any(p >= 0 and p < 13 and p + 4 > 10 for p in first[t, h].tolist()) for h in range(first.shape[1]))
        / first.shape[1]
        for t in range(60)
    ]
    assert hold.tolist() == pytest.approx(brute)
    assert max(brute[:16]) == 0 and max(brute[16:]) > 0  # chunks 8-11 and 12-15 are readable from segment 16 on
