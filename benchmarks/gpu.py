"""The GPU run in one command: `python benchmarks/gpu.py [--device cuda|cpu] [--quick] [--record]`.

On a machine with CUDA (the default device when there is one):
  1. the kernel tests (`pytest kernels`) with every tensor on the GPU (MEMVIZ_TEST_DEVICE=cuda);
  2. each Triton kernel against its PyTorch reference and, where torch has one, torch's own op
     (torch.topk over every product key; F.embedding_bag), at 4k, 16k and 64k tokens: the three
     interleaved (A B C A B C ...), the median time ratio and its spread over the rounds, and the
     error relative to the reference run in float64 on the same inputs; a kernel that fails to build
     or run is a row naming the error;
  3. the product-key bag's bandwidth (bytes it must move over its time) against a measured
     device-to-device copy of as many bytes;
  4. a whole trace's tokens per second (`memviz.trace` over a pass-key input, every memory hook
     kept) on the device against the CPU.
It prints a markdown section and, with --record, appends it to benchmarks/RESULTS.md.

With --device cpu (what the test suite runs) the same steps run end to end on small shapes with
the Triton kernels in the interpreter (TRITON_INTERPRET=1): a check of the harness, whose timings
mean nothing.
"""

from __future__ import annotations

import argparse
import os
import platform
import subprocess
import sys
from collections.abc import Callable
from datetime import datetime, timezone
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: the tree's packages by their installed names (memviz_kernels, memviz_probes: links in .names/), for a GPU machine
#: where memviz is not installed
IMPORTABLE = [str(ROOT), str(ROOT / ".names")]
sys.path[:0] = IMPORTABLE

from timing import interleaved, median_s, ratio_text  # noqa: E402  (benchmarks/timing.py)

#: a reference slower than this a call is timed once, not interleaved round after round (LM2's
#: token-by-token reference is launch-bound on a GPU: about 4 s a call at 16k tokens on an H100)
SLOW_REFERENCE_S = 2.0


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=["cuda", "cpu"], help="default: cuda when torch sees one, else cpu")
    p.add_argument("--quick", action="store_true", help="the smallest shapes and fewest rounds")
    p.add_argument("--rounds", type=int, help="interleaved rounds per comparison (default 9 on cuda, 2 on cpu)")
    p.add_argument("--sample", default="infini_long", help="the checkpoint whose trace is timed")
    p.add_argument("--record", action="store_true", help="append the section to benchmarks/RESULTS.md")
    return p.parse_args(argv)


def synchronize(device: str) -> Callable[[], None]:
    """What waits for the device's queued work before and after a timed call."""
    import torch

    return torch.cuda.synchronize if device == "cuda" else (lambda: None)


