"""MQAR (Zoology's multi-query associative recall) over the English samples and their controls, beside the
linear-memory operator's capacity curve and the released architectures' tiny random models:
`python benchmarks/mqar_capacity.py [NAME ...] --lengths 512 2048 --pairs 4 8 16 32 --n 20 --threads 1
[--out DIR] [--png docs/images/mqar_english.png]`.

Writes `<out>/mqar.csv` (one row per query, every model), `<out>/mqar_tiny.csv` (the tiny random models),
`<out>/capacity_curve.csv` (the operator's recall at d_k = 32) and prints the accuracy tables; `--png` draws the
samples' figure (`memviz_probes.mqar.figure`) and, beside it with the suffix `_tiny`, the tiny models' one.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "benchmarks"))

#: every memory family's English sample, the one drilled to copy, then the two controls
SAMPLES = (
    "gated_deltanet_english_16k",
    "infini_english_16k",
    "lm2_english_16k",
    "titans_english_16k",
    "longmem_english",
    "memory_plus_english",
    "longmem_english_reread",
    "sliding_window_english",
    "dense_english",
)
#: released architectures' tiny random models, one per memory (Gated DeltaNet, Kimi Delta, Mamba-2, mLSTM, Mamba-1)
TINY = ("qwen3_5_text", "kimi_linear", "bamba", "xlstm", "mamba")
#: the tiny models' tokenizer text: short words, none in the procedural filler, so each is one token
ANIMALS = " ".join("ox ant bee cow elk emu fox gnu hen jay owl pig ram yak cat dog eel bat rat ape".split() * 3)


def main(argv: list[str] | None = None) -> int:
    import memviz
    from memviz.models.released.tiny import tiny_checkpoint
    from memviz.threads import thread_count
    from memviz_probes import mqar

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("names", nargs="*", default=list(SAMPLES))
    parser.add_argument("--lengths", type=int, nargs="+", default=[512, 2048])
    parser.add_argument("--pairs", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--n", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--tiny-n", type=int, default=50, help="samples per cell of the tiny random models")
    parser.add_argument("--threads", type=thread_count, default=1)
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "mqar")
    parser.add_argument("--png", type=Path, help="the samples' figure; the tiny models' beside it with _tiny")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    args.out.mkdir(parents=True, exist_ok=True)

    frames = []
    for name in args.names:
        started = time.perf_counter()
        frames.append(
            mqar.run(memviz.load(name), args.lengths, args.pairs, args.n, args.seed, progress=False).assign(model=name)
        )
        print(f"{name}: {time.perf_counter() - started:.0f} s", flush=True)
    df = pd.concat(frames, ignore_index=True)
    mqar.csv_rows(df).to_csv(args.out / "mqar.csv", index=False)

    tiny = []
    with tempfile.TemporaryDirectory() as folder:
        for model_type in TINY:
            tiny_checkpoint(Path(folder) / model_type, model_type, text=ANIMALS)
            model = memviz.load(Path(folder) / model_type)
            run = mqar.run(model, [64, 256], [2, 4, 6], args.tiny_n, args.seed, progress=False)
            tiny.append(run.assign(model=f"{model_type} (tiny, random)"))
    tiny_df = pd.concat(tiny, ignore_index=True)
    mqar.csv_rows(tiny_df).to_csv(args.out / "mqar_tiny.csv", index=False)
    curve = mqar.capacity_curve()
    curve.to_csv(args.out / "capacity_curve.csv", index=False)

    pd.set_option("display.width", 200)
    print("\nSamples: accuracy over the vocabulary, then among the stored values (chance 1 / pairs)")
    print(mqar.summary(df).round(3).to_string())
    print("\nAccuracy among the stored values over chance (x pairs: 1 is chance), by distance from pair to query")
    bins = pd.cut(df["distance"], [0, 64, 256, 1024, 4096], right=False)
    lift = df["correct_among_values"] * df["pairs"]
    print(df.assign(lift=lift).pivot_table(index="model", columns=bins, values="lift", sort=False).round(2).to_string())
    print("\nTiny random models")
    print(mqar.summary(tiny_df).round(3).to_string())
    print("\nLinear memory, d_k = 32: recall (nearest stored value) against pairs")
    print(curve.pivot_table(index="rule", columns="pairs", values="accuracy").round(3).to_string())
    if args.png:
        from retention_curve import save_png

        title = "MQAR on the English samples: recall among the stored values"
        save_png(mqar.figure(df, title=title), args.png, width=1100, height=560)
        tiny_png = args.png.with_name(args.png.stem + "_tiny" + args.png.suffix)
        save_png(mqar.figure(tiny_df, title="MQAR on tiny random released models"), tiny_png, width=1100, height=520)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
