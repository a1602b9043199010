"""LM2: Large Memory Models (Kang et al. 2025, arXiv 2502.06049).

Every decoder block carries a memory bank M [N, d] beside its (local) attention. With E_t the
block's normalised input at token t (Section 2 of the paper):

  memory read      Q = E_t W_Q,  K = M_t W_K,  V = M_t W_V
                   E_mem = softmax(Q K^T / sqrt(d)) V                    (slot attention over N slots)
  output gate      g_out = sigmoid(E_mem W_out),  E_gated = g_out * E_mem
  block output     x + Attn(E) + E_gated, then the FFN as usual          (memory beside attention)
  input gate       g_in = sigmoid(E_t W_in)
  forget gate      g_forget = sigmoid(E_mem W_forget)
  update           M_t+1 = g_in * tanh(E_mem) + g_forget * M_t
  initialisation   each slot is a row of the identity (M_0 = I, N x d; rows past d are zero)

The bank is N slots of d numbers (N x d). The paper's Figure 2 draws each slot as a d x d
matrix; its equations read and write M_t as [N, d] (K = M_t W_K is a key per slot), which is
the form kept here.

Readings where the paper is ambiguous, each with the alternative as an option:
  * output gate: the paper writes E_gated = g_out * M_t. With g_out per token [d] and M_t a
    bank [N, d] the shapes only agree if M_t stands for what token t read, E_mem, which is the
    default (`output_gate="read"`); `output_gate="bank"` multiplies the bank's mean slot.
  * update granularity and what is written (one option, `update`): M is indexed by t, so the
    bank is updated after every token, each token reading the bank left by the one before
    (`update="token"`, the default; sequential, see kernels/lm2/reference.py for the O(N d)
    step). `update="segment"` reads one bank for a whole segment of `segment_len` tokens and
    then applies the update averaged over the segment's tokens, which trains in parallel.
    Either way the paper's update names no slot and writes tanh(E_mem), which is itself read
    from the bank, so every slot receives the same write; slots differ only through their
    initial identity rows, decayed by the forget gates. `update="slots"` (per segment too)
    addresses the write: slot n averages the paper's update over the segment's tokens t with
    its own weights
        b[n, t] = softmax_t(E_t W_Q . M[n] W_K / sqrt(d))     (the read's logits, over tokens)
        M[n] <- sum_t b[n, t] (g_in,t * tanh(E_t W_write) + g_forget,t * M[n])
    so a slot is written by the tokens that would read it, with the token's own content (as
    memory slots that attend to the segment do in RMT-style memories). The default segment
    update is the same sum with b uniform and E_mem as the content. `hook_write_score` records
    the logits of b (0 where every slot receives the same write).
  * a write no slot can refuse (option `write_sink`, this project's, not the paper's): with
    update="slots" each slot's b sums to 1 over every segment's tokens, so filler is written
    into every slot and the forget gates decay it every segment. A learned null logit s[n] per
    slot joins the softmax over the tokens as a write that keeps the slot as it is,
        M[n] <- b0[n] M[n] + sum_t b[n, t] (g_in,t * tanh(E_t W_write) + g_forget,t * M[n]),
        (b0[n], b[n, :]) = softmax over (s[n], the segment's logits),
    so a segment whose tokens all score under s[n] leaves slot n nearly unwritten and unforgotten.

The local attention is the config's `attention`: full causal attention by default (the paper
keeps full attention beside the memory), a sliding window, or attention within the current
segment ({"kind": "segment", "span": segment_len}, as in Infini-attention and Titans), so that
anything further back than the segment reaches a token only through the bank.

State per layer (`LM2BlockState`): the memory, an `LM2Bank` (the bank M [B, N, d] and, with segment
updates, the running per-slot softmax sums of the open segment), and the local attention's `LocalCache`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any, NamedTuple, cast

import numpy as np
import plotly.graph_objects as go
import torch
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz.config import ConfigError, ModelConfig
from memviz.figure_parts import WIDTH, layer_names, layer_prefix, position_heatmap, timeline, with_array
from memviz.layers import AttentionSpan, LocalAttention, LocalCache, SwiGLU, segment_pieces
from memviz.model import Block, MemoryLM
from memviz.options import check_choice, check_finite, check_positive
from memviz.protocol import HookDoc, ModelState, Readout, ReadPath
from memviz.read_lens import captured_at, last_residual
from memviz.registry import register_family
from memviz.running import hooked
from memviz.state import Memory, State
from memviz.trace import Trace
from memviz_kernels.dispatch import lm2_scan

SLOT_ATTN = "blocks.{l}.memory.hook_slot_attn"  # [batch, pos, slot]  the read's attention over slots
GATES = {g: f"blocks.{{l}}.memory.hook_{g}_gate" for g in ("input", "forget", "output")}  # [batch, pos, d_model]
SLOT_NORM = "blocks.{l}.memory.hook_slot_norm"  # [batch, pos, slot]  ||M_n|| the token reads
WRITE_SCORE = "blocks.{l}.memory.hook_write_score"  # [batch, pos, slot]  logit of the token in each slot's write


@dataclass
class LM2Options:
    slots: int = 16
    update: str = "token"  # "token" (paper), "segment", or "slots" (per segment, addressed writes)
    output_gate: str = "read"  # "read" (E_gated = g_out * E_mem) or "bank" (g_out * mean slot)
    # initial gate biases: a fresh bank keeps sigmoid(forget_bias)^T of itself over T updates
    # (2.0: 0.88 an update, half gone in 5; 6.0: 0.9975, half gone in 280), so forget_bias sets
    # how far back a fresh memory reaches and gradient flows (cf. Tallec & Ollivier 2018)
    forget_bias: float = 2.0
    input_bias: float = -2.0
    # update="slots" only: the initial null logit s[n] of every slot's write (learned); None, no null write
    write_sink: float | None = None

    def __post_init__(self) -> None:
        check_positive(slots=self.slots)
        check_finite(forget_bias=self.forget_bias, input_bias=self.input_bias)
        check_choice("update", self.update, ("token", "segment", "slots"))
        check_choice("output_gate", self.output_gate, ("read", "bank"))
        if self.write_sink is not None:
            check_finite(write_sink=self.write_sink)
            if self.update != "slots":
                raise ValueError(f"write_sink needs update='slots' (an addressed write), got update={self.update!r}")

    @property
    def per_segment(self) -> bool:
        return self.update != "token"


class SegmentSums(NamedTuple):
    """Running softmax sums of an open segment's update, per slot: the largest logit so far [B, N],
    the normaliser [B, N], and the unnormalised sums of g_forget and of the write [B, N, d]."""

    max: Tensor
    denom: Tensor
    f_sum: Tensor
    w_sum: Tensor


class LM2Bank(NamedTuple):
    """The memory of one block: the bank M [B, N, d] and, with segment updates, the open segment's sums."""

    M: Tensor
    open_segment: SegmentSums | None = None


