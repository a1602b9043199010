"""The hookable, streaming language model that every family builds on.

`MemoryLM` is a `transformer_lens.HookedRootModule`: embeddings, a stack of blocks, a final
RMSNorm and an unembedding. Each block takes the whole chunk `[batch, pos, d_model]` plus its
own carried state and returns the new state, so every HookPoint fires once per forward with a
`[batch, pos, ...]` tensor and `run_with_cache` / `run_with_hooks` behave as TransformerLens
users expect. A family changes what sits inside the block (a memory beside attention, a
memory instead of attention, a memory layer instead of the FFN); blocks handle segment
boundaries themselves, so feeding an input in one call or in chunks gives the same result.
"""

from __future__ import annotations

import copy
import difflib
import math
import numbers
import re
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar, NamedTuple, Protocol, cast

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from memviz import heap
from memviz.config import ConfigError, ModelConfig
from memviz.layers import AttentionSpan, LocalAttention, RMSNorm, SwiGLU
from memviz.options import parse_options
from memviz.state import Part, State, map_tensors, tensors_of
from memviz.tokenizer import ByteTokenizer, Tokenizer

#: the longest prompt `generate` reads, in tokens (a probe's longest prompt too)
MAX_PROMPT_TOKENS = 1 << 22
#: the most tokens `generate` writes after it: one token at a time, the answer of a probe or a look at what follows
MAX_NEW_TOKENS = 1 << 16
#: a long run's progress: called with (done, total), e.g. the prompt's tokens read so far and all of them
Progress = Callable[[int, int], None]


def check_progress(progress: Progress | None) -> None:
    if progress is not None and not callable(progress):
        raise TypeError(f"progress is called with (tokens read, tokens in all), or None; got {progress!r}")


BACKBONE_FIELDS = (
    "vocab_size",
    "d_model",
    "n_layers",
    "n_heads",
    "d_head",
    "d_mlp",
    "rope_base",
    "norm_eps",
    "tie_embeddings",
    "embed_scale",
)  # what a backbone's weights mean


def generic_hook_name(name: str) -> str:
    """blocks.3.attn.hook_q -> blocks.{l}.attn.hook_q (the form `memory_hooks` and the hook table
    use: a layer's index as {l})."""
    return re.sub(r"(^|\.)(blocks|side_blocks)\.\d+\.", r"\1\2.{l}.", name)


def hooked(point: HookPoint) -> bool:
    """Whether a hook is attached to `point` now: a value only hooks read (a trace's statistic) is
    computed only then, so training and plain forwards skip it."""
    return bool(point._forward_hooks)


class HookDoc(NamedTuple):
    """A hook's entry in the hook table (docs/hooks.md, `python -m memviz hooks`). `nan_means_none`: the hook
    writes NaN where an entry is empty (LongMem's score of a chunk not retrieved), so a trace does not read its NaN
    as the model's numbers stopping being finite."""

    shape: str
    what: str
    nan_means_none: bool = False


#: the hooks of every model built from `Block`s (the hook table's shared rows)
BLOCK_HOOK_DOCS: dict[str, HookDoc] = {
    "hook_embed": HookDoc("[batch, pos, d_model]", "token embeddings"),
    "blocks.{l}.hook_resid_pre": HookDoc("[batch, pos, d_model]", "residual stream entering block `l`"),
    "blocks.{l}.hook_attn_out": HookDoc("[batch, pos, d_model]", "output of the block's attention (or memory mixer)"),
    "blocks.{l}.hook_resid_mid": HookDoc("[batch, pos, d_model]", "residual stream after the attention"),
    "blocks.{l}.hook_mlp_out": HookDoc("[batch, pos, d_model]", "output of the FFN"),
    "blocks.{l}.hook_resid_post": HookDoc("[batch, pos, d_model]", "residual stream leaving block `l`"),
    "blocks.{l}.mlp.hook_post": HookDoc("[batch, pos, d_mlp]", "SwiGLU hidden activation `silu(W_gate x) * W_up x`"),
    "blocks.{l}.attn.hook_q": HookDoc("[batch, pos, head, d_head]", "queries, before rotary embedding"),
    "blocks.{l}.attn.hook_k": HookDoc("[batch, pos, head, d_head]", "keys, before rotary embedding"),
    "blocks.{l}.attn.hook_v": HookDoc("[batch, pos, head, d_head]", "values"),
    "blocks.{l}.attn.hook_z": HookDoc("[batch, pos, head, d_head]", "attention output per head, before `W_O`"),
}


def flushing_subnormals() -> bool:
    """Whether this process now treats float32 values below 1.2e-38 as zero (torch has no getter)."""
    return (torch.tensor([1e-39]) * 1.0).item() == 0.0


