"""Which heads of a baseline copy a pass key it can see: per layer and head, the attention that each position
predicting a key digit pays to that digit in the needle (both of the needle's copies of the key summed).

A LongMem model caches one backbone layer's keys and values (`memory.memory_layer`) and its side network reads
them with queries that start as a backbone block's: the bank can only hand a key to the reader if that layer's
keys mark "the digit after this one" and its values carry the digit, which is what a copying head's keys and
values do. This finds the layer.

`python benchmarks/copy_heads.py [SAMPLE ...] [--haystack NAME] [--n N]` prints one row a layer, one column a
head (the default: `sliding_window_english`, the English LongMem samples' backbone, in the plays' filler).
"""

from __future__ import annotations

import argparse
import random

import torch

import memviz
from memviz.layers import apply_rotary, local_mask, rotary_cos_sin
from memviz_probes.passkey import make_sample


@torch.no_grad()
def attention_patterns(model, ids: list[int]) -> tuple[torch.Tensor, dict]:
    """[layer, head, query, key]: each block's local attention weights over one input, rebuilt from its hooked
    queries and keys under RoPE and the block's own window and segment mask; and the run's cache (its q, k, v, z)."""
    cfg = model.cfg
    names = {f"blocks.{l}.attn.hook_{x}" for l in range(cfg.n_layers) for x in "qkvz"}
    _, cache = model.run_with_cache(torch.tensor([ids]), names_filter=lambda name: name in names)
    positions = torch.arange(len(ids))
    cos, sin = rotary_cos_sin(positions, cfg.d_head, cfg.rope_base)
    patterns = []
    for l, block in enumerate(model.blocks):
        q = apply_rotary(cache[f"blocks.{l}.attn.hook_q"], cos, sin)[0]
        k = apply_rotary(cache[f"blocks.{l}.attn.hook_k"], cos, sin)[0]
        visible = local_mask(positions, positions, block.attn.window, block.attn.segment_len)
        scores = torch.einsum("thd,shd->hts", q, k) / cfg.d_head**0.5
        patterns.append(scores.masked_fill(~visible, -torch.inf).softmax(-1))
    return torch.stack(patterns), cache


def copy_attention(model, haystack: str | None, n: int = 12, length: int = 60, seed: int = 0) -> torch.Tensor:
    """[layer, head]: the mean attention from the position that predicts each key digit to that digit in the
    needle, over n prompts of about `length` tokens (the needle in view of a 64-token window)."""
    tok = model.tokenizer
    found = []
    for i in range(n):
        rng = random.Random(f"copy_heads|{seed}|{i}")
        sample = make_sample(tok, length, 0.3, rng.randrange(10000, 100000), haystack, seed=i, instruction="")
        n_prompt = len(tok.encode(sample.prompt))
        ids = tok.encode(sample.prompt + sample.reply)
        answer = ids[n_prompt:]
        a, b = sample.evidence[0]
        starts = [s for s in range(a, b) if ids[s : s + len(answer)] == answer]  # the key's copies in the needle
        patterns, _ = attention_patterns(model, ids)
        rows = [n_prompt - 1 + j for j in range(len(answer))]
        targets = [[s + j for s in starts] for j in range(len(answer))]
        found.append(torch.stack([patterns[:, :, r, t].sum(-1) for r, t in zip(rows, targets)]).mean(0))
    return torch.stack(found).mean(0)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("samples", nargs="*", default=["sliding_window_english"])
    parser.add_argument("--haystack", default="shakespeare_train")
    parser.add_argument("--n", type=int, default=12)
    args = parser.parse_args(argv)
    for name in args.samples:
        model = memviz.load(name)
        table = copy_attention(model, None if args.haystack == "procedural" else args.haystack, args.n)
        print(f"{name} ({args.haystack}): attention to the digit to copy, layer x head")
        for l, row in enumerate(table.tolist()):
            print(f"  layer {l}: " + "  ".join(f"{x:.2f}" for x in row))


if __name__ == "__main__":
    main()