class LM2BlockState(NamedTuple):
    """An LM2 block's state: its local attention's cache and its memory."""

    attn: LocalCache
    memory: Memory[LM2Bank]


class LM2Memory(nn.Module):
    """The memory module of one block: read, output gate, and the gated bank update."""

    def __init__(self, cfg: ModelConfig, options: LM2Options) -> None:
        super().__init__()
        d, self.options, self.segment_len = cfg.d_model, options, cfg.segment_len
        self.W_Q = nn.Linear(d, d, bias=False)
        self.W_K = nn.Linear(d, d, bias=False)
        self.W_V = nn.Linear(d, d, bias=False)
        self.W_out = nn.Linear(d, d)
        self.W_in = nn.Linear(d, d)
        self.W_forget = nn.Linear(d, d)
        if options.update == "slots":
            self.W_write = nn.Linear(d, d, bias=False)
        if options.write_sink is not None:
            self.write_sink = nn.Parameter(torch.full((options.slots,), options.write_sink))
        self.hook_slot_attn = HookPoint()  # [batch, pos, slot]
        self.hook_read = HookPoint()  # [batch, pos, d_model]  E_mem
        self.hook_input_gate = HookPoint()  # [batch, pos, d_model]
        self.hook_forget_gate = HookPoint()  # [batch, pos, d_model]
        self.hook_output_gate = HookPoint()  # [batch, pos, d_model]
        self.hook_slot_norm = HookPoint()  # [batch, pos, slot]  ||M_t[n]|| of the bank token t reads
        self.hook_write_score = HookPoint()  # [batch, pos, slot]  logit of token t's weight in slot n's write
        self.hook_out = HookPoint()  # [batch, pos, d_model]  E_gated

    def reset_memory_parameters(self) -> None:
        """Forget gates start open (bias `forget_bias`, +2 by default: sigmoid = 0.88) and input
        gates mostly shut (`input_bias`, -2), so a fresh bank keeps its identity rows and writes sparingly."""
        nn.init.constant_(self.W_forget.bias, self.options.forget_bias)
        nn.init.constant_(self.W_in.bias, self.options.input_bias)
        nn.init.zeros_(self.W_out.bias)
        if self.options.write_sink is not None:
            nn.init.constant_(self.write_sink, self.options.write_sink)

    def init_state(self, batch: int, device: torch.device) -> LM2Bank:
        d = self.W_Q.in_features
        bank = torch.eye(self.options.slots, d, device=device).expand(batch, -1, -1).clone()
        if self.options.update == "token":
            return LM2Bank(bank)
        return LM2Bank(bank, self.empty_segment_sums(bank))

    def empty_segment_sums(self, M: Tensor) -> SegmentSums:
        """The sums of a segment no token has reached yet: nothing, or the null write alone (weight
        exp(0) at the running maximum s[n], keeping the slot, writing nothing)."""
        null = self.options.write_sink is not None
        return SegmentSums(
            max=self.write_sink.to(M.dtype).expand(M.shape[:2])
            if null
            else torch.full(M.shape[:2], -torch.inf, device=M.device, dtype=M.dtype),
            denom=torch.full(M.shape[:2], float(null), device=M.device, dtype=M.dtype),
            f_sum=torch.full_like(M, float(null)),
            w_sum=torch.zeros_like(M),
        )

    def write_weights(self, score: Tensor) -> tuple[Tensor, Tensor | None]:
        """Each slot's weights over a whole segment's tokens, b [..., T, N] from the logits `score`
        [..., T, N], and the null write's b0 [..., N] (None without `write_sink`)."""
        if self.options.write_sink is None:
            return torch.softmax(score, dim=-2), None
        sink = self.write_sink.to(score.dtype).expand(*score.shape[:-2], 1, score.shape[-1])
        weights = torch.softmax(torch.cat([score, sink], dim=-2), dim=-2)
        return weights[..., :-1, :], weights[..., -1, :]

    def forward(self, e: Tensor, state: LM2Bank, pos: int) -> tuple[Tensor, LM2Bank]:
        g_in = self.hook_input_gate(torch.sigmoid(self.W_in(e)))
        if self.options.update == "token":
            (attn, read, g_f, norms), M = lm2_scan(
                self.W_Q(e) @ self.W_K.weight / e.shape[-1] ** 0.5,
                g_in,
                self.W_V.weight.T,
                self.W_forget.weight.T,
                self.W_forget.bias,
                state.M,
            )
            banks_mean = None
            if self.options.output_gate == "bank":
                banks_mean = self.token_bank_means(state.M, g_in, read, g_f)
            new_state = LM2Bank(M)
            observed = {
                "write_score": torch.zeros_like(attn),
                "slot_attn": attn,
                "slot_norm": norms,
                "forget_gate": g_f,
            }
        else:  # in the bank's dtype under autocast: bfloat16 speeds none of the scan's many small products
            with torch.autocast(e.device.type, enabled=False):
                dtype = state.M.dtype
                read, banks_mean, observed, new_state = self.segment_scan(e.to(dtype), g_in.to(dtype), state, pos)
        for name in ("write_score", "slot_attn", "slot_norm"):  # observed: the bank is already updated
            if name in observed:
                self.observers[name](observed[name])
        read = self.hook_read(read)
        if "forget_gate" in observed:
            self.hook_forget_gate(observed["forget_gate"])
        g_out = self.hook_output_gate(torch.sigmoid(self.W_out(read)))
        gated = g_out * (read if self.options.output_gate == "read" else banks_mean)
        return self.hook_out(gated), new_state

    @property
    def observers(self) -> dict[str, HookPoint]:
        """The hooks that only observe the scan (editing their values changes nothing), by name."""
        return {
            "write_score": self.hook_write_score,
            "slot_attn": self.hook_slot_attn,
            "slot_norm": self.hook_slot_norm,
            "forget_gate": self.hook_forget_gate,
        }

    @staticmethod
    def token_bank_means(M0: Tensor, g_in: Tensor, read: Tensor, g_f: Tensor) -> Tensor:
        """Mean slot of the bank each token reads, from the same recurrence as the scan."""
        mean0, means = M0.mean(1), []
        D, c = torch.ones_like(mean0), torch.zeros_like(mean0)
        for g_f_t, g_in_t, read_t in zip(g_f.unbind(1), g_in.unbind(1), read.unbind(1)):  # unbind: see segment_scan
            means.append(D * mean0 + c)
            D, c = g_f_t * D, g_f_t * c + g_in_t * torch.tanh(read_t)
        return torch.stack(means, 1)

    def segment_scan(self, e: Tensor, g_in: Tensor, state: LM2Bank, pos: int):
        """update="segment" or "slots": every token of a segment reads the bank of the segment
        start; when the segment completes, M[n] <- sum_t b[n, t] (g_in,t * tanh(content_t) +
        g_forget,t * M[n]), with b uniform and content E_mem ("segment") or b = softmax over
        tokens of the read logits and content E_t W_write ("slots"). A segment met whole is
        updated at once; one split across calls accumulates the softmax online and gives the
        same bank. Returns (E_mem, the mean slot for output_gate="bank" or None, the values of
        the observing hooks that have a hook attached, the new bank): training builds no value
        that only a hook reads."""
        M, sums = state
        assert sums is not None  # a per-segment bank carries its open segment (init_state)
        d, slots = e.shape[-1], self.options.update == "slots"
        wanted = [name for name, point in self.observers.items() if hooked(point)]
        q = self.W_Q(e) / d**0.5
        # K, V and the forget gate's input per slot in one product: W_forget(attn @ V) = attn @ W_forget(V)
        # up to the bias, as attn's rows sum to 1, and a bank has fewer slots than a segment tokens
        W_slot = torch.cat([self.W_K.weight, self.W_V.weight, self.W_forget.weight @ self.W_V.weight]).T
        content = g_in * torch.tanh(self.W_write(e)) if slots else None  # the write needs no bank
        parts: dict[str, list[Tensor]] = {name: [] for name in ("read", "mean", *wanted)}
        pieces = segment_pieces(pos, e.shape[1], self.segment_len)
        sizes = [b - a for a, b in pieces]
        # The pieces come from split, not slicing: a slice's backward adds a zero tensor of the whole
        # input's length, so a long input's backward cost grew with its length times its segments.
        splits = [t.split(sizes, dim=1) if t is not None else [None] * len(sizes) for t in (q, g_in, content)]
        for (a, b), q_piece, g_in_piece, content_piece in zip(pieces, *splits):
            K, VF = (M @ W_slot).split([d, 2 * d], dim=-1)
            logits = q_piece @ K.transpose(1, 2)  # [B, T, N]
            attn = torch.softmax(logits, dim=-1)
            read, f_in = (attn @ VF).split(d, dim=-1)
            g_f = torch.sigmoid(f_in + self.W_forget.bias)
            write = content_piece if slots else g_in_piece * torch.tanh(read)
            score = logits if slots else torch.zeros_like(logits)
            observed = {"write_score": score, "slot_attn": attn, "forget_gate": g_f}
            if "slot_norm" in wanted:
                observed["slot_norm"] = M.norm(dim=-1)[:, None].expand(-1, b - a, -1)
            if self.options.output_gate == "bank":
                parts["mean"].append(M.mean(1)[:, None].expand(-1, b - a, -1))
            parts["read"].append(read)
            for name in wanted:
                parts[name].append(observed[name])
            if (pos + a) % self.segment_len == 0 and b - a == self.segment_len:
                weights, null = self.write_weights(score)  # b [B, T, N], each slot's over the tokens
                keep = weights.transpose(1, 2) @ g_f
                M = (keep if null is None else keep + null[..., None]) * M + weights.transpose(1, 2) @ write
                continue
            sums = self.accumulate(sums, score, g_f, write)
            if (pos + b) % self.segment_len == 0:
                M = (sums.w_sum + sums.f_sum * M) / sums.denom[..., None]
                sums = self.empty_segment_sums(M)
        cat = {name: torch.cat(values, dim=1) for name, values in parts.items() if values}
        read = cat.pop("read")
        return read, cat.pop("mean", None), cat, LM2Bank(M, sums)

    @staticmethod
    def accumulate(sums: SegmentSums, logits: Tensor, g_f: Tensor, write: Tensor) -> SegmentSums:
        """Add a piece's tokens to the running per-slot softmax sums (logits [B, T, N])."""
        new_max = torch.maximum(sums.max, logits.amax(1))
        rescale = torch.exp(sums.max - new_max)  # 0 while the segment is empty
        w = torch.exp(logits - new_max[:, None])  # [B, T, N]
        return SegmentSums(
            max=new_max,
            denom=sums.denom * rescale + w.sum(1),
            f_sum=sums.f_sum * rescale[..., None] + torch.einsum("btn,btd->bnd", w, g_f),
            w_sum=sums.w_sum * rescale[..., None] + torch.einsum("btn,btd->bnd", w, write),
        )


