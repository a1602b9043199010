"""Released models (memviz.models.released) on small random checkpoints of every architecture, made here by
transformers itself (`tiny.tiny_checkpoint`): loading through the family that claims the folder, logits against
transformers' own forward, the memory's quantities against a float64 recomputation from the weights, the
recurrence run once through memviz's kernel, streaming and generation against one pass, read-out, needle hold,
interventions, the rest of memviz on them, and bad folders."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import memviz
from memviz import CheckpointError, interventions
from memviz.models.released import recurrence
from memviz.models.released.tiny import TEXT, tiny_checkpoint
from memviz.registry import get_family
from tests.conftest import HIGH_WATER_KB

ARCHITECTURES = ["qwen3_5_text", "qwen3_next", "olmo_hybrid", "kimi_linear", "bailing_hybrid"]
PER_CHANNEL = ("kimi_linear", "bailing_hybrid")  # Kimi Delta Attention: a decay per key channel
LINEAR = [0, 1, 3]
HEADS, D_K, D_V = 4, 8, 8  # every tiny model's memory layers
PASSAGE = TEXT + " The pass key is 71432. " * 3


@pytest.fixture(scope="module", params=ARCHITECTURES)
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    tiny_checkpoint(folder, request.param)
    return folder


def model_type(folder) -> str:
    return json.loads((folder / "config.json").read_text())["model_type"]


def reference(folder, dtype=torch.float32):
    """transformers' own model of the folder, untouched (its recurrence through its own kernels)."""
    arch = get_family(memviz.load(folder).family).model.architectures[model_type(folder)]
    experts = {"experts_implementation": "eager"} if arch.experts and dtype == torch.float64 else {}
    return arch.causal_lm().from_pretrained(folder, dtype=dtype, use_kernels=False, **experts).eval()


def ids_of(model, n: int = 40) -> torch.Tensor:
    ids = model.tokenizer.encode(PASSAGE * 4)[:n]
    assert len(ids) == n
    return torch.tensor([ids])


def test_each_architecture_is_claimed_by_its_family(checkpoint):
    from memviz.registry import folder_family

    model = memviz.load(checkpoint)
    assert folder_family(model_type(checkpoint)).name == model.family
    assert model.family == ("hf_kimi_delta_attention" if model_type(checkpoint) in PER_CHANNEL else "hf_gated_deltanet")
    assert model.cfg.linear_layers == LINEAR


