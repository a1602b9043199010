"""LongMem: Augmenting Language Models with Long-Term Memory (Wang et al., NeurIPS 2023).

A frozen backbone LM (a trained baseline: embeddings, blocks, unembedding) reads the input as
usual. Its layer-`memory_layer` attention keys and values are cached, segment by segment, in a
FIFO bank of at most `bank_size` tokens. A trainable residual side network of `side_layers`
blocks produces the output (Section 3):

  side input        h_0 = H_0 (the backbone's embeddings)
  cross-network     h_l = SideBlock_l(h_l-1) + (H_b(l) - H_b(l-1)),  b(l) = l * L / L_side
                    (the paper's H^{2l} - H^{2l-2} for L = 2 L_side)
  output            logits = Unembed(norm(h_L_side)), the backbone's frozen unembedding (the
                    final norm belongs to the side network and trains)

One side block, `augmented_layer`, is memory-augmented. Its queries attend locally (the
backbone's window) and to memory retrieved per token (Section 3.3):

  chunks            the bank is cut into chunks of `chunk_size` tokens; a chunk's key is the
                    mean of its tokens' keys (per head)
  retrieval         each token's query picks the top-`topk_chunks` chunks by q . chunk_key and
                    attends over their chunk_size * topk_chunks cached tokens: A_mem
  joining           A = sigmoid(g) * A_mem + (1 - sigmoid(g)) * A_local, g one scalar per head
                    (the official code's convention; the paper's equation puts sigmoid(g) on
                    A_local. With g a free scalar the two are one model, g <-> -g, so no option:
                    read the gate here as the memory's share)

The bank holds earlier segments only: a token retrieves from the bank as it was when its segment
began, and a segment's keys and values join the bank when the segment completes (retrieve before
adding). The bank is a `ChunkBank` (bank.py, beside this file) in the state (`LongMemShared`):
chunk keys are kept as chunks arrive, and the top-K search is exact (every visible chunk scored:
training and the default) or faiss HNSW (`search="hnsw"`, approximate, for banks of millions of
tokens); `bank_size`, `search`, `chunk_size` and `topk_chunks` hold no weights and can be set when
loading. Because the backbone is frozen and runs first, the segments an input chunk completes join
the bank before the side network runs, and each segment's tokens search only the bank entries before their segment.
Memory attention uses un-rotated keys and queries (cached tokens have no position relative to the
reader); local attention uses RoPE. `warm_start` copies a trained baseline into the backbone and
initialises side block l from backbone block b(l), as the paper initialises the SideNet from the
backbone.

Which layer to cache matters: the bank hands the reader a past token only if that layer's keys mark what
follows what and its values carry the token, as a copying head's do. A backbone that copies a pass key in view
does so in particular heads of one layer (`benchmarks/copy_heads.py` finds them); caching that layer is what
let a side network learn to read the bank on English (docs/samples.md).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np
import plotly.graph_objects as go
import torch
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz import heap
from memviz.config import ConfigError, ModelConfig
from memviz.figure_parts import (
    EVIDENCE_OUTLINE,
    WIDTH,
    layer_names,
    layer_prefix,
    outline_evidence,
    position_heatmap,
    table_figure,
    window_of,
)
from memviz.layers import AttentionSpan, LocalAttention, LocalCache, SwiGLU
from memviz.model import BACKBONE_FIELDS, Block, MemoryLM
from memviz.models.longmem.bank import SEARCHES, ChunkBank
from memviz.options import check_choice, check_positive
from memviz.protocol import HookDoc, ModelState, Progress, Tokens
from memviz.registry import register_family
from memviz.running import check_progress
from memviz.state import Memory, State
from memviz.trace import Trace, bin_size

RETRIEVED_POS = "side_blocks.{l}.attn.hook_retrieved_pos"  # [batch, pos, head, topk]  first position of each chunk read
RETRIEVED_SCORES = "side_blocks.{l}.attn.hook_retrieved_scores"  # [batch, pos, head, topk]  q . chunk_key
GATE = "side_blocks.{l}.attn.hook_gate"  # [batch, pos, head]  sigmoid(g)
MEM_OUT = "side_blocks.{l}.attn.hook_mem_out"  # [batch, pos, head, d_head]  A_mem
LOCAL_OUT = "side_blocks.{l}.attn.hook_local_out"  # [batch, pos, head, d_head]  A_local


class OpenSegment(NamedTuple):
    """The memory layer's un-rotated keys and values [B, P, H, d] of the open segment's tokens so far,
    which join the bank when the segment completes."""

    keys: Tensor
    values: Tensor


class LongMemShared(NamedTuple):
    """LongMem's state beside the backbone layers' caches (`ModelState.shared`): the side blocks' caches,
    and the memory: the bank, the open segment, and what the search of the last tokens found
    (`ChunkBank.search_in_stream`)."""

    side: list[LocalCache]
    bank: Memory[ChunkBank]
    open_segment: Memory[OpenSegment]
    recent: Memory[Tensor]


@dataclass
class LongMemOptions:
    side_layers: int = 2
    memory_layer: int = -1  # backbone layer whose keys/values are cached (its copying heads'); -1 = n_layers // 2
    augmented_layer: int = -1  # side block with memory attention; -1 = side_layers // 2
    chunk_size: int = 4
    topk_chunks: int = 8
    bank_size: int = 4096  # tokens kept (FIFO), a multiple of chunk_size
    search: str = "exact"  # "exact" top-k over the bank, or "hnsw" (faiss, approximate; bank.py)
    ef_search: int = 128  # hnsw: candidates kept while searching (more: higher recall, slower)
    exact_below: int = 4096  # hnsw: a query that sees at most this many chunks is answered exactly
    outliers: int = 1024  # hnsw: chunks per head farthest from the mean key, always scored exactly (0: none)
    recent_queries: int = (
        128  # hnsw: a query also scores exactly the graph's finds for the last this many tokens (0: none)
    )

    def __post_init__(self) -> None:
        check_positive(
            side_layers=self.side_layers,
            chunk_size=self.chunk_size,
            topk_chunks=self.topk_chunks,
            bank_size=self.bank_size,
            ef_search=self.ef_search,
            exact_below=self.exact_below,
        )
        for name in ("side_layers", "chunk_size", "topk_chunks", "bank_size", "ef_search", "exact_below"):
            if not isinstance(getattr(self, name), int):
                raise ValueError(f"{name} must be a positive integer, got {getattr(self, name)!r}")
        for name in ("outliers", "recent_queries"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be a whole number >= 0, got {value!r}")
        check_choice("search", self.search, SEARCHES)
        if self.bank_size % self.chunk_size:
            raise ValueError(f"bank_size ({self.bank_size}) must be a multiple of chunk_size ({self.chunk_size})")
        if self.topk_chunks > self.bank_size // self.chunk_size:
            raise ValueError(
                f"topk_chunks ({self.topk_chunks}) is more than the bank's {self.bank_size // self.chunk_size} chunks "
                f"(bank_size {self.bank_size} / chunk_size {self.chunk_size})"
            )


def retrieve_chunks(
    q: Tensor, bank_k: Tensor, chunk_size: int, topk: int, visible: Tensor | None = None
) -> tuple[Tensor, Tensor]:
    """Token-to-chunk retrieval written out over a whole bank: the reference that
    `ChunkBank.search` (bank.py) is tested against. q [B,T,H,d], bank_k [B,M,H,d] (M a multiple of chunk_size)
    -> (scores [B,T,H,K], chunk indices [B,T,H,K]) of the top-K chunks by q . mean(chunk keys),
    best first. `visible` [T, C] bars chunks a token may not read (their score is -inf)."""
    B, M, H, d = bank_k.shape
    chunk_keys = bank_k.view(B, M // chunk_size, chunk_size, H, d).mean(2)  # [B, C, H, d]
    scores = torch.einsum("bthd,bchd->bthc", q, chunk_keys)
    if visible is not None:
        scores = scores.masked_fill(~visible[None, :, None, :], -torch.inf)
    return scores.topk(min(topk, M // chunk_size), dim=-1)


class MemoryAugmentedAttention(LocalAttention):
    """Local attention joined by a per-head gate to attention over retrieved memory chunks."""

    def __init__(self, cfg: ModelConfig, options: LongMemOptions, span: AttentionSpan) -> None:
        super().__init__(cfg, span)
        self.options = options
        self.gate = nn.Parameter(torch.zeros(cfg.n_heads))
        self.hook_retrieved_pos = HookPoint()  # [batch, pos, head, topk]  first position of each chunk
        self.hook_retrieved_scores = HookPoint()  # [batch, pos, head, topk]  q . chunk key
        self.hook_gate = HookPoint()  # [batch, pos, head]  sigmoid(g)
        self.hook_mem_out = HookPoint()  # [batch, pos, head, d_head]
        self.hook_local_out = HookPoint()  # [batch, pos, head, d_head]

    def memory_attend(self, q: Tensor, view: BankView) -> tuple[Tensor, Tensor, Tensor]:
        """A_mem for queries q [B,T,H,d] over the top-K chunks each token may read (those of
        whole segments before its own, at most bank_size tokens back); zero where it may read
        none. Also the retrieved chunks' first positions (-1 where none) and scores (NaN)."""
        B, T, H, d = q.shape
        K = self.options.topk_chunks
        if all(hi <= lo for *_, lo, hi in view.groups):  # nothing to read yet
            return (
                q.new_zeros(B, T, H, d),
                q.new_full((B, T, H, K), -1, dtype=torch.long),
                q.new_full((B, T, H, K), float("nan")),
            )
        scores = q.new_full((B, T, H, K), -torch.inf)
        entries = torch.zeros(B, T, H, K, dtype=torch.long, device=q.device)
        with torch.no_grad():  # which chunks: a discrete choice; the attention below carries the gradient
            for start, stop, lo, hi in view.groups:
                s, e, view.recent = view.bank.search_in_stream(q[:, start:stop].detach(), lo, hi, K, view.recent)
                scores[:, start:stop, :, : s.shape[-1]], entries[:, start:stop, :, : e.shape[-1]] = s, e
        valid = torch.isfinite(scores)
        keys, values, first = view.bank.gather(entries)  # [B,T,H,K*cs,d]
        cs = self.options.chunk_size
        logits = torch.einsum("bthd,bthmd->bthm", q, keys.to(q.dtype)) / d**0.5
        logits = logits.masked_fill(~valid.repeat_interleave(cs, dim=-1), -torch.inf)
        any_valid = valid.any(-1, keepdim=True)
        attn = torch.where(any_valid, torch.softmax(logits.masked_fill(~any_valid, 0.0), dim=-1), 0.0)
        out = torch.einsum("bthm,bthmd->bthd", attn, values.to(q.dtype))
        positions = torch.where(valid, first, -1)
        scores = torch.where(valid, scores, float("nan"))
        return out, positions, scores

    def forward_with_bank(self, x: Tensor, state: LocalCache, pos: int, bank: BankView) -> tuple[Tensor, LocalCache]:
        q, k, v = self.project(x)
        local, new_state = self.attend(q, k, v, state, pos)
        mem, positions, scores = self.memory_attend(q, bank)
        self.hook_retrieved_pos(positions)
        self.hook_retrieved_scores(scores)
        mem, local = self.hook_mem_out(mem), self.hook_local_out(local)
        B, T = x.shape[:2]
        gate = self.hook_gate(torch.sigmoid(self.gate).expand(B, T, self.n_heads))
        z = self.hook_z(gate[..., None] * mem + (1 - gate[..., None]) * local)
        return self.W_O(z.flatten(2)), new_state


