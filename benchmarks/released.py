"""A released hybrid's published shape, with random weights, run by transformers and traced by memviz on this machine:
`python benchmarks/released.py [--arch qwen3_5|qwen3_next|olmo_hybrid|kimi_linear|bailing_hybrid|mamba|mamba2|
falcon_mamba|bamba|granitemoehybrid|nemotron_h|jamba] [--lengths 1024 4096 16384] [--repeats 3] [--layers N] [--vocab V]
[--experts E] [--bridge-gib 8] [--tiny] [--out FILE]`.

The model is the architecture's smallest published config (below; `--tiny` swaps in its 4-layer test model,
`--layers` keeps the layers' shapes and cuts their number, keeping the published pattern of memory and attention
layers (written back in the architecture's own fields: `layer_types`, Bamba's `attn_layer_indices`, Jamba's
`attn_layer_period`/`attn_layer_offset`, Nemotron-H's `hybrid_override_pattern`; Mamba, Mamba-2 and Falcon Mamba have
memory layers only), `--vocab` cuts the vocabulary and `--experts` the experts of each mixture: the published memory
layers stay as they are) with random weights, built by transformers itself. For each length, on
random token ids, interleaved over `--repeats` rounds:

  * `transformers`: transformers' own forward over the input, chunk by chunk (memviz's chunk length) through its
    cache, no hooks, its memory layers on transformers' own kernels (memviz's mapping taken off for the run);
  * `memviz_forward`: the same forward with memviz's operator as the memory layers' kernel, no hooks;
  * `memviz`: `memviz.trace` of the same input with the family's default hooks (one pass: the hooks' quantities
    come from the kernel's own run);
  * `bridge` (Qwen3.5 and Qwen3-Next, whose projections it reads): TransformerLens 4.3's GatedDeltaNetBridge on
    every memory layer with its eager scan and a hook keeping `hook_ssm_state` (one pass: the bridge cannot
    stream), only at lengths whose states fit in `--bridge-gib`.

It prints each one's median seconds and peak memory above what the process held before (VmHWM after resetting it
through /proc/self/clear_refs), and memviz's over transformers' as the median of the per-round ratios (with their
spread); each run's seconds and peak go to stderr as it ends. The bars: a trace of 4,096 tokens at most 1.25 times
transformers' forward in time and 1.5 in peak memory; a traced Qwen3.5-0.8B shape at 16k tokens at most 1.0 times
transformers' untraced forward.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

#: Qwen3.5-0.8B's published text_config (the fields transformers reads)
QWEN3_5_0_8B = dict(
    vocab_size=248320,
    hidden_size=1024,
    intermediate_size=3584,
    num_hidden_layers=24,
    num_attention_heads=8,
    num_key_value_heads=2,
    head_dim=256,
    attn_output_gate=True,
    linear_num_key_heads=16,
    linear_num_value_heads=16,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rms_norm_eps=1e-6,
    full_attention_interval=4,
    max_position_embeddings=262144,
    tie_word_embeddings=True,
    eos_token_id=248044,
    rope_parameters={
        "mrope_interleaved": True,
        "mrope_section": [11, 11, 10],
        "rope_type": "default",
        "rope_theta": 10000000,
        "partial_rotary_factor": 0.25,
    },
)
#: allenai/Olmo-Hybrid-7B's config.json (its only size); its "rope_parameters": null, which transformers 5.25 would
#: fill with default RoPE, written so that it stays off
OLMO_HYBRID_7B = dict(
    vocab_size=100352,
    hidden_size=3840,
    intermediate_size=11008,
    num_hidden_layers=32,
    num_attention_heads=30,
    num_key_value_heads=30,
    hidden_act="silu",
    max_position_embeddings=65536,
    rms_norm_eps=1e-06,
    attention_bias=False,
    tie_word_embeddings=False,
    layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 8,
    linear_num_key_heads=30,
    linear_num_value_heads=30,
    linear_key_head_dim=96,
    linear_value_head_dim=192,
    linear_conv_kernel_dim=4,
    linear_allow_neg_eigval=True,
    pad_token_id=100277,
    bos_token_id=None,
    eos_token_id=100257,
    rope_parameters={"rope_type": "default", "rope_theta": None},
)
#: moonshotai/Kimi-Linear-48B-A3B-Instruct's config.json (the fields transformers reads; its only size)
KIMI_LINEAR_48B_A3B = dict(
    vocab_size=163840,
    hidden_size=2304,
    intermediate_size=9216,
    moe_intermediate_size=1024,
    num_hidden_layers=27,
    num_attention_heads=32,
    num_key_value_heads=32,
    hidden_act="silu",
    rms_norm_eps=1e-05,
    tie_word_embeddings=False,
    kv_lora_rank=512,
    q_lora_rank=None,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_experts=256,
    num_experts_per_token=8,
    num_shared_experts=1,
    num_expert_group=1,
    topk_group=1,
    moe_renormalize=True,
    routed_scaling_factor=2.446,
    first_k_dense_replace=1,
    model_max_length=1048576,
    linear_attn_config={
        "full_attn_layers": [4, 8, 12, 16, 20, 24, 27],
        "head_dim": 128,
        "kda_layers": [1, 2, 3, 5, 6, 7, 9, 10, 11, 13, 14, 15, 17, 18, 19, 21, 22, 23, 25, 26],
        "num_heads": 32,
        "short_conv_kernel_size": 4,
    },
    bos_token_id=163584,
    eos_token_id=163586,
    pad_token_id=163839,
)
#: Qwen/Qwen3-Next-80B-A3B-Instruct's config.json (its only size; vocab_size and the bos/eos ids from the
#: 48-layer Qwen3-Next configs beside it, which agree)
QWEN3_NEXT_80B_A3B = dict(
    vocab_size=151936,
    hidden_size=2048,
    intermediate_size=5120,
    moe_intermediate_size=512,
    shared_expert_intermediate_size=512,
    num_experts=512,
    num_experts_per_tok=10,
    decoder_sparse_step=1,
    mlp_only_layers=[],
    norm_topk_prob=True,
    num_hidden_layers=48,
    num_attention_heads=16,
    num_key_value_heads=2,
    head_dim=256,
    full_attention_interval=4,
    linear_num_key_heads=16,
    linear_num_value_heads=32,
    linear_key_head_dim=128,
    linear_value_head_dim=128,
    linear_conv_kernel_dim=4,
    rope_theta=10000000,
    partial_rotary_factor=0.25,
    rms_norm_eps=1e-6,
    tie_word_embeddings=False,
    max_position_embeddings=262144,
    bos_token_id=151643,
    eos_token_id=151645,
    hidden_act="silu",
)
#: inclusionAI/Ling-3.0-tiny (bailing_hybrid, the smallest Ling 3.0), from the field list pinned to its revision
#: a2ee06c; kda_lower_bound given as a float (its JSON's -5 is refused by transformers' config)
LING_3_0_TINY = dict(
    vocab_size=157184,
    hidden_size=1536,
    intermediate_size=4608,
    moe_intermediate_size=512,
    num_hidden_layers=24,
    num_attention_heads=16,
    num_key_value_heads=16,
    head_dim=128,
    max_position_embeddings=131072,
    rms_norm_eps=1e-06,
    rope_theta=6000000,
    tie_word_embeddings=False,
    layer_group_size=4,
    short_conv_kernel_size=4,
    kda_safe_gate=True,
    kda_lower_bound=-5.0,
    q_lora_rank=256,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    num_experts=128,
    num_experts_per_tok=8,
    num_shared_experts=1,
    n_group=8,
    topk_group=4,
    first_k_dense_replace=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    pad_token_id=156892,
    eos_token_id=156895,
)
#: state-spaces/mamba-130m-hf's config.json (the smallest Mamba); its n_layer, d_model, fused_add_norm, rms_norm and
#: pad_vocab_size_multiple are mamba_ssm's names, which transformers does not read
MAMBA_130M = dict(
    vocab_size=50280,
    hidden_size=768,
    intermediate_size=1536,
    num_hidden_layers=24,
    state_size=16,
    expand=2,
    conv_kernel=4,
    time_step_rank=48,
    time_step_scale=1.0,
    time_step_min=0.001,
    time_step_max=0.1,
    time_step_floor=0.0001,
    time_step_init_scheme="random",
    layer_norm_epsilon=1e-05,
    use_bias=False,
    use_conv_bias=True,
    residual_in_fp32=True,
    rescale_prenorm_residual=False,
    hidden_act="silu",
    initializer_range=0.1,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
#: state-spaces/mamba2-130m's config.json (mamba_ssm's: d_model 768, n_layer 24, vocab_size 50277 padded to a multiple
#: of 16, ssm_cfg {"layer": "Mamba2"} with mamba_ssm's Mamba2 defaults d_state 128, headdim 64, ngroups 1, expand 2,
#: d_conv 4, chunk_size 256, tie_embeddings) in the names of transformers' Mamba2Config (num_heads = 2 * 768 / 64);
#: the token ids are its GPT-NeoX tokenizer's, as in mamba-130m-hf
MAMBA2_130M = dict(
    vocab_size=50288,
    hidden_size=768,
    num_hidden_layers=24,
    num_heads=24,
    head_dim=64,
    state_size=128,
    n_groups=1,
    expand=2,
    conv_kernel=4,
    chunk_size=256,
    layer_norm_epsilon=1e-05,
    use_bias=False,
    use_conv_bias=True,
    residual_in_fp32=True,
    tie_word_embeddings=True,
    bos_token_id=0,
    eos_token_id=0,
    pad_token_id=0,
)
#: tiiuae/falcon-mamba-7b's config.json (its only size). Its "expand": 16 is what the file says; transformers computes
#: intermediate_size from it and then takes the file's intermediate_size 8192 (expand 2 in effect), as loading the
#: published weights does
FALCON_MAMBA_7B = dict(
    vocab_size=65024,
    hidden_size=4096,
    intermediate_size=8192,
    expand=16,
    num_hidden_layers=64,
    state_size=16,
    conv_kernel=4,
    time_step_rank=256,
    time_step_scale=1.0,
    time_step_min=0.001,
    time_step_max=0.1,
    time_step_floor=0.0001,
    time_step_init_scheme="random",
    layer_norm_epsilon=1e-05,
    use_bias=False,
    use_conv_bias=True,
    residual_in_fp32=True,
    rescale_prenorm_residual=False,
    hidden_act="silu",
    initializer_range=0.1,
    tie_word_embeddings=False,
    bos_token_id=0,
    eos_token_id=11,
    pad_token_id=11,
)
#: ibm-ai-platform/Bamba-9B (its only size): the mamba_ssm config it was trained from (`mamba_9.8b` in
#: foundation-model-stack/fms-fsdp's fms_fsdp/utils/config_utils.py: d_model 4096, d_intermediate 14336, n_layer 32,
#: vocab_size 128256, attention at layers 9, 18 and 27 with 32 heads, 8 key-value heads, head_dim 128, rotary_emb_dim
#: 64, untied embeddings) as fms-fsdp's fms_to_hf_mamba_transformers.py converts it for transformers (mamba_d_head 64,
#: mamba_d_state 128, mamba_n_groups 1, rms_norm_eps 1e-5; mamba_n_heads = 2 * 4096 / 64); its rotary_emb_dim 64 of
#: 128 is BambaConfig's fixed partial_rotary_factor 0.5; token ids left at BambaConfig's
BAMBA_9B = dict(
    vocab_size=128256,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    attn_layer_indices=[9, 18, 27],
    mamba_n_heads=128,
    mamba_d_head=64,
    mamba_n_groups=1,
    mamba_d_state=128,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=256,
    mamba_conv_bias=True,
    mamba_proj_bias=False,
    rms_norm_eps=1e-05,
    hidden_act="silu",
    max_position_embeddings=4096,
    tie_word_embeddings=False,
)
#: ibm-granite/granite-4.0-h-350m's config.json (the smallest Granite 4.0-H, dense: no experts; as copied whole, with
#: its model_info naming the repository, in hashneo/nano-vllm-go's models/granite-350m/), its layer_types in the
#: file's own words ("mamba", "attention")
GRANITE_4_0_H_350M = dict(
    vocab_size=100352,
    hidden_size=768,
    intermediate_size=2048,
    shared_intermediate_size=2048,
    num_hidden_layers=32,
    layer_types=["mamba"] * 10
    + ["attention", "mamba", "mamba", "attention"]
    + ["mamba"] * 3
    + ["attention"]
    + ["mamba"] * 9
    + ["attention"]
    + ["mamba"] * 4,
    num_attention_heads=12,
    num_key_value_heads=4,
    attention_bias=False,
    attention_multiplier=0.015625,
    embedding_multiplier=12,
    residual_multiplier=0.246,
    logits_scaling=3,
    position_embedding_type="nope",
    num_local_experts=0,
    num_experts_per_tok=0,
    mamba_n_heads=48,
    mamba_d_head=32,
    mamba_d_state=128,
    mamba_n_groups=1,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_chunk_size=256,
    mamba_conv_bias=True,
    mamba_proj_bias=False,
    max_position_embeddings=32768,
    rms_norm_eps=1e-05,
    hidden_act="silu",
    tie_word_embeddings=True,
    bos_token_id=100257,
    eos_token_id=100257,
    pad_token_id=100256,
)
#: nvidia/Nemotron-H-4B-Base-8K (the smallest Nemotron-H): its widths from NVIDIA-NeMo/Megatron-Bridge's
#: NemotronHModelProvider4B (src/megatron/bridge/models/nemotronh/nemotron_h_provider.py: the 8B's pattern, hidden 3072,
#: FFN 12288, 32 heads over 8 key-value groups of 128, 112 Mamba heads of 64 in 8 groups, state 128), the rest of the
#: fields as nvidia/Nemotron-H-8B-Base-8K's config.json has them (copied whole in Megatron-Bridge's
#: tests/unit_tests/models/nemotronh/test_nemotron_h_bridge.py; its attention_head_dim 128 is transformers' head_dim)
NEMOTRON_H_4B = dict(
    vocab_size=131072,
    hidden_size=3072,
    intermediate_size=12288,
    num_hidden_layers=52,
    hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    num_attention_heads=32,
    num_key_value_heads=8,
    head_dim=128,
    mamba_num_heads=112,
    mamba_head_dim=64,
    ssm_state_size=128,
    n_groups=8,
    conv_kernel=4,
    expand=2,
    chunk_size=128,
    mamba_hidden_act="silu",
    mamba_proj_bias=False,
    mlp_hidden_act="relu2",
    mlp_bias=False,
    attention_bias=False,
    use_bias=False,
    use_conv_bias=True,
    layer_norm_epsilon=1e-05,
    residual_in_fp32=False,
    rescale_prenorm_residual=True,
    max_position_embeddings=8192,
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=2,
    pad_token_id=0,
)
#: ai21labs/AI21-Jamba-1.5-Mini's config.json (the shape of Jamba-v0.1's config.json too): the smallest Jamba whose
#: config could be read here; the 3B AI21-Jamba-Reasoning-3B is smaller, but no copy of its config.json was found
JAMBA_1_5_MINI = dict(
    vocab_size=65536,
    hidden_size=4096,
    intermediate_size=14336,
    num_hidden_layers=32,
    num_attention_heads=32,
    num_key_value_heads=8,
    attn_layer_period=8,
    attn_layer_offset=4,
    expert_layer_period=2,
    expert_layer_offset=1,
    num_experts=16,
    num_experts_per_tok=2,
    mamba_d_state=16,
    mamba_d_conv=4,
    mamba_expand=2,
    mamba_dt_rank=256,
    mamba_conv_bias=True,
    mamba_proj_bias=False,
    max_position_embeddings=262144,
    rms_norm_eps=1e-06,
    hidden_act="silu",
    tie_word_embeddings=False,
    bos_token_id=1,
    eos_token_id=[2, 518],
    pad_token_id=0,
)
#: each architecture's smallest published config (the fields transformers reads)
PUBLISHED = {
    "qwen3_5": QWEN3_5_0_8B,
    "qwen3_next": QWEN3_NEXT_80B_A3B,
    "olmo_hybrid": OLMO_HYBRID_7B,
    "kimi_linear": KIMI_LINEAR_48B_A3B,
    "bailing_hybrid": LING_3_0_TINY,
    "mamba": MAMBA_130M,
    "mamba2": MAMBA2_130M,
    "falcon_mamba": FALCON_MAMBA_7B,
    "bamba": BAMBA_9B,
    "granitemoehybrid": GRANITE_4_0_H_350M,
    "nemotron_h": NEMOTRON_H_4B,
    "jamba": JAMBA_1_5_MINI,
}
#: the field holding the number of experts of each mixture, where it is not `num_experts`
EXPERTS_FIELD = {"granitemoehybrid": "num_local_experts", "nemotron_h": "n_routed_experts"}


def shape_of(arch_name: str, tiny: bool, layers: int | None, vocab: int | None, experts: int | None) -> dict:
    """The config fields of the run (module docstring); the layer pattern is read from a built config, so that a
    published `linear_attn_config` is followed too."""
    from memviz.models.released.tiny import architecture_of

    model_type = "qwen3_5_text" if arch_name == "qwen3_5" else arch_name
    arch = architecture_of(model_type)
    shape = dict(arch.tiny) if tiny else {"model_type": model_type, **PUBLISHED[arch_name]}
    if layers:
        built = arch.config(dict(shape))
        pattern = list(built.layer_types)
        shape.pop("linear_attn_config", None)
        if getattr(built, "mlp_layer_types", None):
            shape["mlp_layer_types"] = list(built.mlp_layer_types)
            shape.pop("first_k_dense_replace", None)
        shape["num_hidden_layers"] = layers
        if model_type == "kimi_linear":  # its memory layers' sizes came from linear_attn_config
            shape.update(linear_num_heads=built.linear_num_heads, linear_head_dim=built.linear_head_dim)
        cut = [pattern[l % len(pattern)] for l in range(layers)]
        if "full_attention" in pattern and "full_attention" not in cut:  # keep one attention layer, as every hybrid has
            cut[max(l for l, kind in enumerate(cut) if kind == "linear_attention")] = "full_attention"
        write_layer_pattern(model_type, shape, pattern, cut)
        if "mlp_layer_types" in shape:
            shape["mlp_layer_types"] = [
                shape["mlp_layer_types"][l % len(shape["mlp_layer_types"])] for l in range(layers)
            ]
        made = list(arch.config(dict(shape)).layer_types)
        if made != cut:
            raise ValueError(f"--layers {layers} on {arch_name}: the config's layers are {made}, not {cut}")
    if vocab:
        shape.update(vocab_size=vocab, eos_token_id=0, pad_token_id=None, bos_token_id=None)
    if experts:
        shape[EXPERTS_FIELD.get(model_type, "num_experts")] = experts
        if shape.get("num_experts_per_tok", 0) > experts:
            shape["num_experts_per_tok"] = experts
    return shape


def write_layer_pattern(model_type: str, shape: dict, pattern: list[str], cut: list[str]) -> None:
    """Write the layer kinds `cut` (transformers' names, as `pattern`, the published config's, reads) in the fields
    the architecture's config keeps them in, in that config's own words."""
    if model_type in ("mamba", "mamba2", "falcon_mamba"):  # memory layers only: num_hidden_layers says it all
        return
    if model_type == "bamba":
        shape["attn_layer_indices"] = [l for l, kind in enumerate(cut) if kind == "full_attention"]
    elif model_type == "jamba":  # attention where l % attn_layer_period == attn_layer_offset
        attention = [l for l, kind in enumerate(cut) if kind == "full_attention"]
        if attention[0] != shape.get("attn_layer_offset"):  # the kept attention layer is a cut stack's last
            shape["attn_layer_offset"] = attention[0]
    elif model_type == "nemotron_h":  # one character a layer: M memory, * attention, - MLP, E mixture of experts
        chars = dict(zip(pattern, shape["hybrid_override_pattern"]))
        shape["hybrid_override_pattern"] = "".join(chars.get(kind, "*") for kind in cut)
    else:  # layer_types, in the published config's words (Granite 4.0-H's "mamba" and "attention")
        words = dict(zip(pattern, shape.get("layer_types") or pattern))
        shape["layer_types"] = [words.get(kind, kind) for kind in cut]


def build(shape: dict, name: str):
    """memviz's model over a random-weight transformers model of `shape` (its `model_type`'s architecture)."""
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    from memviz.models.released import from_transformers
    from memviz.models.released.tiny import architecture_of

    arch = architecture_of(shape["model_type"])
    torch.manual_seed(0)
    model = arch.causal_lm()(arch.config(shape)).eval()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.train_from_iterator(
        ["random weights"],
        trainer=trainers.BpeTrainer(
            vocab_size=300, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False
        ),
    )
    return from_transformers(model, backend, name=name)


def status(field: str) -> int:
    """A /proc/self/status field in bytes (VmRSS, VmHWM)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1]) * 1024
    raise KeyError(field)


