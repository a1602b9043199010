"""memviz's linear-memory operator as transformers' kernel for the memory layers of released models, so that one
pass computes a layer and its hooks.

The state-space layers (Mamba-2's SSD and Mamba-1's selective scan) send their whole scan over the layer's cache
through one named kernel each, `mamba2_scan_forward` and `mamba_scan_forward`; `SelectiveScan2` and
`SelectiveScan1` below run it as the operator without the delta rule (their docstrings give the map).

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
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.nn.functional as F
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
    out: Callable[[Tensor], Tensor] | None = None  # `hook_mem_out` of a layer whose kernel output is its value

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


def keep(watch: Watch | None, **quantities: Tensor | Callable[[], Tensor]) -> None:
    """What the watch wants of a call's quantities [B, T, H, ...], in the work dtype; a quantity that costs a pass
    of its own (a decay per channel and state dimension) is given as a function, called only if wanted."""
    if watch is not None:
        got = {name: quantities[name] for name in watch.wanted}
        watch.calls.append({name: value() if callable(value) else value for name, value in got.items()})


def run_ssd(module: Any, x: Tensor, B: Tensor, C: Tensor, dt: Tensor, cache: Any, watch: Watch | None) -> Tensor:
    """Mamba-2's SSD (Dao and Gu, arXiv 2405.21060, eq. 1) as the operator: per head h and token t,
    dt_t = clamp(softplus(dt_t + dt_bias), time_step_limit), h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t^T and
    y_t = h_t C_t + D x_t with A = -exp(A_log). In the operator's terms S_t = h_t^T [d_state, head_dim], the log decay
    g_t = dt_t A, the key dt_t B_t, the value x_t, the query C_t (B and C repeated from their groups to the heads).
    x [b, T, H P], B, C [b, T, G N], dt [b, T, H] -> y [b, T, H P] in float32 at least; the cache holds S."""
    work = torch.promote_types(x.dtype, torch.float32)
    b, T, _ = x.shape
    H, P, N = module.num_heads, module.head_dim, module.ssm_state_size
    per_group = H // module.n_groups
    step = F.softplus(dt.to(work) + module.dt_bias.to(work)).clamp(*module.time_step_limit)  # [b, T, H]
    log_decay = step * -module.A_log.to(work).exp()
    values = x.to(work).view(b, T, H, P)
    keys, queries = (m.to(work).view(b, T, module.n_groups, N).repeat_interleave(per_group, 2) for m in (B, C))
    S = cache.get_recurrent_state(module.layer_idx) if cache is not None else None
    S = x.new_zeros(b, H, N, P, dtype=work) if S is None else S.to(work)
    (o, norms), S = linear_memory(
        queries.transpose(1, 2),
        (keys * step[..., None]).transpose(1, 2),
        values.transpose(1, 2),
        log_decay.transpose(1, 2),
        None,
        S,
        CHUNK,
        state_norms=watch is not None and "state_norm" in watch.wanted,
    )
    assert o is not None  # the operator reads with the q it is given
    read = o.transpose(1, 2)
    keep(
        watch,
        alpha=lambda: log_decay.exp(),
        beta=step,
        write_key=keys,
        write_value=values,
        read_query=queries,
        read=read,
        **({} if norms is None else {"state_norm": norms.transpose(1, 2)}),
    )
    if cache is not None:
        cache.update_recurrent_state(S, module.layer_idx)
    out = read + module.D.to(work)[:, None] * values
    if watch is not None and watch.out is not None:  # a layer without a gated norm (Falcon-H1's option)
        out = watch.out(out)
    return out.reshape(b, T, H * P)


def run_selective_scan(
    module: Any, x: Tensor, time_step: Tensor, B: Tensor, C: Tensor, gate: Tensor, cache: Any, watch: Watch | None
) -> Tensor:
    """Mamba-1's selective scan (Gu and Dao, arXiv 2312.00752, Algorithm 2) as the operator: per channel c and
    token t, dt_t = softplus(time_step_t + dt_proj.bias), h_t = exp(dt_t A_c) o h_{t-1} + dt_t B_t x_t [d_state],
    y_t = C_t . h_t + D x_t, output y_t silu(z_t), with A = -exp(A_log). In the operator's terms each channel is a
    head with a decay per key channel g_t = dt_t A_c [d_state], the key dt_t B_t, the value x_t (d_v = 1), the
    query C_t. x, time_step, gate [b, D, T], B, C [b, T, N] -> [b, D, T] in x's dtype; the cache holds S
    [b, D, N, 1]."""
    work = torch.promote_types(x.dtype, torch.float32)
    b, channels, T = x.shape
    bias = module.dt_proj.bias
    step = time_step.to(work) + (0 if bias is None else bias.to(work)[:, None])
    step = F.softplus(step)  # [b, D, T]
    # built channel-first, [b, D, T, N], as the operator reads them (the hooks get [b, T, D, N] views)
    A = -module.A_log.to(work).exp()  # [D, N]
    log_decay = step[..., None] * A[:, None]
    values = x.to(work)[..., None]  # [b, D, T, 1]
    keys, queries = (m.to(work)[:, None].expand(b, channels, T, m.shape[-1]) for m in (B, C))
    S = cache.get_recurrent_state(module.layer_idx) if cache is not None else None
    S = x.new_zeros(b, channels, module.ssm_state_size, 1, dtype=work) if S is None else S.to(work)
    (o, norms), S = linear_memory(
        queries,
        keys * step[..., None],
        values,
        log_decay,
        None,
        S,
        CHANNEL_CHUNK,
        state_norms=watch is not None and "state_norm" in watch.wanted,
    )
    assert o is not None  # the operator reads with the q it is given
    read = o.transpose(1, 2)  # [b, T, D, 1]
    keep(
        watch,
        alpha=lambda: (step.transpose(1, 2).contiguous()[..., None] * A).exp(),  # laid out [b, T, D, N]: a
        # trace's mean over d_state then reads contiguous memory (over a transposed view it is several times slower)
        beta=step.transpose(1, 2),
        write_key=keys.transpose(1, 2),
        write_value=values.transpose(1, 2),
        read_query=queries.transpose(1, 2),
        read=read,
        **({} if norms is None else {"state_norm": norms.transpose(1, 2)}),
    )
    if cache is not None:
        cache.update_recurrent_state(S, module.layer_idx)
    out = (o[..., 0] + module.D.to(work)[:, None] * values[..., 0]) * F.silu(gate.to(work))  # [b, D, T]
    if watch is not None and watch.out is not None:  # hook_mem_out is [b, T, D]
        out = watch.out(out.transpose(1, 2)).transpose(1, 2)
    return out.to(x.dtype)


class SelectiveScan2(nn.Module):
    """transformers' `mamba2_scan_forward` (its signature; `run_ssd`)."""

    def forward(self, module, hidden_states, B, C, dt, cache, **kwargs):
        return run_ssd(module, hidden_states, B, C, dt, cache, watching(self))


class SelectiveScan1(nn.Module):
    """transformers' `mamba_scan_forward` (its signature; `run_selective_scan`)."""

    def forward(self, module, hidden_states, time_step, B, C, gate, cache, **kwargs):
        return run_selective_scan(module, hidden_states, time_step, B, C, gate, cache, watching(self))


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
    "mamba2_scan_forward": Local(SelectiveScan2),
    "mamba_scan_forward": Local(SelectiveScan1),
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


def memory_kernels(layer: nn.Module) -> list[str]:
    """The kernels of a memory layer that memviz maps (its recurrence's)."""
    return sorted(name for name in getattr(layer, "_kernel_funcs", {}) if name in KERNELS)


def installed(layer: nn.Module) -> list[str]:
    """The kernels of a memory layer that run memviz's operator (what `install` mapped)."""
    funcs = getattr(layer, "_kernel_funcs", {})
    return sorted(
        name
        for name, func in funcs.items()
        if name in KERNELS and getattr(func.forward, "__func__", None) is KERNELS[name].layer.forward
    )
