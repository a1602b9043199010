"""Benchmarks: `python benchmarks/run.py [--quick] [--only NAME ...] [--record]`.

Prints tables of ratios measured in one run (so machine load cancels out) and, with --record,
appends them to benchmarks/RESULTS.md with the machine and versions. Sections:

  lm2_scan       the factored LM2 bank scan (kernels/lm2_scan.py) against the direct loop that
                 projects the whole bank every token; target >= 20x at 8k tokens
  product_keys   product-key top-k + embedding bag against exhaustive top-k over all n^2 keys
                 + a dense gather
  streaming      trace a long pass-key input through the long-context sample with all its memory
                 hooks: time per token at the longest length against the shortest, and peak RSS
  app            cold start of the Trace page to its first heatmap, and re-drawing a 100k-token
                 trace's figures from the cached trace

Only CPU numbers are measured here; GPU kernels are not written yet (see RESULTS.md).
"""
from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def best_of(fn, repeats: int = 3) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def lm2_scan(quick: bool) -> list[dict]:
    from kernels.lm2_scan import lm2_scan_naive, lm2_scan_reference

    rows = []
    d, N = 128, 64
    for T in ([1024] if quick else [1024, 8192]):
        g = torch.Generator().manual_seed(0)
        q, g_in = torch.randn(1, T, d, generator=g), torch.rand(1, T, d, generator=g)
        M0 = torch.randn(1, N, d, generator=g)
        W_K, W_V, W_f = (torch.randn(d, d, generator=g) / d**0.5 for _ in range(3))
        b_f = torch.zeros(d)
        with torch.no_grad():
            ref = best_of(lambda: lm2_scan_reference(q @ W_K.T / d**0.5, g_in, M0, W_V, W_f, b_f), 2)
            naive = best_of(lambda: lm2_scan_naive(q, g_in, M0, W_K, W_V, W_f, b_f), 1)
        rows.append({"tokens": T, "slots": N, "d": d, "reference_s": round(ref, 3), "naive_s": round(naive, 3),
                     "speedup": round(naive / ref, 2), "target": ">= 20x at 8k"})
    return rows


def product_keys(quick: bool) -> list[dict]:
    from kernels.product_keys import product_key_topk, weighted_bag

    rows = []
    H, dk, k, d = 4, 64, 16, 128
    for n in ([64] if quick else [64, 128]):
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2048, H, dk, generator=g)
        keys = torch.randn(H, 2, n, dk // 2, generator=g)
        values = torch.randn(n * n, d, generator=g)
        full = torch.cat([keys[:, 0, :, None].expand(H, n, n, dk // 2), keys[:, 1, None].expand(H, n, n, dk // 2)], -1).reshape(H, n * n, dk)

        def ours():
            s, i = product_key_topk(q, keys, k)
            return weighted_bag(i.flatten(-2), torch.softmax(s, -1).flatten(-2), values)

        def exhaustive():
            s, i = torch.einsum("thd,hmd->thm", q, full).topk(k, -1)
            return (values[i] * torch.softmax(s, -1)[..., None]).sum((-2, -3))

        with torch.no_grad():
            a, b = best_of(ours), best_of(exhaustive)
        rows.append({"values": n * n, "tokens": 2048, "heads": H, "topk": k, "product_keys_s": round(a, 4),
                     "exhaustive_s": round(b, 4), "speedup": round(b / a, 2)})
    return rows


STREAM_SCRIPT = """
import json, resource, sys, time
sys.path.insert(0, {root!r})
import memviz
from probes import passkey
model = memviz.load({checkpoint!r})
sample = passkey.seeded_sample(model.tokenizer, {length}, 0.5, 0, 0)
start = time.perf_counter()
tr = memviz.trace(model, sample.prompt)
seconds = time.perf_counter() - start
print(json.dumps({{"tokens": len(tr), "seconds": seconds, "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}}))
"""


def streaming(quick: bool) -> list[dict]:
    import memviz

    samples = memviz.list_samples()
    if not samples:
        return [{"note": "no sample checkpoint to stream through"}]
    checkpoint = next(s for s in ("longmem", "sliding_window", *samples) if s in samples)  # long-context first
    rows = []
    for length in ([8_192, 65_536] if quick else [65_536, 1_000_000]):
        out = subprocess.run([sys.executable, "-c", STREAM_SCRIPT.format(root=str(ROOT), checkpoint=checkpoint, length=length)],
                             capture_output=True, text=True, check=True)
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append({"checkpoint": checkpoint, "tokens": r["tokens"], "seconds": round(r["seconds"], 1),
                     "us_per_token": round(1e6 * r["seconds"] / r["tokens"], 1), "peak_rss_mb": round(r["peak_rss_mb"])})
    rows.append({"ratio_time_per_token_long_vs_short": round(rows[1]["us_per_token"] / rows[0]["us_per_token"], 2),
                 "target": "<= 1.2, peak RSS < 3 GB"})
    return rows


APP_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
start = time.perf_counter()
from streamlit.testing.v1 import AppTest
at = AppTest.from_string("import sys\\nsys.path.insert(0, {root!r})\\nfrom app import trace_page\\ntrace_page.render()\\n",
                         default_timeout=600)
at.run()
assert not at.exception, at.exception
assert at.get("plotly_chart")
print(time.perf_counter() - start)
"""


def app(quick: bool) -> list[dict]:
    from app.common import default_sample
    import memviz
    from memviz import viz
    from probes import passkey

    out = subprocess.run([sys.executable, "-c", APP_SCRIPT.format(root=str(ROOT))], capture_output=True, text=True, cwd=ROOT)
    if out.returncode != 0:
        raise RuntimeError(f"the app did not reach its first heatmap:\n{out.stderr[-2000:]}")
    cold = float(out.stdout.strip().splitlines()[-1])
    checkpoint = default_sample()
    model = memviz.load(checkpoint)
    length = 20_000 if quick else 100_000
    sample = passkey.seeded_sample(model.tokenizer, length, 0.5, 0, 0)
    start = time.perf_counter()
    tr = memviz.trace(model, sample.prompt, evidence=sample.evidence)
    trace_s = time.perf_counter() - start
    redraw = best_of(lambda: [f.to_json() for f in viz.family_figures(model, tr).values()])
    return [{"checkpoint": checkpoint, "cold_start_to_first_heatmap_s": round(cold, 1), "tokens": len(tr),
             "first_trace_s": round(trace_s, 1), "redraw_from_cache_s": round(redraw, 3),
             "note": "cold start includes importing torch, TransformerLens and Streamlit"}]


SECTIONS = {"lm2_scan": lm2_scan, "product_keys": product_keys, "streaming": streaming, "app": app}


def table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a minute)")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS))
    parser.add_argument("--record", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    header = (f"## {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC · {platform.machine()} CPU, {torch.get_num_threads()} threads · "
              f"torch {torch.__version__} · python {platform.python_version()}{' · --quick' if args.quick else ''}\n")
    report = [header]
    for name in args.only or SECTIONS:
        rows = SECTIONS[name](args.quick)
        report.append(f"### {name}\n\n{table(rows)}\n")
        print(report[-1], flush=True)
    if args.record:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a", encoding="utf-8") as fh:
            fh.write("\n".join(report) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
