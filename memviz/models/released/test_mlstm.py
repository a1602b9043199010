"""Released mLSTM models (memviz.models.released: `mlstm.py`, the family; `xlstm.py`, xLSTM) on small random
checkpoints made here by transformers itself (`tiny.tiny_checkpoint`, its gates then spread): the kernel against
transformers' own native kernels and the paper's un-stabilised cell, logits against transformers' forward, the
cell's quantities against a float64 recomputation from the weights, the cell run through memviz's operator,
a large input gate, streaming and generation against one pass, read-out (each part the read with that writer
alone), needle hold, interventions, trace, figures, cost and the errors a bad input gets."""

from __future__ import annotations

import json
import math
from typing import Any

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from torch import nn

import memviz
from memviz import interventions
from memviz.models.released import mlstm
from memviz.models.released.loading import ReleasedCheckpointError
from memviz.models.released.mlstm import MLSTMKernel, MLSTMLayerState, run_mlstm
from memviz.models.released.tiny import TEXT, tiny_checkpoint
from memviz.registry import get_family
from memviz_kernels.linear_memory.reference import recurrent

PASSAGE = TEXT + " The pass key is 71432. " * 3
N = 40  # tokens of the tests' input
EPS = 1e-6  # transformers' xLSTMConfig.eps


def spread_gates(
    folder, input_bias: tuple[float, float] = (-4.0, 1.0), forget_bias: tuple[float, float] = (-1.0, 5.0), **config
) -> None:
    """The folder's model with its gates' biases spread over the heads (tiny_checkpoint draws the weights; its
    biases are transformers' initial -10 and 3..6, an input gate too small to let the normaliser's floor go) and
    `config` fields changed."""
    from transformers import xLSTMForCausalLM

    model: Any = xLSTMForCausalLM.from_pretrained(folder)  # transformers' modules are typed loosely
    with torch.no_grad():
        for block in model.backbone.blocks:
            layer = block.mlstm_layer
            layer.igate_preact.bias.copy_(torch.linspace(input_bias[0], input_bias[1], layer.config.num_heads))
            layer.fgate_preact.bias.copy_(torch.linspace(forget_bias[0], forget_bias[1], layer.config.num_heads))
    for field, value in config.items():
        setattr(model.config, field, value)
    model.save_pretrained(folder)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    folder = tmp_path_factory.mktemp("xlstm")
    tiny_checkpoint(folder, "xlstm")
    spread_gates(folder, norm_reduction_force_float32=False)  # a float64 model's norms in float64: 1e-10 is sharp
    return folder


@pytest.fixture(scope="module")
def loud(tmp_path_factory):
    """An input gate far past a float32's exp: pre-activations about 200 (the soft cap moved to 1000)."""
    folder = tmp_path_factory.mktemp("xlstm_loud")
    tiny_checkpoint(folder, "xlstm", seed=1)
    spread_gates(folder, input_bias=(190.0, 210.0), gate_soft_cap=1000.0, norm_reduction_force_float32=False)
    return folder


def reference(folder, dtype=torch.float32):
    """transformers' own model of the folder, untouched (its native kernels)."""
    from transformers import xLSTMForCausalLM

    return xLSTMForCausalLM.from_pretrained(folder, dtype=dtype).eval()


def ids_of(model, n: int = N) -> torch.Tensor:
    ids = model.tokenizer.encode(PASSAGE * 4)[:n]
    assert len(ids) == n
    return torch.tensor([ids])


