"""What a training step takes in memory, estimated before the first step from the model's own graph, so that a
curriculum this machine cannot hold is refused before any work (`training.loop.Trainer.check_step_memory`).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from memviz.model import MemoryLM


def step_bytes(model: MemoryLM, batch: int, length: int) -> int:
    """About the bytes a training step over `batch` x `length` tokens takes: what autograd saves for the
    backward, read from the model's own graph (the family's memory among it) at three short lengths and
    fitted as a + b L + c L^2 per sequence (c is causal attention's quadratic part: its masks and any scores
    kept), twice over for the gradients the backward makes of them, and the local attention's position mask
    (int64 differences and booleans, queries x keys) built one layer at a time."""
    # whole segments, so a segment's memory update is in each; a segment longer than the step is measured at
    # the step's length (a share of a segment: the fit can only overestimate)
    unit = max(64, min(model.cfg.segment_len or 0, length))
    short, middle, long = (saved_bytes(model, n * unit) for n in (4, 8, 16))
    slope_low, slope_high = (middle - short) / (4 * unit), (long - middle) / (8 * unit)
    quadratic = max(0.0, (slope_high - slope_low) / (12 * unit))  # slopes at 6 and 12 units, per token
    linear = slope_low - quadratic * 12 * unit
    saved = batch * (linear * length + quadratic * length**2)
    mask = 0
    if model.attention is not None:
        span = model.attention.span
        keys = length if span is None or length <= 2 * span else 2 * span  # LocalAttention's query blocks
        mask = length * keys * 9
    return int(2 * saved + mask)


def saved_bytes(model: MemoryLM, length: int) -> int:
    """The bytes autograd keeps for the backward of the next-token loss of one sequence of `length` tokens:
    counted as they are saved, or, in a model whose forward runs torch.func transforms (which refuse
    saved-tensor hooks), read from the finished graph's nodes."""
    storages: dict[int, int] = {}

    def count(saved: Any) -> Any:
        if isinstance(saved, Tensor):
            storages[saved.untyped_storage().data_ptr()] = saved.untyped_storage().nbytes()
        elif isinstance(saved, tuple | list):
            for item in saved:
                count(item)
        return saved

    tokens = torch.zeros(1, length, dtype=torch.long, device=model.device)
    with torch.enable_grad():
        try:
            with torch.autograd.graph.saved_tensors_hooks(count, lambda saved: saved):
                model(tokens, return_type="loss")  # the graph is freed on return
        except RuntimeError as exc:
            if "saved tensor hooks" not in str(exc):
                raise
            storages.clear()
            nodes, seen = [model(tokens, return_type="loss").grad_fn], set()
            while nodes:
                node = nodes.pop()
                if node is None or node in seen:
                    continue
                seen.add(node)
                for name in dir(node):
                    if name.startswith("_saved_") or name == "saved_tensors":
                        count(getattr(node, name))
                nodes.extend(following for following, _ in node.next_functions)
    return sum(storages.values())