class LM2Block(Block):
    """x += Attn(norm x) + E_gated(norm x); x += FFN(norm x)."""

    attn: LocalAttention  # set by Block.__init__; declared for its type

    def __init__(self, cfg: ModelConfig, options: LM2Options, span: AttentionSpan) -> None:
        super().__init__(cfg, LocalAttention(cfg, span), SwiGLU(cfg.d_model, cfg.d_mlp))
        self.memory = LM2Memory(cfg, options)
        self.hook_mem_out = HookPoint()  # [batch, pos, d_model]

    def init_state(self, batch: int, device: torch.device) -> LM2BlockState:
        return LM2BlockState(self.attn.init_state(batch, device), self.memory.init_state(batch, device))

    def forward(self, x: Tensor, state: State, pos: int) -> tuple[Tensor, LM2BlockState]:
        state = cast(LM2BlockState, state)  # what init_state built: Block's forward takes any State
        x = self.hook_resid_pre(x)
        e = self.ln1(x)
        a, attn_state = self.attn(e, state.attn, pos)
        m, memory_state = self.memory(e, state.memory, pos)
        x = self.hook_resid_mid(x + self.hook_attn_out(a) + self.hook_mem_out(m))
        x = self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.ln2(x))))
        return x, LM2BlockState(attn_state, memory_state)


