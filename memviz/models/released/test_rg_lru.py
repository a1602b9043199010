"""Released RG-LRU models (memviz.models.released.rg_lru: RecurrentGemma) on a small random checkpoint made by
transformers itself (`tiny.tiny_checkpoint`, its decay parameter spread here from fast to slow forgetting): logits
against transformers' forward, the recurrence's quantities against a float64 recomputation from the weights, the
recurrence run once through memviz's operator, streaming (across the local attention's window) and generation
against one pass, a reset mid-call (packed documents), read-out (each part the read with that writer alone), needle
hold, interventions, trace, figures, cost and bad input."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import memviz
from memviz import interventions
from memviz.models.released import ReleasedCheckpointError, rg_lru
from memviz.models.released.tiny import TEXT, tiny_checkpoint
from memviz.protocol import ModelState
from memviz.registry import get_family
from memviz_kernels.linear_memory.reference import recurrent

PASSAGE = TEXT + " The pass key is 71432. " * 3
N = 40  # tokens of the tests' input, five times the tiny model's attention window of 8
HOOKS = (
    "alpha",
    "beta",
    "write_key",
    "write_value",
    "read_query",
    "read",
    "state_norm",
    "input_gate",
    "recurrence_gate",
    "mem_out",
)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: one thread for this module (on a busy two-core machine an OpenMP team of two made a
    one-pass forward take seconds instead of milliseconds), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """The tiny RecurrentGemma (`tiny_checkpoint` spreads -Lambda over each layer's channels, so that its decays
    a_t = exp(-8 r_t softplus(-Lambda)) run from fast to slow forgetting)."""
    folder = tmp_path_factory.mktemp("recurrent_gemma")
    tiny_checkpoint(folder, "recurrent_gemma")
    return folder


def reference(folder, dtype=torch.float32):
    """transformers' own model of the folder, untouched."""
    return rg_lru.ARCHITECTURES["recurrent_gemma"].causal_lm().from_pretrained(folder, dtype=dtype).eval()


def ids_of(model, n: int = N) -> torch.Tensor:
    ids = model.tokenizer.encode(PASSAGE * 4)[:n]
    assert len(ids) == n
    return torch.tensor([ids])


def scan_in_float64(self, hidden_states, recurrent_gate, reset, recurrent_states, acc_dtype=torch.float32):
    """transformers' `RecurrentGemmaRglru._rnn_scan` (eq. 4 given its normalised inputs) token by token in float64
    (transformers accumulates in float32, a float64 model's too): h_t = a_t h_{t-1} + x_t with a_t zero at a reset."""
    a = (recurrent_gate * ~reset).double()
    h = torch.zeros_like(hidden_states[:, 0], dtype=torch.float64) if recurrent_states is None else recurrent_states
    states = []
    for t in range(hidden_states.shape[1]):
        h = a[:, t] * h.double() + hidden_states[:, t].double()
        states.append(h)
    return torch.stack(states, 1).to(hidden_states.dtype), h


def float64_truth(folder, ids):
    """transformers' float64 forward with its scan in float64 (`scan_in_float64`); its own float64 forward."""
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma

    model = reference(folder, torch.float64)
    with torch.no_grad():
        own = model(ids).logits
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(modeling_recurrent_gemma.RecurrentGemmaRglru, "_rnn_scan", scan_in_float64)
            return model(ids).logits, own


def test_the_architecture_is_claimed_by_its_family(checkpoint):
    from memviz.registry import folder_family

    model = memviz.load(checkpoint)
    assert folder_family("recurrent_gemma").name == model.family == "hf_rg_lru"
    assert model.cfg.linear_layers == [0, 1, 3] and model.attention_span == 8
    assert all(rg_lru.installed(model.memory_layer(l)) for l in model.cfg.linear_layers)


