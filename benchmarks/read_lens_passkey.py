"""The read lens on pass-key prompts: at the token that predicts the key's first digit, what each memory layer's
read promotes, and how much of the read's logit for that digit its writers inside the needle give.

    python benchmarks/read_lens_passkey.py [--samples gated_deltanet_english_16k ...] [--lengths 2048 8192] [--n 4]
        [--figure docs/images/read_lens_gated_deltanet_english_16k.png]

Per sample, length and prompt: for each memory layer, the rank of the key's first digit among the read's lens
logits, and the share of the read's logit for that digit that the needle's tokens wrote (memviz.read_lens: the
writers' shifts add up to the read's logit). Prints the table (mean over prompts) for docs/read_lens.md.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import pandas as pd
import torch
from retention_curve import save_png  # beside this script

import memviz
from memviz.read_lens import logit_shifts, read_lens, read_lens_figure, read_path_of
from memviz.registry import reads_out
from memviz_probes import passkey

SAMPLES = ("gated_deltanet_english_16k", "infini_english_16k", "lm2_english_16k")


def measure(model, sample: passkey.Sample) -> list[dict]:
    tok = model.tokenizer
    prompt_ids = tok.encode(sample.prompt)
    ids = prompt_ids + tok.encode(" " + sample.answer)
    first = next(i for i in range(len(prompt_ids), len(ids)) if tok.decode([ids[i]]).strip())
    position, digit = first - 1, ids[first]
    path = read_path_of(model, ids, position)
    readout = reads_out(model).memory_readout(ids, position)  # type: ignore[union-attr]
    a, b = sample.evidence[0]  # the needle's tokens
    rows = []
    for layer, parts in readout.parts.items():
        if layer not in path.layers:
            continue
        parts = parts.double()
        initial = readout.initial.get(layer, torch.zeros(parts.shape[1:], dtype=torch.float64))
        logits = path.logits(layer, (parts.sum(0) + initial)[None])[0]
        logits = logits - logits.mean()
        shifts = logit_shifts(path, layer, parts, torch.tensor([digit]))[:, 0]  # each writer's, on the digit
        rows.append(
            {
                "layer": layer,
                "digit rank": int((logits > logits[digit]).sum()) + 1,
                "digit logit": float(logits[digit]),
                "needle's share": float(shifts[a:b].sum() / logits[digit]) if logits[digit] > 0 else float("nan"),
            }
        )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--samples", nargs="+", default=list(SAMPLES))
    parser.add_argument("--lengths", nargs="+", type=int, default=[2048, 8192])
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--figure", type=Path, default=None)
    args = parser.parse_args()
    torch.set_num_threads(1)
    rows = []
    for name in args.samples:
        model = memviz.load(name)
        for length in args.lengths:
            for index in range(args.n):
                sample = passkey.seeded_sample(model.tokenizer, length, depth=0.3, seed=7, index=index)
                rows += [{"sample": name, "length": length, **row} for row in measure(model, sample)]
        if args.figure is not None and name == args.samples[0]:
            sample = passkey.seeded_sample(model.tokenizer, args.lengths[0], depth=0.3, seed=7, index=0)
            ids = model.tokenizer.encode(sample.prompt) + model.tokenizer.encode(" " + sample.answer)
            position = len(model.tokenizer.encode(sample.prompt))
            while not model.tokenizer.decode([ids[position]]).strip():
                position += 1
            lens = read_lens(model, ids, position - 1, promoted=8, writers=10)
            last = list(lens.layers)[-1]
            save_png(read_lens_figure(lens.layers[last], position - 1), args.figure, width=1000, height=560)
    table = pd.DataFrame(rows).groupby(["sample", "length", "layer"], sort=False).mean(numeric_only=True)
    print(table.round(3).to_string())


if __name__ == "__main__":
    main()
