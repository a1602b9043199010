"""Titans: Learning to Memorize at Test Time (Behrouz et al. 2024, arXiv 2501.00663).

A neural long-term memory M (a linear map W, or a 2-layer MLP k -> silu(k W1) W2) is trained
while the model reads, on keys and values of the input (Section 3.1):

  k_t = norm(silu(x_t W_K)),  v_t = silu(x_t W_V),  q_t = norm(silu(x_t W_Q))     (l2 norm)
  loss              l(M; x_t) = ||M(k_t) - v_t||^2                                    (eq. 12)
  surprise          S_t = eta_t S_t-1 - theta_t grad l(M_t-1; x_t)                    (eq. 10)
  forgetting        M_t = (1 - alpha_t) M_t-1 + S_t                                   (eq. 13)
  data-dependent    eta_t = eta_max sigmoid(.), alpha_t = sigmoid(.), theta_t = theta_max sigmoid(.)  (of x_t w + b)
  retrieval         y_t = M*(q_t), a forward pass without update                     (eq. 15)

Boundedness: within a chunk of B tokens every gradient is taken at the chunk-start weights and momentum
sums them with weights up to 1 / (1 - eta), so with ||k_t|| = 1 the chunk's step on the summed loss is at
most theta B / (1 - eta) times its Hessian (eigenvalues <= 2); it overshoots without bound once that passes 1.
theta_max <= (1 - eta_max) / B with eta_max < 1 keeps a linear memory bounded on any input (the English
sample: eta_max 0.9, theta_max 0.1 / 64; a test feeds a repeated phrase with the rates at their bounds). The
paper leaves both unbounded (eta_max 1, the default here, and theta_max 0.5 diverge on such input).

Chunked parallel training (Section 3.2): within a chunk of `chunk` tokens every gradient is
taken against the chunk-start weights M_0 (a mini-batch step at the chunk start; chunk = 1 is
the token-by-token rule). Each gradient is a sum of outer products (k_t^T r_t for the linear
memory), and the momentum and forgetting recurrences are linear, so with
w[t,i] = prod_{i<j<=t} eta_j and c_t = prod_{t<j<=b} (1 - alpha_j) the chunk end is

  S_b = (prod eta) S_0 - sum_i w[b,i] theta_i g_i
  M_b = (prod (1 - alpha)) M_0 + (sum_t c_t prod_{j<=t} eta_j) S_0 - sum_i beta_i theta_i g_i,
        beta_i = sum_{t>=i} c_t w[t,i]

i.e. one matmul K^T diag(beta theta) R per weight matrix; products are formed in log space.
Token t retrieves with the weights at the start of its chunk (M_t-1 when chunk = 1), so a
token never reads what it or a later token wrote. Persistent memory (Section 4): learned tokens
prepended to every attention context.

The ways of joining memory and attention (Section 4), `variant`:
  * "lmm": the memory alone replaces attention: x += W_O M*(q).
  * "mal" (memory as a layer): x += W_O M*(q), then x += SWA*(x) (sliding-window attention with
    persistent tokens), then the FFN.
  * "mag" (memory as a gate): x += W_O (norm(SWA*(x)) * sigmoid(norm(M*(q)))).
  * "mac" (memory as context): per segment, h = M*_{t-1}(q) is retrieved with the weights of the
    previous segments; attention within the segment runs over [persistent, h, segment] (token t
    sees h_j and x_j for j <= t); the memory is then trained on the attention output y, and the
    output is y * sigmoid(norm(M*(y))), read with the segment-start weights. MAC updates once
    per segment, so its `chunk` is `segment_len` (another value is an error). A window
    (attention {"kind": "window", "span": segment_len}; the paper is "segment", the default)
    lets the attention see the last tokens and their h across the segment boundary, so a
    segment's first tokens still see the text just before them.
Each variant is a block class (`VARIANT_BLOCKS`); MAG and MAL need attention {"kind": "window"}.
Departures from the paper, said here: no 1-D depthwise convolution after the projections; MAC
and MAG read the output gate's memory with segment/chunk-start weights (the paper's M*_t(y_t)
would let a token see later tokens of its chunk); under MAG and MAL the persistent tokens join
the attention's context only, while the paper feeds [p || x] to the memory as well (here the
memory reads and writes the input tokens alone, so its surprise is the input's).
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import plotly.graph_objects as go
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz.config import ConfigError, ModelConfig
from memviz.figure_parts import WIDTH, layer_names, layer_prefix, timeline
from memviz.layers import AttentionSpan, LocalCache, RMSNorm, SwiGLU, segment_pieces
from memviz.model import Block, MemoryLM
from memviz.models.titans.attention import TitansAttention
from memviz.options import check_choice, check_positive
from memviz.protocol import HookDoc, Readout
from memviz.registry import register_family
from memviz.state import Memory, NoneOr, State
from memviz.trace import Trace
from memviz_kernels.dispatch import LinearMemory, titans_chunk_coefficients, titans_chunk_update, titans_linear_memory

SURPRISE = "blocks.{l}.memory.hook_surprise"  # [batch, pos]  ||grad l(M; x_t)||
LOSS = "blocks.{l}.memory.hook_loss"  # [batch, pos]  l(M_{t-1}; x_t), before the update
LOSS_AFTER = "blocks.{l}.memory.hook_loss_after"  # [batch, pos]  the same loss after the chunk's update
RATES = {r: f"blocks.{{l}}.memory.hook_{r}" for r in ("eta", "theta", "alpha")}  # [batch, pos] each


@dataclass
class TitansOptions:
    variant: str = "mac"  # "lmm", "mac", "mag", "mal"
    memory: str = "linear"  # "linear" or "mlp"
    mlp_hidden: int = 0  # hidden width of the MLP memory; 0 = 2 * d_model
    chunk: int | None = None  # tokens per parallel update; None: 16 (MAC: its segment, always)
    persistent: int = 4  # persistent memory tokens per attention layer
    theta_max: float = 0.5  # largest inner learning rate
    eta_max: float = 1.0  # largest momentum rate: below 1 the momentum S forgets, so the memory stays bounded

    def __post_init__(self) -> None:
        check_choice("variant", self.variant, ("lmm", "mac", "mag", "mal"))
        check_choice("memory", self.memory, ("linear", "mlp"))
        if self.chunk is not None:
            check_positive(chunk=self.chunk)
        check_positive(theta_max=self.theta_max)
        if isinstance(self.eta_max, bool) or not isinstance(self.eta_max, (int, float)) or not 0 < self.eta_max <= 1:
            raise ValueError(f"memory.eta_max must lie in (0, 1], got {self.eta_max!r}")
        if self.persistent < 0 or self.mlp_hidden < 0:
            raise ValueError("persistent and mlp_hidden must be non-negative")


class OpenChunk(NamedTuple):
    """The tokens of a chunk not yet complete, which its update waits for: keys and values [B, P, d],
    rates [B, P, 3] = (eta, theta, alpha)."""

    keys: Tensor
    values: Tensor
    rates: Tensor


class NeuralMemoryState(NamedTuple):
    """The neural memory's weights (None: a fresh stream's, the learned initial weights), its momentum S
    (eq. 10), and the open chunk."""

    params: dict[str, Tensor] | None
    momentum: dict[str, Tensor]
    open_chunk: OpenChunk


class TitansBlockState(NamedTuple):
    """A Titans block's state: its attention's cache (None under LMM, which has none) and its memory."""

    attn: LocalCache | None
    memory: Memory[NeuralMemoryState]


def memory_forward(params: dict[str, Tensor], k: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
    """M(k) for k [B,T,d] with per-sequence weights; returns the output and what the gradient needs."""
    if "W" in params:
        return k @ params["W"], {}
    z = k @ params["W1"]
    h = F.silu(z)
    return h @ params["W2"], {"z": z, "h": h}


def memory_grad_factors(
    params: dict[str, Tensor], k: Tensor, r: Tensor, cache: dict
) -> dict[str, tuple[Tensor, Tensor]]:
    """Per-token gradient of ||M(k_t) - v_t||^2 as outer-product factors (a_t, b_t): the
    gradient for each weight is a_t^T b_t. r = M(k) - v."""
    if "W" in params:
        return {"W": (k, 2 * r)}
    z, h = cache["z"], cache["h"]
    dh = 2 * r @ params["W2"].transpose(-1, -2)
    sig = torch.sigmoid(z)
    dz = dh * sig * (1 + z * (1 - sig))  # silu'(z)
    return {"W1": (k, dz), "W2": (h, 2 * r)}


class NeuralMemory(nn.Module):
    """The long-term memory of one block: projections, data-dependent rates, chunked updates."""

    def __init__(self, cfg: ModelConfig, options: TitansOptions, chunk: int) -> None:
        super().__init__()
        d = cfg.d_model
        self.options, self.chunk, self.d = options, chunk, d
        self.hidden = options.mlp_hidden or 2 * d
        self.W_Q = nn.Linear(d, d, bias=False)
        self.W_K = nn.Linear(d, d, bias=False)
        self.W_V = nn.Linear(d, d, bias=False)
        self.W_rates = nn.Linear(d, 3)  # eta, theta, alpha logits
        if options.memory == "linear":
            self.init_W = nn.Parameter(torch.zeros(d, d))
        else:
            self.init_W1 = nn.Parameter(torch.randn(d, self.hidden) / d**0.5)
            self.init_W2 = nn.Parameter(torch.zeros(self.hidden, d))
        self.hook_eta = HookPoint()  # [batch, pos]
        self.hook_theta = HookPoint()  # [batch, pos]
        self.hook_alpha = HookPoint()  # [batch, pos]
        self.hook_surprise = HookPoint()  # [batch, pos]  ||grad l(M_0; x_t)||
        self.hook_loss = HookPoint()  # [batch, pos]  l(M_0; x_t), before the chunk's update
        self.hook_loss_after = HookPoint()  # [batch, pos]  l(M_b; x_t), after it
        self.hook_retrieved = HookPoint()  # [batch, pos, d_model]  M*(q_t)

    def reset_memory_parameters(self) -> None:
        """eta ~ 0.9, theta ~ 0.12 theta_max, alpha ~ 0.02 at the start of training."""
        nn.init.zeros_(self.W_rates.weight)
        with torch.no_grad():
            self.W_rates.bias.copy_(torch.tensor([2.2, -2.0, -4.0]))

    def init_params(self) -> dict[str, Tensor]:
        if self.options.memory == "linear":
            return {"W": self.init_W}
        return {"W1": self.init_W1, "W2": self.init_W2}

    def init_state(self, batch: int, device: torch.device) -> NeuralMemoryState:
        """params None: a fresh stream, whose weights are the learned initial ones (`start_params`)."""
        momentum = {
            n: torch.zeros(batch, *p.shape, device=device, dtype=p.dtype) for n, p in self.init_params().items()
        }
        empty = torch.zeros(batch, 0, self.d, device=device)
        return NeuralMemoryState(
            None, momentum, OpenChunk(empty, empty.clone(), torch.zeros(batch, 0, 3, device=device))
        )

    def start_params(self, state: NeuralMemoryState) -> dict[str, Tensor]:
        """The memory's weights; a fresh stream's are the learned initial weights (so they train)."""
        if state.params is None:
            batch = state.open_chunk.keys.shape[0]
            return {n: p.expand(batch, *p.shape) for n, p in self.init_params().items()}
        return state.params

    def keys_values(self, x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        k = F.normalize(F.silu(self.W_K(x)), dim=-1)
        v = F.silu(self.W_V(x))
        rates = torch.sigmoid(self.W_rates(x))
        rates = torch.cat(
            [rates[..., :1] * self.options.eta_max, rates[..., 1:2] * self.options.theta_max, rates[..., 2:]], dim=-1
        )
        return k, v, rates

    def query(self, x: Tensor) -> Tensor:
        """q_t = norm(silu(x_t W_Q)), the memory's query (it needs no memory state)."""
        return F.normalize(F.silu(self.W_Q(x)), dim=-1)

    def read(self, x: Tensor, params: dict[str, Tensor]) -> Tensor:
        """M*(q_t) for x's queries with the weights `params`, without an update (eq. 15)."""
        return memory_forward(params, self.query(x))[0]

    def step(
        self, x: Tensor, state: NeuralMemoryState, pos: int, query: Tensor | None = None
    ) -> tuple[Tensor, NeuralMemoryState, dict]:
        """Retrieve M*(q) for every token (q from `query`, default x) with its chunk-start
        weights, and train the memory on x's keys and values chunk by chunk. Fires no hooks:
        returns (retrieved, new state, per-token statistics for `emit`)."""
        k, v, rates = self.keys_values(x)
        params, momentum, open_chunk = self.start_params(state), state.momentum, state.open_chunk
        query = x if query is None else query
        if "W" in params and open_chunk.keys.shape[1] == 0:  # linear memory from a chunk boundary: one call
            q = self.query(query)
            (read, surprise, loss, loss_after), memory = titans_linear_memory(
                q, k, v, rates, LinearMemory(params["W"], momentum["W"]), self.chunk
            )
            open_from = x.shape[1] - x.shape[1] % self.chunk
            open_chunk = OpenChunk(k[:, open_from:], v[:, open_from:], rates[:, open_from:])
            stats = {"surprise": surprise, "loss": loss, "loss_after": loss_after, "rates": rates}
            return read, NeuralMemoryState({"W": memory.W}, {"W": memory.S}, open_chunk), stats
        parts: dict[str, list[Tensor]] = {n: [] for n in ("read", "surprise", "loss", "loss_after")}
        # The pieces come from split, not slicing, so the backward pass concatenates their gradients
        # instead of adding each into a zero tensor of the input's length; the queries need no
        # memory state, so they are projected once for the whole input.
        pieces = segment_pieces(pos, x.shape[1], self.chunk)
        sizes = [b - a for a, b in pieces]
        written = [OpenChunk(*parts) for parts in zip(*(t.split(sizes, dim=1) for t in (k, v, rates)))]
        queries = self.query(query).split(sizes, dim=1)
        # The closed form's scalars depend on the rates alone: one call for every chunk this input
        # completes (the open chunk starts at a chunk boundary).
        chunk_rates = torch.cat([open_chunk.rates, rates], dim=1)
        n_chunks = chunk_rates.shape[1] // self.chunk
        chunk_rates = chunk_rates[:, : n_chunks * self.chunk].unflatten(1, (n_chunks, self.chunk))
        coefficients = zip(*(c.unbind(1) for c in titans_chunk_coefficients(chunk_rates)))
        for (a, b), new, q in zip(pieces, written, queries):
            parts["read"].append(memory_forward(params, q)[0])
            if open_chunk.keys.shape[1]:
                open_chunk = OpenChunk(*(torch.cat([held, more], dim=1) for held, more in zip(open_chunk, new)))
            else:
                open_chunk = new
            ck, cv = open_chunk.keys, open_chunk.values
            out, cache = memory_forward(params, ck)
            r = out - cv
            factors = memory_grad_factors(params, ck, r, cache)
            n_new = b - a
            parts["loss"].append(r[:, -n_new:].pow(2).sum(-1))
            sq = sum(fa.pow(2).sum(-1) * fg.pow(2).sum(-1) for fa, fg in factors.values())
            assert isinstance(sq, Tensor)  # the memory has weights: the sum is not empty
            parts["surprise"].append(sq[:, -n_new:].sqrt())
            if (pos + b) % self.chunk == 0:
                _, (params, momentum) = titans_chunk_update(factors, next(coefficients), (params, momentum))
                open_chunk = OpenChunk(*(t[:, :0] for t in open_chunk))
            after, _ = memory_forward(params, ck[:, -n_new:])
            parts["loss_after"].append((after - cv[:, -n_new:]).pow(2).sum(-1))
        stats = {n: torch.cat(v, 1) for n, v in parts.items()}
        stats["rates"] = rates
        return stats.pop("read"), NeuralMemoryState(params, momentum, open_chunk), stats

    def emit(self, retrieved: Tensor, stats: dict) -> Tensor:
        """Fire the memory's hooks once for the whole chunk; returns the hooked retrieval."""
        self.hook_eta(stats["rates"][..., 0])
        self.hook_theta(stats["rates"][..., 1])
        self.hook_alpha(stats["rates"][..., 2])
        self.hook_surprise(stats["surprise"])
        self.hook_loss(stats["loss"])
        self.hook_loss_after(stats["loss_after"])
        return self.hook_retrieved(retrieved)

    def forward(self, x: Tensor, state: NeuralMemoryState, pos: int) -> tuple[Tensor, NeuralMemoryState]:
        retrieved, state, stats = self.step(x, state, pos)
        return self.emit(retrieved, stats), state


