"""Released state-space models (memviz.models.released: `ssd.py`, Mamba-2 and its hybrids; `selective_scan.py`,
Mamba-1 and its hybrid) on small random checkpoints of every architecture made here by transformers itself
(`tiny.tiny_checkpoint`): logits against transformers' forward, the scan's quantities against a float64
recomputation from the weights, the scan run once through memviz's kernel, streaming and generation against one
pass, read-out (each part the read with that writer alone), needle hold, interventions, trace, figures and cost."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import memviz
from memviz import interventions
from memviz.models.released import recurrence
from memviz.models.released.tiny import TEXT, tiny_checkpoint
from memviz.registry import get_family
from memviz_kernels.linear_memory.reference import recurrent

SSD = ["mamba2", "bamba", "granitemoehybrid", "nemotron_h", "falcon_h1", "zamba2"]  # Mamba-2: a scalar decay per head
SELECTIVE = ["mamba", "falcon_mamba", "jamba"]  # Mamba-1: a decay per channel and state dimension
PURE = ("mamba2", "mamba", "falcon_mamba")  # every layer a memory, no attention, no MLP
EVERY_LAYER = PURE + ("falcon_h1", "zamba2")  # every layer a memory (Falcon-H1's and Zamba2's some with attention)
PASSAGE = TEXT + " The pass key is 71432. " * 3
N = 40  # tokens of the tests' input


@pytest.fixture(scope="module", params=SSD + SELECTIVE)
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    tiny_checkpoint(folder, request.param)
    return folder


def model_type(folder) -> str:
    return json.loads((folder / "config.json").read_text())["model_type"]


def is_ssd(folder) -> bool:
    return model_type(folder) in SSD


def reference(folder, dtype=torch.float32):
    """transformers' own model of the folder, untouched (its scan on its own torch path)."""
    arch = get_family(memviz.load(folder).family).model.architectures[model_type(folder)]
    experts = {"experts_implementation": "eager"} if arch.experts and dtype == torch.float64 else {}
    return arch.causal_lm().from_pretrained(folder, dtype=dtype, use_kernels=False, **experts).eval()


def ids_of(model, n: int = N) -> torch.Tensor:
    ids = model.tokenizer.encode(PASSAGE * 4)[:n]
    assert len(ids) == n
    return torch.tensor([ids])


def cached_state(cache, module, shape) -> torch.Tensor:
    """The layer's state in the cache (memviz's layout, what memviz's kernel keeps there), or zeros."""
    S = cache.get_recurrent_state(module.layer_idx) if cache is not None else None
    return torch.zeros(shape, dtype=torch.float64) if S is None else S.double()


def ssd_written_out(module, x, B, C, dt, cache, watch):
    """Mamba-2's scan as the paper writes it, token by token in float64, independently of memviz's operator:
    h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T and y_t = h_t C_t + D x_t per head, h [head_dim, d_state]."""
    b, T, _ = x.shape
    H, P, N_, G = module.num_heads, module.head_dim, module.ssm_state_size, module.n_groups
    group = torch.arange(H) // (H // G)
    step = F.softplus(dt.double() + module.dt_bias.double()).clamp(*module.time_step_limit)
    A, D = -module.A_log.double().exp(), module.D.double()
    xs, Bs, Cs = x.double().view(b, T, H, P), B.double().view(b, T, G, N_), C.double().view(b, T, G, N_)
    h = cached_state(cache, module, (b, H, N_, P)).transpose(-1, -2)
    ys = []
    for t in range(T):
        decay = (step[:, t] * A).exp()[..., None, None]
        h = decay * h + step[:, t, :, None, None] * xs[:, t, :, :, None] * Bs[:, t, group, None, :]
        ys.append((h * Cs[:, t, group, None, :]).sum(-1) + D[:, None] * xs[:, t])
    if cache is not None:
        cache.update_recurrent_state(h.transpose(-1, -2).to(x.dtype), module.layer_idx)
    return torch.stack(ys, 1).reshape(b, T, H * P).to(x.dtype)