def measured(fn) -> tuple[float, int]:
    """(seconds, peak bytes above the resident set before) of fn(). Memory an earlier run freed is first handed
    back to the system (glibc's malloc_trim), so that the resident set before is what is alive: otherwise a run
    reuses the freed pages of the one before it unseen, and its peak reads as zero."""
    from memviz.heap import release_free_heap

    gc.collect()
    release_free_heap()
    Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current resident set
    before = status("VmRSS")
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start, status("VmHWM") - before


@torch.no_grad()
def chunked_forward(model, ids: torch.Tensor) -> None:
    """The transformers model's forward chunk by chunk through its cache, no hooks."""
    from transformers import DynamicCache

    cache = DynamicCache(config=model.hf.config)
    for piece in ids.split(model.chunk_len, 1):
        model.hf(input_ids=piece, cache=cache, use_cache=True)


def transformers_forward(model, ids: torch.Tensor) -> tuple[float, int]:
    """`chunked_forward` on transformers' own kernels, measured: memviz's mapping is taken off around the run
    (outside the timing)."""
    from memviz.models.released.recurrence import install

    model.hf.reset_kernels()
    try:
        return measured(lambda: chunked_forward(model, ids))
    finally:
        install(model.hf)


def timed(fn):
    """A run measured whole."""
    return lambda model, ids: measured(lambda: fn(model, ids))


