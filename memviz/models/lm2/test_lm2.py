"""LM2 (arXiv 2502.06049): gates, the documented bank update, the factored scan, streaming."""

import pytest
import torch

from memviz_kernels.lm2.reference import lm2_scan_naive, lm2_scan_reference
from tests.conftest import random_ids, scrambled, small_model

SLOTS = 4


def lm2(attention="window", seed=1, **memory):
    return scrambled(
        small_model("lm2", attention={"kind": attention, "span": 8}, segment_len=8, memory={"slots": SLOTS, **memory}),
        std=0.2,
        seed=seed,
    )


def first_layer_run(model, ids):
    """(cache, layer 0's bank after `ids`, layer 0's memory module, its normalised input E [pos, d])."""
    _, cache = model.run_with_cache(ids)
    _, state = model(ids, return_state=True)
    return (
        cache,
        state.layers[0].memory.M[0],
        model.blocks[0].memory,
        model.blocks[0].ln1(cache["blocks.0.hook_resid_pre"])[0],
    )


def test_factored_scan_equals_the_direct_equations_in_float64():
    g = torch.Generator().manual_seed(0)
    for B, T, N, d in [(1, 1, 1, 2), (2, 13, 5, 6), (3, 7, 9, 4)]:
        f64 = dict(dtype=torch.float64, generator=g)
        q, M0 = torch.randn(B, T, d, **f64), torch.randn(B, N, d, **f64)
        g_in = torch.rand(B, T, d, **f64)
        W_K, W_V, W_f = (torch.randn(d, d, **f64) for _ in range(3))
        b_f = torch.randn(d, **f64)
        ours = lm2_scan_reference(q @ W_K.T / d**0.5, g_in, M0, W_V, W_f, b_f)
        naive = lm2_scan_naive(q, g_in, M0, W_K, W_V, W_f, b_f)
        for a, b in zip(ours, naive):
            torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10)


def test_bank_starts_as_identity_rows():
    model = lm2()
    M = model.init_state(2).layers[0].memory.M
    assert M.shape == (2, SLOTS, model.cfg.d_model)
    torch.testing.assert_close(M[1], torch.eye(SLOTS, model.cfg.d_model))


@pytest.mark.parametrize("update", ["token", "segment"])
def test_gates_lie_in_the_open_unit_interval(update):
    model = lm2(update=update)
    _, cache = model.run_with_cache(random_ids(24))
    for gate in ("input_gate", "forget_gate", "output_gate"):
        g = cache[f"blocks.1.memory.hook_{gate}"]
        assert g.shape == (1, 24, model.cfg.d_model)
        assert (g > 0).all() and (g < 1).all() and g.std() > 1e-3
    attn = cache["blocks.0.memory.hook_slot_attn"]
    torch.testing.assert_close(attn.sum(-1), torch.ones(1, 24))
    assert not cache["blocks.0.memory.hook_write_score"].any()  # the paper's write: the same for every slot


