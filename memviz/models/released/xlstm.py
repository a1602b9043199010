"""xLSTM (`xlstm`; transformers' `xLSTMForCausalLM`, NX-AI's xLSTM-7b): every block an mLSTM layer
(`block.mlstm_layer`, `mlstm.py`) and a gated feed-forward (`block.ffn`), each after an RMS norm; no attention, no
convolution. transformers builds its cache (`xLSTMCache`) with heads of hidden_size x qk_dim_factor rounded up to
a multiple of 64 while the layers use it unrounded, so transformers' own cached forward needs that product a
multiple of 64 (xLSTM-7b: 4096 x 0.5); memviz carries the layers' own shapes."""

from __future__ import annotations

from .architecture import Architecture, register
from .mlstm import ARCHITECTURES

#: the mLSTM layer of the `tiny` model: 4 heads, d_k 16 and d_v 32 (xLSTM-7b's ratio, qk_dim_factor 0.5), chunks of
#: 16 tokens in transformers' chunkwise kernel (a 40-token input runs its chunkwise and its step kernels)
TINY_MLSTM = dict(num_heads=4, qk_dim_factor=0.5, v_dim_factor=1.0, chunk_size=16)


def config(data: dict):
    from transformers import xLSTMConfig

    return xLSTMConfig(**data)


def causal_lm():
    from transformers import xLSTMForCausalLM

    return xLSTMForCausalLM


XLSTM = register(
    ARCHITECTURES,
    Architecture(
        model_types={"xlstm": "xLSTM"},
        config=config,
        causal_lm=causal_lm,
        layers=lambda hf: hf.backbone.blocks,
        final_norm=lambda hf: hf.backbone.out_norm,
        memory=lambda block: block.mlstm_layer,
        attention=lambda block: None,
        mlp=lambda block: block.ffn,
        is_memory=lambda config, l: True,
        state=lambda layer: (
            layer.config.num_heads,
            layer.qk_dim // layer.config.num_heads,
            layer.v_dim // layer.config.num_heads,
        ),
        read_norm=lambda layer: layer.multihead_norm,
        attention_sites=lambda attn: {},
        kv_numbers=lambda config: 0,
        tiny={
            "model_type": "xlstm",
            "vocab_size": 320,
            "hidden_size": 128,
            "num_hidden_layers": 4,
            **TINY_MLSTM,
            "ffn_proj_factor": 1.0,
            "ffn_round_up_to_multiple_of": 64,
            "eos_token_id": 0,
            "pad_token_id": None,
            "bos_token_id": None,
        },
    ),
)