def segment_softmax(scores: np.ndarray, segment_len: int, sink: np.ndarray | None = None) -> np.ndarray:
    """Each slot's write weights: softmax of `scores` [pos, slot] over the positions of each
    `segment_len` segment (the trace starts at position 0, so segments start at its multiples),
    beside each slot's null logit `sink` [slot] where the model has one (`write_sink`)."""
    out = np.empty(scores.shape, dtype=np.float64)
    for a in range(0, len(scores), segment_len):
        seg = scores[a : a + segment_len].astype(np.float64)
        if sink is not None:
            seg = np.concatenate([seg, np.asarray(sink, dtype=np.float64)[None]])
        e = np.exp(seg - seg.max(0))
        weights = e / e.sum(0)
        out[a : a + segment_len] = weights[:-1] if sink is not None else weights
    return out


def lm2_figures(trace: Trace, width: int = WIDTH, start: int = 0, stop: int | None = None) -> dict[str, go.Figure]:
    """Per memory layer: its slot attention (token x slot), its three gates over tokens, its slot norms and, with
    update='slots', each slot's write weights over its segment's tokens."""
    zoom: dict[str, Any] = dict(width=width, start=start, stop=stop)  # the figure helpers' keywords
    settings = trace.meta.get("figure_settings", {})
    figs = {}
    for name in layer_names(trace, SLOT_ATTN):
        prefix = layer_prefix(name, SLOT_ATTN)
        layer = prefix.split(".memory")[0]
        figs[f"{layer} slot attention"] = position_heatmap(
            trace, name, f"{layer}: slot attention", "slot", zmin=0, **zoom
        )
        figs[f"{layer} gates"] = timeline(
            trace,
            {f"{prefix}.hook_{g}_gate": f"{layer} {g} gate (mean over dims)" for g in GATES},
            f"{layer}: LM2 gates over tokens",
            **zoom,
        )
        figs[f"{layer} slot norms"] = position_heatmap(
            trace, f"{prefix}.hook_slot_norm", f"{layer}: slot norms", "slot", **zoom
        )
        if settings.get("update") == "slots" and f"{prefix}.hook_write_score" in trace:
            sinks = settings.get("write_sink")
            index = int(layer.split(".")[1])
            writes = segment_softmax(
                trace[f"{prefix}.hook_write_score"], settings["segment_len"], sinks[index] if sinks else None
            )
            figs[f"{layer} slot writes"] = position_heatmap(
                with_array(trace, "writes", writes),
                "writes",
                f"{layer}: each slot's write weights over its segment's tokens",
                "slot",
                zmin=0,
                **zoom,
            )
    return figs


