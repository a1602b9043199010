"""Released hybrids (memviz.models.released) on tiny random Qwen3.5 and Qwen3-Next checkpoints made here with
transformers itself: loading, logits, the Gated DeltaNet quantities against a float64 recomputation
from the weights, streaming, read-out, interventions, the rest of memviz on them, and bad folders."""

from __future__ import annotations

import json
import math
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file

import memviz
from memviz import CheckpointError, interventions

LINEAR = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
SHAPE = dict(
    vocab_size=320,
    hidden_size=32,
    num_hidden_layers=4,
    num_attention_heads=2,
    num_key_value_heads=1,
    head_dim=16,
    linear_num_key_heads=2,
    linear_num_value_heads=4,
    linear_key_head_dim=8,
    linear_value_head_dim=8,
    eos_token_id=0,
    layer_types=LINEAR,
)
TEXT = "The pass key is 71432. Remember it. 71432 is the pass key. " * 3


def write_tokenizer(folder) -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        special_tokens=["<|endoftext|>"],
        show_progress=False,
    )
    tok.train_from_iterator([TEXT, "What is the pass key? There is important info hidden."] * 20, trainer=trainer)
    tok.save(str(folder / "tokenizer.json"))


def make_checkpoint(folder, model_type: str, seed: int = 0):
    """A tiny random checkpoint of `model_type` saved by transformers, with a byte-level BPE tokenizer."""
    import transformers

    torch.manual_seed(seed)
    if model_type == "qwen3_next":
        config = transformers.Qwen3NextConfig(
            **SHAPE,
            intermediate_size=48,
            num_experts=4,
            num_experts_per_tok=2,
            moe_intermediate_size=16,
            shared_expert_intermediate_size=16,
        )
        model = transformers.Qwen3NextForCausalLM(config)
    else:
        model = transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(**SHAPE, intermediate_size=48))
    with torch.no_grad():  # the layers' decays spread as trained ones do, and the projections large enough to matter
        for name, p in model.named_parameters():
            if name.endswith("dt_bias"):
                p.copy_(torch.linspace(-4, 1, p.numel()))
            elif p.dim() >= 2:  # linear maps and the short convolution
                p.normal_(0, 0.3 if p.dim() == 2 else 0.6)
    model.save_pretrained(folder)
    write_tokenizer(folder)
    return model.eval()


@pytest.fixture(scope="module", params=["qwen3_5_text", "qwen3_next"])
def checkpoint(request, tmp_path_factory):
    folder = tmp_path_factory.mktemp(request.param)
    make_checkpoint(folder, request.param)
    return folder


def reference(folder, dtype=torch.float32):
    import transformers

    cls = transformers.Qwen3NextForCausalLM if "next" in folder.name else transformers.Qwen3_5ForCausalLM
    experts = {"experts_implementation": "eager"} if "next" in folder.name and dtype == torch.float64 else {}
    return cls.from_pretrained(folder, dtype=dtype, **experts).eval()


def ids_of(model, n: int = 40) -> torch.Tensor:
    ids = model.tokenizer.encode(TEXT * 4)[:n]
    assert len(ids) == n
    return torch.tensor([ids])


@pytest.mark.parametrize("dtype, tol", [(torch.float32, 1e-5), (torch.float64, 1e-10)])
def test_logits_equal_transformers_forward(checkpoint, dtype, tol):
    model = memviz.load(checkpoint, dtype=str(dtype).split(".")[1])
    ids = ids_of(model)
    with torch.no_grad():
        ours, theirs = model(ids), reference(checkpoint, dtype)(ids).logits
    assert ours.dtype == dtype and theirs.abs().max() > 0.1
    torch.testing.assert_close(ours, theirs, atol=tol, rtol=0)
    with pytest.raises(ValueError, match="makes its logits its own way"):  # transformers' head, not memviz's
        model(ids, return_type="residual")