class SideBlock(Block):
    """A SideNet block; the augmented one reads the memory bank."""

    attn: LocalAttention  # set by Block.__init__; declared for its type

    def init_state(self, batch: int, device: torch.device) -> LocalCache:
        return self.attn.init_state(batch, device)

    def forward(self, x: Tensor, state: State, pos: int, bank: BankView | None = None) -> tuple[Tensor, LocalCache]:
        cache = cast(LocalCache, state)  # what init_state built: Block's forward takes any State
        x = self.hook_resid_pre(x)
        if isinstance(self.attn, MemoryAugmentedAttention):
            assert bank is not None  # run_blocks passes the bank to every side block
            a, cache = self.attn.forward_with_bank(self.ln1(x), cache, pos, bank)
        else:
            a, cache = self.attn(self.ln1(x), cache, pos)
        x = self.hook_resid_mid(x + self.hook_attn_out(a))
        x = self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.ln2(x))))
        return x, cache


def retrieval_map(trace: Trace, prefix: str, width: int = WIDTH, start: int = 0, stop: int | None = None) -> go.Figure:
    """Which past positions each token retrieved: x = reading token, y = retrieved chunk's first
    position, colour = retrieval score (every `bin`-th token over long ranges)."""
    start, stop = window_of(trace, start, stop)
    pos = trace[f"{prefix}.hook_retrieved_pos"][start:stop]  # [T, H, K]
    scores = trace[f"{prefix}.hook_retrieved_scores"][start:stop]
    step = bin_size(len(pos), width)
    xs, ys, cs = [], [], []
    for i in range(0, len(pos), step):
        p, s = pos[i].reshape(-1), scores[i].reshape(-1)
        keep = p >= 0
        xs.extend([start + i] * int(keep.sum()))
        ys.extend(p[keep].tolist())
        cs.extend(s[keep].tolist())
    fig = go.Figure(
        go.Scattergl(
            x=xs,
            y=ys,
            mode="markers",
            marker={"color": cs, "colorscale": "Viridis", "size": 4, "colorbar": {"title": "score"}},
            hovertemplate="token %{x} read chunk at %{y}<br>score %{marker.color:.3g}<extra></extra>",
        )
    )
    for a, b in trace.meta.get("evidence", []):
        for layer in EVIDENCE_OUTLINE[:-1]:
            fig.add_hrect(y0=a - 0.5, y1=b - 0.5, **layer)
        fig.add_hrect(y0=a - 0.5, y1=b - 0.5, annotation_text="evidence", **EVIDENCE_OUTLINE[-1])
    fig.update_layout(
        title="LongMem retrieval: past chunks read by each token",
        xaxis_title="reading token position",
        yaxis_title="retrieved chunk position",
    )
    return fig