@register_family(
    "lm2",
    summary="LM2 (arXiv 2502.06049): a bank of memory slots beside attention, read by cross-attention, "
    "written through input, forget and output gates",
    matrix_state=("memory.M",),
    figures=lm2_figures,
    figure_settings=lambda model: cast(LM2LM, model).figure_settings(),
    quick={"attention": {"kind": "window", "span": 32}, "memory": {"slots": 8}},
    tiny={"attention": {"kind": "window", "span": 8}, "memory": {"slots": 4}},
    sample="lm2_english_16k",
    readout=True,
    needle_hold=True,
    read_lens=True,
)
class LM2LM(MemoryLM):
    """Transformer whose every block has an LM2 memory bank beside its attention."""

    Options = LM2Options
    option_weights = (r"blocks\.\d+\.memory\.write_sink",)
    memory_hooks = {
        SLOT_ATTN: "none",
        **{name: "mean" for name in GATES.values()},
        SLOT_NORM: "none",
        WRITE_SCORE: "none",
    }
    hook_docs = {
        **MemoryLM.hook_docs,
        "blocks.{l}.hook_mem_out": HookDoc(
            "[batch, pos, d_model]", "what the memory adds to the residual stream beside attention (`E_gated`)"
        ),
        SLOT_ATTN: HookDoc(
            "[batch, pos, slot]", "slot attention `softmax(Q K^T / sqrt(d))` of each token over the bank"
        ),
        "blocks.{l}.memory.hook_read": HookDoc("[batch, pos, d_model]", "`E_mem`, the memory read"),
        GATES["input"]: HookDoc("[batch, pos, d_model]", "`g_in = sigmoid(E_t W_in)`"),
        GATES["forget"]: HookDoc("[batch, pos, d_model]", "`g_forget = sigmoid(E_mem W_forget)`"),
        GATES["output"]: HookDoc("[batch, pos, d_model]", "`g_out = sigmoid(E_mem W_out)`"),
        SLOT_NORM: HookDoc("[batch, pos, slot]", "norm of each slot of the bank the token reads"),
        WRITE_SCORE: HookDoc(
            "[batch, pos, slot]",
            "logit of the token's weight in each slot's write: with `update` `slots`, slot n's weights over a "
            "segment are the softmax of these over its tokens, beside its null logit with `write_sink` "
            "(`memviz.models.lm2.segment_softmax`); 0 where every slot receives the same write. Observed after the "
            "update, so editing it changes nothing",
        ),
        "blocks.{l}.memory.hook_out": HookDoc("[batch, pos, d_model]", "`E_gated = g_out * E_mem`"),
    }

    def write_sinks(self) -> list[list[float]] | None:
        """Each layer's learned null logits s[n] of the slots' writes, or None without `write_sink`."""
        if self.options.write_sink is None:
            return None
        return [cast(LM2Block, block).memory.write_sink.tolist() for block in self.blocks]

    def figure_settings(self) -> dict[str, Any]:
        """What `lm2_figures` needs of the model to draw a saved trace: the update, the segment, the null logits."""
        sinks = self.write_sinks()
        return {"update": self.options.update, "segment_len": self.cfg.segment_len} | (
            {"write_sink": sinks} if sinks else {}
        )

    def needle_hold(self, tokens, span: tuple[int, int]) -> dict[str, np.ndarray] | None:
        """Per layer, how much of what the span wrote is still in the bank, under the run's own
        gates (`span_in_bank`): at each token, the size of the span's part of the bank the token
        reads (over all slots), over its largest so far: 1 where the write is whole, falling as
        the forget gates wash it out. None with update="token" (not recorded per segment)."""
        ids, a, b = self.needle_ids(tokens, span)
        if not self.options.per_segment:
            return None
        assert self.cfg.segment_len is not None  # check_config: per-segment updates need it
        L, T = self.cfg.n_layers, ids.shape[1]
        held = np.zeros((L, T), dtype=np.float32)
        peak = [0.0] * L
        for start, parts in self.span_in_bank(ids, (a, b)):
            for l, part in enumerate(parts):
                size = float(part.norm())
                peak[l] = max(peak[l], size)
                held[l, start : start + self.cfg.segment_len] = size / peak[l] if peak[l] > 0 else 0.0
        return {f"layer {l}: what is left of the span's write (over its largest)": held[l] for l in range(L)}

    def span_in_bank(
        self, ids: Tensor, span: tuple[int, int], state: ModelState | None = None
    ) -> Iterator[tuple[int, list[Tensor]]]:
        """The span's part of each layer's bank [slots, d] as the input streams a segment at a time
        (update="segment", batch row 0): yields (start, parts) before each segment and after the
        last whole one. Once the gates are known the bank is linear in the writes,
            M_s+1[n] = A_s[n] * M_s[n] + W_s[n],  A_s[n] = b0[n] + sum_t b[n,t] g_forget,t,
                                                   W_s[n] = sum_t b[n,t] g_in,t * tanh(content_t),
        so the span's part follows C <- A_s * C + (the span's terms of W_s), exactly: the parts
        of all tokens plus the initial bank decayed by the A's add up to the bank."""
        a, b = span
        parts = [
            torch.zeros(self.options.slots, self.cfg.d_model, dtype=self.dtype, device=self.device) for _ in self.blocks
        ]
        yield 0, parts
        assert self.cfg.segment_len is not None  # segment_writes needs it
        for start, layers in self.segment_writes(ids, state):
            positions = torch.arange(start, start + self.cfg.segment_len, device=self.device)
            in_span = ((positions >= a) & (positions < b)).to(self.dtype)
            for l, (weights, keep, write) in enumerate(layers):
                parts[l] = keep * parts[l] + weights.T @ (write * in_span[:, None])
            yield start + self.cfg.segment_len, parts

    def segment_writes(
        self, ids: Tensor, state: ModelState | None = None
    ) -> Iterator[tuple[int, list[tuple[Tensor, Tensor, Tensor]]]]:
        """Each complete segment's update of every layer's bank (update="segment", batch row 0),
        streaming the input a segment at a time: yields (start, per layer (b [t, slot], A [slot, d],
        write [t, d])), the bank then being M <- A * M + b^T write (`span_in_bank`'s equation)."""
        seg = self.cfg.segment_len
        assert seg is not None  # check_config: per-segment updates need it
        seen: dict[int, dict[str, Tensor]] = {l: {} for l in range(self.cfg.n_layers)}

        def keep(name: str):
            def hook(value: Tensor, hook) -> None:
                seen[int(hook.name.split(".")[1])][name] = value[0]

            return hook

        hooks = [
            (f"blocks.{l}.memory.hook_{name}", keep(name))
            for l in range(self.cfg.n_layers)
            for name in ("write_score", "forget_gate", "input_gate", "read")
        ]
        handles = [
            block.memory.register_forward_pre_hook(lambda module, args, l=l: seen[l].__setitem__("e", args[0][0]))
            for l, block in enumerate(cast(Iterable[LM2Block], self.blocks))
        ]
        state = state or self.init_state()
        try:
            with torch.no_grad(), self.hooks(fwd_hooks=hooks):
                for start in range(0, ids.shape[1] - seg + 1, seg):
                    _, state = self(ids[:, start : start + seg], state=state, return_state=True)
                    layers = []
                    for l, block in enumerate(cast(Iterable[LM2Block], self.blocks)):
                        x = seen[l]
                        weights, null = block.memory.write_weights(x["write_score"])  # b[t, n], over the tokens
                        content = block.memory.W_write(x["e"]) if self.options.update == "slots" else x["read"]
                        held = torch.einsum("tn,td->nd", weights, x["forget_gate"])
                        layers.append(
                            (
                                weights,
                                held if null is None else held + null[:, None],
                                x["input_gate"] * torch.tanh(content),
                            )
                        )
                    yield start, layers
        finally:
            for handle in handles:
                handle.remove()

    def read_path(self, tokens, position: int) -> ReadPath | None:
        """From E_mem to the logits at `position`: the output gate g_out frozen at the token (E_gated = g_out * E_mem
        joins the residual stream as it is), then the final norm frozen there and W_U. None with
        output_gate="bank", whose output is not the read."""
        if self.options.output_gate != "read":
            return None
        gates = [GATES["output"].format(l=l) for l in range(self.cfg.n_layers)]
        at = captured_at(self, tokens, position, [*gates, last_residual(self)])
        layers = {f"blocks.{l}": torch.diag(at[gate])[None] for l, gate in enumerate(gates)}
        return ReadPath(position, layers, *self.unembedding_at(at[last_residual(self)]))

    def memory_readout(self, tokens, position: int) -> Readout | None:
        """E_mem at `position`, softmax(Q K^T) V over the bank of its segment's start, as a sum
        over the tokens of the segments before: with the run's own gates the bank is linear in the
        writes (`span_in_bank`), so token s of segment m gives
            sum_n attn[n] (prod_{m<m'} A_m'[n] * b_m[n,s] write_s) W_V,
        exact given the read's slot attention, and the identity bank M_0 decayed by every A gives
        the initial term. None with update="token" (the bank is not recorded per segment)."""
        if not self.options.per_segment:
            return None
        full = self.as_tokens(tokens)
        if not 0 <= position < full.shape[1]:
            raise ValueError(f"position must lie in [0, {full.shape[1]}), got {position}")
        seg = self.cfg.segment_len
        assert seg is not None  # check_config: per-segment updates need it
        ids = full[:, : position // seg * seg]
        segments = [layers for _, layers in self.segment_writes(ids)]
        attn = self.capture(
            full[:, : position + 1], [f"blocks.{l}.memory.hook_slot_attn" for l in range(self.cfg.n_layers)]
        )
        parts, initial = {}, {}
        for l, block in enumerate(cast(Iterable[LM2Block], self.blocks)):
            W_V = block.memory.W_V.weight.detach().double()
            slot_attn = attn[f"blocks.{l}.memory.hook_slot_attn"][position]  # [slot]
            decay = torch.ones(self.options.slots, self.cfg.d_model, dtype=torch.float64)  # prod of the later A's
            pieces = []
            for layers in reversed(segments):
                weights, keep, write = (t.double() for t in layers[l])
                pieces.append(torch.einsum("n,tn,nd,td->td", slot_attn, weights, decay, write) @ W_V.T)
                decay = keep * decay
            bank = torch.eye(self.options.slots, self.cfg.d_model, dtype=torch.float64)
            parts[f"blocks.{l}"] = torch.cat(pieces[::-1] or [torch.zeros(0, self.cfg.d_model, dtype=torch.float64)])[
                :, None
            ]
            initial[f"blocks.{l}"] = (slot_attn @ (decay * bank) @ W_V.T)[None]
        return Readout(
            position, "E_mem = softmax(Q K^T / sqrt(d)) V, the bank's read before the output gate", parts, initial
        )

    def upgrade_options(self, cfg) -> dict:
        """Older configs spelled update="slots" as update="segment" with write="slots"."""
        memory = dict(cfg.memory)
        write = memory.pop("write", "read")
        if write not in ("read", "slots"):
            raise ConfigError(
                "lm2 memory option 'write' (an older spelling of update='slots') must be 'read' or 'slots', got "
                f"{write!r}"
            )
        if write == "slots":
            if memory.get("update", "token") != "segment":
                raise ConfigError("lm2 write='slots' needs update='segment'; today both are update='slots'")
            memory["update"] = "slots"
        return memory

    def check_config(self) -> None:
        if self.options.per_segment and self.cfg.segment_len is None:
            raise ConfigError(f"lm2 with update={self.options.update!r} needs config.segment_len")

    def make_block(self, layer: int) -> nn.Module:
        assert self.attention is not None  # default_attention is causal
        return LM2Block(self.cfg, self.options, self.attention)
