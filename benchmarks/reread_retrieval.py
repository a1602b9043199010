"""Where LongMem's retrieval looks at a passage's second reading: `python benchmarks/reread_retrieval.py NAME
[NAME ...] [--distances 1024 4096 16384] [--n 8] [--seed 0] [--png docs/images/reread_retrieval.png]`.

Draws the re-reading probe's passages (`memviz_probes.reread.draw`: held-out Hamlet and The Tempest, 300 tokens after
a 256-token lead), runs each LongMem checkpoint over them, and at the second reading's first P - 1 tokens (each
predicting the next) counts:
- `in_first`: the share of retrieved chunks (every head's top-k) that overlap the first reading;
- `chance`: the share of the bank's chunks at that token that overlap the first reading (0 once the bank has let it
  go), what a retrieval blind to the passage would give;
- `target`: the share of tokens at which some head retrieved the chunk holding the token to be predicted, at the
  first reading (what a copy reads).
`--png` draws, for the first passage at the first distance, each model's heads' best-scored chunk at every token of
the second reading beside the chunk a copy reads (one panel a model). `--view` saves the app's own view of what one
token retrieved (`viz.read_figures`, the first model), at the middle of the same passage's second reading, the first
reading outlined as the evidence.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from long_grid import load_checkpoints  # noqa: E402
from retention_curve import check_output, save_png  # noqa: E402


def retrieval_shares(model, ids: list[int], first: int, second: int, passage: int) -> dict[str, float]:
    """`in_first`, `chance` and `target` (module docstring) over the second reading's first P - 1 tokens; the chunks
    are `chunk_size` tokens from position 0, as the bank cuts them."""
    chunk, segment = model.options.chunk_size, model.cfg.segment_len
    found: list[torch.Tensor] = []
    name = f"side_blocks.{model.augmented_layer}.attn.hook_retrieved_pos"
    with torch.no_grad(), model.evaluating(), model.hooks(fwd_hooks=[(name, lambda pos, hook: found.append(pos[0]))]):
        for _ in model.stream(torch.tensor([ids])):
            pass
    positions = torch.cat(found)  # [T, H, K] first position of each retrieved chunk, -1 where none
    at = torch.arange(second, second + passage - 1)  # reading token t predicts t + 1
    read = positions[at]
    valid = read >= 0
    overlaps = valid & (read < first + passage) & (read + chunk > first)
    target = first + (at - second) + 1  # the token to predict, at the first reading
    holds_target = (valid & (read <= target[:, None, None]) & (read + chunk > target[:, None, None])).flatten(1).any(1)
    bank_end = (at // segment) * segment  # the bank holds whole segments before the token's, at most bank_size tokens
    bank_start = (bank_end - model.options.bank_size).clamp(min=0)
    first_chunks = (  # the bank's chunks that overlap the first reading, [first // chunk, ceil((first + P) / chunk))
        bank_end.clamp(max=-(-(first + passage) // chunk) * chunk) - bank_start.clamp(min=first // chunk * chunk)
    ).clamp(min=0)
    return {
        "in_first": float(overlaps.sum() / valid.sum()) if valid.any() else float("nan"),
        "chance": float((first_chunks / (bank_end - bank_start).clamp(min=1)).double().mean()),
        "target": float(holds_target.double().mean()),
    }


def best_chunks_figure(models: dict, ids: list[int], first: int, second: int, passage: int):
    """Over the second reading, one panel a model: each head's best-scored retrieved chunk per token, against the
    chunk a copy reads (the next token's place at the first reading)."""
    from plotly.subplots import make_subplots

    import memviz

    fig = make_subplots(rows=len(models), cols=1, shared_xaxes=True, subplot_titles=list(models))
    at = np.arange(second, second + passage - 1)
    for row, model in enumerate(models.values(), start=1):
        prefix, chunk = f"side_blocks.{model.augmented_layer}.attn", model.options.chunk_size
        trace = memviz.trace(model, ids, names=[f"{prefix}.hook_retrieved_pos", f"{prefix}.hook_retrieved_scores"])
        pos, scores = trace[f"{prefix}.hook_retrieved_pos"][at], trace[f"{prefix}.hook_retrieved_scores"][at]
        best = np.take_along_axis(pos, np.nan_to_num(scores, nan=-np.inf).argmax(-1)[..., None], -1)[..., 0]  # [T, H]
        for head in range(best.shape[1]):
            fig.add_scatter(
                x=at,
                y=best[:, head],
                mode="markers",
                marker=dict(size=4, color=f"hsl({90 * head},60%,45%)"),
                name=f"head {head}",
                showlegend=row == 1,
                row=row,
                col=1,
            )
        fig.add_scatter(
            x=at,
            y=(first + (at - second) + 1) // chunk * chunk,  # the chunk holding the next token at the first reading
            mode="lines",
            line=dict(color="black", dash="dot"),
            name="what a copy reads",
            showlegend=row == 1,
            row=row,
            col=1,
        )
        fig.update_yaxes(title_text="retrieved chunk", row=row, col=1)
    fig.update_xaxes(title_text="reading token position", row=len(models), col=1)
    fig.update_layout(
        title=f"Each head's best chunk at a passage's second reading (the first reading: tokens {first}-"
        f"{first + passage - 1})",
        width=1000,
        height=300 + 250 * len(models),
    )
    return fig


def main(argv: list[str] | None = None) -> int:
    from memviz.threads import thread_count
    from memviz_probes import lm, reread
    from memviz_probes.common import check_n

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--distances", type=int, nargs="+", default=[1024, 4096, 16384])
    parser.add_argument("--n", type=int, default=8)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--png", type=Path)
    parser.add_argument("--view", type=Path, help="the app's retrieval view of the first model, as a PNG")
    args = parser.parse_args(argv)
    for flag, path in (("--png", args.png), ("--view", args.view)):
        if path:
            check_output(parser, flag, path)
    torch.set_num_threads(args.threads)
    models = load_checkpoints(parser, args.checkpoints)
    for label, model in models.items():
        if model.family != "longmem":
            parser.error(f"{label} is a {model.family} model: this reads LongMem's retrieval")
    try:
        reread.check_distances(args.distances)
        check_n(args.n)
    except ValueError as exc:
        parser.error(str(exc))
    docs = lm.select("shakespeare", "heldout", None)
    label, model = next(iter(models.items()))
    tokenized = {d.name: model.tokenizer.encode(d.text) for d in docs}
    sample = docs[0].text[:4000]
    for other, m in models.items():  # one drawing of the passages, read alike by every model
        if m.tokenizer.encode(sample) != model.tokenizer.encode(sample):
            parser.error(f"{other} tokenizes text otherwise than {label}: compare models of one tokenizer")
    lead, passage = reread.LEAD_TOKENS, reread.PASSAGE_TOKENS
    readings = reread.draw(tokenized, args.n, args.seed, passage, lead + max(args.distances), "held-out plays")
    print("| model | d | in the first reading | chance | copy target retrieved |")
    print("|---|---|---|---|---|")
    for label, model in models.items():
        for distance in args.distances:
            shares = [retrieval_shares(model, *r.tokens(distance, lead), passage) for r in readings]
            mean = {key: np.mean([s[key] for s in shares]) for key in shares[0]}
            print(
                f"| {label} | {distance:,} | {mean['in_first']:.1%} | {mean['chance']:.1%} | {mean['target']:.1%} |",
                flush=True,
            )
    ids, first, second = readings[0].tokens(args.distances[0], lead)  # the figures' passage
    if args.png:
        save_png(best_chunks_figure(models, ids, first, second, passage), args.png)
        print(f"wrote {args.png}")
    if args.view:
        import memviz
        from memviz import viz

        label, model = next(iter(models.items()))
        trace = memviz.trace(model, ids, evidence=[(first, first + passage)])
        at = second + passage // 2
        view = viz.read_figures(trace, at)["chunks retrieved"]
        view.update_layout(
            title=f"{label}, {args.distances[0]:,} tokens after the first reading<br>{view.layout.title.text}"
        )
        save_png(view, args.view)
        copy = first + (at - second) + 1
        print(f"wrote {args.view}: token {at} of the second reading; a copy reads token {copy} of the first")
    return 0


if __name__ == "__main__":
    sys.exit(main())