@contextmanager
def denormals_flushed() -> Iterator[None]:
    """Within the block, float32 values below 1.2e-38 count as zero (x86 FTZ/DAZ); the mode the
    process was in is restored afterwards.

    Memories that decay multiplicatively make such subnormal numbers in bulk: Titans' closed-form
    chunk update forms w[t,i] = prod eta_j, and with a trained sample's rates a third of those
    entries and up to half of some products' outputs are subnormal, where each x86 multiply takes
    a slow microcode path. Flushing moves no value by more than 1.2e-38. Every forward runs in it,
    and a training step with its backward (training/loop.py)."""
    was_flushing = flushing_subnormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was_flushing)


def allocatable_bytes() -> int | None:
    """What this process can still allocate: the machine's available memory, or less under an address-space
    limit (ulimit -v); None where the system does not say."""
    import resource

    limits = []
    try:
        with open("/proc/meminfo") as fh:
            fields = dict(line.split(":", 1) for line in fh)
        limits.append(int(fields["MemAvailable"].split()[0]) * 1024)
    except (OSError, KeyError, ValueError):
        pass
    soft, _ = resource.getrlimit(resource.RLIMIT_AS)
    if soft != resource.RLIM_INFINITY:
        try:
            with open("/proc/self/statm") as fh:
                used = int(fh.read().split()[0]) * resource.getpagesize()
            limits.append(soft - used)
        except (OSError, ValueError):
            pass
    return min(limits) if limits else None


def check_fits_in_memory(cfg: ModelConfig) -> None:
    """Refuse, before any weight is allocated, a config whose backbone's weights alone (in the default dtype) are
    more than this process can still allocate."""
    need = cfg.backbone_parameters * torch.get_default_dtype().itemsize
    have = allocatable_bytes()
    if have is not None and need > have:
        raise ConfigError(
            f"this config's backbone has about {cfg.backbone_parameters:.2e} parameters, "
            f"{need / 2**30:,.1f} GiB of weights, more than the {max(have, 0) / 2**30:,.1f} GiB this "
            "process can still allocate (d_model, n_layers, d_mlp); nothing was allocated"
        )


class NonFiniteError(ValueError):
    """A model's logits stopped being finite numbers (its memory diverged); nothing is decoded from them."""


class ModelBusyError(RuntimeError):
    """A thread asked a model object to run (a forward, a trace, a hooked run) while another thread's run of the
    same object was under way: hooks and train/eval mode belong to the object, so the two would mix."""


_run_owners: weakref.WeakKeyDictionary[nn.Module, list] = weakref.WeakKeyDictionary()  # model -> [thread, what, depth]
_run_owners_lock = threading.Lock()


def model_label(model: nn.Module) -> str:
    """What a message calls a model: by its config's or card's name, else by its family or class."""
    name = getattr(getattr(model, "cfg", None), "name", "") or getattr(model, "card", {}).get("name")
    return f"model {name!r}" if name else f"this {getattr(model, 'family', '') or type(model).__name__} model"


@contextmanager
def running_alone(model: nn.Module, what: str) -> Iterator[None]:
    """Hold `model` for the calling thread for the block; the same thread may enter again (a trace's forwards),
    another thread is refused with ModelBusyError naming the model and what holds it, instead of seeing this
    run's hooks or mode (or this run seeing its)."""
    me = threading.current_thread()
    with _run_owners_lock:
        owner = _run_owners.get(model)
        if owner is not None and owner[0] is not me:
            raise ModelBusyError(
                f"{model_label(model)} is already running {owner[1]} in thread {owner[0].name!r}; one model object "
                f"runs one input at a time (its hooks and train/eval mode are shared), so {what} here was refused: "
                "wait for that run, or give this thread its own copy (memviz.load again, or copy.deepcopy(model))"
            )
        if owner is None:
            owner = _run_owners[model] = [me, what, 0]
        owner[2] += 1
    try:
        yield
    finally:
        with _run_owners_lock:
            owner[2] -= 1
            if owner[2] == 0:
                _run_owners.pop(model, None)


@dataclass
class ModelState:
    """What a model carries from one chunk to the next: the position reached, per layer that
    layer's state (local caches, memory matrices, slot banks, neural-memory weights), and
    `shared`, state that belongs to no one layer (LongMem's bank and its side network's caches).
    Each part is typed (`memviz.state`): its `Memory` fields are what reset and patch replace."""

    pos: int
    layers: list[State] = field(default_factory=list)
    shared: State = None

    def map(self, fn: Callable[[Tensor], Tensor]) -> ModelState:
        """This state with `fn` applied to every tensor it holds (a `StateValue` is kept as it is)."""
        return ModelState(self.pos, map_tensors(fn, self.layers), map_tensors(fn, self.shared))

    def detach(self) -> ModelState:
        return self.map(lambda t: t.detach())

    def clone(self) -> ModelState:
        return self.map(lambda t: t.clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in tensors_of([self.layers, self.shared]))


class Stateful(Protocol):
    """A block or a block's mixer: builds its part of a fresh `ModelState`."""

    def init_state(self, batch: int, device: torch.device, /) -> State: ...


