"""The family views on held-out English, for the docs: `python benchmarks/english_views.py NAME [NAME ...]
[--document hamlet] [--start 0] [--tokens 2048] [--png-dir docs/images]`.

Traces a passage of a held-out document (no sample was trained on it) through each checkpoint with
`memviz.trace` and saves every figure of `viz.family_figures` as `english_<name>_<figure>.png` (drawn in
Chromium, `retention_curve.save_png`); prints each figure's file and the passage's bits per byte.
"""

from __future__ import annotations

import argparse
import math
import re
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from long_grid import load_checkpoints  # noqa: E402
from retention_curve import check_output, save_png  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    import memviz
    from memviz import viz
    from memviz.threads import thread_count
    from memviz_probes import texts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--document", default="hamlet", help="a held-out document's name")
    parser.add_argument("--start", type=int, default=0, help="first token of the passage")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--png-dir", type=Path)
    args = parser.parse_args(argv)
    if args.tokens < 2:  # the first token is not scored: bits per byte need a second
        parser.error(f"--tokens must be at least 2, got {args.tokens}")
    if args.start < 0:
        parser.error(f"--start must be 0 or more, got {args.start}")
    if args.png_dir:
        check_output(parser, "--png-dir", args.png_dir, folder=True)
    held = {d.name: d for c in texts.CORPORA for d in texts.documents(c, "heldout")}
    if args.document not in held:
        parser.error(f"--document must be a held-out document, one of {sorted(held)}")
    passages = {}
    for name, model in load_checkpoints(parser, args.checkpoints).items():
        document = model.tokenizer.encode(held[args.document].text)
        if args.start > len(document) - 2:
            parser.error(
                f"--start must lie inside {args.document}, {len(document):,} tokens in {name}'s tokenizer: "
                f"at most {len(document) - 2:,} (2 tokens before its end), got {args.start:,}"
            )
        passages[name] = model, document[args.start : args.start + args.tokens]
    torch.set_num_threads(args.threads)
    for name, (model, ids) in passages.items():
        tr = memviz.trace(model, ids)
        bits = (
            float(np.nansum(tr["loss"])) / math.log(2) / model.tokenizer.byte_length(ids[1:])
        )  # loss[t] predicts t + 1
        print(f"{name}: {args.document} tokens {args.start}-{args.start + len(ids)}, {bits:.3f} bits a byte")
        for title, fig in viz.family_figures(tr).items():
            if args.png_dir:
                path = (
                    args.png_dir
                    / f"english_{Path(name).name}_{re.sub(r'[^a-z0-9]+', '_', title.lower()).strip('_')}.png"
                )
                save_png(fig, path, width=1100, height=420)
                print(f"  {title}: {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