class TitansBlock(Block):
    """A Titans block: the neural memory and the FFN, with attention over persistent tokens (but
    for LMM); each variant's class joins them as in Section 4 (module docstring)."""

    side_keys = False
    attn: TitansAttention | None  # set by Block.__init__; declared for its type

    def __init__(self, cfg: ModelConfig, options: TitansOptions, span: AttentionSpan | None, chunk: int) -> None:
        attn = (
            None
            if span is None
            else TitansAttention(cfg, span, n_persistent=options.persistent, side_keys=self.side_keys)
        )
        super().__init__(cfg, attn, SwiGLU(cfg.d_model, cfg.d_mlp))
        self.memory = NeuralMemory(cfg, options, chunk)
        self.hook_mem_out = HookPoint()  # [batch, pos, d_model]

    def init_state(self, batch: int, device: torch.device) -> TitansBlockState:
        attn = None if self.attn is None else self.attn.init_state(batch, device)
        return TitansBlockState(attn, self.memory.init_state(batch, device))

    def forward(self, x: Tensor, state: State, pos: int) -> tuple[Tensor, TitansBlockState]:
        # what init_state built: Block's forward takes any State
        x, new_state = self.mix(self.hook_resid_pre(x), cast(TitansBlockState, state), pos)
        x = self.hook_resid_mid(x)
        x = self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.ln2(x))))
        return x, new_state

    def mix(self, x: Tensor, state: TitansBlockState, pos: int) -> tuple[Tensor, TitansBlockState]:
        """The residual stream after the memory and attention of this variant, and their state."""
        raise NotImplementedError

    def memory_inputs(self, x: Tensor, z: Tensor | None) -> tuple[Tensor, Tensor]:
        """What the memory is trained on and what it is queried with, from the block's input x
        (hook_resid_pre) and, for MAC, the attention's hook_z: (written, queried)."""
        e = self.ln1(x)
        return e, e