class WrittenOut(nn.Module):
    """The mLSTM as the paper writes it, un-stabilised, token by token in float64, independently of memviz's
    operator and of transformers' stabilised kernels: C_t = f_t C_{t-1} + i_t k_t v_t^T (C [d_k, d_v]),
    n_t = f_t n_{t-1} + i_t k_t, h_t = C_t^T q_t / (max(|n_t^T q_t|, 1) + eps e^{m_t}) with q scaled by d_k^-1/2,
    i_t = exp(i~_t), f_t = sigmoid(f~_t) and m_t = max(log f_t + m_{t-1}, i~_t) (only in the eps term). Takes and
    gives transformers' stabilised state (C e^{-m}, n e^{-m}, m)."""

    def forward(self, query, key, value, igate, fgate, c_initial=None, n_initial=None, m_initial=None, **kwargs):
        B, H, T, d_k = query.shape
        q, k, v = query.double() * d_k**-0.5, key.double(), value.double()
        m = torch.zeros(B, H, dtype=torch.float64) if m_initial is None else m_initial.double()[..., 0]
        C = torch.zeros(B, H, d_k, v.shape[-1], dtype=torch.float64)
        n = torch.zeros(B, H, d_k, dtype=torch.float64)
        if c_initial is not None:
            C, n = c_initial.double() * m.exp()[..., None, None], n_initial.double() * m.exp()[..., None]
        hs = []
        for t in range(T):
            i_pre, f_pre = igate[:, :, t].double(), fgate[:, :, t].double()
            f, i = torch.sigmoid(f_pre), i_pre.exp()
            m = torch.maximum(F.logsigmoid(f_pre) + m, i_pre)
            C = f[..., None, None] * C + i[..., None, None] * k[:, :, t, :, None] * v[:, :, t, None, :]
            n = f[..., None] * n + i[..., None] * k[:, :, t]
            read = (q[:, :, t, :, None] * C).sum(-2)
            denominator = torch.maximum((n * q[:, :, t]).sum(-1).abs(), torch.ones_like(m)) + EPS * m.exp()
            hs.append(read / denominator[..., None])
        unscale = (-m).exp()
        state = (C * unscale[..., None, None], n * unscale[..., None], m[..., None])
        return torch.stack(hs, 2).to(query.dtype), tuple(s.to(query.dtype) for s in state)


def head_input(hf, run):
    """The last block's output (what the final RMS norm reads) during run(): xLSTM casts its logits to float32 after
    the head and its final norm reduces in float32, so a float64 model's own precision is in this."""
    kept = []
    handle = hf.backbone.out_norm.register_forward_pre_hook(lambda m, args: kept.append(args[0]))
    try:
        with torch.no_grad():
            logits = run()
    finally:
        handle.remove()
    return torch.cat(kept, 1), logits


def float64_truth(folder, ids):
    """transformers' float64 forward with each layer's cell the written-out one above (transformers' own kernels
    keep a float32 state): (the head's input, the logits)."""
    model = reference(folder, torch.float64)
    for block in model.backbone.blocks:
        block.mlstm_layer.mlstm_backend = WrittenOut()
    return head_input(model, lambda: model(ids).logits)


def random_cell(T: int, loud: bool = False, seed: int = 0):
    """Random float64 inputs of the cell and a start state (B 2, H 3, d_k 8, d_v 5); loud: input gates about
    200 and forget gates from -30 to 30."""
    g = torch.Generator().manual_seed(seed)
    q, k = (torch.randn(2, 3, T, 8, generator=g, dtype=torch.float64) for _ in range(2))
    v = torch.randn(2, 3, T, 5, generator=g, dtype=torch.float64)
    i_pre = torch.randn(2, 3, T, generator=g, dtype=torch.float64) * 3 + (200 if loud else -1)
    f_pre = torch.randn(2, 3, T, generator=g, dtype=torch.float64) * (10 if loud else 2) + 1
    start = (
        torch.randn(2, 3, 8, 5, generator=g, dtype=torch.float64),
        torch.randn(2, 3, 8, generator=g, dtype=torch.float64).abs(),
        torch.randn(2, 3, 1, generator=g, dtype=torch.float64),
    )
    return q, k, v, i_pre, f_pre, start