def retrieved_at(trace: Trace, prefix: str, position: int) -> dict[str, go.Figure]:
    """The chunks one token retrieved: per head, each retrieved chunk's first position, ranked by score (marker size
    and colour), the evidence outlined, and which heads read a chunk inside it; and a table of the chunks, best
    first, each with its text."""
    pos = trace[f"{prefix}.hook_retrieved_pos"][position]  # [H, K]
    scores = trace[f"{prefix}.hook_retrieved_scores"][position]
    heads, ranks = np.nonzero(pos >= 0)
    chunk = int(trace.meta.get("figure_settings", {}).get("chunk_size", 1))
    texts = ["".join(trace.token_text(int(p), int(p) + chunk)) for p in pos[heads, ranks]]
    fig = go.Figure(
        go.Scatter(
            x=pos[heads, ranks],
            y=[f"head {h}" for h in heads],
            mode="markers+text",
            text=[f"#{r + 1}" for r in ranks],
            textposition="top center",
            customdata=texts,
            marker={
                "color": scores[heads, ranks],
                "colorscale": "Viridis",
                "size": 10 + 4 * (pos.shape[1] - ranks),
                "colorbar": {"title": "score"},
            },
            hovertemplate="%{y}: chunk at token %{x} (rank %{text})<br>score %{marker.color:.3g}<br>"
            "%{customdata}<extra></extra>",
        )
    )
    outline_evidence(fig, trace.meta.get("evidence", []), 0, len(trace))
    hit = sorted(
        {
            int(h)
            for h, p in zip(heads, pos[heads, ranks])
            for a, b in trace.meta.get("evidence", [])
            if p < b and p + chunk > a
        }
    )
    said = (
        (f"; heads {hit} read a chunk of the evidence" if hit else "; no head reads the evidence")
        if trace.meta.get("evidence")
        else ""
    )
    token = trace.token_text(position, position + 1)[0]
    if len(heads) == 0:  # nothing in the bank yet to search
        said = ": none, the bank held no chunk yet (it fills as segments complete)"
    fig.update_layout(
        title=f"LongMem: the chunks token {position} ({token!r}) retrieved{said}",
        xaxis_title="retrieved chunk's first token",
        xaxis_range=[-0.5, len(trace)],
        yaxis_title="head",
        height=200 + 40 * pos.shape[0],
    )
    best = np.argsort(-scores[heads, ranks], kind="stable")
    table = table_figure(
        {
            "head": heads[best].tolist(),
            "rank": (ranks[best] + 1).tolist(),
            "score": [f"{x:.3g}" for x in scores[heads, ranks][best]],
            "tokens": [f"{p}-{p + chunk - 1}" for p in pos[heads, ranks][best].tolist()],
            "text": [texts[i] for i in best],
        },
        f"LongMem: the text of the chunks token {position} retrieved, best score first",
    )
    return {"chunks retrieved": fig, "chunks retrieved, their text": table}