@pytest.mark.parametrize("chunk", [1, 5, 16])
def test_streamed_equals_one_pass(checkpoint, chunk):
    """Streamed is transformers' own forward chunk by chunk through its cache, exactly; it is one
    pass up to what chunking moves in transformers itself (its delta rule and norms run in float32)."""
    from transformers import DynamicCache

    model, hf = memviz.load(checkpoint), reference(checkpoint)
    ids = ids_of(model)
    cache = DynamicCache(config=hf.config)
    with torch.no_grad():
        streamed = torch.cat([logits for _, logits, _ in model.stream(ids, chunk_len=chunk)], 1)
        theirs = torch.cat([hf(piece, cache=cache, use_cache=True).logits for piece in ids.split(chunk, 1)], 1)
        whole = hf(ids).logits
    torch.testing.assert_close(streamed, theirs, atol=0, rtol=0)
    assert (theirs - whole).abs().max() > 0  # chunking moves transformers' own logits ...
    torch.testing.assert_close(streamed, whole, atol=5e-4, rtol=0)  # ... by float32 rounding


def rmsnorm_gated(o, z, weight, eps):
    return weight * o * torch.rsqrt(o.pow(2).mean(-1, keepdim=True) + eps) * F.silu(z)


def recompute(gdn, x):
    """The Gated DeltaNet layer over x [T, d_model] from its weights in float64, token by token:
    S_t = alpha_t (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T, o_t = S_t^T q_t (S is [d_k, d_v])."""
    Hk, Hv, dk, dv, K = gdn.num_k_heads, gdn.num_v_heads, gdn.head_k_dim, gdn.head_v_dim, gdn.conv_kernel_size
    r = Hv // Hk
    W = {n: p.detach().double() for n, p in gdn.named_parameters()}
    if "in_proj_qkvz.weight" in W:  # Qwen3-Next: per key head the rows [q, k, v (r heads), z (r heads)], [b (r), a (r)]
        rows = W["in_proj_qkvz.weight"].view(Hk, 2 * dk + 2 * r * dv, -1)
        Wq, Wk, Wv, Wz = rows.split([dk, dk, r * dv, r * dv], 1)
        ba = W["in_proj_ba.weight"].view(Hk, 2 * r, -1)
        Wqkv = torch.cat([w.reshape(-1, w.shape[-1]) for w in (Wq, Wk, Wv)])
        Wz, Wb, Wa = Wz.reshape(-1, Wz.shape[-1]), ba[:, :r].reshape(Hv, -1), ba[:, r:].reshape(Hv, -1)
    else:
        Wqkv, Wz, Wb, Wa = (W[f"in_proj_{n}.weight"] for n in ("qkv", "z", "b", "a"))
    T = x.shape[0]
    pre = torch.cat([torch.zeros(K - 1, Wqkv.shape[0], dtype=torch.float64), x @ Wqkv.T])
    conv = W["conv1d.weight"][:, 0]  # [channels, K]
    mixed = F.silu(torch.stack([(pre[t : t + K].T * conv).sum(-1) for t in range(T)]))
    q, k, v = mixed.split([Hk * dk, Hk * dk, Hv * dv], -1)

    def unit(y):
        return y / torch.sqrt((y * y).sum(-1, keepdim=True) + 1e-6)

    q = unit(q.view(T, Hk, dk)).repeat_interleave(r, 1) / math.sqrt(dk)
    k = unit(k.view(T, Hk, dk)).repeat_interleave(r, 1)
    v = v.view(T, Hv, dv)
    alpha = torch.exp(-W["A_log"].exp() * F.softplus(x @ Wa.T + W["dt_bias"]))
    beta = torch.sigmoid(x @ Wb.T)
    S = torch.zeros(Hv, dk, dv, dtype=torch.float64)
    eye = torch.eye(dk, dtype=torch.float64)
    reads, norms = [], []
    for t in range(T):
        kt = k[t][:, :, None]
        A = alpha[t][:, None, None] * (eye - beta[t][:, None, None] * kt @ kt.transpose(1, 2))
        S = A @ S + beta[t][:, None, None] * kt @ v[t][:, None, :]
        reads.append((S.transpose(1, 2) @ q[t][:, :, None])[..., 0])
        norms.append(S.flatten(1).norm(dim=-1))
    read = torch.stack(reads)
    z = (x @ Wz.T).view(T, Hv, dv)
    mem_out = rmsnorm_gated(read, z, W["norm.weight"], gdn.norm.variance_epsilon)
    return dict(
        alpha=alpha,
        beta=beta,
        write_key=k,
        write_value=v,
        read_query=q,
        read=read,
        state_norm=torch.stack(norms),
        mem_out=mem_out,
    )