def scan_written_out(module, x, time_step, B, C, gate, cache, watch):
    """Mamba-1's scan as the paper writes it, token by token in float64: h_t = exp(dt_t A_c) o h_{t-1} +
    dt_t B_t x_t per channel c, y_t = C_t . h_t + D x_t, output y_t silu(z_t)."""
    b, channels, T = x.shape
    step = F.softplus(time_step.double() + module.dt_proj.bias.double()[:, None])
    A, D = -module.A_log.double().exp(), module.D.double()
    h = cached_state(cache, module, (b, channels, module.ssm_state_size, 1))[..., 0]
    ys = []
    for t in range(T):
        h = (step[:, :, t, None] * A).exp() * h + step[:, :, t, None] * B.double()[:, t, None] * x.double()[
            :, :, t, None
        ]
        ys.append((h * C.double()[:, t, None]).sum(-1) + D * x.double()[:, :, t])
    if cache is not None:
        cache.update_recurrent_state(h[..., None].to(x.dtype), module.layer_idx)
    return (torch.stack(ys, -1) * F.silu(gate.double())).to(x.dtype)


def head_input(hf, run):
    """What transformers' LM head reads (the final hidden states) during run(): Mamba, Mamba-2, Falcon Mamba and
    Nemotron-H cast their logits to float32 after the head, so a float64 model's own precision is in its input."""
    kept = []
    handle = hf.lm_head.register_forward_pre_hook(lambda m, args: kept.append(args[0]))
    try:
        with torch.no_grad():
            logits = run()
    finally:
        handle.remove()
    return torch.cat(kept, 1), logits


def float64_truth(folder, ids):
    """transformers' float64 forward with its scans mapped to the written-out ones above (transformers' own scans
    compute in float32): (the head's input, the logits)."""
    model = reference(folder, torch.float64)
    recurrence.install(model)
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(recurrence, "run_ssd", ssd_written_out)
        patch.setattr(recurrence, "run_selective_scan", scan_written_out)
        return head_input(model, lambda: model(ids).logits)


def test_each_architecture_is_claimed_by_its_family(checkpoint):
    from memviz.registry import folder_family

    model = memviz.load(checkpoint)
    assert folder_family(model_type(checkpoint)).name == model.family
    assert model.family == ("hf_mamba2" if is_ssd(checkpoint) else "hf_mamba")
    every = model_type(checkpoint) in EVERY_LAYER
    assert model.cfg.linear_layers == ([0, 1, 2, 3] if every else [0, 1, 3])