def test_bank_follows_the_documented_update_token_by_token():
    """Rebuild M_t+1 = g_in * tanh(E_mem) + g_forget * M_t from the hooks and compare."""
    model = lm2()
    ids = random_ids(12)
    cache, final_bank, mem, e = first_layer_run(model, ids)
    M = torch.eye(SLOTS, model.cfg.d_model)
    for t in range(12):
        K, V = mem.W_K(M), mem.W_V(M)
        a = torch.softmax(mem.W_Q(e[t]) @ K.T / model.cfg.d_model**0.5, -1)
        read = a @ V
        torch.testing.assert_close(cache["blocks.0.memory.hook_slot_attn"][0, t], a, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(cache["blocks.0.memory.hook_read"][0, t], read, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(cache["blocks.0.memory.hook_slot_norm"][0, t], M.norm(dim=-1), atol=1e-5, rtol=1e-4)
        g_in, g_f = torch.sigmoid(mem.W_in(e[t])), torch.sigmoid(mem.W_forget(read))
        M = g_in * torch.tanh(read) + g_f * M
    torch.testing.assert_close(final_bank, M, atol=1e-5, rtol=1e-4)
    g_out = cache["blocks.0.memory.hook_output_gate"]
    torch.testing.assert_close(cache["blocks.0.memory.hook_out"], g_out * cache["blocks.0.memory.hook_read"])


def test_output_gate_alternative_multiplies_the_mean_slot():
    model = lm2(output_gate="bank")
    _, cache = model.run_with_cache(random_ids(3))
    out, g_out = cache["blocks.0.memory.hook_out"][0, 0], cache["blocks.0.memory.hook_output_gate"][0, 0]
    torch.testing.assert_close(out, g_out * torch.eye(SLOTS, model.cfg.d_model).mean(0))


def test_segment_update_changes_the_bank_only_at_segment_ends():
    model = lm2(update="segment")
    _, cache = model.run_with_cache(random_ids(24))
    norms = cache["blocks.0.memory.hook_slot_norm"][0]
    for s in range(3):
        assert torch.equal(norms[8 * s : 8 * s + 8], norms[8 * s].expand(8, -1))
    assert not torch.equal(norms[0], norms[8])


@pytest.mark.parametrize("sink", [None, 0.5])
def test_addressed_write_follows_the_documented_update_slot_by_slot(sink):
    """Rebuild M[n] <- b0[n] M[n] + sum_t b[n, t] (g_in,t * tanh(E_t W_write) + g_forget,t * M[n]),
    (b0, b) the softmax over the null logit (none: b0 = 0) and the segment's read logits, and
    compare with the bank after two segments."""
    model = lm2(update="segment", write="slots", **({} if sink is None else {"write_sink": sink}))
    ids = random_ids(16)
    cache, final_bank, mem, e = first_layer_run(model, ids)
    M = torch.eye(SLOTS, model.cfg.d_model)
    for a in (0, 8):
        seg = e[a : a + 8]
        logits = mem.W_Q(seg) @ mem.W_K(M).T / model.cfg.d_model**0.5  # [t, n]
        read = torch.softmax(logits, -1) @ mem.W_V(M)
        g_in, g_f = torch.sigmoid(mem.W_in(seg)), torch.sigmoid(mem.W_forget(read))
        null = torch.full((1, SLOTS), -torch.inf) if sink is None else mem.write_sink.detach()[None]
        b = torch.softmax(torch.cat([logits, null]), 0)  # over tokens and the null write, per slot
        b, b0 = b[:-1], b[-1]
        M = b.T @ (g_in * torch.tanh(mem.W_write(seg))) + (b.T @ g_f + b0[:, None]) * M
        torch.testing.assert_close(cache["blocks.0.memory.hook_read"][0, a : a + 8], read, atol=1e-5, rtol=1e-4)
        torch.testing.assert_close(
            cache["blocks.0.memory.hook_write_score"][0, a : a + 8], logits, atol=1e-5, rtol=1e-4
        )
    torch.testing.assert_close(final_bank, M, atol=1e-5, rtol=1e-4)
    assert (M[0] - M[1]).abs().max() > 1e-3  # slots receive different writes


def test_a_high_null_logit_keeps_every_slot_and_a_low_one_is_no_null_write():
    model = lm2(update="slots", write_sink=0.0)
    ids = random_ids(32)
    for block in model.blocks:
        block.memory.write_sink.data.fill_(60.0)
    _, state = model(ids, return_state=True)
    for layer in state.layers:  # b0 = 1 - O(e^-50): the identity bank, unwritten and unforgotten
        torch.testing.assert_close(layer.memory.M[0], torch.eye(SLOTS, model.cfg.d_model), atol=1e-12, rtol=0)
    plain = lm2(update="slots")
    plain.load_state_dict({k: v for k, v in model.state_dict().items() if "write_sink" not in k})
    for block in model.blocks:
        block.memory.write_sink.data.fill_(-60.0)
    with torch.no_grad():
        torch.testing.assert_close(model(ids), plain(ids), atol=1e-6, rtol=1e-6)


def test_the_null_write_is_learnt_and_a_sinkless_checkpoint_warm_starts_it():
    model = lm2(update="slots", write_sink=-1.0)
    model(random_ids(24)).logsumexp(-1).sum().backward()
    assert all(block.memory.write_sink.grad.abs().min() > 0 for block in model.blocks)
    fresh = [block.memory.write_sink.detach().clone() for block in model.blocks]
    base = lm2(update="slots", seed=5)
    model.warm_start(base)
    for name, weight in base.state_dict().items():
        assert torch.equal(model.state_dict()[name], weight), name
    assert all(torch.equal(b.memory.write_sink.detach(), f) for b, f in zip(model.blocks, fresh))
    with pytest.raises(ValueError, match="same shapes"):  # weights other than the option's still refused
        lm2(update="slots", write_sink=-1.0).warm_start(lm2(update="segment"))
    with pytest.raises(ValueError, match="write_sink needs update='slots'"):
        lm2(update="segment", write_sink=0.0)
    with pytest.raises(ValueError, match="write_sink must be a finite number"):
        lm2(update="slots", write_sink=float("inf"))


def test_addressed_writes_are_one_update_kind_and_older_configs_still_load():
    with pytest.raises(ValueError, match="update='slots' needs config.segment_len"):
        small_model("lm2", window=8, memory={"update": "slots"})
    older = small_model("lm2", segment_len=8, memory={"update": "segment", "write": "slots", "local": "segment"})
    assert older.options.update == "slots" and older.cfg.memory == {"update": "slots"}
    assert older.cfg.attention == {"kind": "segment", "span": 8}, "local='segment' attended within the segment"
    with pytest.raises(ValueError, match="write='slots' needs update='segment'"):
        small_model("lm2", window=8, memory={"write": "slots"})
    with pytest.raises(ValueError, match="'write'.* must be 'read' or 'slots'"):
        small_model("lm2", window=8, segment_len=8, memory={"update": "segment", "write": "everywhere"})


ADDRESSED = {"update": "slots"}
SINK = {"update": "slots", "write_sink": 0.5}


@pytest.mark.parametrize(
    "memory",
    [{}, {"update": "segment"}, {"output_gate": "bank"}, ADDRESSED, {**ADDRESSED, "attention": "segment"}, SINK],
)
@pytest.mark.parametrize("chunk_len", [1, 5, 16])
def test_streamed_run_equals_one_pass(memory, chunk_len):
    model = lm2(**memory)
    ids = random_ids(37)
    with torch.no_grad():
        one_pass = model(ids)
        streamed = torch.cat([lg for _, lg, _ in model.stream(ids, chunk_len)], dim=1)
        sizes = {state.nbytes() for _, _, state in model.stream(ids[:, :32], 8)}
    torch.testing.assert_close(streamed, one_pass, atol=2e-5, rtol=1e-5)
    assert len(sizes) == 1  # after each whole segment: the window's cache full (or, segment-local,
    # the segment's cache empty) and a bank of fixed size


@pytest.mark.parametrize("memory", [{"update": "segment"}, ADDRESSED, {**ADDRESSED, "output_gate": "bank"}, SINK])
def test_a_run_nothing_hooks_gives_the_logits_of_a_traced_run(memory):
    """A plain forward skips the values only hooks read (slot norms, slot attention, write scores,
    forget gates); the model's output must not depend on whether anything reads them."""
    model = lm2(**memory)
    ids = random_ids(37)
    with torch.no_grad():
        plain = model(ids)
        traced, cache = model.run_with_cache(ids)
    assert torch.equal(plain, traced)
    for name in ("slot_norm", "slot_attn", "write_score", "forget_gate"):
        assert cache[f"blocks.1.memory.hook_{name}"].shape[:2] == (1, 37)


def test_the_bank_carries_information_past_the_window():
    model = lm2()
    ids = random_ids(40)
    changed = ids.clone()
    changed[0, 2] = (changed[0, 2] + 1) % 256
    with torch.no_grad():
        diff = (model(ids) - model(changed)).abs().amax(-1)[0]
    assert diff[30:].min() > 1e-4  # 2 layers x window 8 cannot reach back 28 tokens; the bank does


def shut_bank(model):
    """Input gates 0 and forget gates 1 at every token: the bank keeps its initial rows."""
    with torch.no_grad():
        for block in model.blocks:
            for gate, bias in ((block.memory.W_in, -40.0), (block.memory.W_forget, 40.0)):
                gate.weight.zero_()
                gate.bias.fill_(bias)
    return model


def test_segment_local_attention_reaches_past_its_segment_only_through_the_bank():
    """Change token 2 of segment 0: with the bank shut, the logits from segment 1 on stay put
    (the window of 8 moves them); with the bank open they move everywhere after."""
    ids = random_ids(32)
    changed = ids.clone()
    changed[0, 2] = (changed[0, 2] + 1) % 256

    def moved(model):
        with torch.no_grad():
            return (model(ids) - model(changed)).abs().amax(-1)[0]

    assert moved(shut_bank(lm2("segment", **ADDRESSED)))[8:].max() < 1e-5
    assert moved(shut_bank(lm2(**ADDRESSED)))[8:10].min() > 1e-3
    assert moved(lm2("segment", **ADDRESSED))[8:].min() > 1e-3


def test_forget_bias_sets_how_long_a_fresh_bank_remembers():
    for bias in (2.0, 6.0):
        model = small_model("lm2", window=8, memory={"slots": SLOTS, "forget_bias": bias, "input_bias": -4.0})
        _, cache = model.run_with_cache(random_ids(16))
        g_f, g_in = cache["blocks.0.memory.hook_forget_gate"], cache["blocks.0.memory.hook_input_gate"]
        assert abs(g_f.mean().item() - torch.sigmoid(torch.tensor(bias)).item()) < 0.02
        assert abs(g_in.mean().item() - torch.sigmoid(torch.tensor(-4.0)).item()) < 0.01
    with pytest.raises(ValueError, match="forget_bias must be a finite number, got nan"):
        small_model("lm2", window=8, memory={"forget_bias": float("nan")})


@pytest.mark.parametrize("memory", [{"update": "slots"}, {"update": "segment"}, SINK])
def test_the_parts_of_all_tokens_add_up_to_the_bank(memory):
    """From an empty bank, the whole input's part under the run's own gates is the bank itself;
    two spans' parts add up to the whole's."""
    model = lm2(**memory).double()
    ids = random_ids(64)
    state = model.init_state()
    for layer in state.layers:
        layer.memory.M.zero_()
    with torch.no_grad():
        banks = [layer.memory.M[0] for layer in model(ids, state=state, return_state=True)[1].layers]

    def last(span):
        return [p.clone() for p in list(model.span_in_bank(ids, span, state))[-1][1]]

    whole, first, rest = last((0, 64)), last((0, 20)), last((20, 64))
    for bank, w, f, r in zip(banks, whole, first, rest):
        torch.testing.assert_close(w, bank, atol=1e-12, rtol=1e-10)
        torch.testing.assert_close(f + r, w, atol=1e-12, rtol=1e-10)


@pytest.mark.parametrize("memory", [{"update": "slots"}, {"update": "segment"}, SINK])
def test_needle_hold_follows_the_spans_write_as_the_forget_gates_decay_it(memory):
    model = lm2(**memory)
    hold = model.needle_hold(random_ids(64), (16, 24))  # the third segment of 8 tokens
    for share in hold.values():
        assert share[:24].max() == 0 and share[24:32].min() == 1.0  # unwritten, then whole
        assert (share[32:] > 0).all() and (share[32:] < 1).all()  # then decayed by forget gates < 1
    assert lm2(update="token").needle_hold(random_ids(16), (0, 4)) is None


@pytest.mark.parametrize("memory", [{"update": "slots"}, {"update": "segment"}, SINK])
def test_the_read_out_parts_sum_to_the_bank_read(memory):
    """memory_readout decomposes E_mem over the tokens of the segments before the read's and the
    decayed identity bank; in float64 they sum to the read the model made (hook_read) in the
    first segment (the identity bank alone), mid-segment and at a segment's last token."""
    model = lm2(**memory).double()
    ids = random_ids(40, seed=4)
    _, cache = model.run_with_cache(ids)
    for position in (3, 21, 31, 39):
        readout = model.memory_readout(ids, position)
        for layer in range(2):
            name = f"blocks.{layer}"
            assert readout.parts[name].shape == (position // 8 * 8, 1, model.cfg.d_model)
            torch.testing.assert_close(
                readout.reads[name][0], cache[f"{name}.memory.hook_read"][0, position], atol=1e-12, rtol=1e-12
            )
            total = readout.shares(name).sum(0) + readout.initial_share(name)
            torch.testing.assert_close(total, torch.ones(1, dtype=torch.float64))
        if position >= 8:
            assert readout.parts["blocks.1"].abs().max() > 1e-3
    with pytest.raises(ValueError, match="position must lie in"):
        model.memory_readout(ids, 40)
    assert lm2(update="token").memory_readout(ids, 20) is None
