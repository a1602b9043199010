"""What memviz needs to know of one released architecture beyond transformers' own classes, as one record per
architecture module (`qwen3_5.py`, `olmo_hybrid.py`, `kimi_linear.py`, ...), claimed by model_type.

transformers runs the model; memviz reads its memory layers through the kernel it gives them (`recurrence.py`),
so a record says only where things are: which decoder layers hold a memory, the memory layer and the norm its
read passes through, the state's shape, the attention layers' hook sites, and how to build the config.
Adding a model_type whose memory layer transformers already routes through one of those kernels is one such
record.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from torch import nn


@dataclass(frozen=True)
class AttentionSite:
    """A full-attention hook: the module whose output ("output") or first input ("input") it is, cut into heads of
    `head_dim`."""

    module: nn.Module
    side: str
    head_dim: int


@dataclass(frozen=True)
class Architecture:
    """One released architecture (module docstring).

    `model_types`: {config.json's model_type: what memviz reads of it}; `config(data)`: transformers' config of the
    language model from config.json's fields; `causal_lm()`: transformers' causal LM class; `memory(layer)`: a
    decoder layer's memory layer (its recurrence runs through memviz's kernel), `attention(layer)` its attention
    (None in a layer without one); `is_memory(config, l)`: whether decoder layer l holds a memory;
    `state(memory)`: (heads, d_k, d_v) of its S; `read_norm(memory)`: the norm its read passes through
    (`hook_mem_out` is that norm's output; None where the kernel's own output is the layer's value);
    `attention_sites(attention)`: {hook name: AttentionSite}; `kv_numbers(config)`: numbers an attention layer
    caches per token; `tiny`: config fields of a small random model with memory layers 0, 1 and 3 and attention
    at 2 (`tiny.tiny_checkpoint`; the tests' models; every layer a memory in a model without attention);
    `experts`: a mixture of experts, whose grouped matmul takes no float64 (the eager loop does);
    `layers(hf)`: the decoder layers of transformers' causal LM; `mlp(layer)`: a layer's MLP, None without one;
    `out_projection(memory)`: the linear map from the read norm's output to what the memory layer adds to the residual
    stream; `final_norm(hf)`: the norm before the unembedding; `residual_scale(config)`: the factor a memory layer's
    output joins the residual stream with; `logit_scale(config)`: the factor on the unembedding's output; `read_lens`:
    None where these steps are all there is between a read norm and the logits, else why the lens is not offered
    (the last five: the read lens, `memviz.read_lens`)."""

    # transformers' modules are typed loosely (their attributes are set in __init__), hence Any
    model_types: Mapping[str, str]
    config: Callable[[dict], Any]
    causal_lm: Callable[[], Any]
    memory: Callable[[Any], Any]
    attention: Callable[[Any], Any]
    is_memory: Callable[[Any, int], bool]
    state: Callable[[Any], tuple[int, int, int]]
    read_norm: Callable[[Any], Any]
    attention_sites: Callable[[Any], dict[str, AttentionSite]]
    kv_numbers: Callable[[Any], int]
    tiny: Mapping[str, Any]
    experts: bool = False
    layers: Callable[[Any], Any] = lambda hf: hf.model.layers
    mlp: Callable[[Any], Any] = lambda layer: layer.mlp
    out_projection: Callable[[Any], Any] = lambda memory: memory.out_proj
    final_norm: Callable[[Any], Any] = lambda hf: hf.model.norm
    residual_scale: Callable[[Any], float] = lambda config: 1.0
    logit_scale: Callable[[Any], float] = lambda config: 1.0
    read_lens: str | None = None


class Claimed(Mapping[str, str]):
    """A family's architectures seen as {model_type: what memviz reads of it} (its `FolderLoader.model_types`),
    live: an architecture module registered later shows."""

    def __init__(self, architectures: Mapping[str, Architecture]) -> None:
        self.architectures = architectures

    def __getitem__(self, model_type: str) -> str:
        return self.architectures[model_type].model_types[model_type]

    def __iter__(self) -> Iterator[str]:
        return iter(self.architectures)

    def __len__(self) -> int:
        return len(self.architectures)


def register(architectures: dict[str, Architecture], architecture: Architecture) -> Architecture:
    """Add an architecture to its family's `architectures` under each of its model types."""
    for model_type in architecture.model_types:
        if model_type in architectures:
            raise ValueError(f"model_type {model_type!r} registered twice")
        architectures[model_type] = architecture
    return architecture


#: the layer pattern of every architecture's `tiny` model: memory layers 0, 1, 3 and attention at 2
TINY_LAYERS = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]
#: the fields every `tiny` config shares (no bos or pad id: the tokenizer's ids stand in)
TINY = dict(
    vocab_size=320,
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=4,
    num_attention_heads=2,
    layer_types=TINY_LAYERS,
    eos_token_id=0,
    pad_token_id=None,
    bos_token_id=None,
)


def layer_types_say_linear(config, layer: int) -> bool:
    """The hybrids' `layer_types` list: "linear_attention" for a memory layer."""
    return config.layer_types[layer] == "linear_attention"


def projection_sites(attn) -> dict[str, AttentionSite]:
    """An attention layer with q_proj, k_proj, v_proj and o_proj: queries, keys and values as the projections give
    them (before RoPE) and the output per head before o_proj."""
    d = attn.head_dim
    return {
        "hook_q": AttentionSite(attn.q_proj, "output", d),
        "hook_k": AttentionSite(attn.k_proj, "output", d),
        "hook_v": AttentionSite(attn.v_proj, "output", d),
        "hook_z": AttentionSite(attn.o_proj, "input", d),
    }


def head_dim(config) -> int:
    """The attention layers' head size: the config's (Zamba2's `attention_head_dim`), or hidden_size over the heads
    (OLMo Hybrid gives none)."""
    given = getattr(config, "head_dim", None) or getattr(config, "attention_head_dim", None)
    return given or config.hidden_size // config.num_attention_heads


def cached_keys_and_values(config) -> int:
    """Numbers a grouped-query attention layer caches per token: a key and a value per key-value head."""
    return 2 * config.num_key_value_heads * head_dim(config)
