"""The baselines: models without memory, what a memory family starts from and is compared with.

`transformer` is full causal attention (`MemoryLM` as it stands); `sliding_window` attends to
the last `window` tokens and is the control every long-context sample is measured against.
"""

from __future__ import annotations

from memviz.config import ConfigError
from memviz.model import MemoryLM
from memviz.registry import register_family


@register_family(
    "transformer",
    summary="full causal attention, no memory (the cache grows with the input)",
    interventions={},
    tiny={},
    sample="dense_english",
    role="baseline",
)
class TransformerLM(MemoryLM):
    """The full-causal transformer."""

    is_baseline = True

    def check_config(self) -> None:
        assert self.attention is not None  # default_attention is causal
        if self.attention.kind != "causal":
            raise ConfigError(
                f"the 'transformer' family is full causal; use 'sliding_window' for {self.attention.kind} attention"
            )


@register_family(
    "sliding_window",
    summary="attention over the last `window` tokens, no memory: the control",
    interventions={},
    quick={"attention": {"kind": "window", "span": 32}},
    tiny={"attention": {"kind": "window", "span": 8}},
    sample="sliding_window_english",
    role="control",
)
class SlidingWindowLM(TransformerLM):
    """Sliding-window transformer: the control every memory family is compared with."""

    def default_attention(self) -> None:
        return None

    def check_config(self) -> None:
        if self.attention is None or self.attention.kind != "window":
            raise ConfigError('the \'sliding_window\' family needs attention {"kind": "window", "span": tokens}')