class LMMBlock(TitansBlock):
    """LMM: the memory alone replaces attention, x += W_O M*(q)."""

    def __init__(self, cfg: ModelConfig, options: TitansOptions, span: AttentionSpan | None, chunk: int) -> None:
        super().__init__(cfg, options, None, chunk)
        self.W_mem_out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)

    def mix(self, x: Tensor, state: TitansBlockState, pos: int) -> tuple[Tensor, TitansBlockState]:
        m, memory = self.memory(self.ln1(x), state.memory, pos)
        return x + self.hook_mem_out(self.W_mem_out(m)), TitansBlockState(None, memory)


class MALBlock(TitansBlock):
    """MAL, memory as a layer: x += W_O M*(q), then x += SWA*(x)."""

    def __init__(self, cfg: ModelConfig, options: TitansOptions, span: AttentionSpan | None, chunk: int) -> None:
        super().__init__(cfg, options, span, chunk)
        self.W_mem_out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.ln_mem = RMSNorm(cfg.d_model, cfg.norm_eps)

    def mix(self, x: Tensor, state: TitansBlockState, pos: int) -> tuple[Tensor, TitansBlockState]:
        m, memory = self.memory(self.ln_mem(x), state.memory, pos)
        x = x + self.hook_mem_out(self.W_mem_out(m))
        assert self.attn is not None  # MAL attends (check_config)
        a, attn = self.attn(self.ln1(x), state.attn, pos)
        return x + self.hook_attn_out(a), TitansBlockState(attn, memory)

    def memory_inputs(self, x: Tensor, z: Tensor | None) -> tuple[Tensor, Tensor]:
        e = self.ln_mem(x)
        return e, e