def kernel_cases(device: str, tokens: int, dtype=None):
    """{kernel: (Triton call, reference call, torch's own op or None)} on random inputs of `tokens`
    tokens, drawn in float32 from a seed of `tokens` and cast to `dtype` (float32 by default; the
    float64 cases give the references the errors are measured against). Each call returns the
    output to compare."""
    import torch
    import torch.nn.functional as F

    from memviz_kernels import dispatch

    dtype = dtype or torch.float32
    small = device == "cpu"
    g = torch.Generator(device=device).manual_seed(tokens)

    def randn(*shape):
        return torch.randn(*shape, generator=g, device=device).to(dtype)

    def rand(*shape):
        return torch.rand(*shape, generator=g, device=device).to(dtype)

    H, dk, n, k, D = (2, 16, 16, 4, 16) if small else (4, 64, 128, 16, 128)
    q, keys = randn(1, tokens, H, dk), randn(H, 2, n, dk // 2)
    full = torch.cat(
        [keys[:, 0, :, None].expand(H, n, n, dk // 2), keys[:, 1, None].expand(H, n, n, dk // 2)], -1
    ).reshape(H, n * n, dk)
    indices = torch.randint(0, n * n, (tokens * H, k), generator=g, device=device)
    weights, values = torch.softmax(randn(tokens * H, k), -1), randn(n * n, D)
    cases = {
        "product_key_topk": (
            lambda: dispatch.product_key_topk(q, keys, k, impl="triton")[0],
            lambda: dispatch.product_key_topk(q, keys, k, impl="reference")[0],
            lambda: torch.einsum("bthd,hmd->bthm", q, full).topk(k, -1)[0],
        ),
        "weighted_bag": (
            lambda: dispatch.weighted_bag(indices, weights, values, impl="triton"),
            lambda: dispatch.weighted_bag(indices, weights, values, impl="reference"),
            lambda: F.embedding_bag(indices, values, per_sample_weights=weights, mode="sum"),
        ),
    }
    Hi, d, S = (2, 8, 16) if small else (8, 64, 256)
    sq, sk, v = F.elu(randn(1, Hi, tokens, d)) + 1, F.elu(randn(1, Hi, tokens, d)) + 1, randn(1, Hi, tokens, d)
    empty = (
        torch.zeros(1, Hi, d, d, device=device, dtype=dtype),
        torch.zeros(1, Hi, d, device=device, dtype=dtype),
        torch.zeros(1, Hi, 0, d, device=device, dtype=dtype),
        torch.zeros(1, Hi, 0, d, device=device, dtype=dtype),
    )
    cases["infini_memory"] = (
        lambda: dispatch.infini_memory(sq, sk, v, empty, S, "delta", impl="triton")[0][0],
        lambda: dispatch.infini_memory(sq, sk, v, empty, S, "delta", impl="reference")[0][0],
        None,
    )
    N, dm = (4, 8) if small else (16, 128)
    # a contracting scan: W_V at half the usual scale, W_f at a tenth so the forget gates stay near
    # sigmoid(b_f), 0.3-0.9. With both at full scale the scan is chaotic and rounding alone decides the
    # read (float32 and float64 references differ by 89% of its norm)
    scan = (
        randn(1, tokens, dm),
        rand(1, tokens, dm),
        randn(dm, dm) * 0.5 * dm**-0.5,
        randn(dm, dm) * 0.1 * dm**-0.5,
        randn(dm) * 0.5 + 0.5,
        randn(1, N, dm),
    )
    cases["lm2_scan"] = (
        lambda: dispatch.lm2_scan(*scan, impl="triton")[0][1],
        lambda: dispatch.lm2_scan(*scan, impl="reference")[0][1],
        None,
    )
    dt, chunk = (8, 8) if small else (128, 64)
    tq, tk = F.normalize(randn(1, tokens, dt), dim=-1), F.normalize(randn(1, tokens, dt), dim=-1)
    titans = (tq, tk, randn(1, tokens, dt), rand(1, tokens, 3) * 0.5)
    state = (randn(1, dt, dt) * 0.1, torch.zeros(1, dt, dt, device=device, dtype=dtype))
    cases["titans_linear_memory"] = (
        lambda: dispatch.titans_linear_memory(*titans, state, chunk, impl="triton")[0][0],
        lambda: dispatch.titans_linear_memory(*titans, state, chunk, impl="reference")[0][0],
        None,
    )
    bag_bytes = indices.numel() * 8 + weights.numel() * 4 + indices.numel() * D * 4 + tokens * H * D * 4
    return cases, bag_bytes


def kernel_rows(device: str, lengths: list[int], rounds: int) -> tuple[list[str], list[str]]:
    """The kernel table and the bag-bandwidth table, as markdown rows."""
    import torch

    kernel_table, bandwidth_table = [], []
    for tokens in lengths:
        with torch.no_grad():
            try:
                cases, bag_bytes = kernel_cases(device, tokens)
                exact, _ = kernel_cases(device, tokens, torch.float64)
            except Exception as exc:  # e.g. out of memory at this length: the shorter lengths' rows stay
                kernel_table.append(progress(f"| (inputs) | {tokens:,} | failed: {failure(exc)} | | | |"))
                continue
            for name, (triton_path, reference_path, own) in cases.items():
                try:
                    expected = exact[name][1]().double()
                    error = ((triton_path().double() - expected).norm() / expected.norm()).item()
                    once = interleaved({"reference": reference_path}, 1, synchronize(device), warmup=False)
                    one_call = once["reference"][0]
                    slow = one_call > SLOW_REFERENCE_S
                    paths = {
                        "triton": triton_path,
                        **({} if slow else {"reference": reference_path}),
                        **({"torch": own} if own else {}),
                    }
                    times = interleaved(paths, rounds, synchronize(device))
                except Exception as exc:  # one kernel that fails to build or run must not lose the others' rows
                    kernel_table.append(progress(f"| {name} | {tokens:,} | failed: {failure(exc)} | | | |"))
                    continue
                triton_s = median_s(times, "triton")
                versus_reference = (
                    f"{one_call / triton_s:.0f}x (one call of {one_call:.1f} s)"
                    if slow
                    else ratio_text(times, "reference", "triton")
                )
                kernel_table.append(
                    progress(
                        f"| {name} | {tokens:,} | {triton_s * 1e3:.3f} | {versus_reference} | "
                        f"{ratio_text(times, 'torch', 'triton') if own else '-'} | {error:.1e} |"
                    )
                )
                if name == "weighted_bag":
                    copy_src = torch.empty(bag_bytes // 4, device=device)
                    copy_dst = torch.empty_like(copy_src)
                    copy = interleaved(
                        {"copy": lambda: copy_dst.copy_(copy_src), "bag": triton_path}, rounds, synchronize(device)
                    )
                    copy_bw = 2 * copy_src.numel() * 4 / median_s(copy, "copy") / 1e9  # read + write
                    bag_bw = bag_bytes / median_s(copy, "bag") / 1e9
                    bandwidth_table.append(
                        progress(
                            f"| {tokens:,} | {bag_bytes / 2**20:.1f} | {bag_bw:.1f} | {copy_bw:.1f} | "
                            f"{bag_bw / copy_bw:.0%} |"
                        )
                    )
    return kernel_table, bandwidth_table


def progress(row: str) -> str:
    """A table row, also written to stderr as it is made, so a run cut short keeps what it measured."""
    print(row, file=sys.stderr, flush=True)
    return row


def failure(exc: BaseException) -> str:
    """An exception as one table cell: its type and the first line of its message."""
    first = (str(exc).strip().splitlines() or [""])[0]
    return f"{type(exc).__name__}: {first[:200]}".replace("|", "/")


def trace_rows(device: str, sample: str, tokens: int, rounds: int) -> list[str]:
    """A whole trace's tokens per second on the device and on the CPU (the same model and input)."""
    import torch

    import memviz
    from memviz_probes import passkey

    model = memviz.load(sample)
    text = passkey.seeded_sample(model.tokenizer, tokens, 0.5, 0, 0).prompt
    n = len(model.tokenizer.encode(text))
    try:
        on_device = model if device == "cpu" else memviz.load(sample).to(device)
        paths = {"cpu": lambda: memviz.trace(model, text), device + " ": lambda: memviz.trace(on_device, text)}
        with torch.no_grad():
            times = interleaved(paths, max(1, rounds // 3), synchronize(device))
    except Exception as exc:  # the kernel tables above are worth keeping without this row
        return [progress(f"| {sample} | {n:,} | failed: {failure(exc)} | | |")]
    return [
        progress(
            f"| {sample} | {n:,} | {n / median_s(times, 'cpu'):,.0f} | "
            f"{n / median_s(times, device + ' '):,.0f} | {ratio_text(times, 'cpu', device + ' ')} |"
        )
    ]


def kernel_tests(device: str) -> str:
    """Run the kernel tests (`pytest kernels`) with their tensors on `device`; returns pytest's summary line."""
    env = {**os.environ, "MEMVIZ_TEST_DEVICE": device}
    env["PYTHONPATH"] = os.pathsep.join([*IMPORTABLE, *filter(None, [os.environ.get("PYTHONPATH")])])
    if device == "cuda":
        env["TRITON_INTERPRET"] = "0"
    else:
        env["TRITON_INTERPRET"] = "1"
    out = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(ROOT / "kernels")],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
    )
    lines = [line for line in out.stdout.strip().splitlines() if line.strip()]
    summary = lines[-1] if lines else out.stderr.strip().splitlines()[-1]
    if out.returncode != 0:
        print(out.stdout[-5000:], file=sys.stderr)
    return summary


def machine(device: str) -> str:
    import torch

    if device == "cuda":
        return f"{torch.cuda.get_device_name()} · torch {torch.__version__} · CUDA {torch.version.cuda}"
    return f"{platform.machine()} CPU, {os.cpu_count()} cores · torch {torch.__version__} · Triton in the interpreter"


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.device == "cpu" or args.device is None and os.environ.get("TRITON_INTERPRET") == "1":
        os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        print("error: --device cuda, but torch sees no CUDA device", file=sys.stderr)
        return 2
    if device == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"
    if args.rounds is not None and args.rounds < 1:
        print(f"error: --rounds must be at least 1, got {args.rounds}", file=sys.stderr)
        return 2
    rounds = args.rounds or (9 if device == "cuda" else 2)
    lengths = ([4096] if args.quick else [4096, 16384, 65536]) if device == "cuda" else [64]
    trace_tokens = (4096 if args.quick else 16384) if device == "cuda" else 300

    tests = kernel_tests(device)
    progress(f"kernel tests on {device}: {tests}")
    kernels, bandwidth = kernel_rows(device, lengths, rounds)
    traces = trace_rows(device, args.sample, trace_tokens, rounds)
    stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    section = "\n".join(
        [
            f"## {stamp} · GPU run (`python benchmarks/gpu.py{' --quick' if args.quick else ''}`) · {machine(device)}",
            "",
            ""
            if device == "cuda"
            else "CPU mode: the harness checked end to end on small shapes; these timings mean nothing.\n",
            f"**Kernel tests on {device}:** {tests}",
            "",
            f"**Triton kernels** ({rounds} interleaved rounds; ratios are the median of the per-round ratios, "
            "the range in brackets; above 1 the Triton kernel is faster):",
            "",
            "| kernel | tokens | Triton ms | reference / Triton | torch's op / Triton | relative error against "
            "the float64 reference |",
            "|---|---|---|---|---|---|",
            *kernels,
            "",
            "**Product-key bag bandwidth** against a device-to-device copy (read + write) of as many bytes:",
            "",
            "| tokens | bytes moved (MiB) | bag GB/s | copy GB/s | bag / copy |",
            "|---|---|---|---|---|",
            *bandwidth,
            "",
            f"**A whole trace** (`memviz.trace`, every memory hook), tokens per second on the CPU and on {device}:",
            "",
            f"| sample | tokens | CPU tokens/s | {device} tokens/s | {device} / CPU |",
            "|---|---|---|---|---|",
            *traces,
            "",
        ]
    )
    print(section)
    if args.record:
        with open(ROOT / "benchmarks" / "RESULTS.md", "a") as f:
            f.write("\n" + section)
    rows_failed = any("| failed: " in row for row in kernels + traces)
    return 0 if "failed" not in tests and "error" not in tests and not rows_failed else 1


if __name__ == "__main__":
    sys.exit(main())
