"""How much of each segment an LM2 null write keeps out of the bank: `python benchmarks/null_write.py NAME
--lengths 16384 [--depths 0.5] [--n 1] [--haystack grass] [--threads 2]`.

For a sample with `write_sink` (docs/families.md), slot n's write over a segment is the softmax over its tokens'
logits and its null logit s[n]; the tokens take 1 - b0[n] of it, the null write b0[n] (which keeps the slot as it
is). Per pass-key prompt (probe seed 11 by default) and layer, this prints the tokens' share 1 - b0 in a filler
segment and in the segment(s) that hold the needle: the median over slots, and the share of the slot written most
(for filler, the median over segments of that). Filler written little and the needle written much into some slot is a
memory that keeps what matters.
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def written_shares(scores: np.ndarray, sink: np.ndarray, segment_len: int) -> np.ndarray:
    """Per whole segment and slot, the share 1 - b0 of the write that its tokens take, from the logits
    `scores` [pos, slot] and the null logits `sink` [slot] [segments, slot]."""
    from memviz.models.lm2 import segment_softmax

    n = len(scores) // segment_len * segment_len
    weights = segment_softmax(scores[:n], segment_len, sink)
    return weights.reshape(-1, segment_len, weights.shape[1]).sum(1)


def columns(row: list[list[float]]) -> str:
    """filler median, filler top slot | needle median, needle top slot; one number a layer in each."""
    cells = [" ".join(f"{v:.2f}" for v in values) for values in row]
    return f"{cells[0]}, {cells[1]} | {cells[2]}, {cells[3]}"


def main(argv: list[str] | None = None) -> int:
    from key_share import load_checked, prompt_parser, prompts

    from memviz_probes.passkey import score

    parser = prompt_parser(__doc__.split("\n\n")[0], depths=[0.5], n=1)
    args = parser.parse_args(argv)
    model = load_checked(parser, args)
    if model.family != "lm2" or model.cfg.memory.get("write_sink") is None:
        parser.error(f"{args.checkpoint}: not an LM2 sample with a null write (family {model.family})")
    L, layers = model.cfg.segment_len, range(model.cfg.n_layers)
    sinks = [model.blocks[layer].memory.write_sink.detach().double().numpy() for layer in layers]
    print("length  depth  i  right  tokens' share, per layer: filler median, top slot | needle median, top slot")
    table = []
    for length, depth, i, sample, ids in prompts(model, args):
        start, end = sample.evidence[0]
        needle = np.zeros(len(ids) // L, dtype=bool)
        needle[start // L : min((end - 1) // L + 1, len(needle))] = True
        if needle.all() or not needle.any():  # no whole segment of filler, or the needle's still open
            missing = "of filler" if needle.all() else "holds the needle"
            print(f"{length:6d}  {depth:5.2f}  {i}  skipped: no whole segment {missing}")
            continue
        with torch.no_grad():
            _, cache = model.run_with_cache(
                torch.tensor([ids]), names_filter=lambda name: name.endswith("hook_write_score")
            )
        shares = [
            written_shares(cache[f"blocks.{layer}.memory.hook_write_score"][0].double().numpy(), sinks[layer], L)
            for layer in layers
        ]
        row = [
            [float(np.median(s[~needle])) for s in shares],
            [float(np.median(s[~needle].max(1))) for s in shares],
            [float(np.median(s[needle])) for s in shares],
            [float(s[needle].max()) for s in shares],
        ]
        right = score(model.generate(sample.prompt, max_new_tokens=8), sample)
        table.append(row)
        print(f"{length:6d}  {depth:5.2f}  {i}  {'yes' if right else 'no ':5s}  {columns(row)}", flush=True)
    if len(table) > 1:
        medians = [[statistics.median(col) for col in zip(*(row[c] for row in table))] for c in range(4)]
        print(f"median over {len(table)} prompts:  {columns(medians)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
