"""Does LongMem's approximate search find the needle? `python benchmarks/bank_outliers.py NAME
[--distance 262144] [--sample 0] [--outliers 0 64 256 1024] [--ef 128 256]`.

Streams one retention sample (a pass key, `distance` tokens of filler, the question; probe seed
11) through the checkpoint, keeps the bank it built, then rebuilds that bank once per setting and
asks it the question's queries and the queries of 1,000 filler tokens. For each setting it prints
  * recall@K over the filler queries: the share of the exact top-K chunks the search returns, and
  * needle hits: the share of (question token, head) pairs whose top-K holds a chunk of the needle,
    which is what answering needs; the exact search's share is the ceiling.
`outliers` 0 is the HNSW graph alone; more scores that many chunks per head farthest from the
mean key exactly as well (memviz.models.longmem.bank).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def main(argv: list[str] | None = None) -> int:
    import memviz
    from memviz.models.longmem.bank import ChunkBank
    from memviz.threads import thread_count
    from memviz_probes.passkey import QUESTION
    from memviz_probes.retention import seeded_sample

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint")
    parser.add_argument("--distance", type=int, default=1 << 18)
    parser.add_argument("--sample", type=int, default=0)
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--outliers", type=int, nargs="+", default=[0, 64, 256, 1024])
    parser.add_argument("--ef", type=int, nargs="+", default=[128])
    parser.add_argument("--threads", type=thread_count, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    model = memviz.load(args.checkpoint, bank_size=1 << 21, search="hnsw")
    sample = seeded_sample(model.tokenizer, args.distance, args.seed, args.sample)
    ids = model.tokenizer.encode(sample.prompt)
    question = len(ids) - len(model.tokenizer.encode("\n" + QUESTION))
    state = None
    started = time.perf_counter()
    with torch.no_grad():
        for _, _, chunk_state in model.stream(ids[:question], model.chunk_len):
            state = chunk_state
        queries = {}
        hook = (f"side_blocks.{model.augmented_layer}.attn.hook_q", lambda q, hook: queries.setdefault("q", q))
        model.run_with_hooks(torch.tensor([ids[question:]]), fwd_hooks=[hook], state=state)
        asked = queries.pop("q")
        filler = ids[question - 1100 : question - 100]
        model.run_with_hooks(torch.tensor([filler]), fwd_hooks=[hook], state=state)
        filler_q = queries.pop("q")
    streamed = time.perf_counter() - started
    held = state.shared.bank
    keys, values, first = held.keys, held.values, int(held.positions[0])
    K = model.options.topk_chunks
    needle_lo, needle_hi = sample.evidence[0]
    print(
        f"{args.checkpoint}: {sample.n_tokens:,} tokens ({streamed:.0f} s), {len(held) // held.chunk_size:,} chunks, "
        f"top-{K}"
    )
    print("| search | recall@K (filler queries) | needle hits (question) | search time (s, both sets) |")
    print("|---|---|---|---|")
    exact_hits = None
    for ef in args.ef:
        for outliers in args.outliers:
            bank = ChunkBank.empty(
                1,
                keys.shape[2],
                keys.shape[3],
                held.chunk_size,
                capacity=len(held),
                search="hnsw",
                ef_search=ef,
                exact_below=1,
                outliers=outliers,
            ).append(keys, values, first)
            lo, hi = 0, len(bank) // bank.chunk_size
            bank.search(filler_q[:, :1], lo, hi, K)  # builds the graphs and the outlier sets
            t = time.perf_counter()
            approx_f = bank.search(filler_q, lo, hi, K)[1]
            approx_q = bank.search(asked, lo, hi, K)[1]
            seconds = time.perf_counter() - t
            exact_f = bank.search(filler_q, lo, hi, K, kind="exact")[1]
            recall = float((approx_f[..., :, None] == exact_f[..., None, :]).any(-1).float().mean())

            def needle_share(entries: torch.Tensor) -> float:
                pos = bank.gather(entries)[2]
                return float(((pos + bank.chunk_size > needle_lo) & (pos < needle_hi)).any(-1).float().mean())

            if exact_hits is None:
                exact_hits = needle_share(bank.search(asked, lo, hi, K, kind="exact")[1])
                print(f"| exact | 1 | {exact_hits:.2f} | |")
            print(
                f"| hnsw ef {ef}, {outliers} outliers | {recall:.3f} | {needle_share(approx_q):.2f} | {seconds:.1f} |",
                flush=True,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