def test_logits_equal_transformers_forward(checkpoint):
    """float64: memviz's model against transformers' forward with its scan in float64, to 1e-10 (transformers' own
    float64 forward is further: its scan accumulates in float32). float32: against transformers' own forward to
    1e-5 of the logits' scale."""
    ids = ids_of(memviz.load(checkpoint))
    truth, own64 = float64_truth(checkpoint, ids)
    exact = memviz.load(checkpoint, dtype="float64")
    with torch.no_grad():
        ours64 = exact(ids)
    assert ours64.dtype == torch.float64 and truth.abs().max() > 1
    torch.testing.assert_close(ours64, truth, atol=1e-10, rtol=0)
    assert (own64 - truth).abs().max() > 1e-9  # the float32 scan, and why the truth writes it out
    with torch.no_grad():
        ours, theirs = memviz.load(checkpoint)(ids), reference(checkpoint)(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_the_recurrence_runs_once_through_the_operator(checkpoint, monkeypatch):
    """A traced forward (every hook) calls the operator once a recurrent layer; transformers' own forward back
    (`rg_lru.uninstall`) gives transformers' own forward to the bit, and memviz then refuses to run."""
    model = memviz.load(checkpoint)
    linear = model.cfg.linear_layers
    calls = []
    operator = rg_lru.linear_memory
    monkeypatch.setattr(rg_lru, "linear_memory", lambda *a, **kw: calls.append(1) or operator(*a, **kw))
    ids = ids_of(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
    assert len(calls) == len(linear) and cache[f"blocks.{linear[-1]}.attn.hook_state_norm"].shape[:2] == (1, N)
    rg_lru.uninstall(model.hf)
    with torch.no_grad():
        torch.testing.assert_close(model.hf(ids).logits, reference(checkpoint)(ids).logits, atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="transformers' own forward"):
        model(ids)


@pytest.mark.parametrize("chunk", [3, 16])
def test_streamed_equals_one_pass(checkpoint, chunk):
    """Streamed in float64 is one pass to float64 rounding, across the attention's window of 8 tokens (the
    convolution continues from its cached inputs, h from the state, the attention from its cached keys), and it
    is the model's own forward (memviz's blocks installed) chunk by chunk through its cache, exactly."""
    from transformers import DynamicCache

    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    with torch.no_grad():
        streamed = torch.cat([logits for _, logits, _ in model.stream(ids, chunk_len=chunk)], 1)
        cache = DynamicCache(config=model.hf.config)
        by_hand = [
            model.hf(piece, position_ids=at, cache=cache, use_cache=True).logits
            for piece, at in zip(ids.split(chunk, 1), torch.arange(N)[None].split(chunk, 1))
        ]
        model.forget()
        torch.testing.assert_close(streamed, torch.cat(by_hand, 1), atol=0, rtol=0)
        torch.testing.assert_close(streamed, model(ids), atol=1e-10, rtol=0)


def test_transformers_own_chunked_forward_restarts_its_convolution(checkpoint):
    """Why memviz replaces the recurrent block's forward: transformers' own block, fed chunks through its cache,
    restarts its convolution from zeros at each multi-token call (its h carries on), so its chunked forward is not its
    one pass; memviz's is (test_streamed_equals_one_pass)."""
    from transformers import DynamicCache

    model = reference(checkpoint, torch.float64)
    ids = ids_of(memviz.load(checkpoint))
    with torch.no_grad():
        whole = model(ids).logits
        cache = DynamicCache(config=model.config)
        model.model._setup_cache(model.config, 1, ids.device, torch.float64)
        pieces = [
            model(piece, position_ids=at, cache=cache, use_cache=True).logits
            for piece, at in zip(ids.split(16, 1), torch.arange(N)[None].split(16, 1))
        ]
    assert (torch.cat(pieces, 1) - whole)[:, 16:].abs().max() > 1e-3


def recompute(model, l, u):
    """Recurrent layer l over its input u [T, d_model] from its weights in float64, token by token (eq. 1-4 as
    transformers parametrises them: the block-diagonal gates x W + b, -Lambda stored, a reset at position 0)."""
    block = model.memory_layer(l)
    W = {n: p.detach().double() for n, p in block.named_parameters()}
    T, K, width = len(u), block.conv1d_width, block.lru_width
    heads, size = block.rg_lru.num_attention_heads, block.rg_lru.block_width
    y = F.gelu(u @ W["linear_y.weight"].T + W["linear_y.bias"], approximate="tanh")
    padded = torch.cat(
        [torch.zeros(K - 1, width, dtype=torch.float64), u @ W["linear_x.weight"].T + W["linear_x.bias"]]
    )
    x = torch.stack([(padded[t : t + K].T * W["conv_1d.weight"][:, 0]).sum(-1) for t in range(T)]) + W["conv_1d.bias"]

    def gate(name):
        pre = torch.einsum("thc,hcd->thd", x.view(T, heads, size), W[f"rg_lru.{name}_gate_weight"])
        return torch.sigmoid(pre + W[f"rg_lru.{name}_gate_bias"]).reshape(T, width)

    i, r = gate("input"), gate("recurrent")
    a = torch.exp(-8 * r * F.softplus(W["rg_lru.recurrent_param"]))
    scale = torch.sqrt(1 - a**2)
    a[0], scale[0] = 0, 1  # position 0: transformers' reset
    h, reads = torch.zeros(width, dtype=torch.float64), []
    for t in range(T):
        h = a[t] * h + scale[t] * i[t] * x[t]
        reads.append(h)
    read = torch.stack(reads)
    ones = torch.ones(T, width, 1, dtype=torch.float64)
    return dict(
        alpha=a,
        beta=scale * i,
        write_key=ones,
        write_value=x[..., None],
        read_query=ones,
        read=read[..., None],
        state_norm=read.abs(),
        input_gate=i,
        recurrence_gate=r,
        mem_out=read * y,
    )


def test_captured_quantities_equal_a_float64_recomputation(checkpoint):
    """Every hook of every recurrent layer from the layer's weights in float64 over its own input, to 1e-10."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    linear = model.cfg.linear_layers
    inputs = {}
    handles = [
        model.memory_layer(l).register_forward_pre_hook(lambda m, args, l=l: inputs.__setitem__(l, args[0]))
        for l in linear
    ]
    try:
        seen = model.capture(ids, [f"blocks.{l}.attn.hook_{n}" for l in linear for n in HOOKS])
    finally:
        for handle in handles:
            handle.remove()
    for l in linear:
        expected = recompute(model, l, inputs[l][0].double())
        for what, value in expected.items():
            torch.testing.assert_close(
                seen[f"blocks.{l}.attn.hook_{what}"], value, atol=1e-10, rtol=1e-10, msg=lambda m: f"{l} {what}: {m}"
            )
        alpha = seen[f"blocks.{l}.attn.hook_alpha"][1:]
        assert expected["state_norm"].max() > 0.3 and alpha.min() < 0.5 < 0.99 < alpha.max()


def test_generation_time_hooks_equal_a_one_pass_run_over_the_same_tokens(checkpoint):
    """Generation feeds one token a step through the same forward; its hooks at every step equal a one-pass run over
    the prompt and the generated tokens."""
    model = memviz.load(checkpoint, dtype="float64")
    linear = model.cfg.linear_layers
    names = [f"blocks.{l}.attn.hook_{n}" for l in (linear[0], linear[-1]) for n in HOOKS]
    names += ["blocks.2.attn.hook_k", "blocks.2.hook_attn_out", f"blocks.{linear[-1]}.hook_resid_post"]
    steps = {n: [] for n in names}
    prompt = model.tokenizer.encode("What is the pass key?")
    with model.hooks(fwd_hooks=[(n, lambda v, hook: steps[hook.name].append(v[0])) for n in names]):
        generated = model.generate_ids(prompt, max_new_tokens=6)
    assert len(generated) == 6 and [len(v) for v in steps[names[0]][1:]] == [1] * 6
    assert len(prompt) + 6 > 8  # past the attention's window
    whole = model.capture(prompt + generated, names)
    for name in names:
        torch.testing.assert_close(torch.cat(steps[name]), whole[name], atol=1e-10, rtol=1e-10, msg=name)


def test_a_reset_mid_call_is_transformers_packed_documents(checkpoint):
    """Positions that restart at 0 (packed documents) reset h there, as transformers does (its convolution does not
    reset): the logits equal transformers' float64 forward with its scan in float64 on the same call, the reset
    token's alpha is 0 and its h is its own write alone."""
    from transformers.models.recurrent_gemma import modeling_recurrent_gemma

    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)[:, :30]
    positions = torch.cat([torch.arange(13), torch.arange(17)])[None]
    names = [f"blocks.0.attn.hook_{n}" for n in ("read", "alpha", "beta", "write_value")]
    kept: dict[str, torch.Tensor] = {}
    hooks = [(n, lambda v, hook: kept.__setitem__(hook.name, v[0])) for n in names]
    with model.hooks(fwd_hooks=hooks), model.watching(), torch.no_grad():
        ours = model.hf(ids, position_ids=positions, use_cache=False).logits
    theirs = reference(checkpoint, torch.float64)
    with torch.no_grad(), pytest.MonkeyPatch.context() as patch:
        patch.setattr(modeling_recurrent_gemma.RecurrentGemmaRglru, "_rnn_scan", scan_in_float64)
        truth = theirs(ids, position_ids=positions, use_cache=False).logits  # a cache would change its masks
    torch.testing.assert_close(ours, truth, atol=1e-10, rtol=0)
    read, alpha, beta, value = (kept[n] for n in names)
    assert alpha[13].abs().max() == 0 < alpha[12].min()
    torch.testing.assert_close(read[13], beta[13, :, None] * value[13], atol=1e-12, rtol=0)


def test_readout_parts_sum_to_the_read_and_each_is_that_writer_alone(checkpoint):
    """h_t splits over the writers: the parts sum to hook_read, and part j equals the operator fed writer j's value
    alone (the others' zero), the run's own decays and write scales."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    position = 30
    readout = model.memory_readout(ids, position)
    parts_of = ("write_key", "write_value", "alpha", "beta", "read_query", "read")
    seen = model.capture(
        ids[:, : position + 1], [f"blocks.{l}.attn.hook_{n}" for l in model.cfg.linear_layers for n in parts_of]
    )
    assert set(readout.parts) == {f"blocks.{l}" for l in model.cfg.linear_layers}
    for l in model.cfg.linear_layers:
        k, v, alpha, beta, q, read = (seen[f"blocks.{l}.attn.hook_{n}"] for n in parts_of)
        parts = readout.parts[f"blocks.{l}"]
        assert parts.shape == (position + 1, *read.shape[1:])
        torch.testing.assert_close(readout.reads[f"blocks.{l}"], read[position], atol=1e-10, rtol=0)
        heads_first = lambda t: t.transpose(0, 1)[None]  # noqa: E731
        log_decay = heads_first(alpha.clamp_min(1e-300).log())
        for j in (0, position - 7, position):
            alone = torch.zeros_like(v)
            alone[j] = v[j]
            S = torch.zeros(1, k.shape[1], 1, 1, dtype=torch.float64)
            (o, _), _ = recurrent(
                heads_first(q), heads_first(k * beta[..., None]), heads_first(alone), log_decay, None, S
            )
            torch.testing.assert_close(parts[j], o[0, :, -1], atol=1e-12, rtol=0, msg=f"layer {l} writer {j}")
        assert parts[position - 7].abs().max() > 1e-6


def test_needle_hold_of_everything_is_the_state_norm(checkpoint):
    """The part of h the whole input wrote is h itself; a later span holds nothing before it."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    hold = model.needle_hold(ids, (0, N))
    _, cache = model.run_with_cache(ids)
    for l in model.cfg.linear_layers:
        norms = cache[f"blocks.{l}.attn.hook_state_norm"][0].amax(-1)
        np.testing.assert_allclose(
            hold[f"layer {l}: share of the span's write still in the state"], (norms / norms.max()).numpy(), atol=1e-6
        )
    later = model.needle_hold(ids, (20, 25))["layer 0: share of the span's write still in the state"]
    assert (later[:20] == 0).all() and later[20:25].max() > 0


def test_reset_and_patch_act_on_h_only(checkpoint):
    """A reset zeroes h and keeps the convolution's last inputs and the attention's cache; it moves the answer, and
    a patch with the run's own state gives the clean answer back."""
    model = memviz.load(checkpoint, segment_len=8)
    ids = ids_of(model).tolist()[0]
    with torch.no_grad():
        _, state = model(ids[:24], return_state=True)
    position, reset = interventions.ablate_at(model, 3)
    edited = reset(state)
    assert position == 24
    for l, (before, after) in enumerate(zip(state.layers, edited.layers)):
        if l in model.cfg.linear_layers:
            assert after.S.abs().max() == 0 < before.S.abs().max() and after.conv is before.conv
            assert after.S.dtype == torch.float32 and after.conv.abs().max() > 0
        else:
            assert after.k is before.k and after.k.shape[2] == 7  # the window's last 7 keys
    prompt, answer = model.tokenizer.decode(ids[:30]), model.tokenizer.decode(ids[30:34])
    clean = interventions.answer_logprob(model, prompt, answer)["logprob"]
    ablated = interventions.answer_logprob(model, prompt, answer, [interventions.ablate_at(model, 3)])["logprob"]
    patched = interventions.answer_logprob(model, prompt, answer, [interventions.replace_at(model, 3, prompt)])
    assert abs(ablated - clean) > 0.1 and patched["logprob"] == pytest.approx(clean, abs=1e-3)


def test_a_mem_out_hook_replaces_the_block_s_value(checkpoint):
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    name = f"blocks.{model.cfg.linear_layers[-1]}.attn.hook_mem_out"
    with torch.no_grad():
        clean = model(ids)
        same = model.run_with_hooks(ids, fwd_hooks=[(name, lambda v, hook: v)])
        zeroed = model.run_with_hooks(ids, fwd_hooks=[(name, lambda v, hook: torch.zeros_like(v))])
    torch.testing.assert_close(same, clean, atol=0, rtol=0)
    assert (zeroed - clean).abs().max() > 1e-3


def test_trace_figures_and_cost(checkpoint):
    """A default trace keeps a_t per channel, the mean write scale and ||h_t||; the figures draw them (a row a
    channel); cost prices what the trace keeps, the fixed state and the window's keys and values."""
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    tr = memviz.trace(model, ids[0].tolist())
    width = model.memory_layer(0).lru_width
    assert tr["blocks.0.attn.hook_alpha"].shape == (N, width) and np.isfinite(tr["loss"][:-1]).all()
    assert tr["blocks.0.attn.hook_state_norm"].shape == tr["blocks.0.attn.hook_beta"].shape == (N,)
    _, cache = model.run_with_cache(ids)
    np.testing.assert_allclose(tr["blocks.0.attn.hook_alpha"], cache["blocks.0.attn.hook_alpha"][0].numpy())
    np.testing.assert_allclose(
        tr["blocks.0.attn.hook_state_norm"], cache["blocks.0.attn.hook_read"][0].norm(dim=(-1, -2)).numpy(), rtol=1e-6
    )
    figs = get_family(model.family).figures(tr)
    assert {"blocks.0 alpha", "blocks.3 alpha", "write scale", "state norm"} <= set(figs)
    assert len(figs["blocks.0 alpha"].data[0].y) == width
    cost = model.cost(N)
    assert cost["trace"] == sum(a.nbytes for a in tr.arrays.values())
    with torch.no_grad():
        _, state = model(ids, return_state=True)
    linear = model.cfg.linear_layers
    assert cost["memory_state"] == sum(state.layers[l].S.numel() * 4 + state.layers[l].conv.numel() * 4 for l in linear)
    assert cost["kv_cache"] == state.layers[2].k.numel() * 4 + state.layers[2].v.numel() * 4 > 0
    assert model.cost(3)["kv_cache"] == cost["kv_cache"] * 3 // 7


def test_a_bfloat16_model_traces_with_its_quantities_in_float32(checkpoint):
    exact, half = memviz.load(checkpoint), memviz.load(checkpoint, dtype="bfloat16")
    ids = ids_of(exact)[0].tolist()
    a, b = memviz.trace(exact, ids), memviz.trace(half, ids)
    for name in ("blocks.0.attn.hook_alpha", "blocks.0.attn.hook_state_norm"):
        assert b[name].dtype == np.float32
        np.testing.assert_allclose(b[name], a[name], atol=0.05 * np.abs(a[name]).max())
    _, state = half(ids, return_state=True)
    assert state.layers[0].S.dtype == torch.float32 and state.layers[0].conv.dtype == torch.bfloat16


def test_every_hook_is_documented_and_every_documented_hook_is_somewhere(checkpoint):
    from memviz.running import generic_hook_name

    model = memviz.load(checkpoint)
    declared, present = set(get_family(model.family).hook_docs), {generic_hook_name(n) for n in model.hook_dict}
    assert present == declared


def test_the_family_declares_its_capabilities():
    family = get_family("hf_rg_lru")
    assert not family.from_config and family.readout and family.needle_hold and family.folders is not None
    assert not family.model.delta_rule and not family.model.decay_per_channel


def test_bad_input_gets_a_clear_error(checkpoint, tmp_path):
    """A config whose gates cannot be cut into a block a head, a state made for another batch, and a state from
    another model are refused by what is wrong."""
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(checkpoint, broken)
    config = json.loads((broken / "config.json").read_text())
    (broken / "config.json").write_text(json.dumps(config | {"lru_width": 33}))
    with pytest.raises(ReleasedCheckpointError, match="lru_width 33 is not a multiple of num_attention_heads 2"):
        memviz.load(broken)
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    with pytest.raises(ValueError, match="the state holds 2 sequence"):
        model(ids, state=model.init_state(2))
    with pytest.raises(ValueError, match="comes from another model"):
        model(ids, state=ModelState(0, model.init_state(1).layers[:2]))