def kernel_written_out(query, key, value, g, beta, initial_state, output_final_state, normalise, extra, watch):
    """transformers' memory-kernel contract written out here, token by token in float64, independently of memviz's
    kernel: q, k repeated to the value heads, unit-norm (x / sqrt(|x|^2 + 1e-6)), q scaled by d_k^-1/2, then
    S_t = (I - beta_t k_t k_t^T) Diag(exp g_t) S_{t-1} + beta_t k_t v_t^T and o_t = S_t^T q_t."""
    heads = value.shape[2]
    q, k = (t.double().repeat_interleave(heads // t.shape[2], 2) for t in (query, key))
    if normalise:
        q, k = (t / torch.sqrt((t * t).sum(-1, keepdim=True) + 1e-6) for t in (q, k))
    q = q / q.shape[-1] ** 0.5
    v, g, beta = value.double(), g.double(), beta.double()
    B, T, _, d_k = k.shape
    S = (
        torch.zeros(B, heads, d_k, v.shape[-1], dtype=torch.float64)
        if initial_state is None
        else initial_state.double()
    )
    reads = []
    for t in range(T):
        decay = g[:, t].exp()
        S = S * (decay[..., None] if decay.dim() == 3 else decay[..., None, None])
        kt = k[:, t, :, :, None]
        S = S + beta[:, t, :, None, None] * kt * (v[:, t, :, None, :] - (kt * S).sum(-2, keepdim=True))
        reads.append((q[:, t, :, :, None] * S).sum(-2))
    return torch.stack(reads, 1).to(value.dtype), S if output_final_state else None


def float64_truth(folder, ids):
    """transformers' float64 forward with its memory kernels mapped to `kernel_written_out` (transformers' own
    kernels compute in float32)."""
    model = reference(folder, torch.float64)
    recurrence.install(model)
    with pytest.MonkeyPatch.context() as patch, torch.no_grad():
        patch.setattr(recurrence, "run_memory", kernel_written_out)
        return model(ids).logits


def test_logits_equal_transformers_forward(checkpoint):
    """float64: memviz's model against transformers' forward with a token-by-token float64 recurrence, to float64
    rounding. float32: memviz's forward and transformers' own (its recurrence in its own float32 kernels) are as far
    from that float64 truth as each other; float32 rounding, amplified by these random weights, moves both."""
    ids = ids_of(memviz.load(checkpoint))
    truth = float64_truth(checkpoint, ids)
    exact = memviz.load(checkpoint, dtype="float64")
    with torch.no_grad():
        ours64, ours, theirs = exact(ids), memviz.load(checkpoint)(ids), reference(checkpoint)(ids).logits
    assert ours64.dtype == torch.float64 and truth.abs().max() > 1
    torch.testing.assert_close(ours64, truth, atol=1e-10, rtol=0)
    ours_off, theirs_off = ((x.double() - truth).abs().max().item() for x in (ours, theirs))
    assert ours_off <= 1.5 * theirs_off + 1e-6, (ours_off, theirs_off)
    torch.testing.assert_close(ours, theirs, atol=1e-3, rtol=1e-4)
    with pytest.raises(ValueError, match="makes its logits its own way"):  # transformers' head, not memviz's
        exact(ids, return_type="residual")


def test_the_recurrence_runs_once_through_memviz_s_kernel(checkpoint, monkeypatch):
    """Every memory layer's chunked and one-token kernels are memviz's; a traced forward (every hook) calls the
    operator once a layer, and transformers' own recurrence not at all."""
    model = memviz.load(checkpoint)
    for l in LINEAR:
        assert len(recurrence.installed(model.memory_layer(l))) == 2
    calls = []
    operator = recurrence.linear_memory
    monkeypatch.setattr(recurrence, "linear_memory", lambda *a, **kw: calls.append(1) or operator(*a, **kw))
    ids = ids_of(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
    assert len(calls) == len(LINEAR) and cache["blocks.3.attn.hook_state_norm"].shape == (1, 40, HEADS)
    model.hf.train()  # transformers re-kernelizes on a mode change only when it made the mapping
    model.hf.eval()
    assert all(len(recurrence.installed(model.memory_layer(l))) == 2 for l in LINEAR)
    model.hf.reset_kernels()  # transformers' own kernels back: its own forward to the bit
    with torch.no_grad():
        torch.testing.assert_close(model.hf(ids).logits, reference(checkpoint)(ids).logits, atol=0, rtol=0)
    assert not any(recurrence.installed(model.memory_layer(l)) for l in LINEAR)


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_streamed_equals_one_pass(checkpoint, chunk):
    """Streamed is the model's own forward chunk by chunk through transformers' cache, exactly; it is one pass up to
    what chunking moves by float32 rounding: no more than chunking moves transformers' own model (an expert
    router's choice can flip on that rounding)."""
    from transformers import DynamicCache

    def chunked(forward, config):
        cache = DynamicCache(config=config)
        return torch.cat([forward(piece, cache=cache, use_cache=True).logits for piece in ids.split(chunk, 1)], 1)

    model, hf = memviz.load(checkpoint), reference(checkpoint)
    ids = ids_of(model)
    with torch.no_grad():
        streamed = torch.cat([logits for _, logits, _ in model.stream(ids, chunk_len=chunk)], 1)
        torch.testing.assert_close(streamed, chunked(model.hf, model.hf.config), atol=0, rtol=0)
        moved, moved_theirs = (streamed - model(ids)).abs().max(), (chunked(hf, hf.config) - hf(ids).logits).abs().max()
    assert moved <= 2 * moved_theirs + 2e-4, (moved, moved_theirs)


def rms(o, weight, eps):
    return weight * o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps)


def memory_inputs(kind: str, mixer, x):
    """From a memory layer's weights in float64 over x [T, d_model]: its projections before the convolution
    [T, channels], the decay's log g [T, H] (or [T, H, d_k] per channel), beta [T, H], and the read's gated norm."""
    W = {n: p.detach().double() for n, p in mixer.named_parameters()}
    if kind == "bailing_hybrid":  # its safe gate: lower_bound sigmoid(exp(A_log) (f x + dt_bias))
        Wqkv = torch.cat([W[f"{n}_proj.weight"] for n in "qkv"])
        f = (x @ W["forget_gate.f_proj.weight"].T + W["forget_gate.dt_bias"]).view(len(x), HEADS, D_K)
        gate_rate = W["forget_gate.A_log"].exp()[:, None]
        g = mixer.forget_gate.lower_bound * torch.sigmoid(gate_rate * f)
        beta = torch.sigmoid(x @ W["b_proj.weight"].T)
        gate = (x @ W["g_proj.weight"].T).view(len(x), HEADS, D_V)
        out = lambda o: rms(o, W["o_norm.weight"], mixer.o_norm.variance_epsilon) * torch.sigmoid(gate)  # noqa: E731
        return Wqkv, g, beta, out
    if kind == "kimi_linear":
        Wqkv = torch.cat([W[f"{n}_proj.weight"] for n in "qkv"])
        f = x @ W["forget_gate.f_a_proj.weight"].T @ W["forget_gate.f_b_proj.weight"].T + W["forget_gate.dt_bias"]
        g = -W["forget_gate.A_log"].exp()[0, 0] * F.softplus(f.view(len(x), HEADS, D_K))
        beta = torch.sigmoid(x @ W["b_proj.weight"].T)
        gate = (x @ W["g_a_proj.weight"].T @ W["g_b_proj.weight"].T).view(len(x), HEADS, D_V)
        out = lambda o: rms(o, W["o_norm.weight"], mixer.o_norm.variance_epsilon) * torch.sigmoid(gate)  # noqa: E731
        return Wqkv, g, beta, out
    r = mixer.num_v_heads // mixer.num_k_heads
    if kind == "qwen3_next":  # per key head the rows [q, k, v (r heads), z (r heads)], [b (r), a (r)]
        rows = W["in_proj_qkvz.weight"].view(mixer.num_k_heads, 2 * D_K + 2 * r * D_V, -1)
        Wq, Wk, Wv, Wz = rows.split([D_K, D_K, r * D_V, r * D_V], 1)
        ba = W["in_proj_ba.weight"].view(mixer.num_k_heads, 2 * r, -1)
        Wqkv = torch.cat([w.reshape(-1, w.shape[-1]) for w in (Wq, Wk, Wv)])
        Wz, Wb, Wa = Wz.reshape(-1, Wz.shape[-1]), ba[:, :r].reshape(HEADS, -1), ba[:, r:].reshape(HEADS, -1)
        norm = "norm"
    elif kind == "olmo_hybrid":
        Wqkv = torch.cat([W[f"{n}_proj.weight"] for n in "qkv"])
        Wz, Wb, Wa, norm = W["g_proj.weight"], W["b_proj.weight"], W["a_proj.weight"], "o_norm"
    else:
        Wqkv, Wz, Wb, Wa = (W[f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a"))
        norm = "norm"
    g = -W["A_log"].exp() * F.softplus(x @ Wa.T + W["dt_bias"])
    beta = torch.sigmoid(x @ Wb.T) * (2 if kind == "olmo_hybrid" else 1)
    z = (x @ Wz.T).view(len(x), HEADS, D_V)
    eps = getattr(mixer, norm).variance_epsilon
    return Wqkv, g, beta, lambda o: rms(o, W[f"{norm}.weight"], eps) * F.silu(z)


def recompute(kind: str, mixer, x, alpha=None):
    """The memory layer over x [T, d_model] from its weights in float64, token by token with the transition written
    out: S_t = (I - beta_t k_t k_t^T) Diag(alpha_t) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t (S is [d_k, d_v]).
    With `alpha`, that decay instead of the one recomputed (the layers compute it in float32)."""
    Wqkv, g, beta, out = memory_inputs(kind, mixer, x)
    T, K = len(x), mixer.conv1d.weight.shape[-1]
    pre = torch.cat([torch.zeros(K - 1, Wqkv.shape[0], dtype=torch.float64), x @ Wqkv.T])
    conv = mixer.conv1d.weight.detach().double()[:, 0]  # [channels, K]
    mixed = F.silu(torch.stack([(pre[t : t + K].T * conv).sum(-1) for t in range(T)]))
    key_heads = mixed.shape[1] // D_K - HEADS * D_V // D_K
    q, k, v = mixed.split([key_heads // 2 * D_K, key_heads // 2 * D_K, HEADS * D_V], -1)

    def unit(y):
        return y / torch.sqrt((y * y).sum(-1, keepdim=True) + 1e-6)

    r = HEADS // (key_heads // 2)
    q = unit(q.view(T, -1, D_K)).repeat_interleave(r, 1) / D_K**0.5
    k = unit(k.view(T, -1, D_K)).repeat_interleave(r, 1)
    v = v.view(T, HEADS, D_V)
    decay = g.exp() if alpha is None else alpha
    per_channel = decay if decay.dim() == 3 else decay[..., None].expand(T, HEADS, D_K)
    S = torch.zeros(HEADS, D_K, D_V, dtype=torch.float64)
    eye = torch.eye(D_K, dtype=torch.float64)
    reads, norms = [], []
    for t in range(T):
        kt = k[t][:, :, None]
        A = (eye - beta[t][:, None, None] * kt @ kt.transpose(1, 2)) @ torch.diag_embed(per_channel[t])
        S = A @ S + beta[t][:, None, None] * kt @ v[t][:, None, :]
        reads.append((S.transpose(1, 2) @ q[t][:, :, None])[..., 0])
        norms.append(S.flatten(1).norm(dim=-1))
    read = torch.stack(reads)
    return dict(
        alpha=g.exp(),
        beta=beta,
        write_key=k,
        write_value=v,
        read_query=q,
        read=read,
        state_norm=torch.stack(norms),
        mem_out=out(read),
    )


def test_captured_quantities_equal_a_float64_recomputation(checkpoint):
    """The decay against its formula in float64 (the layers compute it in float32); every other quantity exactly,
    given the layer's own decay; the gated norm to float32 (the layers compute it in float32). Ling 3.0 keeps its
    short convolution's weights in float32, so its keys, values and queries, and what follows, to float32."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    hooks = ("alpha", "beta", "write_key", "write_value", "read_query", "read", "state_norm", "mem_out")
    names = [f"blocks.{l}.attn.hook_{n}" for l in LINEAR for n in hooks] + [
        f"blocks.{l}.hook_resid_pre" for l in LINEAR
    ]
    seen = {}

    def keep(value, hook):
        seen.setdefault(hook.name, []).append(value[0])

    with torch.no_grad(), model.hooks(fwd_hooks=[(n, keep) for n in names]):
        model(ids)
    seen = {n: torch.cat(v) for n, v in seen.items()}
    kind = model_type(checkpoint)
    for l in LINEAR:
        layer = model.decoder_layers[l]
        x = layer.input_layernorm(seen[f"blocks.{l}.hook_resid_pre"])
        alpha = seen[f"blocks.{l}.attn.hook_alpha"]
        assert alpha.shape == ((40, HEADS, D_K) if kind in PER_CHANNEL else (40, HEADS))
        expected = recompute(kind, model.memory_layer(l), x, alpha)
        for what, value in expected.items():
            tol = {"alpha": 1e-6, "mem_out": 1e-5}.get(what, 1e-5 if kind == "bailing_hybrid" else 1e-10)
            torch.testing.assert_close(
                seen[f"blocks.{l}.attn.hook_{what}"], value, atol=tol, rtol=tol, msg=lambda m: f"layer {l} {what}: {m}"
            )
        assert expected["state_norm"].max() > 0.3 and alpha.min() < 0.5 < alpha.max()


def test_streamed_quantities_equal_one_pass(checkpoint):
    """A chunk's quantities start from the state transformers carried: in float64 a streamed run's equal one pass's
    to float64 rounding (Kimi Delta Attention's layers keep their state in float32 between calls), where a wrong
    carry would move them by O(1)."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    names = [f"blocks.{l}.attn.hook_{n}" for l in LINEAR for n in ("read", "state_norm", "write_key", "alpha")]
    whole = model.capture(ids, names)
    parts = {n: [] for n in names}
    with torch.no_grad(), model.hooks(fwd_hooks=[(n, lambda v, hook: parts[hook.name].append(v[0])) for n in names]):
        for _ in model.stream(ids, chunk_len=6):
            pass
    tol = 1e-5 if model_type(checkpoint) in PER_CHANNEL else 1e-10  # float32 between chunks: its rounding, carried on
    for name in names:
        torch.testing.assert_close(torch.cat(parts[name]), whole[name], atol=tol, rtol=0, msg=name)


def test_generation_time_hooks_equal_a_one_pass_run_over_the_same_tokens(checkpoint):
    """Generation feeds one token a step through the one-token kernel; its hooks at every step equal a one-pass run
    over the prompt and the generated tokens."""
    model = memviz.load(checkpoint, dtype="float64")
    names = [f"blocks.{l}.attn.hook_{n}" for l in (0, 3) for n in ("read", "state_norm", "alpha", "beta")]
    steps = {n: [] for n in names}
    prompt = model.tokenizer.encode("What is the pass key?")
    with model.hooks(fwd_hooks=[(n, lambda v, hook: steps[hook.name].append(v[0])) for n in names]):
        generated = model.generate_ids(prompt, max_new_tokens=6)
    assert len(generated) == 6 and [len(v) for v in steps["blocks.0.attn.hook_read"][1:]] == [1] * 6
    tokens = prompt + generated  # each generated token is fed back, one a step
    whole = model.capture(tokens, names)
    tol = (
        1e-6 if model_type(checkpoint) in PER_CHANNEL else 1e-10
    )  # their layers keep the state in float32 between calls
    for name in names:
        torch.testing.assert_close(torch.cat(steps[name]), whole[name], atol=tol, rtol=tol, msg=name)


def test_the_read_is_what_transformers_read(checkpoint):
    """hook_read (memviz's kernel) is the read transformers passes to the layer's norm."""
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    theirs = []
    norm = model.arch.read_norm(model.memory_layer(1))
    handle = norm.register_forward_hook(lambda m, args, out: theirs.append(args[0].reshape(1, 40, HEADS, D_V)))
    try:
        _, cache = model.run_with_cache(ids, names_filter="blocks.1.attn.hook_read")
    finally:
        handle.remove()
    torch.testing.assert_close(cache["blocks.1.attn.hook_read"], theirs[0], atol=0, rtol=0)


def test_readout_parts_sum_to_the_read(checkpoint):
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    position = 30
    readout = model.memory_readout(ids, position)
    _, cache = model.run_with_cache(ids[:, : position + 1])
    assert set(readout.parts) == {"blocks.0", "blocks.1", "blocks.3"}
    for layer, read in readout.reads.items():
        assert readout.parts[layer].shape == (position + 1, HEADS, D_V)
        torch.testing.assert_close(read, cache[f"{layer}.attn.hook_read"][0, position], atol=1e-10, rtol=0)
        shares = readout.shares(layer).sum(0)
        torch.testing.assert_close(shares, torch.ones_like(shares), atol=1e-9, rtol=0)


def test_needle_hold_of_everything_is_the_state_norm(checkpoint):
    """The part of the state the whole input wrote is the state itself."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    hold = model.needle_hold(ids, (0, ids.shape[1]))
    _, cache = model.run_with_cache(ids)
    for l in LINEAR:
        norms = cache[f"blocks.{l}.attn.hook_state_norm"][0].amax(-1)
        np.testing.assert_allclose(
            hold[f"layer {l}: share of the span's write still in the state"], (norms / norms.max()).numpy(), atol=1e-6
        )
    later = model.needle_hold(ids, (20, 25))["layer 0: share of the span's write still in the state"]
    assert (later[:20] == 0).all() and later[20:25].max() > 0


def test_hooks_fire_at_every_token_during_generate(checkpoint):
    model = memviz.load(checkpoint)
    positions = []
    prompt = "What is the pass key?"
    with model.hooks(
        fwd_hooks=[
            ("blocks.0.attn.hook_alpha", lambda v, hook: positions.append(v.shape[1])),
            ("blocks.2.attn.hook_q", lambda v, hook: None),
        ]
    ):
        model.generate_ids(model.tokenizer.encode(prompt), max_new_tokens=6)
    n = len(model.tokenizer.encode(prompt))
    assert positions[0] == n and positions[1:] == [1] * (len(positions) - 1) and len(positions) >= 2


def test_the_tokenizer_reads_its_model_s_ids_and_refuses_others(checkpoint):
    tok = memviz.load(checkpoint).tokenizer
    ids = tok.encode(TEXT)
    assert tok.decode(ids) == TEXT and tok.token_strings(ids)[0] == tok.decode(ids[:1])
    for bad in (-1, tok.vocab_size):
        with pytest.raises(ValueError, match=f"token id {bad} at position 1 is outside"):
            tok.decode([ids[0], bad])


def test_reset_and_patch_act_on_the_memory_state_only(checkpoint):
    model = memviz.load(checkpoint, segment_len=16)
    ids = ids_of(model).tolist()[0]
    with torch.no_grad():
        _, state = model(ids[:16], return_state=True)
    position, reset = interventions.ablate_at(model, 1)
    edited = reset(state)
    assert position == 16
    for l, (before, after) in enumerate(zip(state.layers, edited.layers)):
        if l in LINEAR:
            assert after.S.abs().max() == 0 < before.S.abs().max()
            assert after.conv is before.conv
        else:
            assert after.k is before.k and after.k.shape[2] == 16
    prompt, answer = model.tokenizer.decode(ids[:30]), model.tokenizer.decode(ids[30:34])
    clean = interventions.answer_logprob(model, prompt, answer)["logprob"]
    ablated = interventions.answer_logprob(model, prompt, answer, [interventions.ablate_at(model, 1)])["logprob"]
    patched = interventions.answer_logprob(model, prompt, answer, [interventions.replace_at(model, 1, prompt)])[
        "logprob"
    ]
    assert abs(ablated - clean) > 0.05 and patched == pytest.approx(clean, abs=1e-3)


def test_trace_and_figures(checkpoint):
    model = memviz.load(checkpoint)
    tr = memviz.trace(model, PASSAGE)
    assert {"blocks.0.attn.hook_alpha", "blocks.3.attn.hook_state_norm", "blocks.1.attn.hook_mem_out"} <= set(tr.names)
    assert tr["blocks.0.attn.hook_beta"].shape == (len(tr), HEADS) and np.isfinite(tr["loss"][:-1]).all()
    per_channel = model_type(checkpoint) in PER_CHANNEL
    assert tr["blocks.0.attn.hook_alpha"].shape == ((len(tr), HEADS, D_K) if per_channel else (len(tr), HEADS))
    _, cache = model.run_with_cache(model.tokenizer.encode(PASSAGE))  # every hook: the read computed too
    np.testing.assert_allclose(
        tr["blocks.1.attn.hook_state_norm"], cache["blocks.1.attn.hook_state_norm"][0], rtol=1e-6
    )
    figs = get_family(model.family).figures(tr)
    assert {"blocks.0 alpha", "blocks.3 beta", "state norm"} <= set(figs)
    rows = len(figs["blocks.0 alpha"].data[0].y)
    assert rows == (HEADS * D_K if per_channel else HEADS)  # a row per head, or per head and key channel


def test_cost_counts_the_attention_cache_and_the_fixed_state(checkpoint):
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    with torch.no_grad():
        _, state = model(ids, return_state=True)
    cost = model.cost(ids.shape[1])
    assert cost["kv_cache"] == sum(t.numel() * 4 for t in (state.layers[2].k, state.layers[2].v))
    assert cost["memory_state"] == sum(state.layers[l].S.numel() * 4 + state.layers[l].conv.numel() * 4 for l in LINEAR)
    tr = memviz.trace(model, ids[0].tolist())
    assert cost["trace"] == sum(a.nbytes for a in tr.arrays.values())
    for nonsense in (-5, 2.5, True):
        with pytest.raises(ValueError, match="n_tokens must be a whole number of tokens"):
            model.cost(nonsense)


def test_a_bfloat16_model_traces_with_its_quantities_in_float32(checkpoint):
    exact, half = memviz.load(checkpoint), memviz.load(checkpoint, dtype="bfloat16")
    ids = ids_of(exact)[0].tolist()
    a, b = memviz.trace(exact, ids), memviz.trace(half, ids)
    for name in ("blocks.0.attn.hook_alpha", "blocks.0.attn.hook_state_norm"):
        assert b[name].dtype == np.float32
        np.testing.assert_allclose(b[name], a[name], atol=0.05 * np.abs(a[name]).max())


def test_the_family_declares_exactly_the_hooks_its_models_have(checkpoint):
    from memviz.running import generic_hook_name

    model = memviz.load(checkpoint)
    declared = set(get_family(model.family).hook_docs)
    assert {generic_hook_name(name) for name in model.hook_dict} == declared


def test_the_released_families_declare_they_are_not_built_from_a_config():
    for name in ("hf_gated_deltanet", "hf_kimi_delta_attention"):
        family = get_family(name)
        assert not family.from_config and family.readout and family.needle_hold and family.folders is not None
        with pytest.raises(memviz.ConfigError, match=f"family '{name}' is not built from a config"):
            memviz.build_model(memviz.ModelConfig(family=name, d_model=32, n_layers=2, n_heads=2, d_mlp=64))


# ----- one architecture is enough for what follows: the folder checks come before any architecture's code -----
@pytest.fixture(scope="module")
def qwen(tmp_path_factory):
    folder = tmp_path_factory.mktemp("qwen3_5_text")
    tiny_checkpoint(folder, "qwen3_5_text")
    return folder


def test_a_vision_language_qwen3_5_folder_loads_its_language_model(qwen, tmp_path):
    """model_type qwen3_5 (Qwen3.5's published form) holds its language model under text_config and
    model.language_model.*; transformers' own Qwen3_5ForCausalLM reads it."""
    vl = tmp_path / "vl"
    vl.mkdir()
    config = json.loads((qwen / "config.json").read_text())
    (vl / "config.json").write_text(
        json.dumps(
            {
                "model_type": "qwen3_5",
                "architectures": ["Qwen3_5ForConditionalGeneration"],
                "text_config": config,
                "vision_config": {"depth": 1},
            }
        )
    )
    weights = load_file(qwen / "model.safetensors")
    save_file(
        {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}, vl / "model.safetensors"
    )
    (vl / "tokenizer.json").write_text((qwen / "tokenizer.json").read_text())
    a, b = memviz.load(qwen), memviz.load(vl)
    ids = ids_of(a)
    with torch.no_grad():
        torch.testing.assert_close(a(ids), b(ids), atol=0, rtol=0)


def test_bad_folders_get_one_clear_error(qwen, tmp_path):
    good = qwen
    config = json.loads((good / "config.json").read_text())

    def folder(name, config_data, weights=True):
        path = tmp_path / name
        path.mkdir()
        (path / "config.json").write_text(json.dumps(config_data))
        (path / "tokenizer.json").write_text((good / "tokenizer.json").read_text())
        if weights:
            (path / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes())
        return path

    with pytest.raises(CheckpointError, match=r"no \*\.safetensors weights"):
        memviz.load(folder("no_weights", config, weights=False))
    with pytest.raises(
        CheckpointError,
        match=r"config\.json: field 'model_type' is 'rwkv', a model type memviz does not read; memviz loads "
        r".*kimi_linear \(Kimi Linear\), mamba \(Mamba\), mamba2 \(Mamba-2\), .*olmo_hybrid \(OLMo Hybrid\), qwen3_5 ",
    ):
        memviz.load(folder("unknown", {**config, "model_type": "rwkv"}))
    with pytest.raises(CheckpointError, match=r"config\.json: not a mamba2 config transformers accepts"):
        memviz.load(folder("relabelled", {**config, "model_type": "mamba2"}))  # Qwen3.5's fields are not Mamba-2's
    with pytest.raises(
        CheckpointError, match=r"config\.json: field 'model_type' is 'qwen2_5_vl', a vision-language checkpoint"
    ):
        memviz.load(folder("vision", {"model_type": "qwen2_5_vl", "vision_config": {}, "text_config": config}))
    with pytest.raises(
        CheckpointError,
        match=r"weights \(model\.safetensors\) do not fit config\.json: tensor "
        r"'model\.layers\.0\.linear_attn\.conv1d\.weight' is \(64, 1, 4\) but config\.json makes it \(48, 1, 4\)",
    ):
        memviz.load(folder("wrong_shape", {**config, "linear_key_head_dim": 4}))
    with pytest.raises(CheckpointError, match=r"takes the overrides dtype and segment_len, not \['bank_size'\]"):
        memviz.load(good, bank_size=4)
    # what transformers, huggingface_hub and safetensors refuse in their own exception types, each named here
    for name, changes in {
        "zero_heads": {"num_attention_heads": 0},
        "layers_and_types_differ": {"num_hidden_layers": 5},
        "float8": {"dtype": "float8", "torch_dtype": "float8"},
        "rope_bogus": {"rope_parameters": {"rope_type": "bogus"}},
    }.items():
        with pytest.raises(CheckpointError, match=rf"{name}.*config\.json"):
            memviz.load(folder(name, {**config, **changes}))
    quantised = folder("int8", config)
    weights = load_file(good / "model.safetensors")
    save_file({k: v.to(torch.int8) if v.dim() == 2 else v for k, v in weights.items()}, quantised / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"int8/model\.safetensors: weights stored as I8: a quantised checkpoint"):
        memviz.load(quantised)
    truncated = folder("truncated", config)
    (truncated / "model.safetensors").write_bytes((good / "model.safetensors").read_bytes()[:100])
    with pytest.raises(
        CheckpointError, match=r"truncated: transformers could not build the model .* or read its weights"
    ):
        memviz.load(truncated)
    # what transformers accepts but memviz would run wrongly by, or could not allocate
    for name, changes, said in [
        ("sizes_left_out", None, r"describes a model of [\d,]+ parameters, but .* nothing was allocated"),
        ("eos_empty", {"eos_token_id": []}, r"field 'eos_token_id' is \[\]"),
        ("eos_outside", {"eos_token_id": 10**6}, r"field 'eos_token_id' is 1000000; .* in \[0, "),
        ("type_list", {"model_type": ["qwen3_5"]}, r"field 'model_type' is \['qwen3_5'\]"),
        ("eps_nan", {"rms_norm_eps": float("nan")}, r"field 'rms_norm_eps' is nan"),
        (
            "layer_dropped",
            {"num_hidden_layers": 3, "layer_types": config["layer_types"][:3]},
            r"'model\.layers\.3\.[\w.]+' belongs to a layer past the config's num_hidden_layers \(3\)",
        ),
    ]:
        data = {"model_type": "qwen3_5_text"} if changes is None else {**config, **changes}
        with pytest.raises(CheckpointError, match=rf"{name}.*{said}"):
            memviz.load(folder(name, data))
    corrupt = folder("nan_weight", config)
    weights = load_file(good / "model.safetensors")
    weights["model.norm.weight"][0] = float("nan")
    save_file(weights, corrupt / "model.safetensors")
    with pytest.raises(CheckpointError, match=r"nan_weight: tensor 'model\.norm\.weight' holds NaN or infinity"):
        memviz.load(corrupt)
    fifo = folder("pipe", config)
    (fifo / "config.json").unlink()
    os.mkfifo(fifo / "config.json")
    with pytest.raises(CheckpointError, match=r"pipe/config\.json: not a regular file"):
        memviz.load(fifo)


GROWN_CONFIG_PEAK = HIGH_WATER_KB + textwrap.dedent(
    """
    import json, sys
    sys.path.insert(0, {root!r})
    import memviz
    memviz.load({small!r})  # the imports and a load's own working set, before the measured one
    before = high_water_kb()
    try:
        memviz.load({folder!r})
        said = "loaded"
    except memviz.CheckpointError as exc:
        said = str(exc)
    print(json.dumps({{"said": said, "growth_kb": high_water_kb() - before}}))
    """
)


@pytest.mark.parametrize("layers", [10**5, 10**7])
def test_a_config_of_millions_of_layers_is_refused_before_memory_grows(qwen, tmp_path, layers):
    """num_hidden_layers far past what the weights hold, layer_types left out (transformers would build every
    layer's modules before any size check): refused from the numbers, the process's peak growing under 200 MB."""
    grown = tmp_path / "grown"
    grown.mkdir()
    config = json.loads((qwen / "config.json").read_text())
    del config["layer_types"]
    (grown / "config.json").write_text(json.dumps(config | {"num_hidden_layers": layers}))
    for name in ("model.safetensors", "tokenizer.json"):
        (grown / name).write_bytes((qwen / name).read_bytes())
    root = str(Path(__file__).resolve().parents[3])
    script = GROWN_CONFIG_PEAK.format(root=root, small=str(qwen), folder=str(grown))
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=600)
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert re.search(
        rf"grown/config\.json: field 'num_hidden_layers' is {layers:,}, but its weights hold 4 layers", result["said"]
    )
    assert result["growth_kb"] < 200 * 1024, result


def test_sharded_folders_and_a_foreign_tokenizer_are_refused_naming_the_file(qwen, tmp_path):
    """A shard index that is not JSON, or that names a shard not there; a sharded folder whose config.json is not
    JSON; a tokenizer.json of more tokens than the config's vocab_size: each refused at load, naming its file."""
    from memviz.models.released.tiny import write_tokenizer

    weights = load_file(qwen / "model.safetensors")
    names = sorted(weights)

    def sharded(name: str, config_text: str, index_text: str | None = None) -> Path:
        folder = tmp_path / name
        folder.mkdir()
        (folder / "config.json").write_text(config_text)
        (folder / "tokenizer.json").write_bytes((qwen / "tokenizer.json").read_bytes())
        half = len(names) // 2
        shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
        for shard, keys in shards.items():
            save_file({k: weights[k] for k in keys}, folder / shard)
        total = sum(t.numel() * t.element_size() for t in weights.values())
        index = {"metadata": {"total_size": total}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
        (folder / "model.safetensors.index.json").write_text(index_text or json.dumps(index))
        return folder

    config = (qwen / "config.json").read_text()
    whole = sharded("sharded", config)
    with torch.no_grad():
        ids = ids_of(memviz.load(qwen))
        torch.testing.assert_close(memviz.load(whole)(ids), memviz.load(qwen)(ids), atol=0, rtol=0)
    with pytest.raises(CheckpointError, match=r"bad_index/model\.safetensors\.index\.json: not readable JSON"):
        memviz.load(sharded("bad_index", config, "{not json"))
    gone = json.dumps({"metadata": {}, "weight_map": {names[0]: "model-00003-of-00002.safetensors"}})
    with pytest.raises(CheckpointError, match=r"index\.json: names shard 'model-00003-of-00002\.safetensors', which"):
        memviz.load(sharded("gone_shard", config, gone))
    with pytest.raises(
        CheckpointError, match=r"bad_config/config\.json: cannot read the config|bad_config/config\.json"
    ):
        memviz.load(sharded("bad_config", "{not json"))
    big = tmp_path / "big_tokenizer"
    big.mkdir()
    for name in ("config.json", "model.safetensors"):
        (big / name).write_bytes((qwen / name).read_bytes())
    write_tokenizer(big, " ".join(f"word{i} thing{i * 7}" for i in range(400)), vocab_size=400)
    vocab = json.loads(config)["vocab_size"]
    with pytest.raises(
        CheckpointError,
        match=rf"big_tokenizer/tokenizer\.json has [\d,]+ tokens, but .*/config\.json's vocab_size is {vocab}",
    ):
        memviz.load(big)


def test_transformer_lens_bridge_agrees_where_it_has_the_quantity(qwen):
    """TransformerLens 4.3's GatedDeltaNetBridge on the same layer, cache-less prefill with its eager scan: beta,
    the log decay (alpha = exp g) and S_t (its norm, and the last S against the state memviz carries). Given
    transformers' `cache=` (it looks for `cache_params`) the bridge ignores the cache, which is why memviz streams
    through its own hooks (docs/released.md)."""
    from transformer_lens.model_bridge.generalized_components.gated_delta_net import GatedDeltaNetBridge

    model = memviz.load(qwen)
    ids = ids_of(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
        _, state = model(ids, return_state=True)
    layer = model.hf.model.layers[1]
    bridge = GatedDeltaNetBridge("linear_attn")
    bridge.set_original_component(layer.linear_attn)
    bridge.eager_scan = True
    got = {}
    for name in ("hook_beta", "hook_log_decay", "hook_ssm_state"):
        getattr(bridge, name).add_hook(lambda value, hook, name=name: got.__setitem__(name, value))
    x = layer.input_layernorm(cache["blocks.1.hook_resid_pre"])
    with torch.no_grad():
        bridge(hidden_states=x)
        torch.testing.assert_close(got["hook_beta"], cache["blocks.1.attn.hook_beta"], atol=1e-7, rtol=0)
        torch.testing.assert_close(got["hook_log_decay"].exp(), cache["blocks.1.attn.hook_alpha"], atol=1e-7, rtol=0)
        states = got["hook_ssm_state"]  # [batch, pos, head, d_k, d_v]
        torch.testing.assert_close(
            states.flatten(3).norm(dim=-1), cache["blocks.1.attn.hook_state_norm"], atol=1e-4, rtol=1e-5
        )
        torch.testing.assert_close(states[:, -1], state.layers[1].S, atol=1e-5, rtol=1e-5)
        _, early = model(ids[:, :20], return_state=True)
        bridged = bridge(hidden_states=x[:, 20:], cache=model.cache_from(early))
    assert (bridged - cache["blocks.1.hook_attn_out"][:, 20:]).abs().max() > 0.1
