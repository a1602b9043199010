"""Language modelling on held-out text: `python benchmarks/english_lm.py NAME [NAME ...] [--corpus all]
[--max-tokens N] [--record] [--png docs/images/lm_position.png]`.

`memviz_probes.lm` over the held-out documents (Hamlet and The Tempest, Botchan's last chapter) for each named
checkpoint: bits per byte per corpus, and each model's loss against token position over the whole documents,
binned on a log scale. Prints a table of bits per byte and, per model, the mean loss inside the local window
(tokens 1-63) and past it (64 on), with the difference from the first checkpoint named `*sliding_window*`
(the control). `--record` stores the scores in each card under `lm`; `--png` draws the position figure in
Chromium (`retention_curve.save_png`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from long_grid import load_checkpoints, refused  # noqa: E402
from retention_curve import check_output, save_png  # noqa: E402


def window_split(losses, window: int) -> tuple[float, float]:
    """Mean loss of tokens inside the window (positions 1..window-1) and past it."""
    inside = np.concatenate([x[: window - 1] for x in losses])
    past = [x[window - 1 :] for x in losses if len(x) >= window]
    return float(inside.mean()), float(np.concatenate(past).mean()) if past else float("nan")


def main(argv: list[str] | None = None) -> int:
    from memviz.checkpoint import CARD_FILE, resolve
    from memviz.files import atomic_write_text
    from memviz.threads import thread_count
    from memviz_probes import lm, texts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument(
        "--corpus", default="all", choices=[*texts.CORPORA, "all"], help="the held-out split of one corpus, or all"
    )
    parser.add_argument("--max-tokens", type=int)
    parser.add_argument("--window", type=int, default=64)
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--record", action="store_true")
    parser.add_argument("--png", type=Path)
    args = parser.parse_args(argv)
    if args.window < 2 or (args.max_tokens is not None and args.max_tokens < 2):
        parser.error(f"--window and --max-tokens must be at least 2 tokens, got {args.window} and {args.max_tokens}")
    corpus = None if args.corpus == "all" else args.corpus
    refused(parser, "--corpus", lm.select, corpus, "heldout", None)  # its texts are there (Botchan's is installed)
    if args.png:
        check_output(parser, "--png", args.png)
    started = time.perf_counter()
    models = load_checkpoints(parser, args.checkpoints, record=args.record)
    torch.set_num_threads(args.threads)
    df = lm.compare(models, corpus=corpus, max_tokens=args.max_tokens)
    table = lm.summary(df)["bits_per_byte"].unstack("corpus")
    control = next((n for n in args.checkpoints if "sliding_window" in n), None)
    splits = {name: window_split(group["losses"], args.window) for name, group in df.groupby("model", sort=False)}
    print(
        f"bits per byte on held-out text ({', '.join(f'{c}: {list(v)}' for c, v in texts.HELD_OUT.items())}); "
        f"loss in nats a token inside / past the {args.window}-token window, all documents"
    )
    print("| model | " + " | ".join(table.columns) + " | inside | past | past - control's |")
    print("|---|" + "---|" * (len(table.columns) + 3))
    for name, row in table.iterrows():
        inside, past = splits[name]
        delta = f"{past - splits[control][1]:+.3f}" if control else ""
        print(f"| `{name}` | " + " | ".join(f"{v:.3f}" for v in row) + f" | {inside:.3f} | {past:.3f} | {delta} |")
    if args.record:
        command = "python benchmarks/english_lm.py " + " ".join(
            shlex.quote(a) for a in (argv if argv is not None else sys.argv[1:])
        )
        for name, row in table.iterrows():
            path = resolve(name) / CARD_FILE
            card = json.loads(path.read_text())
            card["lm"] = {
                "bits_per_byte": {c: round(float(v), 4) for c, v in row.items()},
                "held_out": {c: list(v) for c, v in texts.HELD_OUT.items()},
                "loss_inside_window": round(splits[name][0], 4),
                "loss_past_window": round(splits[name][1], 4),
                "command": command,
            }
            atomic_write_text(path, json.dumps(card, indent=2, sort_keys=True))
    if args.png:
        fig = lm.position_curve(
            lm.by_position(df), window=args.window, title="Loss against token position over the held-out documents"
        )
        save_png(fig, args.png)
        print(f"saved {args.png}")
    print(f"{time.perf_counter() - started:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