def test_captured_quantities_equal_a_float64_recomputation(checkpoint):
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    linear = model.cfg.linear_layers
    names = [
        f"blocks.{l}.attn.hook_{n}"
        for l in linear
        for n in ("alpha", "beta", "write_key", "write_value", "read_query", "read", "state_norm", "mem_out")
    ]
    names += [f"blocks.{l}.hook_resid_pre" for l in linear]
    seen = {}

    def keep(value, hook):
        seen.setdefault(hook.name, []).append(value[0])

    with torch.no_grad(), model.hooks(fwd_hooks=[(n, keep) for n in names]):
        model(ids)
    seen = {n: torch.cat(v) for n, v in seen.items()}
    assert linear == [0, 1, 3]
    for l in linear:
        layer = model.hf.model.layers[l]
        expected = recompute(layer.linear_attn, layer.input_layernorm(seen[f"blocks.{l}.hook_resid_pre"]))
        for what, value in expected.items():
            tol = 1e-4 if what == "mem_out" else 1e-10  # the layer's own read and norm run in float32
            torch.testing.assert_close(
                seen[f"blocks.{l}.attn.hook_{what}"], value, atol=tol, rtol=tol, msg=lambda m: f"layer {l} {what}: {m}"
            )
        assert expected["state_norm"].max() > 0.3 and expected["alpha"].min() < 0.5 < expected["alpha"].max()


def test_streamed_quantities_equal_one_pass(checkpoint):
    """A chunk's quantities start from the state transformers carried; chunking moves them by float32
    rounding (as it moves transformers' own logits, test_streamed_equals_one_pass), a wrong carry by O(1)."""
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    names = [f"blocks.{l}.attn.hook_{n}" for l in model.cfg.linear_layers for n in ("read", "state_norm", "write_key")]
    whole = model.capture(ids, names)
    parts = {n: [] for n in names}
    with torch.no_grad(), model.hooks(fwd_hooks=[(n, lambda v, hook: parts[hook.name].append(v[0])) for n in names]):
        for _ in model.stream(ids, chunk_len=6):
            pass
    for name in names:
        torch.testing.assert_close(torch.cat(parts[name]).double(), whole[name], atol=5e-4, rtol=0, msg=name)


def test_the_read_is_what_transformers_read(checkpoint):
    """hook_read (memviz's recurrence) against the read transformers passes to the layer's norm."""
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    gdn = model.hf.model.layers[1].linear_attn
    theirs = []
    handle = gdn.norm.register_forward_hook(lambda m, args, out: theirs.append(args[0].reshape(1, -1, 4, 8)))
    try:
        _, cache = model.run_with_cache(ids, names_filter="blocks.1.attn.hook_read")
    finally:
        handle.remove()
    torch.testing.assert_close(cache["blocks.1.attn.hook_read"], theirs[0], atol=2e-6, rtol=1e-4)


def test_readout_parts_sum_to_the_read(checkpoint):
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    position = 30
    readout = model.memory_readout(ids, position)
    _, cache = model.run_with_cache(ids[:, : position + 1])
    assert set(readout.parts) == {"blocks.0", "blocks.1", "blocks.3"}
    for layer, read in readout.reads.items():
        assert readout.parts[layer].shape == (position + 1, 4, 8)
        torch.testing.assert_close(read, cache[f"{layer}.attn.hook_read"][0, position], atol=1e-10, rtol=0)
        shares = readout.shares(layer).sum(0)
        torch.testing.assert_close(shares, torch.ones_like(shares), atol=1e-9, rtol=0)