def memviz_trace(model, ids: torch.Tensor) -> None:
    import memviz

    memviz.trace(model, ids[0].tolist())


@torch.no_grad()
def bridge_scan(model, ids: torch.Tensor) -> None:
    """TransformerLens's bridge on each Gated DeltaNet layer, eager scan, S_t kept as a cache hook keeps it."""
    from transformer_lens.model_bridge.generalized_components.gated_delta_net import GatedDeltaNetBridge

    layers, kept = model.hf.model.layers, []
    originals = {l: layers[l].linear_attn for l in model.cfg.linear_layers}
    try:
        for l, original in originals.items():
            bridge = GatedDeltaNetBridge("linear_attn")
            bridge.set_original_component(original)
            bridge.eager_scan = True
            bridge.hook_ssm_state.add_hook(lambda value, hook: kept.append(value))
            layers[l].linear_attn = bridge
        model.hf(input_ids=ids, use_cache=False)
    finally:
        for l, original in originals.items():
            layers[l].linear_attn = original


def main(argv: list[str] | None = None) -> int:
    from memviz.threads import thread_count

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", choices=sorted(PUBLISHED), default="qwen3_5")
    parser.add_argument("--lengths", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--bridge-gib", type=float, default=8.0, help="the most the bridge's kept states may take")
    parser.add_argument("--threads", type=thread_count, default=torch.get_num_threads())
    parser.add_argument("--tiny", action="store_true", help="the architecture's 4-layer test model (a smoke run)")
    parser.add_argument("--layers", type=int, help="LAYERS layers of the published shape's only")
    parser.add_argument("--vocab", type=int, help="a smaller vocabulary (the unembedding dominates a short stack)")
    parser.add_argument(
        "--experts", type=int, help="fewer experts in each mixture (the memory layers keep their shape)"
    )
    parser.add_argument("--no-bridge", action="store_true", help="leave TransformerLens's bridge out")
    parser.add_argument("--out", type=Path, help="also write the results here as JSON")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    checked = (("lengths", min(args.lengths)), ("repeats", args.repeats), ("layers", args.layers or 1))
    for name, value in (*checked, ("vocab", args.vocab or 1), ("experts", args.experts or 1)):
        if value < 1:
            parser.error(f"--{name} must be at least 1")
    shape = shape_of(args.arch, args.tiny, args.layers, args.vocab, args.experts)
    name = (
        f"{args.arch} tiny"
        if args.tiny
        else f"{args.arch} published shape"
        + (f", {args.layers} layers" if args.layers else "")
        + (f", vocab {args.vocab}" if args.vocab else "")
        + (f", {args.experts} experts" if args.experts else "")
    )
    model = build(shape, name)
    heads, d_k, d_v = model.arch.state(model.memory_layer(model.cfg.linear_layers[0]))
    state_bytes = len(model.cfg.linear_layers) * heads * d_k * d_v * 4
    bridged = model.cfg.model_type.startswith("qwen3") and not args.no_bridge  # its bridge reads Qwen's projections
    rows = []
    for length in args.lengths:
        ids = torch.randint(0, model.cfg.vocab_size, (1, length), generator=torch.Generator().manual_seed(length))
        runs = {
            "transformers": transformers_forward,
            "memviz_forward": timed(chunked_forward),
            "memviz": timed(memviz_trace),
        }
        if bridged and length * state_bytes <= args.bridge_gib * 2**30:
            runs["bridge"] = timed(bridge_scan)
        seen: dict[str, list[tuple[float, int]]] = {name: [] for name in runs}
        for round_ in range(args.repeats):  # interleaved, so that the machine's load falls on all alike
            for name, run in runs.items():
                seen[name].append(run(model, ids))
                seconds, peak = seen[name][-1]  # each run as it ends, on stderr: a long run shows its progress
                print(
                    f"{length} tokens, round {round_ + 1}: {name} {seconds:.1f} s, {peak / 2**20:.0f} MiB",
                    file=sys.stderr,
                )
        row: dict = {"length": length, "threads": args.threads, "model": model.cfg.name, "repeats": args.repeats}
        for name in ("memviz", "memviz_forward"):
            ratios = [m[0] / t[0] for m, t in zip(seen[name], seen["transformers"])]
            row[f"time_{name}_over_transformers"] = statistics.median(ratios)
            row[f"time_{name}_over_transformers_range"] = [min(ratios), max(ratios)]
        peaks = [m[1] / max(t[1], 1) for m, t in zip(seen["memviz"], seen["transformers"])]
        row["peak_memviz_over_transformers"] = statistics.median(peaks)
        for name, values in seen.items():
            row[f"{name}_s"] = statistics.median(v[0] for v in values)
            row[f"{name}_peak_mib"] = max(v[1] for v in values) / 2**20
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.out:
        args.out.write_text(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
