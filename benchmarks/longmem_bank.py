"""LongMem at the scale of its paper: `python benchmarks/longmem_bank.py [CHECKPOINT] [--tokens N] [--record]`.

Streams N tokens (default 2^20) of pass-key filler through a LongMem checkpoint loaded with a
bank of N tokens and faiss HNSW search (`memviz.load(path, bank_size=N, search="hnsw")`), with
every memory hook traced as the Trace page does (`memviz.trace`), and reports:

  * wall time of the whole trace and peak RSS of this process;
  * time per token over the 16k tokens ending at 64k against the 16k tokens ending at N
    (the bank then holds 16x more chunks): target at most 1.5x;
  * the search's recall@K: for the queries of one 1k-token chunk read against the bank as it
    stands at 64k and at N tokens, the share of the exact top-K chunks (over every visible
    chunk) that the HNSW search returns: target at least 0.95.

Targets (issue "memory that lasts"): a 1M-token trace in at most 10 minutes on 2 cores, peak
RSS under 4 GB. Timings are wall-clock on this machine; run it with nothing else running.
"""

from __future__ import annotations

import argparse
import platform
import resource
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WINDOW = 16384


def filler_ids(model, n: int) -> list[int]:
    """n tokens of the probes' procedural filler with a pass-key needle near the start."""
    from memviz_probes import retention

    return model.tokenizer.encode(retention.seeded_sample(model.tokenizer, n - 100, seed=0, index=0).prompt)[:n]


def recall_at(model, state, ids: list[int]) -> float:
    """Recall@K of the HNSW search against exact top-K for the side queries of `ids` read after
    `state` (each query also reading what the search found for the queries before it, from the
    first of `ids` on: the model's `recent_queries`)."""
    layer = model.side_blocks[model.augmented_layer].attn
    captured = {}
    hook = (f"side_blocks.{model.augmented_layer}.attn.hook_q", lambda q, hook: captured.setdefault("q", q))
    with torch.no_grad():
        model.run_with_hooks(torch.tensor([ids]), fwd_hooks=[hook], state=state)
    bank = state.shared.bank
    lo, hi = bank.visible_range(state.pos - model.options.bank_size, state.pos)
    K, q, seg = layer.options.topk_chunks, captured["q"], model.cfg.segment_len
    exact = bank.search(q, lo, hi, K, kind="exact")[1]
    approx, recent = [], model.no_recent_queries(q.shape[0])  # the queries in order, a segment at a time, as a stream
    for start in range(0, q.shape[1], seg):
        _, found, recent = bank.search_in_stream(q[:, start : start + seg], lo, hi, K, recent)
        approx.append(found)
    approx = torch.cat(approx, 1)
    return float((approx[..., :, None] == exact[..., None, :]).any(-1).float().mean())


def run(checkpoint: str, n_tokens: int, threads: int, chunk_size: int | None = None) -> dict:
    import memviz
    from memviz.tracing import trace

    torch.set_num_threads(threads)
    model = memviz.load(
        checkpoint, bank_size=n_tokens, search="hnsw", **({"chunk_size": chunk_size} if chunk_size else {})
    )
    ids = filler_ids(model, n_tokens + 1024)
    marks: dict[int, float] = {}
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        marks[done] = time.perf_counter() - started
        if done & (done - 1) == 0 or done == total:  # powers of two: a long run shows how far it got
            print(f"traced {done:,} tokens in {marks[done]:.0f} s", file=sys.stderr, flush=True)

    tr = trace(model, ids[:n_tokens], progress=progress, max_tokens=n_tokens)
    wall = time.perf_counter() - started

    def per_token(end: int) -> float:
        ends = sorted(marks)
        stop = min(e for e in ends if e >= end)
        begin = max(e for e in ends if e <= stop - WINDOW)
        return (marks[stop] - marks[begin]) / (stop - begin)

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # the peak so far: the trace's
    n_hooks = len(tr.names)
    del tr
    recalls = {}
    for at in (65536, n_tokens):
        _, state = model.prefill(ids[:at])  # the bank a stream leaves, without the side network's searches
        recalls[at] = recall_at(model, state, ids[at : at + 1024])
    return {
        "checkpoint": checkpoint,
        "tokens": n_tokens,
        "threads": threads,
        "chunk_size": model.options.chunk_size,
        "wall_s": wall,
        "peak_rss_gb": rss,
        "us_per_token_at_64k": 1e6 * per_token(65536),
        "us_per_token_at_end": 1e6 * per_token(n_tokens),
        "recall": recalls,
        "traced_hooks": n_hooks,
    }


def main() -> int:
    from memviz.threads import thread_count

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", default="longmem_long")
    parser.add_argument("--tokens", type=int, default=2**20)
    parser.add_argument("--threads", type=thread_count, default=2)
    parser.add_argument("--chunk-size", type=int, help="tokens a bank chunk (default: the checkpoint's config)")
    parser.add_argument("--record", action="store_true", help="append the table to benchmarks/RESULTS.md")
    args = parser.parse_args()
    if args.tokens < 2 * 65536:
        parser.error("--tokens must be at least 131072 (the comparison is against the time per token at 64k)")
    r = run(args.checkpoint, args.tokens, args.threads, args.chunk_size)
    ratio = r["us_per_token_at_end"] / r["us_per_token_at_64k"]
    recall = ", ".join(f"{k:,} tokens: {v:.3f}" for k, v in r["recall"].items())
    table = "\n".join(
        [
            "| measure | value | target |",
            "|---|---|---|",
            f"| trace of {r['tokens']:,} tokens ({r['traced_hooks']} hooks kept) | {r['wall_s']:.0f} s | <= 600 s |",
            f"| peak RSS of the trace (loading, streaming, the kept hooks) | {r['peak_rss_gb']:.2f} GB | < 4 GB |",
            f"| time per token, 16k tokens ending at 64k | {r['us_per_token_at_64k']:.0f} us | |",
            f"| time per token, 16k tokens ending at {r['tokens']:,} | {r['us_per_token_at_end']:.0f} us | |",
            f"| ratio (end / 64k) | {ratio:.2f}x | <= 1.5x |",
            f"| HNSW recall@{8} against exact top-k | {recall} | >= 0.95 |",
        ]
    )
    print(table)
    if args.record:
        head = (
            f"\n## {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC · LongMem bank at {r['tokens']:,} tokens "
            f"({r['checkpoint']}, HNSW, chunks of {r['chunk_size']}) · {platform.machine()} CPU, {r['threads']} "
            f"threads · torch {torch.__version__}\n\n"
            f"Command: `python benchmarks/longmem_bank.py {r['checkpoint']} --tokens {r['tokens']} --threads "
            f"{r['threads']}"
            f"{f' --chunk-size {args.chunk_size}' if args.chunk_size else ''}"
            " --record`\n\n"
        )
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as fh:
            fh.write(head + table + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