@pytest.mark.parametrize("loud", [False, True])
def test_the_kernel_computes_transformers_cell_through_the_operator(loud):
    """memviz's kernel against transformers' three native kernels (chunkwise, sequence, step) in float64 from a
    start state, and against the paper's un-stabilised cell: the read and the state (C, n, m) to float64
    rounding; in float32 it stays finite and close where the input gate is e^200 (a float32 holds e^88)."""
    from transformers.models.xlstm import modeling_xlstm as hf_xlstm

    q, k, v, i_pre, f_pre, start = random_cell(24, loud)
    ours, state = run_mlstm(q, k, v, i_pre, f_pre, start, EPS, None)
    chunkwise = hf_xlstm.mlstm_chunkwise_native_autograd(
        q, k, v, i_pre, f_pre, *start, return_last_states=True, eps=EPS, chunk_size=8
    )
    sequence = hf_xlstm.mlstm_recurrent_sequence_native(
        q, k, v, i_pre, f_pre, *start, return_last_states=True, eps=EPS, dtype_state=torch.float64
    )
    written = WrittenOut()(q, k, v, i_pre, f_pre, *start)
    for name, (h, theirs) in {"chunkwise": chunkwise, "sequence": sequence, "written out": written}.items():
        torch.testing.assert_close(ours, h, atol=1e-12, rtol=1e-10, msg=name)
        for what, a, b in zip("Cnm", state, theirs):
            torch.testing.assert_close(a, b.reshape(a.shape), atol=1e-12, rtol=1e-10, msg=f"{name} {what}")
    step, step_state = hf_xlstm.mlstm_recurrent_step_native(
        q[:, :, 0], k[:, :, 0], v[:, :, 0], i_pre[:, :, :1], f_pre[:, :, :1], *start, eps=EPS, dtype_state=torch.float64
    )
    one, one_state = run_mlstm(
        q[:, :, :1], k[:, :, :1], v[:, :, :1], i_pre[:, :, :1], f_pre[:, :, :1], start, EPS, None
    )
    torch.testing.assert_close(one[:, :, 0], step, atol=1e-12, rtol=1e-10)
    for a, b in zip(one_state, step_state):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-10)
    single = [t.float() for t in (q, k, v, i_pre, f_pre)]
    low, low_state = run_mlstm(*single, tuple(s.float() for s in start), EPS, None)
    assert torch.isfinite(low).all() and all(torch.isfinite(s).all() for s in low_state)
    torch.testing.assert_close(low.double(), ours, atol=1e-4, rtol=1e-4)
    if loud:  # the un-stabilised write overflows a float32
        assert not torch.isfinite(i_pre.float().exp()).all()


def test_the_kernel_s_gradients_are_the_written_out_cell_s():
    """Gradients flow through the operator, the running maximum and the start state (which transformers overwrites
    in place afterwards: the kernel works on copies) as through the paper's cell."""
    q, k, v, i_pre, f_pre, start = random_cell(12)
    inputs = [t.requires_grad_() for t in (q, k, v, i_pre, f_pre, *start)]
    weights = torch.randn(2, 3, 12, 5, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    ours = torch.autograd.grad((run_mlstm(*inputs[:5], tuple(inputs[5:]), EPS, None)[0] * weights).sum(), inputs)
    theirs = torch.autograd.grad((WrittenOut()(*inputs)[0] * weights).sum(), inputs)
    for name, a, b in zip(["q", "k", "v", "i~", "f~", "C_0", "n_0", "m_0"], ours, theirs):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-8, msg=name)


def test_xlstm_is_claimed_by_its_family(checkpoint):
    from memviz.registry import folder_family

    model = memviz.load(checkpoint)
    assert folder_family("xlstm").name == model.family == "hf_mlstm"
    assert model.cfg.linear_layers == [0, 1, 2, 3] and (model.cfg.n_heads, model.cfg.d_head) == (4, 32)
    assert all(isinstance(model.memory_layer(l).mlstm_backend, MLSTMKernel) for l in range(4))


def test_logits_equal_transformers_forward(checkpoint):
    """float64: memviz's model against transformers' forward with the written-out float64 cell, to 1e-10 (the
    head's input; the logits, which transformers casts to float32, to float32 rounding). float32: against
    transformers' own forward (its chunkwise and step kernels) to 1e-5 of the logits' scale."""
    ids = ids_of(memviz.load(checkpoint))
    truth_hidden, truth = float64_truth(checkpoint, ids)
    exact = memviz.load(checkpoint, dtype="float64")
    hidden, ours64 = head_input(exact.hf, lambda: exact(ids))
    assert hidden.dtype == torch.float64 and truth.abs().max() > 1
    torch.testing.assert_close(hidden, truth_hidden, atol=1e-10, rtol=0)
    torch.testing.assert_close(ours64, truth, atol=1e-5, rtol=0)
    with torch.no_grad():
        ours, theirs = memviz.load(checkpoint)(ids), reference(checkpoint)(ids).logits
    assert (ours - theirs).abs().max() <= 1e-5 * theirs.abs().max()


