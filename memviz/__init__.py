"""memviz: an interpretability workbench for small memory-augmented language models."""

from memviz.checkpoint import CheckpointError, list_samples, list_user_checkpoints, load, save
from memviz.config import ConfigError, ModelConfig
from memviz.layers import LocalCache
from memviz.model import MemoryLM
from memviz.models import build_model, families
from memviz.protocol import MemoryModel, ModelState
from memviz.registry import register_family
from memviz.running import NonFiniteError
from memviz.state import Memory
from memviz.threads import ModelBusyError
from memviz.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from memviz.trace import Trace
from memviz.trace_files import TraceFileError
from memviz.tracing import trace

__all__ = [
    "BPETokenizer",
    "ByteTokenizer",
    "CheckpointError",
    "ConfigError",
    "LocalCache",
    "Memory",
    "MemoryLM",
    "MemoryModel",
    "ModelBusyError",
    "ModelConfig",
    "ModelState",
    "NonFiniteError",
    "Trace",
    "TraceFileError",
    "build_model",
    "families",
    "list_samples",
    "list_user_checkpoints",
    "load",
    "load_tokenizer",
    "register_family",
    "save",
    "trace",
]
