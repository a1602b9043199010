"""Released language models with linear memories, loaded through transformers and watched, never re-implemented
(DESIGN.md, "Released memories"). Rooms:

  model.py          `ReleasedLM`: the model contract over a transformers causal LM (state, streaming, hooks)
  recurrence.py     memviz's linear-memory operator as the memory layers' kernel (transformers' kernel mapping)
  loading.py        a Hugging Face folder checked and read; `from_transformers`
  tokenizer.py      the checkpoint's tokenizer.json
  architecture.py   the record one architecture gives
  gated_deltanet.py, kimi_delta_attention.py   the families (their hooks, figures and folder loaders)
  qwen3_5.py, qwen3_next.py, olmo_hybrid.py, kimi_linear.py, bailing_hybrid.py   one architecture each

A new model_type whose memory layer transformers sends through a kernel memviz maps is one architecture module
here: its config, its class and where its layers keep things. Every module is imported below, in name order, so
each registers itself.
"""

from memviz.registry import import_family_folders

from .loading import ReleasedCheckpointError, from_transformers, load
from .model import MemoryLayerState, ReleasedConfig, ReleasedLM
from .tokenizer import HFTokenizer

import_family_folders(__name__, __path__)

__all__ = [
    "HFTokenizer",
    "MemoryLayerState",
    "ReleasedCheckpointError",
    "ReleasedConfig",
    "ReleasedLM",
    "from_transformers",
    "load",
]
