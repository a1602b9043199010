"""Benchmarks: `python benchmarks/run.py [--quick] [--only NAME ...] [--record]`.

Prints tables of ratios measured in one run and, with --record, appends them to
benchmarks/RESULTS.md with the machine and versions. Every comparison runs its paths in turn,
round after round (benchmarks/timing.py), and gives the median time of each and the median of the
per-round ratios with their range in brackets. Sections:

  lm2_scan       the factored LM2 bank scan against the direct loop that projects the whole bank
                 every token: the PyTorch reference (kernels/lm2/reference.py) and the compiled CPU
                 kernel (kernels/lm2/cpu.c, the default CPU path), forward (target >= 20x at 8k
                 tokens) and forward + backward (target >= 10x)
  product_keys   product-key top-k + embedding bag against exhaustive top-k over all n^2 keys
                 + a dense gather
  titans_update  Titans' closed-form chunk update (kernels/titans/reference.py) against the
                 token-by-token rule written with torch.autograd (chunk 1: the same numbers)
  peers          our PyTorch paths against the peers on PyPI on matched shapes (product-key-memory,
                 infini-transformer-pytorch, titans-pytorch; benchmarks/peers.txt), forward and
                 backward; --install-peers installs them into benchmarks/.peers first
  streaming      trace a long pass-key input through the long-context sample with all its memory
                 hooks: time per token at the longest length against the shortest, and peak RSS
  app            cold start of the Trace page to its first heatmap, and re-drawing a 100k-token
                 trace's figures from the cached trace

Only CPU numbers are measured here, on the PyTorch references and the compiled CPU kernel (the
Triton kernels run on the CPU only in the interpreter, whose timings mean nothing); the GPU
columns of RESULTS.md stay empty until a GPU run fills them.
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

from timing import interleaved, median_s, ratio_text  # noqa: E402  (benchmarks/timing.py)


def rounds(quick: bool, full: int = 5) -> int:
    """Interleaved rounds a comparison runs (benchmarks/timing.py)."""
    return 3 if quick else full


def lm2_scan(quick: bool) -> list[dict]:
    from memviz_kernels.lm2 import cpu as lm2_scan_cpu
    from memviz_kernels.lm2.reference import lm2_scan_naive, lm2_scan_reference

    rows = []
    d, N = 128, 64
    for T in [1024] if quick else [1024, 8192]:
        g = torch.Generator().manual_seed(0)
        q, g_in = torch.randn(1, T, d, generator=g), torch.rand(1, T, d, generator=g)
        M0 = torch.randn(1, N, d, generator=g)
        W_K, W_V, W_f = (torch.randn(d, d, generator=g) / d**0.5 for _ in range(3))
        b_f = torch.zeros(d)
        with torch.no_grad():
            times = interleaved(
                {
                    "reference": lambda: lm2_scan_reference(q @ W_K.T / d**0.5, g_in, M0, W_V, W_f, b_f),
                    "naive": lambda: lm2_scan_naive(q, g_in, M0, W_K, W_V, W_f, b_f),
                    "c_kernel": lambda: lm2_scan_cpu.lm2_scan(q @ W_K.T / d**0.5, g_in, M0, W_V, W_f, b_f),
                },
                rounds(quick, 3),
            )
        rows.append(
            {
                "pass": "forward",
                "tokens": T,
                "slots": N,
                "d": d,
                "reference_s": round(median_s(times, "reference"), 3),
                "naive_s": round(median_s(times, "naive"), 3),
                "speedup": ratio_text(times, "naive", "reference"),
                "c_kernel_s": round(median_s(times, "c_kernel"), 4),
                "c_kernel_speedup": ratio_text(times, "naive", "c_kernel"),
                "target": ">= 20x at 8k",
            }
        )
    # forward + backward (training): gradients to every input, from the read and the last bank
    T = 1024 if quick else 4096
    g = torch.Generator().manual_seed(1)
    leaves = [
        torch.randn(1, T, d, generator=g),
        torch.rand(1, T, d, generator=g),
        torch.randn(1, N, d, generator=g),
        *(torch.randn(d, d, generator=g) / d**0.5 for _ in range(3)),
        torch.zeros(d),
    ]
    for x in leaves:
        x.requires_grad_()
    q, g_in, M0, W_K, W_V, W_f, b_f = leaves

    def fwd_bwd(scan, naive=False):
        def run():
            outputs = (
                scan(q, g_in, M0, W_K, W_V, W_f, b_f) if naive else scan(q @ W_K.T / d**0.5, g_in, M0, W_V, W_f, b_f)
            )
            (outputs[1].pow(2).mean() + outputs[4].pow(2).mean()).backward()
            for x in leaves:
                x.grad = None

        return run

    times = interleaved(
        {
            "reference": fwd_bwd(lm2_scan_reference),
            "naive": fwd_bwd(lm2_scan_naive, naive=True),
            "c_kernel": fwd_bwd(lm2_scan_cpu.lm2_scan),
        },
        rounds(quick, 3),
    )
    rows.append(
        {
            "pass": "fwd+bwd",
            "tokens": T,
            "slots": N,
            "d": d,
            "reference_s": round(median_s(times, "reference"), 3),
            "naive_s": round(median_s(times, "naive"), 3),
            "speedup": ratio_text(times, "naive", "reference"),
            "c_kernel_s": round(median_s(times, "c_kernel"), 4),
            "c_kernel_speedup": ratio_text(times, "naive", "c_kernel"),
            "target": ">= 10x",
        }
    )
    return rows


def product_keys(quick: bool) -> list[dict]:
    from memviz_kernels.product_keys.reference import product_key_topk, weighted_bag

    rows = []
    H, dk, k, d = 4, 64, 16, 128
    for n in [64] if quick else [64, 128]:
        g = torch.Generator().manual_seed(0)
        q = torch.randn(2048, H, dk, generator=g)
        keys = torch.randn(H, 2, n, dk // 2, generator=g)
        values = torch.randn(n * n, d, generator=g)
        full = torch.cat(
            [keys[:, 0, :, None].expand(H, n, n, dk // 2), keys[:, 1, None].expand(H, n, n, dk // 2)], -1
        ).reshape(H, n * n, dk)

        def ours():
            s, i = product_key_topk(q, keys, k)
            return weighted_bag(i.flatten(-2), torch.softmax(s, -1).flatten(-2), values)

        def exhaustive():
            s, i = torch.einsum("thd,hmd->thm", q, full).topk(k, -1)
            return (values[i] * torch.softmax(s, -1)[..., None]).sum((-2, -3))

        with torch.no_grad():
            times = interleaved({"ours": ours, "exhaustive": exhaustive}, rounds(quick, 7))
        rows.append(
            {
                "values": n * n,
                "tokens": 2048,
                "heads": H,
                "topk": k,
                "product_keys_s": round(median_s(times, "ours"), 4),
                "exhaustive_s": round(median_s(times, "exhaustive"), 4),
                "speedup": ratio_text(times, "exhaustive", "ours"),
            }
        )
    return rows


def titans_update(quick: bool) -> list[dict]:
    import torch.nn.functional as F

    from memviz_kernels.titans.reference import titans_linear_reference

    def per_token_autograd(q, k, v, rates, W, S):
        """Eqs. 10, 12, 13 one token at a time, the gradient from torch.autograd."""
        reads = []
        for t in range(k.shape[1]):
            reads.append(q[:, t] @ W)
            Wg = W.detach().requires_grad_()
            loss = (torch.einsum("bd,bde->be", k[:, t], Wg) - v[:, t]).pow(2).sum()
            (grad,) = torch.autograd.grad(loss, Wg)
            eta, theta, alpha = (rates[:, t, i, None, None] for i in range(3))
            S = eta * S - theta * grad
            W = (1 - alpha) * W + S
        return torch.stack(reads, 1), W

    rows = []
    d = 128
    for T in [256] if quick else [256, 2048]:
        g = torch.Generator().manual_seed(0)
        q, k = (F.normalize(torch.randn(1, T, d, generator=g), dim=-1) for _ in range(2))
        v, rates = torch.randn(1, T, d, generator=g), torch.rand(1, T, 3, generator=g) * 0.5
        W, S = torch.zeros(1, d, d), torch.zeros(1, d, d)

        def no_grad(fn):
            def run():
                with torch.no_grad():
                    return fn()

            return run

        times = interleaved(
            {
                "autograd": lambda: per_token_autograd(q, k, v, rates, W, S),
                "chunk1": no_grad(lambda: titans_linear_reference(q, k, v, rates, W, S, 1)),
                "chunk16": no_grad(lambda: titans_linear_reference(q, k, v, rates, W, S, 16)),
            },
            rounds(quick, 3),
        )
        rows.append(
            {
                "tokens": T,
                "d": d,
                "autograd_per_token_s": round(median_s(times, "autograd"), 3),
                "closed_form_chunk1_s": round(median_s(times, "chunk1"), 3),
                "closed_form_chunk16_s": round(median_s(times, "chunk16"), 4),
                "speedup_chunk1": ratio_text(times, "autograd", "chunk1"),
                "speedup_chunk16": ratio_text(times, "autograd", "chunk16"),
            }
        )
    return rows


PEERS_DIR = ROOT / "benchmarks" / ".peers"


def install_peers() -> None:
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "install",
            "--quiet",
            "--no-deps",
            "--target",
            str(PEERS_DIR),
            "-r",
            str(ROOT / "benchmarks" / "peers.txt"),
        ],
        check=True,
    )


def peers(quick: bool) -> list[dict]:
    if not (PEERS_DIR / "titans_pytorch").exists():
        return [{"note": "peers not installed: run with --install-peers (benchmarks/peers.txt)"}]
    sys.path.insert(0, str(PEERS_DIR))
    from infini_transformer_pytorch import InfiniTransformer
    from product_key_memory import PKM
    from titans_pytorch import NeuralMemory as PeerNeuralMemory

    import memviz
    from memviz.models.memory_layer import MemoryLayerOptions, ProductKeyMemory
    from memviz.models.titans import NeuralMemory, TitansOptions

    def compare(op, shape, peer_name, ours_call, peer_call, ours_params, peer_params):
        """Two rows: the forward without gradients, and forward + backward of a squared-output loss."""

        def fwd_bwd(call, params):
            def run():
                call().float().pow(2).mean().backward()
                for p in params:
                    p.grad = None

            return run

        def no_grad(call):
            def run():
                with torch.no_grad():
                    call()

            return run

        out = []
        for mode, wrap in (("forward", no_grad), ("fwd+bwd", None)):
            paths = (
                {"ours": no_grad(ours_call), "peer": no_grad(peer_call)}
                if wrap
                else {"ours": fwd_bwd(ours_call, ours_params), "peer": fwd_bwd(peer_call, peer_params)}
            )
            times = interleaved(paths, n_rounds)
            out.append(
                {
                    "op": f"{op} {mode}",
                    "shape": shape,
                    "ours_s": round(median_s(times, "ours"), 4),
                    "peer": peer_name,
                    "peer_s": round(median_s(times, "peer"), 4),
                    "peer_over_ours": ratio_text(times, "peer", "ours"),
                }
            )
        return out

    n_rounds = rounds(quick, 9)
    rows = []
    T = 256 if quick else 1024
    # product keys: 4 heads, 64 x 64 = 4096 values, top-16, 32-dim half keys, d_model 256
    x = torch.randn(2, T, 256)
    cfg = memviz.ModelConfig(family="memory_layer", d_model=256, n_layers=1, n_heads=4, vocab_size=256)
    opts = MemoryLayerOptions(n_keys=64, topk=16, heads=4, d_key=64, swilu=False, qk_norm=False)
    ours = ProductKeyMemory(cfg, opts, torch.nn.Parameter(torch.randn(64 * 64, 256) / 16))
    ours.reset_memory_parameters()
    peer = PKM(256, heads=4, num_keys=64, topk=16, dim_head=32)
    rows += compare(
        "product-key memory",
        f"2x{T}x256, 4 heads, 4096 values, top-16",
        "product-key-memory 0.3.0",
        lambda: ours(x),
        lambda: peer(x),
        list(ours.parameters()),
        list(peer.parameters()),
    )
    # Infini-attention: 2 layers, d 128, 4 heads of 32, segments of 64, delta rule, over 4T tokens; the
    # peer's feed-forward is a GEGLU of inner width int(4 * 128 * 2 / 3) = 341, so ours is a SwiGLU of 341
    ids = torch.randint(0, 256, (1, 4 * T))
    cfg = memviz.ModelConfig(
        family="infini",
        d_model=128,
        n_layers=2,
        n_heads=4,
        d_mlp=341,
        vocab_size=256,
        segment_len=64,
        memory={"update": "delta"},
    )
    ours = memviz.build_model(cfg)
    peer = InfiniTransformer(num_tokens=256, dim=128, depth=2, dim_head=32, heads=4, use_mem_delta_rule=True)

    def peer_segments():
        memories, logits = None, []
        for segment in ids.split(64, dim=1):
            out, _, memories = peer(segment, past_memories=memories, return_new_memories=True)
            logits.append(out)
        return torch.cat(logits, dim=1)

    rows += compare(
        "Infini-attention model",
        f"1x{4 * T} tokens, 2 layers, d 128, segment 64, delta",
        "infini-transformer-pytorch 0.2.1",
        lambda: ours(ids),
        peer_segments,
        list(ours.parameters()),
        list(peer.parameters()),
    )
    # Titans neural memory: MLP memory (2 layers, hidden 2d), d 128, chunks of 16. theta_max 0.1 keeps
    # ours finite on these random inputs: at the default 0.5 its weights overflow to NaN by token 128,
    # and the time was then arithmetic on NaN (the peer's stay finite)
    x = torch.randn(1, T, 128)
    cfg = memviz.ModelConfig(family="titans", d_model=128, n_layers=1, n_heads=4, vocab_size=256, segment_len=16)
    ours = NeuralMemory(cfg, TitansOptions(variant="lmm", memory="mlp", chunk=16, theta_max=0.1), 16)
    ours.reset_memory_parameters()
    peer = PeerNeuralMemory(dim=128, chunk_size=16)
    with torch.no_grad():
        read = ours.step(x, ours.init_state(1, x.device), 0)[0]
    if not torch.isfinite(read).all():
        raise RuntimeError(
            "the Titans memory's read overflowed on the benchmark's inputs: its timing would be of NaN arithmetic"
        )
    rows += compare(
        "Titans neural memory",
        f"1x{T}x128, MLP memory, chunk 16",
        "titans-pytorch 0.5.5",
        lambda: ours.step(x, ours.init_state(1, x.device), 0)[0],
        lambda: peer(x)[0],
        list(ours.parameters()),
        list(peer.parameters()),
    )
    return rows


STREAM_SCRIPT = """
import json, sys, time
sys.path.insert(0, {root!r})
import memviz
from benchmarks.released import status
from memviz_probes import passkey
model = memviz.load({checkpoint!r})
sample = passkey.seeded_sample(model.tokenizer, {length}, 0.5, 0, 0)
start = time.perf_counter()
tr = memviz.trace(model, sample.prompt)
seconds = time.perf_counter() - start
peak_rss_mb = status("VmHWM") / 2**20  # this process's own peak: ru_maxrss starts from the forking parent's
print(json.dumps({{"tokens": len(tr), "seconds": seconds, "peak_rss_mb": peak_rss_mb}}))
"""


def streaming(quick: bool) -> list[dict]:
    import memviz

    samples = memviz.list_samples()
    if not samples:
        return [{"note": "no sample checkpoint to stream through"}]
    checkpoint = next(s for s in ("longmem_long", "sliding_window", *samples) if s in samples)  # long-context first
    rows = []
    for length in [8_192, 65_536] if quick else [65_536, 1_000_000]:
        out = subprocess.run(
            [sys.executable, "-c", STREAM_SCRIPT.format(root=str(ROOT), checkpoint=checkpoint, length=length)],
            capture_output=True,
            text=True,
            check=True,
        )
        r = json.loads(out.stdout.strip().splitlines()[-1])
        rows.append(
            {
                "checkpoint": checkpoint,
                "tokens": r["tokens"],
                "seconds": round(r["seconds"], 1),
                "us_per_token": round(1e6 * r["seconds"] / r["tokens"], 1),
                "peak_rss_mb": round(r["peak_rss_mb"]),
            }
        )
    rows.append(
        {
            "ratio_time_per_token_long_vs_short": round(rows[1]["us_per_token"] / rows[0]["us_per_token"], 2),
            "target": "<= 1.2, peak RSS < 3 GB",
        }
    )
    return rows


APP_SCRIPT = """
import sys, time
sys.path.insert(0, {root!r})
start = time.perf_counter()
from streamlit.testing.v1 import AppTest
script = "import sys\\nsys.path.insert(0, {root!r})\\nfrom app import trace_page\\ntrace_page.render()\\n"
at = AppTest.from_string(script, default_timeout=600)
at.run()
assert not at.exception, at.exception
assert at.get("plotly_chart")
print(time.perf_counter() - start)
"""


def app(quick: bool) -> list[dict]:
    import memviz
    from app.common import default_sample
    from memviz import viz
    from memviz_probes import passkey

    out = subprocess.run(
        [sys.executable, "-c", APP_SCRIPT.format(root=str(ROOT))], capture_output=True, text=True, cwd=ROOT
    )
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
    redraw = median_s(
        interleaved({"redraw": lambda: [f.to_json() for f in viz.family_figures(tr).values()]}, rounds(quick)), "redraw"
    )
    return [
        {
            "checkpoint": checkpoint,
            "cold_start_to_first_heatmap_s": round(cold, 1),
            "tokens": len(tr),
            "first_trace_s": round(trace_s, 1),
            "redraw_from_cache_s": round(redraw, 3),
            "note": "cold start includes importing torch, TransformerLens and Streamlit",
        }
    ]


SECTIONS = {
    "lm2_scan": lm2_scan,
    "product_keys": product_keys,
    "titans_update": titans_update,
    "peers": peers,
    "streaming": streaming,
    "app": app,
}


def table(rows: list[dict]) -> str:
    keys = list(dict.fromkeys(k for r in rows for k in r))
    lines = ["| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
    lines += ["| " + " | ".join(str(r.get(k, "")) for k in keys) + " |" for r in rows]
    return "\n".join(lines)


def main() -> int:
    from memviz.threads import thread_count

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a minute)")
    parser.add_argument("--only", nargs="+", choices=sorted(SECTIONS))
    parser.add_argument("--record", action="store_true", help="append the tables to benchmarks/RESULTS.md")
    parser.add_argument(
        "--install-peers", action="store_true", help="pip-install benchmarks/peers.txt into benchmarks/.peers"
    )
    parser.add_argument(
        "--threads", type=thread_count, default=torch.get_num_threads(), help="torch threads (default: all cores)"
    )
    args = parser.parse_args()
    if args.install_peers:
        install_peers()
    torch.set_num_threads(args.threads)
    header = (
        f"## {datetime.now(timezone.utc):%Y-%m-%d %H:%M} UTC · {platform.machine()} CPU, {torch.get_num_threads()} "
        "threads · "
        f"torch {torch.__version__} · python {platform.python_version()}{' · --quick' if args.quick else ''}\n"
    )
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