class Block(nn.Module):
    """Pre-norm residual block: x += mixer(norm(x)); x += mlp(norm(x)).

    `attn` is any mixer with `forward(x, state, pos) -> (out, state)` and `init_state`, whose
    state is the block's; `mlp` is a stateless `x -> y` module (SwiGLU, or a memory layer).
    `attn` is None in a block without attention (Titans' LMM), whose own forward mixes.
    """

    def __init__(self, cfg: ModelConfig, attn: nn.Module | None, mlp: nn.Module) -> None:
        super().__init__()
        self.ln1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = attn
        self.ln2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = mlp
        self.hook_resid_pre = HookPoint()  # [batch, pos, d_model]
        self.hook_attn_out = HookPoint()
        self.hook_resid_mid = HookPoint()
        self.hook_mlp_out = HookPoint()
        self.hook_resid_post = HookPoint()

    def init_state(self, batch: int, device: torch.device) -> State:
        return cast(Stateful, self.attn).init_state(batch, device)  # nn.Module types attributes as Tensor | Module

    def forward(self, x: Tensor, state: State, pos: int) -> tuple[Tensor, State]:
        x = self.hook_resid_pre(x)
        assert self.attn is not None  # a block without attention has its own forward
        a, state = self.attn(self.ln1(x), state, pos)
        x = self.hook_resid_mid(x + self.hook_attn_out(a))
        x = self.hook_resid_post(x + self.hook_mlp_out(self.mlp(self.ln2(x))))
        return x, state


@dataclass
class NoOptions:
    """The baselines take no memory options."""