def test_a_large_input_gate_stays_finite(loud):
    """Input gates about e^200: memviz's operator (its key e^{i~ - m} k <= k) stays finite in float32 and no further
    from the float64 truth than transformers' stabilised kernels (1.5 times theirs: near a cancelling n_t^T q_t both
    are 2e-4 from it, logits about 13), and the float64 model is the un-stabilised float64 cell. The hooks,
    un-stabilised, overflow a float32 there (documented); a float64 model's are finite."""
    model = memviz.load(loud)
    ids = ids_of(model)
    truth_hidden, truth = float64_truth(loud, ids)
    with torch.no_grad():
        ours, theirs = model(ids), reference(loud)(ids).logits
    assert torch.isfinite(ours).all() and (ours - truth).abs().max() <= 1.5 * (theirs - truth).abs().max()
    exact = memviz.load(loud, dtype="float64")
    hidden, _ = head_input(exact.hf, lambda: exact(ids))
    torch.testing.assert_close(hidden, truth_hidden, atol=1e-10, rtol=0)
    logits, cache = exact.run_with_cache(ids)
    assert (
        cache["blocks.0.attn.hook_beta"].min() > math.exp(150)
        and torch.isfinite(cache["blocks.0.attn.hook_read"]).all()
    )
    _, cache32 = model.run_with_cache(ids)
    assert not torch.isfinite(cache32["blocks.0.attn.hook_beta"]).all()


def test_the_cell_runs_once_through_memviz_s_kernel(checkpoint, monkeypatch):
    """A forward calls the operator once a layer, a traced one (every hook) once more for ||C_t||; transformers'
    own backends back give transformers' own forward to the bit."""
    model = memviz.load(checkpoint)
    calls = []
    operator = mlstm.linear_memory
    monkeypatch.setattr(mlstm, "linear_memory", lambda *a, **kw: calls.append(1) or operator(*a, **kw))
    ids = ids_of(model)
    with torch.no_grad():
        model(ids)
        assert len(calls) == 4
        _, cache = model.run_with_cache(ids)
    assert len(calls) == 4 + 8 and cache["blocks.3.attn.hook_state_norm"].shape == (1, N, 4)
    for l in range(4):
        layer = model.memory_layer(l)
        layer.mlstm_backend = layer.mlstm_backend.native
    with torch.no_grad():
        torch.testing.assert_close(model.hf(ids).logits, reference(checkpoint)(ids).logits, atol=0, rtol=0)


@pytest.mark.parametrize("chunk", [1, 7])
def test_streamed_equals_one_pass(checkpoint, chunk):
    """Streamed in float64 is one pass to float64 rounding (each chunk starts from the (C, n, m) carried in
    transformers' cache), and it is the model's own forward chunk by chunk through an xLSTMCache, exactly (a token
    a chunk over the first 12 tokens, 7 over all 40)."""
    from transformers.models.xlstm.modeling_xlstm import xLSTMCache

    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model, 12 if chunk == 1 else N)
    names = ["blocks.3.hook_resid_post", *(f"blocks.{l}.attn.hook_{n}" for l in (0, 3) for n in ("read", "normaliser"))]
    kept = {n: [] for n in names}
    with torch.no_grad(), model.hooks(fwd_hooks=[(n, lambda v, hook: kept[hook.name].append(v)) for n in names]):
        streamed = torch.cat([logits for _, logits, _ in model.stream(ids, chunk_len=chunk)], 1)
    with torch.no_grad():
        cache = xLSTMCache(model.hf.config, 1, dtype=torch.float64)
        by_hand = [model.hf(piece, cache=cache, use_cache=True).logits for piece in ids.split(chunk, 1)]
        torch.testing.assert_close(streamed, torch.cat(by_hand, 1), atol=0, rtol=0)
        _, whole = model.run_with_cache(ids, names_filter=names)
    for name in names:
        torch.testing.assert_close(torch.cat(kept[name], 1), whole[name], atol=1e-10, rtol=1e-10, msg=name)
    torch.testing.assert_close(streamed, model(ids), atol=1e-5, rtol=0)


