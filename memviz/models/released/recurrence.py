"""memviz's linear-memory operator as transformers' kernel for the memory layers of released models, so that one
pass computes a layer and its hooks.

transformers sends each Gated DeltaNet and Kimi Delta Attention layer's recurrence through a named kernel
(`chunk_gated_delta_rule` and `fused_recurrent_gated_delta_rule`, `chunk_kda` and `fused_recurrent_kda`), which
Hugging Face's `kernels` package maps to an implementation per model instance (`kernels.use_kernel_mapping` and
`kernels.kernelize`, the way transformers takes fla's kernels on a GPU). `install` maps all four to the classes
here, which run `memviz_kernels.dispatch.linear_memory` on what transformers passes: q, k [B, T, H_k, d_k] (l2
normalised here when `use_qk_l2norm_in_kernel`, eps 1e-6, and q scaled by d_k^-1/2, as transformers' own kernels
do), v [B, T, H_v, d_v] (q and k repeated to the H_v value heads), g the log decay [B, T, H_v] or per key channel
[B, T, H_v, d_k], beta [B, T, H_v], and the state [B, H_v, d_k, d_v]. The work is in float32 at least (the
layers' own precision: transformers' kernels compute in float32), float64 for a float64 model.

While memviz watches a layer (`watch`: the model's hooks give the layer's own kernel instances a `Watch` around the
layer's forward), each call also keeps what the layer's HookPoints want of what it read and wrote; unwatched, it is
the layer's recurrence and nothing more.
"""

from __future__ import annotations

import importlib
import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor, nn

from memviz_kernels.dispatch import linear_memory

#: tokens a step of the chunked form: a decay per key channel forms [chunk, chunk, d_k] ratios, so it steps shorter
CHUNK, CHANNEL_CHUNK = 64, 32


@dataclass
class Watch:
    """One watched forward of one memory layer: the quantities its hooks want (the state's norm is the costly
    one), and what each kernel call saw of them (transformers may call the kernel more than once a forward)."""

    wanted: frozenset[str]
    calls: list[dict[str, Tensor]] = field(default_factory=list)

    def seen(self) -> dict[str, Tensor]:
        """The calls' quantities joined over positions, [B, T, H, ...]."""
        if len(self.calls) == 1:
            return self.calls[0]
        return {name: torch.cat([call[name] for call in self.calls], 1) for name in self.wanted}


def watch(layer: nn.Module, seen: Watch | None) -> None:
    """Give a memory layer's kernels (`install` mapped them; each layer has its own instances) the watch of its
    coming forward, or None to stop keeping anything."""
    for name, func in getattr(layer, "_kernel_funcs", {}).items():
        if name in KERNELS:
            func.watching = seen


def unit(x: Tensor) -> Tensor:
    """transformers' l2 normalisation of q and k, x rsqrt(|x|^2 + 1e-6)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def run_memory(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    g: Tensor,
    beta: Tensor,
    initial_state: Tensor | None,
    output_final_state: bool,
    normalise: bool,
    extra: dict,
    watch: Watch | None,
) -> tuple[Tensor, Tensor | None]:
    """The layer's recurrence through the operator (module docstring) -> (o [B, T, H_v, d_v] in v's dtype, the
    final state or None); with a `watch`, what its hooks want is kept in it."""
    if extra.get("cu_seqlens") is not None:
        raise NotImplementedError("memviz reads one sequence a row: packed sequences (cu_seqlens) are not supported")
    work = torch.promote_types(value.dtype, torch.float32)
    heads = value.shape[2]
    q, k = (t.to(work).repeat_interleave(heads // t.shape[2], 2) for t in (query, key))
    if normalise:
        q, k = unit(q), unit(k)
    q = q * q.shape[-1] ** -0.5
    B, _, _, d_k = k.shape
    S = initial_state if initial_state is not None else k.new_zeros(B, heads, d_k, value.shape[-1])
    per_channel = g.dim() == 4
    heads_first = [t.transpose(1, 2) for t in (q, k, value, g, beta)]  # [B, H, T, ...]
    (o, norms), final = linear_memory(
        heads_first[0],
        heads_first[1],
        heads_first[2],
        heads_first[3],
        heads_first[4],
        S,
        CHANNEL_CHUNK if per_channel else CHUNK,
        state_norms=watch is not None and "state_norm" in watch.wanted,
    )
    assert o is not None  # the operator reads with the q it is given
    o = o.transpose(1, 2)
    if watch is not None:
        quantities = dict(read_query=q, write_key=k, write_value=value, alpha=g.to(work).exp(), beta=beta, read=o)
        if norms is not None:
            quantities["state_norm"] = norms.transpose(1, 2)
        watch.calls.append({name: quantities[name].to(work) for name in watch.wanted})
    return o.to(value.dtype), final if output_final_state else None


def watching(kernel: nn.Module) -> Watch | None:
    """The watch `watch` gave this kernel instance, if any."""
    return kernel.__dict__.get("watching")


def watching_of(layer: nn.Module) -> Watch | None:
    """The watch a memory layer's kernels hold."""
    funcs = [f for name, f in getattr(layer, "_kernel_funcs", {}).items() if name in KERNELS]
    return next((w for w in map(watching, funcs) if w is not None), None)