class MemoryLM(HookedRootModule):
    """Base language model, the full-causal transformer as it stands; a family subclasses it
    and registers (`memviz.registry.register_family`).

    One model object runs one input at a time: its hooks and train/eval mode are shared by every
    thread, so a thread that enters a forward, a trace or a hooked run while another thread's is
    under way gets ModelBusyError (`running_alone`); threads that run at once each load their own."""

    family = ""  # set by memviz.registry.register_family
    #: a model without memory (what a memory family can start from, `warm_start`)
    is_baseline = False
    Options: type = NoOptions
    #: generic hook names (layer index as {l}) that `memviz.trace` records by default, each
    #: with the reduction applied over its trailing axis while tracing ('none', 'mean', 'norm')
    memory_hooks: dict[str, str] = {}
    #: every hook the family's default model has (generic names), each with its shape and meaning: the hook
    #: table is made from these, and the tests check them against the model's `hook_dict`
    hook_docs: ClassVar[dict[str, HookDoc]] = BLOCK_HOOK_DOCS
    #: weights (regular expressions over state_dict names) that an option adds: a warm start from a
    #: checkpoint of the same family without them keeps their fresh init (`warm_start`)
    option_weights: ClassVar[tuple[str, ...]] = ()
    #: the types of a fresh state's layers (`check_state`), made at the first forward
    _state_types: list[type] | None = None

    def __init__(self, cfg: ModelConfig, tokenizer: Tokenizer | None = None, card: dict | None = None) -> None:
        super().__init__()
        self.cfg = cfg = copy.deepcopy(cfg)  # completed below (options, attention); the caller's stays as given
        cfg.memory = self.upgrade_options(cfg)
        self.options = parse_options(self.Options, self.family, cfg.memory)
        spec = cfg.attention if cfg.attention is not None else self.default_attention()
        #: what a token's local attention sees (None for a model without attention)
        self.attention = None if spec is None else AttentionSpan.parse(spec)
        cfg.attention = self.attention.to_dict() if self.attention is not None else None
        self.check_config()
        if tokenizer is None and cfg.vocab_size == ByteTokenizer().vocab_size:
            tokenizer = ByteTokenizer()
        if tokenizer is not None and tokenizer.vocab_size != cfg.vocab_size:
            raise ConfigError(f"tokenizer has {tokenizer.vocab_size} ids but config.vocab_size is {cfg.vocab_size}")
        self._tokenizer = tokenizer
        self.card = dict(card or {})
        check_fits_in_memory(cfg)
        self.build_embeddings()
        self.build()
        self.reset_parameters()
        self.setup()

    # ----- construction, overridden by families -------------------------------------------
    def upgrade_options(self, cfg: ModelConfig) -> dict:
        """The config's `memory` options, with what an older config spelled otherwise rewritten
        (a family that renamed an option overrides this, so old checkpoints keep loading)."""
        return cfg.memory

    def default_attention(self) -> dict | None:
        """The attention a config that names none gets (`memviz.layers.AttentionSpan`)."""
        return {"kind": "causal"}

    def check_config(self) -> None:
        """Raise ConfigError for settings the family cannot build."""

    def build_embeddings(self) -> None:
        """The token embedding, the final norm and the unembedding (`run`). A family that wraps a
        whole outside language model (an adapter) has its own and overrides this with nothing."""
        cfg = self.cfg
        self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.hook_embed = HookPoint()  # [batch, pos, d_model]
        self.ln_final = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.unembed = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.unembed.weight = self.embed.weight

    def build(self) -> None:
        self.blocks = nn.ModuleList(self.make_block(layer) for layer in range(self.cfg.n_layers))

    def make_block(self, layer: int) -> nn.Module:
        cfg = self.cfg
        assert self.attention is not None  # default_attention is causal
        return Block(cfg, LocalAttention(cfg, self.attention), SwiGLU(cfg.d_model, cfg.d_mlp))

    def reset_parameters(self) -> None:
        """Weights N(0, std^2), output projections' std scaled by 1/sqrt(2 n_layers) (GPT-2).

        init "gpt2": std 0.02 everywhere, embeddings included (the GPT-2 value for d_model 768).
        init "fan_in": std 1/sqrt(fan_in) for linear maps and 1/sqrt(d_model) for the embedding;
        with embed_scale sqrt(d_model) the token embedding then dominates the residual stream at
        initialisation, which small models need to learn to bind facts (see README, qa1).
        """
        out_scale = 1 / math.sqrt(2 * self.cfg.n_layers)
        for name, module in self.named_modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                std = 0.02 if self.cfg.init == "gpt2" else module.weight.shape[1] ** -0.5  # [out, in] or [vocab, d]
                if name.endswith(("W_O", "W_down", "W_mem_out", "W_2")):
                    std *= out_scale
                nn.init.normal_(module.weight, std=std)
                bias = getattr(module, "bias", None)
                if bias is not None:
                    nn.init.zeros_(bias)
        for module in self.modules():
            reset = getattr(module, "reset_memory_parameters", None)
            if module is not self and reset is not None:
                reset()

    @property
    def tokenizer(self) -> Tokenizer:
        if self._tokenizer is None:
            raise ValueError("this model was built without a tokenizer; it runs on token ids only")
        return self._tokenizer

    # ----- running ------------------------------------------------------------------------
    @property
    def device(self) -> torch.device:
        return next(self.parameters()).device

    @property
    def chunk_len(self) -> int:
        """Default streaming chunk: about 1k tokens, a whole number of segments."""
        seg = self.cfg.segment_len
        return max(1, 1024 // seg) * seg if seg else 1024

    @property
    def dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def init_state(self, batch_size: int = 1) -> ModelState:
        """A fresh state in the model's dtype (blocks build theirs in the default dtype), so that
        `model.to(torch.float64)` or `.to(torch.bfloat16)` runs every family."""
        states = [cast(Stateful, block).init_state(batch_size, self.device) for block in self.blocks]
        return ModelState(0, self.in_model_dtype(states))

    def in_model_dtype(self, state: Part) -> Part:
        """`state` with its floating-point tensors cast to the model's dtype."""
        return map_tensors(lambda t: t.to(self.dtype) if t.is_floating_point() else t, state)

    def as_tokens(self, tokens: str | Tensor | Sequence[int] | Sequence[Sequence[int]]) -> Tensor:
        """Token ids as a [batch, pos] tensor on the model's device; a string goes through the
        model's tokenizer (so `model("text")`, `run_with_cache("text")` and `run_with_hooks("text")`
        work as in TransformerLens)."""
        if isinstance(tokens, str):
            tokens = self.tokenizer.encode(tokens)
        if isinstance(tokens, (bytes, bytearray)):
            raise TypeError("a model takes a str or token ids, not bytes: decode the text first")
        if not isinstance(tokens, Tensor):
            tokens = torch.as_tensor(tokens, dtype=torch.long)
        if tokens.dim() == 1:
            tokens = tokens[None]
        if tokens.dim() != 2 or tokens.dtype not in (torch.int64, torch.int32):
            raise ValueError(
                f"tokens must be integer ids shaped [batch, pos], got {tuple(tokens.shape)} {tokens.dtype}"
            )
        if tokens.shape[1] == 0:
            raise ValueError("empty input: at least one token is needed")
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= self.cfg.vocab_size:
            raise ValueError(f"token ids must lie in [0, {self.cfg.vocab_size}), got range [{lo}, {hi}]")
        return tokens.long().to(self.device)

    def forward(
        self,
        tokens: str | Tensor | Sequence[int],
        state: ModelState | None = None,
        return_type: str = "logits",
        return_state: bool = False,
    ):
        """Run a chunk. `return_type` is 'logits', 'loss' (mean next-token NLL within the chunk),
        'both', or 'residual' (the final normalised residual stream, the unembedding's input: for a
        loss that applies the unembedding itself); with `return_state` the new ModelState is returned last."""
        tokens = self.as_tokens(tokens)
        if state is None:
            state = self.init_state(tokens.shape[0])
        self.check_state(state)
        if return_type == "residual" and not self.unembeds_last:
            raise ValueError(f"{type(self).__name__} makes its logits its own way: it has no 'residual' return")
        run = self.run_residual if return_type == "residual" else self.run
        with running_alone(self, "a forward"), denormals_flushed():
            out, layer_states, shared = run(tokens, state)
        outputs: list[Any] = []
        if return_type in ("logits", "both", "residual"):
            outputs.append(out)
        if return_type in ("loss", "both"):
            outputs.append(next_token_loss(out, tokens, self._tokenizer.pad_id if self._tokenizer else -100))
        if not outputs:
            raise ValueError(f"return_type must be 'logits', 'loss', 'both' or 'residual', got {return_type!r}")
        if return_state:
            outputs.append(ModelState(state.pos + tokens.shape[1], layer_states, shared))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    def check_state(self, state: object) -> None:
        """Refuse, by what is wrong, a state that this model's `init_state` or `return_state` did not make."""
        if not isinstance(state, ModelState):
            raise TypeError(
                f"state must be a ModelState from this model (init_state, or return_state=True), got "
                f"{type(state).__name__}"
            )
        if self._state_types is None:  # the types of a fresh state's layers, made once
            self._state_types = [type(layer) for layer in self.init_state(1).layers]
        theirs, ours = [type(layer) for layer in state.layers], self._state_types
        if theirs != ours:
            raise ValueError(
                f"state holds {len(theirs)} layer state(s) of {sorted({t.__name__ for t in theirs})}; this "
                f"{self.family} model's has {len(ours)} of {sorted({t.__name__ for t in ours})}: it comes from "
                "another model"
            )

    @property
    def unembeds_last(self) -> bool:
        """Whether the logits are `unembed(ln_final(blocks' output))`, as `run` makes them (a family that
        overrides `run` makes them its own way)."""
        return type(self).run is MemoryLM.run

    def run(self, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], State]:
        """A chunk's logits, each layer's new state and the new shared state."""
        x, layer_states, shared = self.run_residual(tokens, state)
        return self.unembed(x), layer_states, shared

    def run_residual(self, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], State]:
        """`run` but for the unembedding: the final normalised residual stream [batch, pos, d_model]."""
        x, layer_states, shared = self.run_blocks(self.embedded(tokens), tokens, state)
        return self.ln_final(x), layer_states, shared

    def embedded(self, tokens: Tensor) -> Tensor:
        """The residual stream's input: scaled token embeddings (hook_embed)."""
        return self.hook_embed(self.embed(tokens) * self.cfg.embed_scale)

    def run_blocks(self, x: Tensor, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], State]:
        """The blocks over a chunk: (output, each layer's new state, the new shared state)."""
        new_states = []
        for block, layer_state in zip(self.blocks, state.layers):
            x, layer_state = block(x, layer_state, state.pos)
            new_states.append(layer_state)
        return x, new_states, state.shared

    def stream(
        self, tokens: Sequence[int] | Tensor, chunk_len: int | None = None, state: ModelState | None = None
    ) -> Iterator[tuple[int, Tensor, ModelState]]:
        """Feed a long input chunk by chunk, carrying the state: yields (start, logits, state)."""
        tokens = self.as_tokens(tokens)
        chunk_len = self.chunk_len if chunk_len is None else chunk_len
        if not isinstance(chunk_len, numbers.Integral) or isinstance(chunk_len, bool) or chunk_len <= 0:
            raise ValueError(
                f"chunk_len must be a positive number of tokens (or None: the model's {self.chunk_len}), "
                f"got {chunk_len!r}"
            )
        chunk_len = int(chunk_len)
        state = state or self.init_state(tokens.shape[0])
        for start in range(0, tokens.shape[1], chunk_len):
            logits, state = self(tokens[:, start : start + chunk_len], state=state, return_state=True)
            state = state.detach()
            heap.release_between(start, start + chunk_len)
            yield start, logits, state
            del logits  # so that the next chunk's forward does not hold this chunk's [chunk, vocab] logits

    @torch.no_grad()
    def prefill(
        self, tokens: Sequence[int] | Tensor, state: ModelState | None = None, progress: Progress | None = None
    ) -> tuple[Tensor, ModelState]:
        """Read a prompt for what follows it: the last position's logits [batch, 1, vocab] and the
        state after the prompt, as `stream` gives them. A family may skip work that cannot reach
        them (LongMem's side network far from the end). `progress(done, total)` after each chunk, in tokens."""
        tokens = self.as_tokens(tokens)
        if tokens.shape[1] == 0:
            raise ValueError("empty prompt: at least one token is needed")
        check_progress(progress)
        logits = None
        for start, chunk_logits, chunk_state in self.stream(tokens, state=state):
            logits, state = chunk_logits, chunk_state
            if progress is not None:
                progress(start + logits.shape[1], tokens.shape[1])
        assert logits is not None and state is not None  # the prompt is not empty: stream yields
        return logits[:, -1:], state

    @torch.no_grad()
    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 16,
        state: ModelState | None = None,
        progress: Progress | None = None,
    ) -> list[int]:
        """Greedy decoding after streaming the prompt (`progress` as `prefill` reports it); stops at eos.
        Special ids other than eos are never produced."""
        if (
            not isinstance(max_new_tokens, int)
            or isinstance(max_new_tokens, bool)
            or not 0 <= max_new_tokens <= MAX_NEW_TOKENS
        ):
            raise ValueError(
                f"max_new_tokens must be a whole number from 0 to {MAX_NEW_TOKENS:,}, got {max_new_tokens!r}"
            )
        logits, state = self.prefill(prompt_ids, state, progress)
        banned = [self.tokenizer.pad_id, self.tokenizer.bos_id]
        out: list[int] = []
        for step in range(max_new_tokens):
            last = logits[0, -1].clone()
            if not torch.isfinite(last).all():  # argmax of NaN logits is an arbitrary token, never an answer
                where = "the prompt's last token" if step == 0 else f"generated token {step}"
                raise NonFiniteError(
                    f"the logits at {where} (position {state.pos - 1}) are not finite: the model's "
                    "state diverged on this input (memviz.trace shows where its quantities stop being finite)"
                )
            last[banned] = -math.inf
            nxt = int(last.argmax())
            if nxt == self.tokenizer.eos_id:
                break
            out.append(nxt)
            logits, state = self(torch.tensor([[nxt]], device=self.device), state=state, return_state=True)
        return out

    def generate(self, prompt: str, max_new_tokens: int = 16, progress: Progress | None = None) -> str:
        """Greedy continuation of `prompt`, streaming over long prompts in bounded memory; a prompt of more than
        MAX_PROMPT_TOKENS is refused before it is tokenized whole. `progress(done, total)`: the prompt's tokens
        read, after each chunk."""
        ids = self.tokenizer.encode_within(prompt, MAX_PROMPT_TOKENS, "prompt", "prompt limit")
        if not ids:
            raise ValueError("empty prompt: at least one token is needed")
        with self.evaluating():
            return self.tokenizer.decode(self.generate_ids(ids, max_new_tokens, progress=progress))

    @contextmanager
    def evaluating(self) -> Iterator[None]:
        """Eval mode for the block, then the mode the model was in (training or not); the model is this
        thread's for the block (`running_alone`)."""
        with running_alone(self, "an evaluation"):
            was_training = self.training
            self.eval()
            try:
                yield
            finally:
                self.train(was_training)

    @contextmanager
    def hooks(self, fwd_hooks=(), bwd_hooks=(), reset_hooks_end: bool = True, clear_contexts: bool = False):
        """TransformerLens' temporary hooks (so `run_with_hooks` and `run_with_cache` too), with the model this
        thread's while they are on: another thread's run would otherwise pass through them. A hook named that
        this model does not have is a KeyError naming it (TransformerLens would say only the name)."""
        fwd_hooks, bwd_hooks = list(fwd_hooks), list(bwd_hooks)  # read once: a generator would be empty after
        self.check_hook_names([name for name, _ in [*fwd_hooks, *bwd_hooks] if isinstance(name, str)])
        with (
            running_alone(self, "a hooked run"),
            super().hooks(fwd_hooks, bwd_hooks, reset_hooks_end, clear_contexts) as model,
        ):
            yield model

    def run_with_cache(self, *args, names_filter=None, **kwargs):
        """TransformerLens' `run_with_cache`; a `names_filter` naming hooks this model does not have is a KeyError
        naming them, not an empty cache."""
        if isinstance(names_filter, str | list | tuple):
            self.check_hook_names([names_filter] if isinstance(names_filter, str) else names_filter)
        return super().run_with_cache(*args, names_filter=names_filter, **kwargs)

    def value_tables(self) -> list[nn.Parameter]:
        """Tables read a few rows at a time, so each row is trained only when selected (memory
        layers' values); `optim.memory_value_lr` trains them at their own lr without decay."""
        return []

    def warm_start(self, base: MemoryLM) -> None:
        """Start from a trained model `base` (a training config's `init_from`): the same family
        with weights of the same names and shapes (a second training stage, which may change
        options that hold no weights, e.g. a window or a memory's update rule, or that add the
        `option_weights`, which keep their fresh init), or a baseline
        of the same shape, whose attention and MLP weights become this model's backbone while
        the memory keeps its fresh init (the continual pre-training of Munkhdalai et al. 2024,
        §4); LongMem overrides this. Raises ConfigError saying how the two differ."""
        if base.is_baseline and not self.is_baseline:
            self._load_baseline_backbone(base)
        else:
            ours, theirs = self.state_dict(), base.state_dict()
            added = {k for k in ours.keys() - theirs.keys() if any(re.fullmatch(p, k) for p in self.option_weights)}
            same_names = ours.keys() - added == theirs.keys()
            same_weights = same_names and all(ours[k].shape == theirs[k].shape for k in theirs)
            same_kind = base.family == self.family or (base.is_baseline and self.is_baseline)  # a window is no weight
            if not same_kind or not same_weights:
                base_cfg = base.cfg.to_dict()
                differ = sorted(k for k, v in self.cfg.to_dict().items() if k != "name" and v != base_cfg.get(k))
                raise ConfigError(
                    f"init_from needs a {self.family} checkpoint with weights of the same shapes; "
                    f"it is a {base.family} model differing in {differ or 'family'}"
                )
            self.load_state_dict(theirs, strict=not added)
        self._tokenizer = base.tokenizer

    def _load_baseline_backbone(self, base: MemoryLM) -> None:
        mismatch = [f for f in BACKBONE_FIELDS if getattr(base.cfg, f) != getattr(self.cfg, f)]
        ours = self.state_dict()
        theirs = {k: v for k, v in base.state_dict().items() if not self.replaces_baseline_weight(k)}
        missing = [k for k, v in theirs.items() if k not in ours or ours[k].shape != v.shape]
        if mismatch or missing:
            raise ConfigError(
                f"a {self.family} model can start from a {base.family} baseline only with "
                f"the same shape; they differ in {mismatch or missing[:5]}"
            )
        self.load_state_dict(theirs, strict=False)

    def replaces_baseline_weight(self, name: str) -> bool:
        """Whether a baseline's weight `name` has no counterpart here because the memory takes
        its place (a memory layer in place of an FFN); such weights are left out of a warm start."""
        return False

    # ----- introspection ------------------------------------------------------------------
    def needle_hold(self, tokens: Tensor | Sequence[int], span: tuple[int, int]) -> dict[str, Any] | None:
        """How much of what the tokens `span` = [start, end) wrote the memory still holds, at
        every token of `tokens`: {label: array [pos] in [0, 1]}, streaming the input once.
        None for a family that does not define it (the baselines have no memory to hold it)."""
        return None

    def needle_ids(self, tokens: Tensor | Sequence[int], span: tuple[int, int]) -> tuple[Tensor, int, int]:
        """What `needle_hold` takes, checked: the ids [1, pos] and the span's start and stop, whole positions with
        0 <= start < stop <= pos (ValueError naming the span otherwise)."""
        ids = self.as_tokens(tokens)
        pair = (
            span.tolist()
            if isinstance(span, (Tensor, np.ndarray))
            else list(span)
            if isinstance(span, (list, tuple))
            else []
        )
        whole = all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in pair)
        if len(pair) != 2 or not whole or not 0 <= int(pair[0]) < int(pair[1]) <= ids.shape[1]:
            raise ValueError(
                f"span {str(span)[:60]} is not [start, stop) of token positions, start < stop, inside the "
                f"input's {ids.shape[1]:,} tokens"
            )
        return ids, int(pair[0]), int(pair[1])

    def memory_readout(self, tokens: Tensor | Sequence[int], position: int) -> Readout | None:
        """What the memory returned at token `position` of `tokens` and which written tokens it
        came from: per layer, each token's exact part of the read (the parts sum to it). None for a
        family without a linear memory to decompose."""
        return None

    def check_hook_names(self, names: Iterable[str]) -> None:
        """KeyError naming the hook names this model does not have, and the nearest names it has."""
        unknown = [n for n in names if n not in self.hook_dict]
        if unknown:
            near = difflib.get_close_matches(str(unknown[0]), list(self.hook_dict), n=3)
            hint = f"; the nearest are {near}" if near else ""
            raise KeyError(
                f"unknown hook names {unknown[:5]}{hint}; model.hook_dict lists this model's "
                f"{len(self.hook_dict)} (docs/hooks.md)"
            )

    def capture(self, tokens: Tensor | Sequence[int], names: Sequence[str]) -> dict[str, Tensor]:
        """The hooks `names` over the whole input (batch 1), streamed, as [pos, ...] float64 tensors."""
        self.check_hook_names(names)
        parts: dict[str, list[Tensor]] = {name: [] for name in names}

        def keep(value: Tensor, hook) -> None:
            parts[hook.name].append(value[0].detach().double().cpu())

        with self.evaluating(), torch.no_grad(), self.hooks(fwd_hooks=[(name, keep) for name in names]):
            for _ in self.stream(tokens):
                pass
        return {name: torch.cat(values) for name, values in parts.items()}

    def default_trace_reducers(self) -> dict[str, str]:
        """The family's memory hooks, expanded over layers: what `memviz.trace` keeps by default."""
        return {
            name: self.memory_hooks[generic_hook_name(name)]
            for name in self.hook_dict
            if generic_hook_name(name) in self.memory_hooks
        }

    @classmethod
    def nan_means_none(cls, names: Iterable[str]) -> list[str]:
        """Of these hook names, those whose NaN entries mark an empty entry (`HookDoc.nan_means_none`)."""
        docs = cls.hook_docs
        return sorted(n for n in names if (doc := docs.get(generic_hook_name(n))) is not None and doc.nan_means_none)

    def step_bytes(self, batch: int, length: int) -> int:
        """About the bytes a training step over `batch` x `length` tokens takes: what autograd saves for the
        backward, read from this model's own graph (the family's memory among it) at three short lengths and
        fitted as a + b L + c L^2 per sequence (c is causal attention's quadratic part: its masks and any scores
        kept), twice over for the gradients the backward makes of them, and the local attention's position mask
        (int64 differences and booleans, queries x keys) built one layer at a time."""
        # whole segments, so a segment's memory update is in each; a segment longer than the step is measured at
        # the step's length (a share of a segment: the fit can only overestimate)
        unit = max(64, min(self.cfg.segment_len or 0, length))
        short, middle, long = (self.saved_bytes(n * unit) for n in (4, 8, 16))
        slope_low, slope_high = (middle - short) / (4 * unit), (long - middle) / (8 * unit)
        quadratic = max(0.0, (slope_high - slope_low) / (12 * unit))  # slopes at 6 and 12 units, per token
        linear = slope_low - quadratic * 12 * unit
        saved = batch * (linear * length + quadratic * length**2)
        mask = 0
        if self.attention is not None:
            span = self.attention.span
            keys = length if span is None or length <= 2 * span else 2 * span  # LocalAttention's query blocks
            mask = length * keys * 9
        return int(2 * saved + mask)

    def saved_bytes(self, length: int) -> int:
        """The bytes autograd keeps for the backward of the next-token loss of one sequence of `length` tokens:
        counted as they are saved, or, in a model whose forward runs torch.func transforms (which refuse
        saved-tensor hooks), read from the finished graph's nodes."""
        storages: dict[int, int] = {}

        def count(saved: Any) -> Any:
            if isinstance(saved, Tensor):
                storages[saved.untyped_storage().data_ptr()] = saved.untyped_storage().nbytes()
            elif isinstance(saved, tuple | list):
                for item in saved:
                    count(item)
            return saved

        tokens = torch.zeros(1, length, dtype=torch.long, device=self.device)
        with torch.enable_grad():
            try:
                with torch.autograd.graph.saved_tensors_hooks(count, lambda saved: saved):
                    self(tokens, return_type="loss")  # the graph is freed on return
            except RuntimeError as exc:
                if "saved tensor hooks" not in str(exc):
                    raise
                storages.clear()
                nodes, seen = [self(tokens, return_type="loss").grad_fn], set()
                while nodes:
                    node = nodes.pop()
                    if node is None or node in seen:
                        continue
                    seen.add(node)
                    for name in dir(node):
                        if name.startswith("_saved_") or name == "saved_tensors":
                            count(getattr(node, name))
                    nodes.extend(following for following, _ in node.next_functions)
        return sum(storages.values())

    def num_parameters(self, trainable_only: bool = False) -> int:
        seen, total = set(), 0
        for p in self.parameters():
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            total += p.numel()
        return total