def recompute(model, l, u):
    """mLSTM layer l over its input u [T, d_model] from its weights in float64, token by token, un-stabilised:
    q, k, v and the gates' pre-activations (soft-capped) from the projections, then the paper's cell."""
    layer = model.memory_layer(l)
    W = {n: p.detach().double() for n, p in layer.named_parameters()}
    H, T = layer.config.num_heads, len(u)
    cap = layer.config.gate_soft_cap
    q, k, v = (u @ W[f"{n}.weight"].T for n in "qkv")
    q, k, v = (x.view(T, H, -1) for x in (q, k, v))
    q = q * q.shape[-1] ** -0.5
    i_pre, f_pre = (
        cap * torch.tanh((u @ W[f"{g}.weight"].T + W[f"{g}.bias"]) / cap) for g in ("igate_preact", "fgate_preact")
    )
    f, i = torch.sigmoid(f_pre), i_pre.exp()
    C = torch.zeros(H, k.shape[-1], v.shape[-1], dtype=torch.float64)
    n = torch.zeros(H, k.shape[-1], dtype=torch.float64)
    m = torch.zeros(H, dtype=torch.float64)
    reads, normalisers, norms, hidden = [], [], [], []
    for t in range(T):
        m = torch.maximum(F.logsigmoid(f_pre[t]) + m, i_pre[t])
        C = f[t, :, None, None] * C + i[t, :, None, None] * k[t, :, :, None] * v[t, :, None, :]
        n = f[t, :, None] * n + i[t, :, None] * k[t]
        reads.append((q[t, :, :, None] * C).sum(-2))
        normalisers.append((n * q[t]).sum(-1))
        norms.append(C.flatten(1).norm(dim=-1))
        hidden.append(reads[-1] / (normalisers[-1].abs().clamp_min(1) + EPS * m.exp())[:, None])
    h = torch.stack(hidden)  # [T, H, d_v]: per head a layer norm, then the output gate
    normed = (h - h.mean(-1, keepdim=True)) * torch.rsqrt(h.var(-1, unbiased=False, keepdim=True) + 1e-6)
    gate = torch.sigmoid(u @ W["ogate_preact.weight"].T).view(T, H, -1)
    return dict(
        alpha=f,
        beta=i,
        write_key=k,
        write_value=v,
        read_query=q,
        read=torch.stack(reads),
        normaliser=torch.stack(normalisers),
        state_norm=torch.stack(norms),
        mem_out=gate * normed * W["multihead_norm.weight"].view(H, -1),
    )


def test_captured_quantities_equal_a_float64_recomputation(checkpoint):
    """Every cell quantity from the layer's weights in float64 over the layer's own input, to float64 rounding (the
    checkpoint's norms reduce in float64: `norm_reduction_force_float32` off). The gates spread: forget gates on
    both sides of 1/2, normalisers on both sides of the floor 1."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    hooks = ("alpha", "beta", "write_key", "write_value", "read_query", "read", "normaliser", "state_norm", "mem_out")
    names = [f"blocks.{l}.attn.hook_{n}" for l in range(4) for n in hooks]
    inputs = {}
    handles = [
        model.memory_layer(l).register_forward_pre_hook(lambda m, args, l=l: inputs.__setitem__(l, args[0]))
        for l in range(4)
    ]
    try:
        seen = model.capture(ids, names)
    finally:
        for handle in handles:
            handle.remove()
    for l in range(4):
        expected = recompute(model, l, inputs[l][0].double())
        for what, value in expected.items():
            tol = 1e-10
            torch.testing.assert_close(
                seen[f"blocks.{l}.attn.hook_{what}"], value, atol=tol, rtol=tol, msg=lambda m: f"layer {l} {what}: {m}"
            )
        alpha, reach = seen[f"blocks.{l}.attn.hook_alpha"], seen[f"blocks.{l}.attn.hook_normaliser"].abs()
        assert alpha.min() < 0.5 < alpha.max() and reach.min() < 1 < reach.max()


def test_generation_time_hooks_equal_a_one_pass_run_over_the_same_tokens(checkpoint):
    """Generation feeds one token a step through the same kernel; its hooks at every step equal a one-pass run over
    the prompt and the generated tokens."""
    model = memviz.load(checkpoint, dtype="float64")
    names = [f"blocks.{l}.attn.hook_{n}" for l in (0, 3) for n in ("read", "normaliser", "state_norm", "alpha")]
    names.append("blocks.3.attn.hook_mem_out")
    steps = {n: [] for n in names}
    prompt = model.tokenizer.encode("What is the pass key?")
    with model.hooks(fwd_hooks=[(n, lambda v, hook: steps[hook.name].append(v[0])) for n in names]):
        generated = model.generate_ids(prompt, max_new_tokens=6)
    assert len(generated) == 6 and [len(v) for v in steps[names[0]][1:]] == [1] * 6
    whole = model.capture(prompt + generated, names)
    for name in names:
        torch.testing.assert_close(torch.cat(steps[name]), whole[name], atol=1e-10, rtol=1e-10, msg=name)


def test_readout_parts_sum_to_the_read_and_each_is_that_writer_alone(checkpoint):
    """The read C_t q_t splits over the writers: the parts sum to hook_read, and part j equals the memory fed
    writer j's v_j alone (the others' values zero), the run's own forget gates, input gates and keys."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    position = 30
    readout = model.memory_readout(ids, position)
    wanted = ("write_key", "write_value", "alpha", "beta", "read_query", "read")
    seen = model.capture(ids[:, : position + 1], [f"blocks.{l}.attn.hook_{n}" for l in range(4) for n in wanted])
    assert set(readout.parts) == {f"blocks.{l}" for l in range(4)}
    for l in range(4):
        k, v, alpha, beta, q, read = (seen[f"blocks.{l}.attn.hook_{n}"] for n in wanted)
        parts = readout.parts[f"blocks.{l}"]
        assert parts.shape == (position + 1, *read.shape[1:])
        torch.testing.assert_close(readout.reads[f"blocks.{l}"], read[position], atol=1e-10, rtol=1e-12)
        heads_first = lambda t: t.transpose(0, 1)[None]  # noqa: E731
        for j in (0, position - 7, position):
            alone = torch.zeros_like(v)
            alone[j] = v[j]
            S = torch.zeros(1, k.shape[1], k.shape[2], v.shape[2], dtype=torch.float64)
            (o, _), _ = recurrent(
                heads_first(q), heads_first(k * beta[..., None]), heads_first(alone), heads_first(alpha.log()), None, S
            )
            torch.testing.assert_close(parts[j], o[0, :, -1], atol=1e-10, rtol=1e-10, msg=f"layer {l} writer {j}")
        assert parts[position - 7].abs().max() > 1e-6