class MAGBlock(TitansBlock):
    """MAG, memory as a gate: x += W_O (norm(SWA*(x)) * sigmoid(norm(M*(q))))."""

    def __init__(self, cfg: ModelConfig, options: TitansOptions, span: AttentionSpan | None, chunk: int) -> None:
        super().__init__(cfg, options, span, chunk)
        self.W_mem_out = nn.Linear(cfg.d_model, cfg.d_model, bias=False)
        self.norm_mem = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.norm_attn = RMSNorm(cfg.d_model, cfg.norm_eps)

    def mix(self, x: Tensor, state: TitansBlockState, pos: int) -> tuple[Tensor, TitansBlockState]:
        e = self.ln1(x)
        assert self.attn is not None  # MAG attends (check_config)
        a, attn = self.attn(e, state.attn, pos)
        m, memory = self.memory(e, state.memory, pos)
        x = x + self.hook_attn_out(self.W_mem_out(self.norm_attn(a) * torch.sigmoid(self.norm_mem(m))))
        self.hook_mem_out(m)
        return x, TitansBlockState(attn, memory)


class MACBlock(TitansBlock):
    """MAC, memory as context: attention over [persistent, h, segment], gated by M*(y)."""

    side_keys = True

    def __init__(self, cfg: ModelConfig, options: TitansOptions, span: AttentionSpan | None, chunk: int) -> None:
        super().__init__(cfg, options, span, chunk)
        self.norm_mem = RMSNorm(cfg.d_model, cfg.norm_eps)

    def mix(self, x: Tensor, state: TitansBlockState, pos: int) -> tuple[Tensor, TitansBlockState]:
        y, new_state = self.memory_as_context(self.ln1(x), state, pos)
        return x + self.hook_attn_out(y), new_state

    def memory_inputs(self, x: Tensor, z: Tensor | None) -> tuple[Tensor, Tensor]:
        """MAC trains the memory on the attention output y = W_O z and reads h with ln1(x)."""
        assert self.attn is not None and z is not None  # MAC attends, and its hook_z is passed
        return self.attn.W_O(z.flatten(2)), self.ln1(x)

    def memory_as_context(self, e: Tensor, state: TitansBlockState, pos: int) -> tuple[Tensor, TitansBlockState]:
        """MAC, segment by segment: retrieve h with the previous segments' memory, attend over
        [persistent, h, x] within the segment, train the memory on the attention output y, and
        gate y by M*(y). Each segment's h needs the memory trained on the segment before, so the
        loop is sequential; hooks fire once afterwards (hook_z and the memory statistics are
        observed there: editing them changes the block output, not what the memory stored)."""
        assert self.attn is not None  # MAC attends (check_config)
        pieces = segment_pieces(pos, e.shape[1], self.memory.chunk)
        sizes = [b - a for a, b in pieces]  # split, not sliced: see NeuralMemory.step
        q, k, v = (t.split(sizes, dim=1) for t in self.attn.project(e))
        memory_queries = self.memory.query(e).split(sizes, dim=1)
        attn_state, memory_state = state
        assert attn_state is not None  # the cache of MAC's attention
        zs, hs, gate_reads, stats = [], [], [], []
        for (a, _), q_piece, k_piece, v_piece, memory_query in zip(pieces, q, k, v, memory_queries):
            h = memory_forward(self.memory.start_params(memory_state), memory_query)[0]
            side = (self.attn.heads(self.attn.W_K(h)), self.attn.heads(self.attn.W_V(h)))
            z, attn_state = self.attn.attend(q_piece, k_piece, v_piece, attn_state, pos + a, side=side)
            read, memory_state, piece_stats = self.memory.step(self.attn.W_O(z.flatten(2)), memory_state, pos + a)
            zs.append(z)
            hs.append(h)
            gate_reads.append(read)
            stats.append(piece_stats)
        self.hook_mem_out(torch.cat(hs, 1))
        y = self.attn.W_O(self.attn.hook_z(torch.cat(zs, 1)).flatten(2))
        merged = {n: torch.cat([st[n] for st in stats], 1) for n in stats[0]}
        gate_read = self.memory.emit(torch.cat(gate_reads, 1), merged)
        return y * torch.sigmoid(self.norm_mem(gate_read)), TitansBlockState(attn_state, memory_state)


