"""TransformerLens's effective attention for a Gated DeltaNet head against memviz's exact read-out:
`python benchmarks/bridge_readout.py [--positions 8 32 63] [--tokens 64]`.

On a small random Qwen3.5 checkpoint (`memviz.models.released.tiny`, float64), layer 1: TransformerLens 4.3's
`GatedDeltaNetBridge.compute_effective_attention` gives M[t, j] = (q_t . k_j) beta_j prod_{s=j+1..t} alpha_s from its
hooked q and k (before the layer's l2 normalisation and d_k^-1/2 scale) and, by its docstring, drops the delta rule's
key removal. memviz's `memory_readout` gives the exact weight of each write, w_j = beta_j k_j^T r_j with
r_{j-1} = Diag(alpha_j) (I - beta_j k_j k_j^T) r_j, r_t = q_t. For each position it prints both rows' distance (all
heads) and how far each row's read sum_j a_tj v_j is from the layer's read o_t, for TL's matrix as returned and
rescaled to unit q and k (which leaves only the dropped key removal), then the same at beta scaled down (the
dropped term is of order beta).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

TEXT = "The pass key is 71432. Remember it. " * 40
LAYER = 1


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


def unit(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def heuristic(q, k, beta, g) -> torch.Tensor:
    """TL's formula on [T, H, d] inputs: M [H, T, T] = (q_i . k_j) beta_j exp(G_i - G_j), j <= i."""
    G = g.T.cumsum(-1)
    decay = torch.tril(torch.exp(G[:, :, None] - G[:, None, :]))
    return (q.transpose(0, 1) @ k.permute(1, 2, 0)) * beta.T[:, None, :] * decay


def main(argv: list[str] | None = None) -> int:
    import memviz
    from memviz.models.released.tiny import tiny_checkpoint
    from memviz_kernels.dispatch import linear_memory, linear_memory_read_parts

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--positions", type=int, nargs="+", default=[8, 32, 63])
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args(argv)
    if not 1 <= args.tokens <= 400 or not all(0 <= t < args.tokens for t in args.positions):
        parser.error("--tokens must be in [1, 400] and every position below it")
    from transformer_lens.model_bridge.generalized_components.gated_delta_net import GatedDeltaNetBridge

    folder = Path(tempfile.mkdtemp()) / "qwen3_5_text"
    tiny_checkpoint(folder, "qwen3_5_text")
    model = memviz.load(folder, dtype="float64")
    ids = torch.tensor([model.tokenizer.encode(TEXT)[: args.tokens]])
    with torch.no_grad():
        _, cache = model.run_with_cache(ids)
    hook = f"blocks.{LAYER}.attn.hook_"
    q, k, v, alpha, beta, o = (
        cache[hook + n][0] for n in ("read_query", "write_key", "write_value", "alpha", "beta", "read")
    )
    g, d_k = alpha.log(), q.shape[-1]

    layer = model.hf.model.layers[LAYER]
    bridge = GatedDeltaNetBridge("linear_attn")
    bridge.set_original_component(layer.linear_attn)
    bridge.eager_scan = True
    seen: dict[str, torch.Tensor] = {}
    for name in ("hook_q", "hook_k", "hook_beta", "hook_log_decay"):
        getattr(bridge, name).add_hook(
            lambda value, hook, name=name: seen.__setitem__(f"blocks.{LAYER}.linear_attn.{name}", value)
        )
    with torch.no_grad():
        bridge(hidden_states=layer.input_layernorm(cache[f"blocks.{LAYER}.hook_resid_pre"]))
        returned = bridge.compute_effective_attention(seen, LAYER)[0].double()  # [H, T, T]
    repeat = q.shape[1] // seen[f"blocks.{LAYER}.linear_attn.hook_q"].shape[2]
    tq, tk = (seen[f"blocks.{LAYER}.linear_attn.hook_{n}"][0].repeat_interleave(repeat, 1) for n in "qk")
    norms = lambda x: torch.sqrt((x * x).sum(-1) + 1e-6).T  # noqa: E731  [H, T]
    rescaled = returned / (norms(tq)[:, :, None] * norms(tk)[:, None, :] * math.sqrt(d_k))

    def rows(beta_used: torch.Tensor, matrices: dict[str, torch.Tensor], read: torch.Tensor) -> None:
        for t in args.positions:
            exact = linear_memory_read_parts(
                q[t][None], k[: t + 1].permute(1, 0, 2)[None], g[: t + 1].T[None], beta_used[: t + 1].T[None]
            )[0]
            values = v[: t + 1].transpose(0, 1)  # [H, t+1, d_v]
            print(f"  t={t:3d}  memviz: read error {rel((exact[..., None] * values).sum(1), read[t]):.1e}", end="")
            for name, M in matrices.items():
                a = M[:, t, : t + 1]
                error = rel((a[..., None] * values).sum(1), read[t])
                print(f" | {name}: weights off {rel(a, exact):.3f}, read error {error:.3f}", end="")
            print()

    print(f"Qwen3.5 tiny, float64, layer {LAYER}, {ids.shape[1]} tokens; relative errors over all heads")
    rows(beta, {"TL as returned": returned, "TL at unit q, k": rescaled}, o)
    for scale in (0.01, 0.1, 0.3):
        scaled = beta * scale
        (read, _), _ = linear_memory(
            *(t.transpose(0, 1)[None] for t in (q, k, v, g, scaled)),
            torch.zeros(1, q.shape[1], d_k, v.shape[-1], dtype=q.dtype),
        )
        print(f"beta x {scale} (mean {scaled.mean():.3f})")
        rows(scaled, {"TL at unit q, k": heuristic(q, k, scaled, g)}, read[0].transpose(0, 1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
