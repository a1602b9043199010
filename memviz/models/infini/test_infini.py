"""Infini-attention: equations (arXiv 2404.07143 eqs. 3-6) on hand-checkable cases, streaming."""

import pytest
import torch

from memviz.models.infini import feature_map
from memviz_kernels.infini.reference import memory_retrieve, memory_update
from tests.conftest import random_ids, scrambled, small_model

SEG = 8


def test_feature_map_is_elu_plus_one():
    x = torch.tensor([-2.0, 0.0, 3.0])
    torch.testing.assert_close(feature_map(x), torch.tensor([torch.exp(torch.tensor(-2.0)).item(), 1.0, 4.0]))


def test_retrieval_and_linear_update_by_hand():
    # one head, d = 2: store sigma(k) = (1, 0) -> v = (3, 5) and sigma(k) = (0, 2) -> v = (7, 1)
    M, z = torch.zeros(1, 1, 2, 2), torch.zeros(1, 1, 2)
    sk = torch.tensor([[[[1.0, 0.0], [0.0, 2.0]]]])
    v = torch.tensor([[[[3.0, 5.0], [7.0, 1.0]]]])
    M, z = memory_update(sk, v, M, z, "linear")
    torch.testing.assert_close(M[0, 0], torch.tensor([[3.0, 5.0], [14.0, 2.0]]))
    torch.testing.assert_close(z[0, 0], torch.tensor([1.0, 2.0]))
    # a query with sigma(q) = (1, 0) reads (3, 5) / 1; sigma(q) = (0, 1) reads (14, 2) / 2
    sq = torch.tensor([[[[1.0, 0.0], [0.0, 1.0]]]])
    torch.testing.assert_close(memory_retrieve(sq, M, z)[0, 0], torch.tensor([[3.0, 5.0], [7.0, 1.0]]))


def test_retrieval_from_empty_memory_is_zero_not_nan():
    sq = feature_map(torch.randn(2, 3, 5, 4))
    out = memory_retrieve(sq, torch.zeros(2, 3, 4, 4), torch.zeros(2, 3, 4))
    assert torch.equal(out, torch.zeros_like(out))


def test_delta_rule_leaves_a_stored_binding_unchanged():
    g = torch.Generator().manual_seed(0)
    M = torch.randn(1, 2, 4, 4, generator=g)
    z = feature_map(torch.randn(1, 2, 4, generator=g)) * 3
    sk = feature_map(torch.randn(1, 2, 1, 4, generator=g))
    stored = memory_retrieve(sk, M, z)  # the value the memory already returns for this key
    M_delta, _ = memory_update(sk, stored, M, z, "delta")
    M_linear, _ = memory_update(sk, stored, M, z, "linear")
    torch.testing.assert_close(M_delta, M)
    assert (M_linear - M).abs().max() > 1e-2
    # a new value is written as the difference from what was stored
    new = torch.randn(1, 2, 1, 4, generator=g)
    M_new, _ = memory_update(sk, new, M, z, "delta")
    torch.testing.assert_close(M_new - M, sk.transpose(-1, -2) @ (new - stored))


@pytest.mark.parametrize("update,local", [("linear", "segment"), ("delta", "segment"), ("delta", "window")])
@pytest.mark.parametrize("chunk_len", [1, 5, 8, 13])
def test_streamed_run_equals_one_pass(update, local, chunk_len):
    model = scrambled(small_model("infini", segment_len=SEG, memory={"update": update, "local": local}), std=0.2)
    ids = random_ids(5 * SEG + 3)
    with torch.no_grad():
        one_pass = model(ids)
        streamed = torch.cat([lg for _, lg, _ in model.stream(ids, chunk_len)], dim=1)
    torch.testing.assert_close(streamed, one_pass, atol=1e-5, rtol=1e-4)


def test_memory_carries_information_across_segments_and_state_is_bounded():
    model = scrambled(small_model("infini", segment_len=SEG), std=0.2)
    ids = random_ids(6 * SEG)
    with torch.no_grad():
        one_pass = model(ids)
        stateless = torch.cat([model(ids[:, s : s + SEG]) for s in range(0, 6 * SEG, SEG)], dim=1)
        sizes = [state.nbytes() for _, _, state in model.stream(ids, SEG)]
    torch.testing.assert_close(stateless[:, :SEG], one_pass[:, :SEG])  # nothing to remember yet
    assert (stateless[:, SEG:] - one_pass[:, SEG:]).abs().max() > 1e-2  # later segments read memory
    assert len(set(sizes)) == 1  # M, z and an empty segment buffer after each whole segment


@pytest.mark.parametrize("local", ["segment", "window"])
def test_local_window_sees_across_the_segment_boundary_and_the_memory_still_works_per_segment(local):
    model = scrambled(small_model("infini", segment_len=SEG, memory={"local": local}), std=0.2)
    ids = random_ids(3 * SEG)
    edited = ids.clone()
    edited[0, SEG - 1] = (ids[0, SEG - 1] + 1) % 256
    _, cache = model.run_with_cache(ids)
    _, cache_edited = model.run_with_cache(edited)
    local_out = cache["blocks.0.attn.hook_local_out"][0, SEG]
    changed = (local_out - cache_edited["blocks.0.attn.hook_local_out"][0, SEG]).abs().max()
    assert (changed > 1e-4) == (local == "window")  # the first token of segment 2 sees the last of segment 1
    far = cache["blocks.0.attn.hook_local_out"][0, 2 * SEG] - cache_edited["blocks.0.attn.hook_local_out"][0, 2 * SEG]
    assert far.abs().max() == 0  # SEG tokens later, out of either window
    norms = cache["blocks.0.attn.hook_mem_norm"][0, :, 0]
    assert norms[SEG - 1] == 0 and norms[SEG] > 0 and torch.equal(norms[SEG : 2 * SEG], norms[SEG].expand(SEG))