VARIANT_BLOCKS: dict[str, type[TitansBlock]] = {"lmm": LMMBlock, "mal": MALBlock, "mag": MAGBlock, "mac": MACBlock}


def titans_figures(trace: Trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> dict[str, go.Figure]:
    """Per memory layer: surprise and the memory's loss over tokens, with eta / theta / alpha beneath."""
    zoom: dict[str, Any] = dict(width=width, start=start, stop=stop)  # the figure helpers' keywords
    figs = {}
    for prefix in (layer_prefix(n, SURPRISE) for n in layer_names(trace, SURPRISE)):
        figs[f"{prefix} surprise"] = timeline(
            trace,
            {
                f"{prefix}.hook_surprise": "surprise ||grad||",
                f"{prefix}.hook_loss": "memory loss before update",
                f"{prefix}.hook_eta": "eta (momentum)",
                f"{prefix}.hook_theta": "theta (step)",
                f"{prefix}.hook_alpha": "alpha (forget)",
            },
            f"{prefix.split('.memory')[0]}: where the memory is surprised",
            **zoom,
        )
    return figs


@register_family(
    "titans",
    summary="Titans (arXiv 2501.00663): a neural memory trained at test time by the gradient of its "
    "recall loss, with momentum and forgetting; MAC, MAG, MAL or LMM",
    matrix_state=("memory.params",),
    figures=titans_figures,
    quick={"segment_len": 32, "memory": {"variant": "mac"}, "lr": 1e-3},
    tiny={"segment_len": 8, "memory": {"variant": "mac"}},
    sample="titans_english_16k",
    readout=True,
)
class TitansLM(MemoryLM):
    """Titans: a neural long-term memory trained at test time, joined to attention by `variant`."""

    Options = TitansOptions
    memory_hooks = {SURPRISE: "none", LOSS: "none", LOSS_AFTER: "none", **{name: "none" for name in RATES.values()}}
    hook_docs = {
        **MemoryLM.hook_docs,
        "blocks.{l}.hook_mem_out": HookDoc(
            "[batch, pos, d_model]",
            "the memory's contribution: `W_O M*(q)` for lmm/mal (what is added to the residual), `M*(q)` before the "
            "gate for mag, the retrieved context tokens `h` for mac",
        ),
        SURPRISE: HookDoc(
            "[batch, pos]", "surprise: the norm of the gradient of `||M(k_t) - v_t||^2` at the chunk-start weights"
        ),
        LOSS: HookDoc("[batch, pos]", "the memory's loss `||M(k_t) - v_t||^2` before the chunk's update"),
        LOSS_AFTER: HookDoc("[batch, pos]", "the same loss after the chunk's update"),
        RATES["eta"]: HookDoc("[batch, pos]", "momentum decay `eta_t` (surprise carried over)"),
        RATES["theta"]: HookDoc("[batch, pos]", "inner step size `theta_t`"),
        RATES["alpha"]: HookDoc("[batch, pos]", "forgetting `alpha_t` (weight decay of the memory)"),
        "blocks.{l}.memory.hook_retrieved": HookDoc(
            "[batch, pos, d_model]",
            "`M*(q_t)`, read with the chunk-start weights (for mac: the read of the attention output that gates it)",
        ),
    }

    def state_spec(self, batch: int) -> tuple[Any, Any]:
        """A fresh state's spec, the memory's weights (None until their first update) shaped as its momentum."""
        layers, shared = super().state_spec(batch)
        layers = [part._replace(memory=part.memory._replace(params=NoneOr(part.memory.momentum))) for part in layers]
        return layers, shared

    def default_attention(self) -> dict | None:
        if self.options.variant == "mac" and self.cfg.segment_len:
            return {"kind": "segment", "span": self.cfg.segment_len}
        return None

    def check_config(self) -> None:
        variant, chunk, kind = self.options.variant, self.options.chunk, self.attention and self.attention.kind
        if variant == "mac":
            if self.cfg.segment_len is None:
                raise ConfigError("titans variant 'mac' needs config.segment_len (its attention is per segment)")
            if chunk is not None and chunk != self.cfg.segment_len:
                raise ConfigError(
                    f"titans variant 'mac' updates once a segment: chunk must be segment_len "
                    f"({self.cfg.segment_len}) or unset, got {chunk}"
                )
            if kind not in ("segment", "window"):
                raise ConfigError(f"titans variant 'mac' attends within the segment or a window, not {kind!r}")
        if variant in ("mag", "mal") and kind != "window":
            raise ConfigError(
                f'titans variant {variant!r} needs sliding-window attention, attention {{"kind": "window", "span": '
                f"tokens}}"
            )
        if variant == "lmm" and self.attention is not None:
            raise ConfigError("titans variant 'lmm' has no attention (its memory replaces it); leave 'attention' unset")

    def make_block(self, layer: int) -> nn.Module:
        o = self.options
        chunk = self.cfg.segment_len if o.variant == "mac" else o.chunk or 16
        assert chunk is not None  # check_config: 'mac' needs segment_len
        return VARIANT_BLOCKS[o.variant](self.cfg, o, self.attention, chunk)

    def memory_readout(self, tokens, position: int) -> Readout | None:
        """The memory's read at `position` (MAC: the context h_t = M*(q_t) with the segment-start
        weights; the other variants: M*(q_t), hook_retrieved) as a sum over the tokens of the
        complete chunks before it, plus what the learned initial weights still give. The linear
        memory's gradient 2 k^T (k W - v) is linear in W and v, and eqs. 10 and 13 are linear in
        (W, S) with transitions that depend on keys and rates only, so the read is linear in the
        values with d read / d v_s = lambda_s I: token s gives lambda_s v_s, the lambdas from one
        backward pass (in float64) and the initial term from the same chunks with every v zero.
        None for the MLP memory (not linear in its writes)."""
        if self.options.memory != "linear":
            return None
        full = self.as_tokens(tokens)
        if not 0 <= position < full.shape[1]:
            raise ValueError(f"position must lie in [0, {full.shape[1]}), got {position}")
        model = copy.deepcopy(self).to(torch.float64)
        mac = self.options.variant == "mac"
        hooks = ("hook_resid_pre", "attn.hook_z") if mac else ("hook_resid_pre",)
        seen = model.capture(
            full[:, : position + 1], [f"blocks.{l}.{h}" for l in range(self.cfg.n_layers) for h in hooks]
        )
        direction = torch.randn(self.cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(0))
        parts, initial = {}, {}
        for layer, block in enumerate(cast(Iterable[TitansBlock], model.blocks)):
            memory, name = block.memory, f"blocks.{layer}"
            written_at = position // memory.chunk * memory.chunk  # the complete chunks before the read's
            with torch.no_grad():
                z = seen[f"{name}.attn.hook_z"][None] if mac else None
                written, queried = block.memory_inputs(seen[f"{name}.hook_resid_pre"][None], z)
                k, v, rates = memory.keys_values(written[:, :written_at])
                q = memory.query(queried[:, position])  # [1, d]
                W0 = memory.init_W[None]

            def read_with(values: Tensor) -> Tensor:
                W, S = W0, torch.zeros_like(W0)
                # split, not sliced (see step); nothing written yet: no chunk (split would give one empty piece)
                chunks = zip(*(t.split(memory.chunk, dim=1) for t in (k, values, rates))) if written_at else ()
                for ck, cv, cr in chunks:
                    gradient = {"W": (ck, 2 * (ck @ W - cv))}
                    _, (new, momentum) = titans_chunk_update(
                        gradient, titans_chunk_coefficients(cr), ({"W": W}, {"W": S})
                    )
                    W, S = new["W"], momentum["W"]
                return (q @ W)[0, 0]

            with torch.enable_grad():
                values = v.clone().requires_grad_()
                read = read_with(values)
                grad = torch.autograd.grad(read @ direction, values)[0][0] if written_at else v[0]
            parts[name] = ((grad @ direction / direction.pow(2).sum())[:, None] * v[0])[:, None]  # [source, head 1, d]
            with torch.no_grad():
                initial[name] = read_with(torch.zeros_like(v))[None]
        what = (
            "h_t = M*(q_t), the memory's context tokens (read with the segment-start weights)"
            if mac
            else "M*(q_t), the memory's retrieval (hook_retrieved)"
        )
        return Readout(position, what, parts, initial)