class Chunked(nn.Module):
    """transformers' `chunk_gated_delta_rule` and `chunk_kda` (their signature; module docstring)."""

    def forward(
        self,
        query,
        key,
        value,
        g,
        beta,
        chunk_size=64,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        return run_memory(
            query,
            key,
            value,
            g,
            beta,
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
            kwargs,
            watching(self),
        )


class OneToken(nn.Module):
    """transformers' `fused_recurrent_gated_delta_rule` and `fused_recurrent_kda`, a cached step of one token
    (their signature: `kernels` checks the parameters' number and kinds, not their defaults)."""

    def forward(
        self,
        query,
        key,
        value,
        g,
        beta,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        **kwargs,
    ):
        return run_memory(
            query,
            key,
            value,
            g,
            beta,
            initial_state,
            output_final_state,
            use_qk_l2norm_in_kernel,
            kwargs,
            watching(self),
        )


class Local:
    """A `kernels` repository holding one class of this module (nothing is downloaded)."""

    def __init__(self, layer: type[nn.Module]) -> None:
        self.layer = layer

    def load(self) -> type[nn.Module]:
        return self.layer


#: transformers' kernel name -> memviz's implementation
KERNELS = {
    "chunk_gated_delta_rule": Local(Chunked),
    "fused_recurrent_gated_delta_rule": Local(OneToken),
    "chunk_kda": Local(Chunked),
    "fused_recurrent_kda": Local(OneToken),
}


def install(hf: Any) -> None:
    """Map a transformers model's memory kernels to memviz's (this instance only). A mapping transformers made
    when loading (`use_kernels`, fla's kernels on a GPU) is reset first: it would come back on `train()`."""
    # Hugging Face's kernels (transformers requires it); by module name, since from the repository's root a type
    # checker would take the name for memviz's own kernels/ folder
    hub = importlib.import_module("kernels")
    Mode, kernelize, use_kernel_mapping = hub.Mode, hub.kernelize, hub.use_kernel_mapping
    if getattr(hf, "use_kernels", False):
        hf.reset_kernels()
    mapping = {name: {device: repo for device in ("cpu", "cuda")} for name, repo in KERNELS.items()}
    device = next(hf.parameters()).device.type
    said = logging.getLogger("kernels")  # it warns of every other kernel-ready layer, left as transformers made it
    level = said.level
    said.setLevel(logging.ERROR)
    try:
        with use_kernel_mapping(mapping, inherit_mapping=False):
            kernelize(hf, mode=Mode.INFERENCE, device=device if device in ("cpu", "cuda") else "cpu")
    finally:
        said.setLevel(level)


def installed(layer: nn.Module) -> list[str]:
    """The kernels of a memory layer that run memviz's operator (what `install` mapped)."""
    funcs = getattr(layer, "_kernel_funcs", {})
    return sorted(
        name
        for name, func in funcs.items()
        if name in KERNELS and getattr(func.forward, "__func__", None) is KERNELS[name].layer.forward
    )