def test_needle_hold_of_everything_is_the_state_norm(checkpoint):
    """The part of the state the whole input wrote is the state itself."""
    model = memviz.load(checkpoint, dtype="float64")
    ids = ids_of(model)
    hold = model.needle_hold(ids, (0, ids.shape[1]))
    _, cache = model.run_with_cache(ids)
    for l in model.cfg.linear_layers:
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


def test_reset_and_patch_act_on_the_delta_rule_state_only(checkpoint):
    model = memviz.load(checkpoint, segment_len=16)
    ids = ids_of(model).tolist()[0]
    with torch.no_grad():
        _, state = model(ids[:16], return_state=True)
    position, reset = interventions.ablate_at(model, 1)
    edited = reset(state)
    assert position == 16
    for l, (before, after) in enumerate(zip(state.layers, edited.layers)):
        if l in model.cfg.linear_layers:
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
    assert ablated != pytest.approx(clean) and patched == pytest.approx(clean, abs=1e-4)


def test_trace_figures_and_the_probes_run_on_it(checkpoint):
    from memviz.registry import get_family
    from memviz_probes import lm, passkey, retention, ruler

    model = memviz.load(checkpoint)
    tr = memviz.trace(model, TEXT)
    assert {"blocks.0.attn.hook_alpha", "blocks.3.attn.hook_state_norm", "blocks.1.attn.hook_mem_out"} <= set(tr.names)
    assert tr["blocks.0.attn.hook_beta"].shape == (len(tr), 4) and np.isfinite(tr["loss"][:-1]).all()
    _, cache = model.run_with_cache(model.tokenizer.encode(TEXT))  # every hook: the read computed too
    np.testing.assert_allclose(
        tr["blocks.1.attn.hook_state_norm"], cache["blocks.1.attn.hook_state_norm"][0], rtol=1e-6
    )
    figs = get_family(model.family).figures(tr)
    assert {"blocks.0 alpha", "blocks.3 beta", "state norm"} <= set(figs)
    df = passkey.run(model, lengths=[200], depths=[0.5], n=1, progress=False)
    assert len(df) == 1 and {"length", "depth", "answer", "prediction", "correct"} <= set(df.columns)
    assert len(ruler.run(model, tasks=["niah_single_1"], lengths=[600], n=1, progress=False)) == 1
    assert len(retention.run(model, distances=[64], n=1, progress=False)) == 1
    text = lm.run(model, max_tokens=200)
    assert (text["tokens"] == 200).all() and (text["bits_per_byte"] > 0).all()


def test_a_vision_language_qwen3_5_folder_loads_its_language_model(tmp_path):
    """model_type qwen3_5 (Qwen3.5's published form) holds its language model under text_config and
    model.language_model.*; transformers' own Qwen3_5ForCausalLM reads it."""
    from safetensors.torch import load_file, save_file

    text = tmp_path / "text"
    make_checkpoint(text, "qwen3_5_text")
    vl = tmp_path / "vl"
    vl.mkdir()
    config = json.loads((text / "config.json").read_text())
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
    weights = load_file(text / "model.safetensors")
    save_file(
        {k.replace("model.", "model.language_model.", 1): v for k, v in weights.items()}, vl / "model.safetensors"
    )
    (vl / "tokenizer.json").write_text((text / "tokenizer.json").read_text())
    a, b = memviz.load(text), memviz.load(vl)
    ids = ids_of(a)
    with torch.no_grad():
        torch.testing.assert_close(a(ids), b(ids), atol=0, rtol=0)


def test_bad_folders_get_one_clear_error(tmp_path):
    good = tmp_path / "good"
    make_checkpoint(good, "qwen3_5_text")
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
        CheckpointError, match=r"config\.json: field 'model_type' is 'mamba2', a model type memviz does not read"
    ):
        memviz.load(folder("unknown", {**config, "model_type": "mamba2"}))
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