def longmem_figures(trace: Trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> dict[str, go.Figure]:
    """The augmented side block's retrieval map and its gate per head (what one token retrieved: `read_at`)."""
    zoom: dict[str, Any] = dict(width=width, start=start, stop=stop)  # the figure helpers' keywords
    figs = {}
    for prefix in (layer_prefix(n, RETRIEVED_POS) for n in layer_names(trace, RETRIEVED_POS)):
        figs["retrieval"] = retrieval_map(trace, prefix, **zoom)
        figs["gate"] = position_heatmap(
            trace, f"{prefix}.hook_gate", "LongMem gate sigmoid(g) per head", "head", zmin=0, zmax=1, **zoom
        )
    return figs


def longmem_read_at(trace: Trace, position: int) -> dict[str, go.Figure]:
    """What token `position` retrieved from the bank (`retrieved_at`)."""
    return {
        title: fig
        for prefix in (layer_prefix(n, RETRIEVED_POS) for n in layer_names(trace, RETRIEVED_POS))
        for title, fig in retrieved_at(trace, prefix, position).items()
    }


@register_family(
    "longmem",
    summary="LongMem (NeurIPS 2023): a frozen backbone's cached key/value bank, searched by chunk "
    "and read by a memory-augmented side network",
    figures=longmem_figures,
    read_at=longmem_read_at,
    figure_settings=lambda model: {"chunk_size": cast(LongMemLM, model).options.chunk_size},
    tiny={
        "attention": {"kind": "window", "span": 8},
        "segment_len": 8,
        "memory": {"chunk_size": 4, "topk_chunks": 2, "bank_size": 16},
    },
    sample="longmem_english",
    prefix_capacity="bank_size",
    needle_hold=True,
)
class LongMemLM(MemoryLM):
    """A frozen backbone, its cached key/value bank, and a trainable memory-augmented SideNet."""

    Options = LongMemOptions
    memory_hooks = {RETRIEVED_POS: "none", RETRIEVED_SCORES: "none", GATE: "none", MEM_OUT: "norm", LOCAL_OUT: "norm"}
    hook_docs = {
        **MemoryLM.hook_docs,
        "hook_side_out": HookDoc(
            "[batch, pos, d_model]", "the SideNet's output stream, before the final norm and the frozen unembedding"
        ),
        "side_blocks.{l}.hook_resid_pre": HookDoc(
            "[batch, pos, d_model]",
            "SideNet residual stream entering side block `l` (the backbone's blocks keep `blocks.{l}.*`)",
        ),
        "side_blocks.{l}.hook_attn_out": HookDoc("[batch, pos, d_model]", "side block attention output"),
        "side_blocks.{l}.hook_resid_mid": HookDoc("[batch, pos, d_model]", "side residual after attention"),
        "side_blocks.{l}.hook_mlp_out": HookDoc("[batch, pos, d_model]", "side block FFN output"),
        "side_blocks.{l}.hook_resid_post": HookDoc(
            "[batch, pos, d_model]", "side block output, before the cross-network residual is added"
        ),
        "side_blocks.{l}.mlp.hook_post": HookDoc("[batch, pos, d_mlp]", "side block SwiGLU hidden activation"),
        "side_blocks.{l}.attn.hook_q": HookDoc("[batch, pos, head, d_head]", "side block queries (un-rotated)"),
        "side_blocks.{l}.attn.hook_k": HookDoc("[batch, pos, head, d_head]", "side block keys (un-rotated)"),
        "side_blocks.{l}.attn.hook_v": HookDoc("[batch, pos, head, d_head]", "side block values"),
        "side_blocks.{l}.attn.hook_z": HookDoc(
            "[batch, pos, head, d_head]", "side block attention output per head (gated mix in the augmented block)"
        ),
        RETRIEVED_POS: HookDoc(
            "[batch, pos, head, topk_chunks]",
            "first token position of each retrieved chunk (-1: none); augmented block only",
        ),
        RETRIEVED_SCORES: HookDoc(
            "[batch, pos, head, topk_chunks]",
            "`q . chunk_key` of each retrieved chunk (NaN: none)",
            nan_means_none=True,
        ),
        GATE: HookDoc("[batch, pos, head]", "`sigmoid(g)`: the share of memory attention per head"),
        MEM_OUT: HookDoc("[batch, pos, head, d_head]", "attention over the retrieved chunks"),
        LOCAL_OUT: HookDoc("[batch, pos, head, d_head]", "local (windowed) attention"),
    }

    def check_config(self) -> None:
        o, cfg = self.options, self.cfg
        if cfg.segment_len is None:
            raise ConfigError("longmem needs config.segment_len (the bank grows a segment at a time)")
        if cfg.segment_len % o.chunk_size:
            raise ConfigError(f"segment_len ({cfg.segment_len}) must be a multiple of chunk_size ({o.chunk_size})")
        self.memory_layer = o.memory_layer if o.memory_layer >= 0 else cfg.n_layers // 2
        self.augmented_layer = o.augmented_layer if o.augmented_layer >= 0 else o.side_layers // 2
        if not 0 <= self.memory_layer < cfg.n_layers:
            raise ConfigError(f"longmem memory_layer must lie in 0..{cfg.n_layers - 1}")
        if not 0 <= self.augmented_layer < o.side_layers:
            raise ConfigError(f"longmem augmented_layer must lie in 0..{o.side_layers - 1}")
        if o.side_layers > cfg.n_layers:
            raise ConfigError("longmem side_layers cannot exceed the backbone's n_layers")

    def build(self) -> None:
        cfg, o = self.cfg, self.options
        assert self.attention is not None  # default_attention is causal
        self.blocks = nn.ModuleList(
            Block(cfg, LocalAttention(cfg, self.attention), SwiGLU(cfg.d_model, cfg.d_mlp)) for _ in range(cfg.n_layers)
        )
        self.side_blocks = nn.ModuleList(
            SideBlock(
                cfg,
                MemoryAugmentedAttention(cfg, o, self.attention)
                if i == self.augmented_layer
                else LocalAttention(cfg, self.attention),
                SwiGLU(cfg.d_model, cfg.d_mlp),
            )
            for i in range(o.side_layers)
        )
        self.hook_side_out = HookPoint()  # [batch, pos, d_model]  the SideNet's output stream

    def reset_parameters(self) -> None:
        super().reset_parameters()
        self.freeze_backbone()

    def freeze_backbone(self) -> None:
        """The backbone (embeddings, blocks, unembedding) is frozen; `ln_final` is the side
        network's final norm and trains."""
        for module in (self.embed, self.blocks, self.unembed):
            for p in module.parameters():
                p.requires_grad_(False)

    def warm_start(self, base: MemoryLM) -> None:
        """Load a trained baseline into the backbone; side block l starts as backbone block b(l).
        A LongMem model is a second stage instead: all its weights, new bank options."""
        if base.family == self.family:
            super().warm_start(base)
            self.freeze_backbone()
            return
        mismatch = [f for f in (*BACKBONE_FIELDS, "attention") if getattr(base.cfg, f) != getattr(self.cfg, f)]
        if not base.is_baseline or mismatch:
            raise ConfigError(f"a LongMem backbone must be a baseline with the same {mismatch or 'family'}")
        with torch.no_grad():
            self.embed.load_state_dict(base.embed.state_dict())
            self.blocks.load_state_dict(base.blocks.state_dict())
            self.ln_final.load_state_dict(base.ln_final.state_dict())
            for side, tap in zip(self.side_blocks, self.taps()):
                side.load_state_dict(base.blocks[tap].state_dict(), strict=False)  # the gate stays at 0
        self._tokenizer = base.tokenizer

    @torch.no_grad()
    def needle_hold(self, tokens, span: tuple[int, int]) -> dict[str, np.ndarray]:
        """The share of heads whose top-k retrieved chunks include one that overlaps the span."""
        ids, a, b = self.needle_ids(tokens, span)
        cs, hits = self.options.chunk_size, []

        def retrieved(positions: Tensor, hook) -> None:
            hits.append(
                ((positions[0] >= 0) & (positions[0] < b) & (positions[0] + cs > a)).any(-1).float().mean(-1).cpu()
            )

        with self.hooks(fwd_hooks=[(f"side_blocks.{self.augmented_layer}.attn.hook_retrieved_pos", retrieved)]):
            for _ in self.stream(ids):
                pass
        return {"heads that retrieve a chunk of the span (share)": torch.cat(hits).numpy()}

    def taps(self) -> list[int]:
        """b(l): the backbone depth whose hidden state side block l's residual ends at."""
        L, S = self.cfg.n_layers, self.options.side_layers
        return [round(l * L / S) for l in range(S + 1)]

    def init_state(self, batch_size: int = 1) -> ModelState:
        state = super().init_state(batch_size)  # backbone blocks
        o, cfg = self.options, self.cfg
        empty = torch.zeros(batch_size, 0, cfg.n_heads, cfg.d_head, device=self.device, dtype=self.dtype)
        state.shared = LongMemShared(
            side=self.init_side_state(batch_size),
            bank=ChunkBank.empty(
                batch_size,
                cfg.n_heads,
                cfg.d_head,
                o.chunk_size,
                o.bank_size,
                o.search,
                o.ef_search,
                o.exact_below,
                o.outliers,
                o.recent_queries,
                device=self.device,
                dtype=self.dtype,
            ),
            open_segment=OpenSegment(empty, empty.clone()),
            recent=self.no_recent_queries(batch_size),
        )
        return state

    def cost(self, n_tokens: int) -> dict[str, int]:
        """`MemoryLM.cost` with the bank's growth past the tokens it measures: the backbone's keys and values of up
        to `bank_size` past tokens (its chunk keys and search index, a chunk's share of that, aside)."""
        parts = super().cost(n_tokens)
        item = torch.finfo(self.dtype).bits // 8
        measured = min(n_tokens, self.measured_tokens, self.options.bank_size)
        grown = min(n_tokens, self.options.bank_size) - measured
        parts["memory_state"] += 2 * grown * self.cfg.n_heads * self.cfg.d_head * item
        return parts

    def no_recent_queries(self, batch_size: int) -> Tensor:
        """What the search of the last tokens found, before any (ChunkBank.search_in_stream)."""
        return torch.zeros(batch_size, self.cfg.n_heads, 0, 0, dtype=torch.long, device=self.device)

    def init_side_state(self, batch_size: int) -> list[LocalCache]:
        """The side blocks' empty local caches."""
        return self.in_model_dtype(
            [b.init_state(batch_size, self.device) for b in cast(Iterable[SideBlock], self.side_blocks)]
        )

    def run_blocks(self, x: Tensor, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], LongMemShared]:
        pos, T = state.pos, x.shape[1]
        shared = cast(LongMemShared, state.shared)  # what init_state built
        hidden, new_states, bank, open_segment, open_from = self.run_backbone(x, state)
        view = BankView(bank, self.query_groups(bank, pos, T), shared.recent)
        taps, h, side_states = self.taps(), hidden[0], []
        for l, (block, s) in enumerate(zip(self.side_blocks, shared.side)):
            h, s = block(h, s, pos, view)
            h = h + (hidden[taps[l + 1]] - hidden[taps[l]])
            side_states.append(s)
        bank = bank.trimmed(open_from - self.options.bank_size)
        return self.hook_side_out(h), new_states, LongMemShared(side_states, bank, open_segment, view.recent)

    def run_backbone(
        self, x: Tensor, state: ModelState
    ) -> tuple[list[Tensor], list[State], ChunkBank, OpenSegment, int]:
        """The frozen backbone over a chunk and what it writes: (hidden states after each layer,
        the layers' new states, the bank with the segments this chunk completes (untrimmed, as
        the chunk's own tokens search it), the open segment's keys/values, its first position)."""
        pos, T, seg = state.pos, x.shape[1], self.cfg.segment_len
        assert seg is not None  # check_config: longmem needs it
        shared = cast(LongMemShared, state.shared)  # what init_state built
        hidden, new_states = [x], []
        for layer, (block, layer_state) in enumerate(zip(cast(Iterable[Block], self.blocks), state.layers)):
            if layer == self.memory_layer:
                attn = cast(LocalAttention, block.attn)  # the backbone's blocks attend locally
                k_mem, v_mem = attn.project(block.ln1(hidden[-1]))[1:]  # un-rotated [B,T,H,d]
            h, layer_state = block(hidden[-1], layer_state, pos)
            hidden.append(h)
            new_states.append(layer_state)
        # the segments this chunk completes join the bank first; each token then searches only
        # the chunks of segments before its own (the bank as it was when its segment began)
        held = shared.open_segment
        n_held = held.keys.shape[1]
        ext_k = torch.cat([held.keys, k_mem.detach()], 1)
        ext_v = torch.cat([held.values, v_mem.detach()], 1)
        open_from = (pos + T) - (pos + T) % seg  # first position of the open segment
        n_closed = max(0, open_from - (pos - n_held))
        bank = shared.bank.append(ext_k[:, :n_closed], ext_v[:, :n_closed], pos - n_held)
        return hidden, new_states, bank, OpenSegment(ext_k[:, n_closed:], ext_v[:, n_closed:]), open_from

    @torch.no_grad()
    def prefill(
        self, tokens: Tokens, state: ModelState | None = None, progress: Progress | None = None
    ) -> tuple[Tensor, ModelState]:
        """`StreamingLM.prefill` without the work nobody reads: a token more than the side network's
        reach (side_layers x the attention span) before the end reaches the last logits only
        through the bank, which the frozen backbone writes. So over those tokens only the backbone
        runs (its caches, the bank and the open segment exactly as a full run leaves them), then the
        whole model over the last `reach` tokens with the side caches starting empty: the side
        outputs are exact from `reach` tokens in, and so are the last logits and the side caches
        (test_longmem.py, beside this file, compares with a full stream). Hooks on the side network fire only
        for those last tokens. Full-causal attention has no reach: the default path. With HNSW
        search a query also reads what the search found for the `recent_queries` tokens before it,
        so the reach is that much longer."""
        tokens = self.as_tokens(tokens)
        check_progress(progress)
        assert self.attention is not None  # default_attention is causal
        span = self.attention.span
        if span is None:
            return super().prefill(tokens, state, progress)
        o = self.options
        reach = o.side_layers * span + (o.recent_queries if o.search == "hnsw" else 0)
        head = max(0, tokens.shape[1] - reach)
        if head:
            state = self.backbone_prefill(tokens[:, :head], state, shifted(progress, 0, tokens.shape[1]))
        return super().prefill(tokens[:, head:], state, shifted(progress, head, tokens.shape[1]))

    @torch.no_grad()
    def backbone_prefill(
        self, tokens: Tensor | Sequence[int], state: ModelState | None = None, progress: Progress | None = None
    ) -> ModelState:
        """The state after `tokens` as the frozen backbone leaves it (its caches, the bank, the open
        segment), the side caches empty. No trained weight enters it, so training can start batch
        after batch from one such state (a bank of distractors: `data.prefix_tokens`)."""
        tokens = self.as_tokens(tokens)
        check_progress(progress)
        state = state or self.init_state(tokens.shape[0])
        fresh_side = self.init_side_state(tokens.shape[0])
        for start in range(0, tokens.shape[1], self.chunk_len):
            chunk = tokens[:, start : start + self.chunk_len]
            _, layer_states, bank, open_segment, open_from = self.run_backbone(self.embedded(chunk), state)
            shared = LongMemShared(
                side=fresh_side,
                bank=bank.trimmed(open_from - self.options.bank_size),
                open_segment=open_segment,
                recent=self.no_recent_queries(tokens.shape[0]),
            )
            state = ModelState(state.pos + chunk.shape[1], layer_states, shared, self.state_owner)
            heap.release_between(start, start + chunk.shape[1])
            if progress is not None:
                progress(start + chunk.shape[1], tokens.shape[1])
        return state

    def query_groups(self, bank: ChunkBank, pos: int, T: int) -> list[tuple[int, int, int, int]]:
        """(start, stop, lo, hi) per segment of the chunk: its tokens start:stop read bank
        entries [lo, hi), the chunks of whole segments before theirs within bank_size tokens."""
        seg, groups = self.cfg.segment_len, []
        assert seg is not None  # check_config: longmem needs it
        start = 0
        while start < T:
            segment_start = (pos + start) - (pos + start) % seg
            stop = min(T, segment_start + seg - pos)
            lo, hi = bank.visible_range(segment_start - self.options.bank_size, segment_start)
            groups.append((start, stop, lo, hi))
            start = stop
        return groups


def shifted(progress: Progress | None, offset: int, total: int) -> Progress | None:
    """`progress` over a whole prompt, for a part of it that starts `offset` tokens in."""
    if progress is None:
        return None
    whole = progress
    return lambda done, _: whole(offset + done, total)


@dataclass
class BankView:
    """What the memory attention reads in one forward: the bank and, per segment of the
    input, the range of bank entries its tokens may search."""

    bank: ChunkBank
    groups: list[tuple[int, int, int, int]]
    recent: Tensor  # what the search found for the last tokens (ChunkBank.search_in_stream), updated as it reads