def test_needle_hold_of_everything_is_the_state_norm(checkpoint):
    """The part of C the whole input wrote is C itself; a later span holds nothing before it."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    hold = model.needle_hold(ids, (0, N))
    _, cache = model.run_with_cache(ids)
    for l in range(4):
        norms = cache[f"blocks.{l}.attn.hook_state_norm"][0].amax(-1)
        np.testing.assert_allclose(
            hold[f"layer {l}: share of the span's write still in the state"], (norms / norms.max()).numpy(), atol=1e-6
        )
    later = model.needle_hold(ids, (20, 25))["layer 0: share of the span's write still in the state"]
    assert (later[:20] == 0).all() and later[20:25].max() > 0


def test_reset_and_patch_act_on_the_memory_state_only(checkpoint):
    """A reset gives C, n and m a fresh state's values (so the rest of the input runs as from its start, exactly);
    it moves the answer, and a patch with the run's own state gives the clean answer back."""
    model = memviz.load(checkpoint, segment_len=16, dtype="float64")
    ids = ids_of(model).tolist()[0]
    with torch.no_grad():
        _, state = model(ids[:16], return_state=True)
        position, reset = interventions.ablate_at(model, 1)
        edited = reset(state)
        assert position == 16
        for before, after in zip(state.layers, edited.layers):
            assert isinstance(after, MLSTMLayerState) and after.C.dtype == torch.float64
            assert all(t.abs().max() == 0 for t in after) and before.C.abs().max() > 0 and before.m.abs().max() > 0
        torch.testing.assert_close(model(ids[16:], state=edited), model(ids[16:]), atol=0, rtol=0)
    prompt, answer = model.tokenizer.decode(ids[:30]), model.tokenizer.decode(ids[30:34])
    clean = interventions.answer_logprob(model, prompt, answer)["logprob"]
    ablated = interventions.answer_logprob(model, prompt, answer, [interventions.ablate_at(model, 1)])["logprob"]
    patched = interventions.answer_logprob(model, prompt, answer, [interventions.replace_at(model, 1, prompt)])
    assert abs(ablated - clean) > 0.05 and patched["logprob"] == pytest.approx(clean, abs=1e-6)


def test_a_mem_out_hook_replaces_the_layer_s_value(checkpoint):
    """What a hook on hook_mem_out returns is what the layer's out_proj reads: zeroing it in the last layer moves
    the logits, and an identity hook leaves them as they were."""
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    name = "blocks.3.attn.hook_mem_out"
    with torch.no_grad():
        clean = model(ids)
        same = model.run_with_hooks(ids, fwd_hooks=[(name, lambda v, hook: v)])
        zeroed = model.run_with_hooks(ids, fwd_hooks=[(name, lambda v, hook: torch.zeros_like(v))])
    torch.testing.assert_close(same, clean, atol=0, rtol=0)
    assert (zeroed - clean).abs().max() > 1e-3