def test_transformer_lens_bridge_agrees_where_it_has_the_quantity(checkpoint):
    """TransformerLens 4.3's GatedDeltaNetBridge on the same layer, cache-less prefill with its eager
    scan: beta, the log decay (alpha = exp g) and S_t (its norm, and the last S against the state
    memviz carries). Given transformers 5.24's `cache=` (it looks for `cache_params`) the bridge
    ignores the cache, which is why memviz streams through its own hooks (docs/released.md)."""
    from transformer_lens.model_bridge.generalized_components.gated_delta_net import GatedDeltaNetBridge

    model = memviz.load(checkpoint)
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


def test_cost_counts_the_attention_cache_and_the_fixed_state(checkpoint):
    model = memviz.load(checkpoint)
    ids = ids_of(model)
    with torch.no_grad():
        _, state = model(ids, return_state=True)
    cost = model.cost(ids.shape[1])
    assert cost["kv_cache"] == sum(t.numel() * 4 for t in (state.layers[2].k, state.layers[2].v))
    assert cost["memory_state"] == sum(
        state.layers[l].S.numel() * 4 + state.layers[l].conv.numel() * 4 for l in model.cfg.linear_layers
    )
    tr = memviz.trace(model, ids[0].tolist())
    assert cost["trace"] == sum(a.nbytes for a in tr.arrays.values())
    for nonsense in (-5, 2.5, True):
        with pytest.raises(ValueError, match="n_tokens must be a whole number of tokens"):
            model.cost(nonsense)


def test_the_app_opens_a_hugging_face_folder_and_traces_it(checkpoint):
    from tests.test_app import chart_titles, choose_path, open_app, open_trace_page

    at = choose_path(open_app(), str(checkpoint))
    assert {m.label: m.value for m in at.metric}["family"] == "hf_gated_deltanet"
    assert "blocks.{l}.attn.hook_state_norm" in set(at.dataframe[0].value["hook"])
    trace_page = open_trace_page(str(checkpoint))
    assert any(c.value.startswith("About ") and "kv cache" in c.value for c in trace_page.caption)  # before it runs
    titles = chart_titles(trace_page)
    assert {
        "blocks.0: decay alpha (1 keeps the state)",
        "||S_t|| (mean over heads)",
        "How much of the evidence the memory still holds",
    } <= set(titles), titles
    assert any(t.startswith("blocks.3: where the read at token") for t in titles), titles


def test_a_bfloat16_model_traces_with_its_quantities_in_float32(checkpoint):
    exact, half = memviz.load(checkpoint), memviz.load(checkpoint, dtype="bfloat16")
    ids = ids_of(exact)[0].tolist()
    a, b = memviz.trace(exact, ids), memviz.trace(half, ids)
    for name in ("blocks.0.attn.hook_alpha", "blocks.0.attn.hook_state_norm"):
        assert b[name].dtype == np.float32
        np.testing.assert_allclose(b[name], a[name], atol=0.05 * np.abs(a[name]).max())


def test_the_family_declares_exactly_the_hooks_its_models_have(checkpoint):
    from memviz.model import generic_hook_name
    from memviz.registry import get_family

    declared = set(get_family("hf_gated_deltanet").hook_docs)
    assert {generic_hook_name(name) for name in memviz.load(checkpoint).hook_dict} == declared


def test_the_released_family_declares_it_is_not_built_from_a_config():
    from memviz.registry import get_family
    from training import quick_families

    family = get_family("hf_gated_deltanet")
    assert not family.from_config and family.cost
    assert "hf_gated_deltanet" not in quick_families()
    with pytest.raises(memviz.ConfigError, match="family 'hf_gated_deltanet' is not built from a config"):
        memviz.build_model(memviz.ModelConfig(family="hf_gated_deltanet", d_model=32, n_layers=2, n_heads=2, d_mlp=64))