def test_logits_equal_transformers_forward(checkpoint):
    """float64: memviz's model against transformers' forward with a token-by-token float64 scan, to 1e-10 (the
    head's input; the logits to their own dtype's rounding, float32 where transformers casts them). float32: against
    transformers' own forward (its scan on its float32 torch path) to 1e-5 of the logits' scale."""
    ids = ids_of(memviz.load(checkpoint))
    truth_hidden, truth = float64_truth(checkpoint, ids)
    exact = memviz.load(checkpoint, dtype="float64")
    hidden, ours64 = head_input(exact.hf, lambda: exact(ids))
    assert hidden.dtype == torch.float64 and truth.abs().max() > 1
    torch.testing.assert_close(hidden, truth_hidden, atol=1e-10, rtol=0)
    torch.testing.assert_close(ours64, truth, atol=1e-10 if truth.dtype == torch.float64 else 1e-5, rtol=0)
    with torch.no_grad():
        ours, theirs = memviz.load(checkpoint)(ids), reference(checkpoint)(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_the_scan_runs_once_through_memviz_s_kernel(checkpoint, monkeypatch):
    """Every memory layer's scan kernel is memviz's; a traced forward (every hook) calls the operator once a layer;
    transformers' own kernels back give transformers' own forward to the bit."""
    model = memviz.load(checkpoint)
    linear = model.cfg.linear_layers
    name = "mamba2_scan_forward" if is_ssd(checkpoint) else "mamba_scan_forward"
    assert all(recurrence.installed(model.memory_layer(l)) == [name] for l in linear)
    calls = []
    operator = recurrence.linear_memory
    monkeypatch.setattr(recurrence, "linear_memory", lambda *a, **kw: calls.append(1) or operator(*a, **kw))
    ids = ids_of(model)
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
    assert len(calls) == len(linear) and cache[f"blocks.{linear[-1]}.attn.hook_state_norm"].shape[:2] == (1, N)
    model.hf.reset_kernels()
    with torch.no_grad():
        torch.testing.assert_close(model.hf(ids).logits, reference(checkpoint)(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_streamed_equals_one_pass(checkpoint, chunk):
    """Streamed in float64 is one pass to float64 rounding (the scan starts each chunk from the state carried in
    transformers' cache), and it is the model's own forward chunk by chunk through that cache, exactly."""
    from transformers import DynamicCache

    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    with torch.no_grad():
        streamed = torch.cat([logits for _, logits, _ in model.stream(ids, chunk_len=chunk)], 1)
        cache = DynamicCache(config=model.hf.config)
        positions = torch.arange(N)[None].split(chunk, 1)  # given: a hybrid's cache counts tokens in layer 0, a scan
        by_hand = [
            model.hf(piece, position_ids=at, cache=cache, use_cache=True).logits
            for piece, at in zip(ids.split(chunk, 1), positions)
        ]
        torch.testing.assert_close(streamed, torch.cat(by_hand, 1), atol=0, rtol=0)
        torch.testing.assert_close(
            streamed, model(ids), atol=1e-10 if streamed.dtype == torch.float64 else 1e-5, rtol=0
        )


def mixer_inputs(model, folder, l, u):
    """From memory layer l's weights in float64 over its input u [T, d_model]: x [T, H, P] (Mamba-1: [T, channels,
    1]), B and C repeated to the heads (or channels), the step dt (after bias and softplus), the log decay, and the
    gate z. The short convolution is written out; Falcon Mamba's and Jamba's norms of B, C and dt are the mixer's own
    modules."""
    mixer = model.memory_layer(l)
    W = {n: p.detach().double() for n, p in mixer.named_parameters()}
    T, K = len(u), mixer.conv1d.weight.shape[-1]

    def conv(pre):  # causal depthwise convolution over K tokens with bias, then silu
        padded = torch.cat([torch.zeros(K - 1, pre.shape[1], dtype=torch.float64), pre])
        w = W["conv1d.weight"][:, 0]
        return F.silu(torch.stack([(padded[t : t + K].T * w).sum(-1) for t in range(T)]) + W.get("conv1d.bias", 0))

    u = u * getattr(mixer, "ssm_in_multiplier", 1)  # Falcon-H1's multipliers, of the input and each projection
    projected = (u @ W["in_proj.weight"].T + W.get("in_proj.bias", 0)) * getattr(mixer, "mup_vector", torch.ones(1))[0]
    if is_ssd(folder):
        H, P, N_, G = mixer.num_heads, mixer.head_dim, mixer.ssm_state_size, mixer.n_groups
        inner = H * P
        z, xBC, dt = projected.split([inner, inner + 2 * G * N_, H], -1)
        x, B, C = conv(xBC).split([inner, G * N_, G * N_], -1)
        B, C = (m.view(T, G, N_).repeat_interleave(H // G, 1) for m in (B, C))
        step = F.softplus(dt + W["dt_bias"]).clamp(*mixer.time_step_limit)
        return x.view(T, H, P), B, C, step, step * -W["A_log"].exp(), z.view(T, H, P)
    channels, N_ = mixer.intermediate_size, mixer.ssm_state_size
    x, z = projected.split([channels, channels], -1)
    x = conv(x)
    ts, B, C = (x @ W["x_proj.weight"].T).split([mixer.time_step_rank, N_, N_], -1)
    if hasattr(mixer, "b_layernorm"):
        ts, B, C = mixer.dt_layernorm(ts), mixer.b_layernorm(B), mixer.c_layernorm(C)
    step = F.softplus(ts @ W["dt_proj.weight"].T + W["dt_proj.bias"])
    B, C = (m[:, None].expand(T, channels, N_) for m in (B, C))
    return x[..., None], B, C, step, step[..., None] * -W["A_log"].exp(), z


def recompute(model, folder, l, u):
    """Memory layer l over u from its weights in float64, token by token: S_t = Diag(alpha_t) S_{t-1} +
    dt_t B_t x_t^T, y_t = S_t^T C_t (S [d_state, d_v] per head or channel)."""
    mixer = model.memory_layer(l)
    x, B, C, step, log_decay, z = mixer_inputs(model, folder, l, u)
    alpha = log_decay.exp()
    per_channel = alpha if alpha.dim() == 3 else alpha[..., None].expand(B.shape)
    S = torch.zeros(*B.shape[1:], x.shape[-1], dtype=torch.float64)
    reads, norms = [], []
    for t in range(len(u)):
        S = per_channel[t][..., None] * S + step[t][:, None, None] * B[t][..., None] * x[t][:, None, :]
        reads.append((S * C[t][..., None]).sum(-2))
        norms.append(S.flatten(1).norm(dim=-1))
    read = torch.stack(reads)
    D = mixer.D.double()
    if is_ssd(folder) and model.arch.read_norm(mixer) is None:  # Falcon-H1 without its gated norm: before the gate
        mem_out = read + D[:, None] * x
    elif is_ssd(folder):
        y = (read + D[:, None] * x) * F.silu(z)  # the gated norm: RMS per group of channels, in float32
        grouped = y.reshape(len(u), -1, mixer.norm.group_size)
        normed = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + mixer.norm.variance_epsilon)
        mem_out = (mixer.norm.weight.double() * normed.reshape(len(u), -1)).view(x.shape)
    else:
        mem_out = (read[..., 0] + D * x[..., 0]) * F.silu(z)
    return dict(
        alpha=alpha,
        beta=step,
        write_key=B,
        write_value=x,
        read_query=C,
        read=read,
        state_norm=torch.stack(norms),
        mem_out=mem_out,
    )


def test_captured_quantities_equal_a_float64_recomputation(checkpoint):
    """Every scan quantity from the layer's weights in float64 over the layer's own input, to float64 rounding; the
    gated norm to float32 (transformers computes it in float32)."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    linear = model.cfg.linear_layers
    hooks = ("alpha", "beta", "write_key", "write_value", "read_query", "read", "state_norm", "mem_out")
    names = [f"blocks.{l}.attn.hook_{n}" for l in linear for n in hooks]
    inputs = {}
    handles = [
        model.memory_layer(l).register_forward_pre_hook(
            lambda m, args, kwargs, l=l: inputs.__setitem__(
                l, (kwargs.get("hidden_states", args[0] if args else None))
            ),
            with_kwargs=True,
        )
        for l in linear
    ]
    try:
        seen = model.capture(ids, names)
    finally:
        for handle in handles:
            handle.remove()
    for l in linear:
        expected = recompute(model, checkpoint, l, inputs[l][0].double())
        for what, value in expected.items():
            tol = 1e-5 if what == "mem_out" and is_ssd(checkpoint) else 1e-10
            torch.testing.assert_close(
                seen[f"blocks.{l}.attn.hook_{what}"], value, atol=tol, rtol=tol, msg=lambda m: f"layer {l} {what}: {m}"
            )
        alpha = seen[f"blocks.{l}.attn.hook_alpha"]
        assert expected["state_norm"].max() > 0.3 and alpha.min() < 0.5 < alpha.max()


def test_generation_time_hooks_equal_a_one_pass_run_over_the_same_tokens(checkpoint):
    """Generation feeds one token a step through the same kernel; its hooks at every step equal a one-pass run over
    the prompt and the generated tokens."""
    model = memviz.load(checkpoint, dtype="float64")
    linear = model.cfg.linear_layers
    names = [f"blocks.{l}.attn.hook_{n}" for l in (linear[0], linear[-1]) for n in ("read", "state_norm", "alpha")]
    names.append(f"blocks.{linear[-1]}.attn.hook_mem_out")
    steps = {n: [] for n in names}
    prompt = model.tokenizer.encode("What is the pass key?")
    with model.hooks(fwd_hooks=[(n, lambda v, hook: steps[hook.name].append(v[0])) for n in names]):
        generated = model.generate_ids(prompt, max_new_tokens=6)
    assert len(generated) == 6 and [len(v) for v in steps[names[0]][1:]] == [1] * 6
    whole = model.capture(prompt + generated, names)
    for name in names:
        torch.testing.assert_close(torch.cat(steps[name]), whole[name], atol=1e-10, rtol=1e-10, msg=name)


def test_readout_parts_sum_to_the_read_and_each_is_that_writer_alone(checkpoint):
    """The read h_t C_t splits over the writers: the parts sum to hook_read, and part j equals the scan fed writer
    j's x_j alone (the others' values zero), the run's own decays, steps and keys."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    position = 30
    readout = model.memory_readout(ids, position)
    names = [
        f"blocks.{l}.attn.hook_{n}"
        for l in model.cfg.linear_layers
        for n in ("write_key", "write_value", "alpha", "beta", "read_query", "read")
    ]
    seen = model.capture(ids[:, : position + 1], names)
    assert set(readout.parts) == {f"blocks.{l}" for l in model.cfg.linear_layers}
    for l in model.cfg.linear_layers:
        k, v, alpha, beta, q, read = (
            seen[f"blocks.{l}.attn.hook_{n}"]
            for n in ("write_key", "write_value", "alpha", "beta", "read_query", "read")
        )
        parts = readout.parts[f"blocks.{l}"]
        assert parts.shape == (position + 1, *read.shape[1:])
        torch.testing.assert_close(readout.reads[f"blocks.{l}"], read[position], atol=1e-10, rtol=0)
        heads_first = lambda t: t.transpose(0, 1)[None]  # noqa: E731
        log_decay = heads_first(alpha.log())
        for j in (0, position - 7, position):
            alone = torch.zeros_like(v)
            alone[j] = v[j]
            S = torch.zeros(1, k.shape[1], k.shape[2], v.shape[2], dtype=torch.float64)
            (o, _), _ = recurrent(
                heads_first(q), heads_first(k * beta[..., None]), heads_first(alone), log_decay, None, S
            )
            torch.testing.assert_close(parts[j], o[0, :, -1], atol=1e-12, rtol=0, msg=f"layer {l} writer {j}")
        assert parts[position - 7].abs().max() > 1e-6


def test_needle_hold_of_everything_is_the_state_norm(checkpoint):
    """The part of the state the whole input wrote is the state itself; a later span holds nothing before it."""
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


def test_reset_and_patch_act_on_the_memory_state_only(checkpoint):
    """A reset zeroes S and keeps the convolution's last inputs and the attention caches; it moves the answer, and a
    patch with the run's own state gives the clean answer back."""
    model = memviz.load(checkpoint, segment_len=16)
    ids = ids_of(model).tolist()[0]
    with torch.no_grad():
        _, state = model(ids[:16], return_state=True)
    position, reset = interventions.ablate_at(model, 1)
    edited = reset(state)
    assert position == 16
    for l, (before, after) in enumerate(zip(state.layers, edited.layers)):
        if l in model.cfg.linear_layers:
            assert after.S.abs().max() == 0 < before.S.abs().max() and after.conv is before.conv
            attends = bool(model.attention_sites(l))  # Falcon-H1's every layer, Zamba2's hybrid layers
            assert after.attention is before.attention and (before.attention is not None) == attends
        else:
            assert after.k is before.k
    prompt, answer = model.tokenizer.decode(ids[:30]), model.tokenizer.decode(ids[30:34])
    clean = interventions.answer_logprob(model, prompt, answer)["logprob"]
    ablated = interventions.answer_logprob(model, prompt, answer, [interventions.ablate_at(model, 1)])["logprob"]
    patched = interventions.answer_logprob(model, prompt, answer, [interventions.replace_at(model, 1, prompt)])
    assert abs(ablated - clean) > 0.05 and patched["logprob"] == pytest.approx(clean, abs=1e-3)


def test_a_mem_out_hook_replaces_the_layer_s_value(checkpoint):
    """What a hook on hook_mem_out returns is what the layer passes on: zeroing it in the last memory layer moves
    the logits, and an identity hook leaves them as they were."""
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
    """A default trace keeps the decay, the step and the state norm (Mamba-1: the decay a channel, averaged over
    its state dimensions, and the layer's norms); the family's figures draw them; cost prices what the trace keeps
    and the fixed state."""
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    tr = memviz.trace(model, ids[0].tolist())
    first = model.memory_layer(0)
    width = first.num_heads if is_ssd(checkpoint) else first.intermediate_size
    assert tr["blocks.0.attn.hook_alpha"].shape == (N, width) and np.isfinite(tr["loss"][:-1]).all()
    assert tr["blocks.0.attn.hook_state_norm"].shape == ((N, width) if is_ssd(checkpoint) else (N,))
    _, cache = model.run_with_cache(ids)
    np.testing.assert_allclose(
        tr["blocks.0.attn.hook_alpha"],
        cache["blocks.0.attn.hook_alpha"][0].numpy().reshape(N, width, -1).mean(-1),
        rtol=1e-6,
    )
    figs = get_family(model.family).figures(tr)
    assert {"blocks.0 alpha", "state norm"} <= set(figs) and len(figs["blocks.0 alpha"].data[0].y) == width
    assert ("blocks.0 dt" in figs) == is_ssd(checkpoint)
    cost = model.cost(N)
    assert cost["trace"] == sum(a.nbytes for a in tr.arrays.values())
    with torch.no_grad():
        _, state = model(ids, return_state=True)
    linear = model.cfg.linear_layers
    assert cost["memory_state"] == sum(state.layers[l].S.numel() * 4 + state.layers[l].conv.numel() * 4 for l in linear)
    attention = [part if l not in linear else part.attention for l, part in enumerate(state.layers)]
    attention = [part for part in attention if part is not None and part.k.shape[2]]
    assert cost["kv_cache"] == sum(p.k.numel() * 4 + p.v.numel() * 4 for p in attention)
    assert (cost["kv_cache"] == 0) == (model_type(checkpoint) in PURE)


def test_a_bfloat16_model_traces_with_its_quantities_in_float32(checkpoint):
    exact, half = memviz.load(checkpoint), memviz.load(checkpoint, dtype="bfloat16")
    ids = ids_of(exact)[0].tolist()
    a, b = memviz.trace(exact, ids), memviz.trace(half, ids)
    for name in ("blocks.0.attn.hook_alpha", "blocks.0.attn.hook_state_norm"):
        assert b[name].dtype == np.float32
        np.testing.assert_allclose(b[name], a[name], atol=0.05 * np.abs(a[name]).max())


def test_every_hook_is_documented_and_every_documented_hook_is_somewhere(checkpoint):
    """The model's hooks are the family's documented ones; a documented hook a model lacks is an attention or MLP
    hook of a model without attention or MLP, or the queries, keys and values of Zamba2's attention with adapters."""
    from memviz.running import generic_hook_name

    model = memviz.load(checkpoint)
    declared, present = set(get_family(model.family).hook_docs), {generic_hook_name(n) for n in model.hook_dict}
    assert present <= declared
    missing = declared - present
    assert all(".attn.hook_" in n and n.split("hook_")[1] in "q k v z" or n.endswith("mlp_out") for n in missing)
    adapters = getattr(model.hf.config, "use_shared_attention_adapter", False)  # Zamba2's: no hook_q, hook_k, hook_v
    assert missing == ({n for n in declared if n.split("hook_")[1] in "q k v"} if adapters else missing)
    assert not missing or model_type(checkpoint) in PURE or adapters


def test_the_state_space_families_declare_their_capabilities():
    for name in ("hf_mamba2", "hf_mamba"):
        family = get_family(name)
        assert not family.from_config and family.readout and family.needle_hold and family.folders is not None
        assert not family.model.delta_rule