def test_trace_figures_and_cost(checkpoint):
    """A default trace keeps the gates, the normaliser's read and ||C_t|| per head and |mem_out|; the family's
    figures draw them; cost prices what the trace keeps and the fixed state (C, n, m)."""
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    tr = memviz.trace(model, ids[0].tolist())
    for hook in ("alpha", "beta", "normaliser", "state_norm"):
        assert tr[f"blocks.0.attn.hook_{hook}"].shape == (N, 4)
    assert tr["blocks.0.attn.hook_mem_out"].shape == (N, 4) and np.isfinite(tr["loss"][:-1]).all()
    _, cache = model.run_with_cache(ids)
    np.testing.assert_allclose(tr["blocks.0.attn.hook_beta"], cache["blocks.0.attn.hook_beta"][0].numpy(), rtol=1e-6)
    figs = get_family(model.family).figures(tr)
    assert {"blocks.0 alpha", "blocks.0 beta", "blocks.0 normaliser", "state norm"} <= set(figs)
    assert len(figs["blocks.3 normaliser"].data[0].y) == 4
    np.testing.assert_allclose(
        figs["blocks.0 beta"].data[0].z.max(), np.log(tr["blocks.0.attn.hook_beta"]).max(), rtol=1e-5
    )
    cost = model.cost(N)
    assert cost["trace"] == sum(a.nbytes for a in tr.arrays.values()) and cost["kv_cache"] == 0
    with torch.no_grad():
        _, state = model(ids, return_state=True)
    assert (
        cost["memory_state"] == sum(t.numel() * 4 for part in state.layers for t in part) == 4 * 4 * (16 * 33 + 1) * 4
    )


def test_a_bfloat16_model_traces_with_its_quantities_and_state_in_float32(checkpoint):
    exact, half = memviz.load(checkpoint), memviz.load(checkpoint, dtype="bfloat16")
    ids = ids_of(exact)[0].tolist()
    a, b = memviz.trace(exact, ids), memviz.trace(half, ids)
    for name in ("blocks.0.attn.hook_alpha", "blocks.0.attn.hook_state_norm"):
        assert b[name].dtype == np.float32
        np.testing.assert_allclose(b[name], a[name], atol=0.05 * np.abs(a[name]).max())
    with torch.no_grad():
        _, state = half(ids, return_state=True)
    assert all(t.dtype == torch.float32 for part in state.layers for t in part)


def test_every_hook_is_documented_and_every_documented_hook_is_somewhere(checkpoint):
    from memviz.running import generic_hook_name

    model = memviz.load(checkpoint)
    assert {generic_hook_name(n) for n in model.hook_dict} == set(get_family(model.family).hook_docs)


def test_the_family_declares_its_capabilities():
    family = get_family("hf_mlstm")
    assert not family.from_config and family.readout and family.needle_hold and family.folders is not None
    assert not family.model.delta_rule and "xlstm" in family.folders.model_types


def test_bad_input_gets_a_clear_error(checkpoint, tmp_path):
    """A model whose heads do not divide its layers' widths is refused, naming the fields (transformers would fail
    at its first forward; from a folder, its gates' weights are shaped wrong first); a state of another model, a
    read-out past the input and a span outside it, each named."""
    from tokenizers import Tokenizer
    from transformers import xLSTMConfig, xLSTMForCausalLM

    from memviz.models.released import from_transformers

    config = json.loads((checkpoint / "config.json").read_text())
    three = xLSTMForCausalLM(xLSTMConfig(**dict(config, num_heads=3)))  # loads: none of its weights is shaped wrong
    backend = Tokenizer.from_file(str(checkpoint / "tokenizer.json"))
    with pytest.raises(ReleasedCheckpointError, match=r"num_heads \(3\) must divide .* \(64\) .* \(128\)"):
        from_transformers(three, backend)
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    foreign = memviz.ModelState(0, [torch.zeros(1)] * 4)
    with pytest.raises(ValueError, match="another model"):
        model(ids, state=foreign)
    with pytest.raises(ValueError, match="position must lie in"):
        model.memory_readout(ids, N)
    with pytest.raises(ValueError, match="span"):
        model.needle_hold(ids, (30, N + 1))
    with pytest.raises(ValueError, match="n_tokens"):
        model.cost(-1)