def test_hooks_show_gate_memory_and_local_paths():
    model = scrambled(small_model("infini", segment_len=SEG), std=0.2)
    ids = random_ids(3 * SEG)
    _, cache = model.run_with_cache(ids)
    gate = cache["blocks.0.attn.hook_gate"]
    assert gate.shape == (1, 3 * SEG, model.cfg.n_heads)
    torch.testing.assert_close(gate[0, 0], torch.sigmoid(model.blocks[0].attn.beta))
    mem = cache["blocks.0.attn.hook_mem_out"]
    assert torch.equal(mem[:, :SEG], torch.zeros_like(mem[:, :SEG]))  # first segment: empty memory
    assert mem[:, SEG:].abs().max() > 0
    norms = cache["blocks.0.attn.hook_mem_norm"][0, :, 0]
    assert norms[0] == 0 and norms[SEG] > 0 and norms[2 * SEG] != norms[SEG]  # changes once per segment
    assert torch.equal(norms[SEG : 2 * SEG], norms[SEG].expand(SEG))
    mixed = gate[..., None] * mem + (1 - gate[..., None]) * cache["blocks.0.attn.hook_local_out"]
    torch.testing.assert_close(cache["blocks.0.attn.hook_z"], mixed)


def test_infini_config_errors():
    from memviz import ConfigError

    with pytest.raises(ConfigError, match="needs config.segment_len"):
        small_model("infini")
    with pytest.raises(ConfigError, match="update must be one of"):
        small_model("infini", segment_len=SEG, memory={"update": "quadratic"})
    with pytest.raises(ConfigError, match="local"):
        small_model("infini", segment_len=SEG, memory={"local": "global"})


def test_needle_hold_is_the_span_weight_in_the_linear_memory_read():
    """Under the linear update, A_mem_t = sum_j w_tj v_j / sum_j w_tj over the keys written before
    t's segment, w_tj = sigma(q_t) . sigma(k_j): rebuilt from the cached q, k, v it equals the
    model's read, and the span's part of the weights is what needle_hold reports."""
    model = scrambled(small_model("infini", segment_len=SEG, memory={"update": "linear"}), std=0.1)
    ids, span = random_ids(45), (9, 14)
    hold = model.needle_hold(ids, span)
    _, cache = model.run_with_cache(ids)
    for layer in range(model.cfg.n_layers):
        sq, sk = (
            feature_map(cache[f"blocks.{layer}.attn.hook_q"][0]),
            feature_map(cache[f"blocks.{layer}.attn.hook_k"][0]),
        )
        v = cache[f"blocks.{layer}.attn.hook_v"][0]
        w = torch.einsum("thd,jhd->thj", sq, sk)  # [t, head, j]
        written = torch.arange(45)[None, :] < (torch.arange(45) - torch.arange(45) % SEG)[:, None]  # [t, j]
        w = w * written[:, None, :]
        read = torch.einsum("thj,jhd->thd", w, v) / w.sum(-1, keepdim=True).clamp_min(1e-30)
        torch.testing.assert_close(
            read[SEG:], cache[f"blocks.{layer}.attn.hook_mem_out"][0, SEG:], atol=1e-4, rtol=1e-4
        )
        share = (w[..., span[0] : span[1]].sum(-1) / w.sum(-1).clamp_min(1e-30)).amax(-1)
        got = next(v for k, v in hold.items() if k.startswith(f"layer {layer}:"))
        torch.testing.assert_close(torch.from_numpy(got), share.float(), atol=1e-5, rtol=1e-4)
        assert got[:16].max() == 0 and got[16:].min() > 0  # the span's segment (8-15) is written at 16


@pytest.mark.parametrize("update", ["linear", "delta"])
def test_the_read_out_parts_sum_to_the_memory_read(update):
    """memory_readout decomposes A_mem over the tokens of earlier segments; in float64 the parts
    sum to the read the model made (hook_mem_out), at a position in the first segment (nothing
    written: zero), mid-segment and at a segment's last token."""
    model = scrambled(small_model("infini", segment_len=8, memory={"update": update}), std=0.2).to(torch.float64)
    ids = random_ids(45, seed=2)
    _, cache = model.run_with_cache(ids)
    for position in (5, 20, 39, 44):
        readout = model.memory_readout(ids, position)
        for layer in range(2):
            read = cache[f"blocks.{layer}.attn.hook_mem_out"][0, position]
            torch.testing.assert_close(readout.parts[f"blocks.{layer}"].sum(0), read, atol=1e-12, rtol=1e-12)
            assert readout.parts[f"blocks.{layer}"].shape[0] == position // 8 * 8  # the complete segments before
            if position >= 8:
                torch.testing.assert_close(readout.shares(f"blocks.{layer}").sum(0), torch.ones(2, dtype=torch.float64))
    with pytest.raises(ValueError, match="position must lie in"):
        model.memory_readout(ids, 45)