@dataclass
class Readout:
    """A memory read at `position` decomposed over the tokens that wrote it
    (`MemoryLM.memory_readout`): per layer (`blocks.{l}`), `parts` [source position, head, d]
    and, for a memory that holds something before any token writes (Titans' learned initial
    weights, LM2's identity bank), `initial` [head, d], what that start still gives the read.
    The parts and the initial term sum to the read."""

    position: int
    what: str  # what the read is, in the family's terms
    parts: dict[str, Tensor]
    initial: dict[str, Tensor] = field(default_factory=dict)

    @property
    def reads(self) -> dict[str, Tensor]:
        """Per layer, the read itself [head, d]: the sum of its parts and the initial term."""
        return {layer: parts.sum(0) + self.initial.get(layer, 0) for layer, parts in self.parts.items()}

    def shares(self, layer: str) -> Tensor:
        """Each written token's part projected on its head's read, over |read|^2: [source, head]
        (negative where a token's part points away); with `initial_share` they sum to 1 over
        sources for a non-zero read."""
        return self.project(layer, self.parts[layer])

    def initial_share(self, layer: str) -> Tensor:
        """The initial term's share of each head's read [head] (0 without one)."""
        initial = self.initial.get(layer)
        return (
            self.project(layer, initial[None])[0]
            if initial is not None
            else torch.zeros(self.parts[layer].shape[1], dtype=torch.float64)
        )

    def project(self, layer: str, parts: Tensor) -> Tensor:
        read = self.reads[layer]
        return (parts * read).sum(-1) / read.pow(2).sum(-1).clamp_min(1e-300)


def next_token_loss(logits: Tensor, tokens: Tensor, pad_id: int) -> Tensor:
    """Mean cross-entropy of predicting tokens[t+1] from position t, padding excluded."""
    if tokens.shape[1] < 2:
        return logits.new_zeros(())
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), ignore_index=pad_id)
