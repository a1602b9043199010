"""What every model in memviz runs on: `StreamingLM`, the `memviz.protocol.MemoryModel` contract kept for any
torch model that builds its state (`init_state`) and runs a chunk from it (`run`).

It turns text into ids, runs a chunk under the model's own thread (`memviz.threads.running_alone`) with
subnormals flushed, streams a long input chunk by chunk carrying the state, prefills and decodes greedily, and
gives TransformerLens' hooks with their names checked. memviz's own transformer (`memviz.model.MemoryLM`) and the
released models' adapter (`memviz.models.released.ReleasedLM`) both subclass it.
"""

from __future__ import annotations

import abc
import difflib
import math
import numbers
import re
import warnings
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from transformer_lens import HookedRootModule
from transformer_lens.hook_points import HookPoint

from memviz import heap
from memviz.card import TrainedFacts, trained_facts
from memviz.protocol import HookDoc, ModelDescription, ModelState, Progress, Tokens
from memviz.state import Part, State, map_tensors, misfit, spec_of, tensors_of
from memviz.threads import running_alone
from memviz.tokenizer import Tokenizer

#: the longest prompt `generate` reads, in tokens (a probe's longest prompt too)
MAX_PROMPT_TOKENS = 1 << 22
#: an input longer than this is announced with what it will hold before it runs (`LongRunWarning`)
ANNOUNCED_TOKENS = 100_000


class LongRunWarning(UserWarning):
    """A run over a long input, announced with the memory it will hold before it starts."""


def announce_cost(
    model, n_tokens: int, what: str, parts: Iterable[str] = ("kv_cache", "memory_state", "trace")
) -> None:
    """Warn, before a run over more than ANNOUNCED_TOKENS tokens starts, what it holds beyond the weights
    (`model.cost`'s `parts`): the library's form of the app's cost line."""
    if n_tokens <= ANNOUNCED_TOKENS:
        return
    cost = {k: v for k, v in model.cost(n_tokens).items() if k in parts}
    each = ", ".join(f"{k.replace('_', ' ')} {v / 2**20:,.1f} MiB" for k, v in cost.items())
    warnings.warn(
        f"{what} {n_tokens:,} tokens: about {sum(cost.values()) / 2**20:,.1f} MiB beyond the weights ({each}); "
        "progress= follows it",
        LongRunWarning,
        stacklevel=3,
    )


#: the most tokens `generate` writes after it: one token at a time, the answer of a probe or a look at what follows
MAX_NEW_TOKENS = 1 << 16


def check_progress(progress: Progress | None) -> None:
    if progress is not None and not callable(progress):
        raise TypeError(f"progress is called with (tokens read, tokens in all), or None; got {progress!r}")


def generic_hook_name(name: str) -> str:
    """blocks.3.attn.hook_q -> blocks.{l}.attn.hook_q (the form `memory_hooks` and the hook table
    use: a layer's index as {l})."""
    return re.sub(r"(^|\.)(blocks|side_blocks)\.\d+\.", r"\1\2.{l}.", name)


def hooked(point: HookPoint) -> bool:
    """Whether a hook is attached to `point` now: a value only hooks read (a trace's statistic) is
    computed only then, so training and plain forwards skip it."""
    return bool(point._forward_hooks)


def flushing_subnormals() -> bool:
    """Whether this process now treats float32 values below 1.2e-38 as zero (torch has no getter)."""
    return (torch.tensor([1e-39]) * 1.0).item() == 0.0


@contextmanager
def denormals_flushed() -> Iterator[None]:
    """Within the block, float32 values below 1.2e-38 count as zero (x86 FTZ/DAZ); the mode the
    process was in is restored afterwards.

    Memories that decay multiplicatively make such subnormal numbers in bulk (Titans' closed-form
    chunk update forms w[t,i] = prod eta_j), and each x86 multiply of one takes a slow microcode
    path (benchmarks/RESULTS.md). Flushing moves no value by more than 1.2e-38. Every forward runs
    in it, and a training step with its backward (training/loop.py)."""
    was_flushing = flushing_subnormals()
    torch.set_flush_denormal(True)
    try:
        yield
    finally:
        torch.set_flush_denormal(was_flushing)


class NonFiniteError(ValueError):
    """A model's logits stopped being finite numbers (its memory diverged); nothing is decoded from them."""


class StreamingLM(HookedRootModule, metaclass=abc.ABCMeta):
    """The `MemoryModel` contract over `init_state` and `run`, which a subclass gives (module docstring); a
    subclass calls `setup()` last in its `__init__`, as TransformerLens asks.

    One model object runs one input at a time: its hooks and train/eval mode are shared by every
    thread, so a thread that enters a forward, a trace or a hooked run while another thread's is
    under way gets ModelBusyError (`memviz.threads.running_alone`); threads that run at once each load their own."""

    family = ""  # set by memviz.registry.register_family
    #: generic hook names (layer index as {l}) that `memviz.trace` records by default, each
    #: with the reduction applied over its trailing axis while tracing ('none', 'mean', 'norm')
    memory_hooks: ClassVar[dict[str, str]] = {}
    #: every hook the family's default model has (generic names), each with its shape and meaning: the hook
    #: table is made from these, and the tests check them against the model's `hook_dict`
    hook_docs: ClassVar[dict[str, HookDoc]] = {}
    #: a fresh state's layout and sizes by (batch, dtype, device), without its numbers (`check_state`)
    _state_specs: dict[tuple[int, torch.dtype, torch.device], tuple[Any, Any]] | None = None

    def __init__(self, cfg: ModelDescription, tokenizer: Tokenizer | None, card: dict[str, Any] | None) -> None:
        super().__init__()
        self.cfg = cfg
        self._tokenizer = tokenizer
        self.card: dict[str, Any] = dict(card or {})

    # ----- what a subclass gives ----------------------------------------------------------
    @abc.abstractmethod
    def init_state(self, batch_size: int = 1) -> ModelState:
        """A fresh state for `batch_size` sequences."""

    @abc.abstractmethod
    def run(self, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], State]:
        """A chunk's logits, each layer's new state and the new shared state."""

    def run_residual(self, tokens: Tensor, state: ModelState) -> tuple[Tensor, list[State], State]:
        """`run` but for the unembedding: the final normalised residual stream [batch, pos, d_model], for a
        model whose logits are its unembedding of it (`unembeds_last`)."""
        raise ValueError(f"{type(self).__name__} makes its logits its own way: it has no 'residual' return")

    @property
    def unembeds_last(self) -> bool:
        """Whether the logits are an unembedding of `run_residual`'s output."""
        return False

    @property
    def attention_span(self) -> int | None:
        """Tokens a token's attention sees at most; None: every earlier token (a subclass with local attention
        says)."""
        return None

    @property
    def segment(self) -> int | None:
        """Tokens between two of the boundaries where reset and patch act (the config's segment)."""
        return self.cfg.segment_len

    @abc.abstractmethod
    def cost(self, n_tokens: int) -> dict[str, int]:
        """Bytes a run over `n_tokens` holds beyond the weights, by part (the state carried between chunks, at
        its largest over `n_tokens`, and what a default trace keeps)."""

    @property
    def facts(self) -> TrainedFacts | None:
        """The knowledge base the model was trained on, as its card says (`memviz.card`); None if none."""
        folder = self.card.get("path")  # memviz.load notes the checkpoint's folder; a model built in memory has none
        return trained_facts(self.card, f"{folder}/card.json" if folder else "the model's card.json")

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

    def in_model_dtype(self, state: Part) -> Part:
        """`state` with its floating-point tensors cast to the model's dtype."""
        return map_tensors(lambda t: t.to(self.dtype) if t.is_floating_point() else t, state)

    def as_tokens(self, tokens: Tokens) -> Tensor:
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
        tokens: Tokens,
        state: ModelState | None = None,
        return_type: str = "logits",
        return_state: bool = False,
    ) -> Any:
        """Run a chunk. `return_type` is 'logits', 'loss' (mean next-token NLL within the chunk),
        'both', or 'residual' (the final normalised residual stream, the unembedding's input: for a
        loss that applies the unembedding itself); with `return_state` the new ModelState is returned last."""
        tokens = self.as_tokens(tokens)
        if state is None:
            state = self.init_state(tokens.shape[0])
        self.check_state(state, tokens.shape[0])
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
            outputs.append(ModelState(state.pos + tokens.shape[1], layer_states, shared, self.state_owner))
        return outputs[0] if len(outputs) == 1 else tuple(outputs)

    @property
    def state_owner(self) -> str:
        """Whose the states this model makes are (`ModelState.owner`): its family and, for a released model, its
        model_type. A state carries over between models of one architecture and size (a fine-tuned copy's)."""
        model_type = getattr(self.cfg, "model_type", None)
        return f"{self.family} ({model_type})" if model_type else self.family

    def check_state(self, state: object, batch: int = 1) -> None:
        """Refuse, naming what does not fit, a state this model's `init_state` or `return_state` could not have
        made for `batch` sequences: another architecture's, another layout or size, dtype, device or batch, or a
        negative position."""
        if not isinstance(state, ModelState):
            raise TypeError(
                f"state must be a ModelState from this model (init_state, or return_state=True), got "
                f"{type(state).__name__}"
            )
        if isinstance(state.pos, bool) or not isinstance(state.pos, numbers.Integral) or state.pos < 0:
            raise ValueError(f"state.pos must be a whole number of tokens, 0 or more; got {state.pos!r}")
        if state.owner and self.family and state.owner != self.state_owner:
            raise ValueError(
                f"the state was made by a model of {state.owner}, and this model is of {self.state_owner}: a state "
                "carries over only between models of one architecture"
            )
        layout = self.state_misfit(state, batch, sizes=False)
        if layout:
            raise ValueError(
                f"the state does not fit this {self.state_owner} model: {layout}; it comes from another model"
            )
        wrong = self.state_misfit(state, batch)
        if wrong is None:
            return
        held = next(iter(tensors_of(state.layers)), None)
        if held is not None and held.dim() and held.shape[0] != batch and not self.state_misfit(state, held.shape[0]):
            raise ValueError(f"the state holds {held.shape[0]} sequence(s); the input has {batch}")
        raise ValueError(f"the state does not fit this {self.state_owner} model: {wrong}")

    def state_spec(self, batch: int) -> tuple[Any, Any]:
        """What a state of this model for `batch` sequences holds, without its numbers (`memviz.state.spec_of` of
        `init_state`'s layers and shared part); a family whose fresh state leaves a part None that a run fills
        says what it will hold (`memviz.state.NoneOr`)."""
        fresh = self.init_state(batch)
        return spec_of(fresh.layers), spec_of(fresh.shared)

    def state_misfit(self, state: ModelState, batch: int, sizes: bool = True) -> str | None:
        """Where `state` differs from this model's fresh state for `batch` sequences (`memviz.state.misfit`)."""
        if self._state_specs is None:
            self._state_specs = {}
        key = (batch, self.dtype, self.device)
        if key not in self._state_specs:
            self._state_specs[key] = self.state_spec(batch)
        layers, shared = self._state_specs[key]
        return misfit(state.layers, layers, "state.layers", sizes) or misfit(
            state.shared, shared, "state.shared", sizes
        )

    def stream(
        self, tokens: Tokens, chunk_len: int | None = None, state: ModelState | None = None
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
        self, tokens: Tokens, state: ModelState | None = None, progress: Progress | None = None
    ) -> tuple[Tensor, ModelState]:
        """Read a prompt for what follows it: the last position's logits [batch, 1, vocab] and the
        state after the prompt, as `stream` gives them. A family may skip work that cannot reach
        them (LongMem's side network far from the end). `progress(done, total)` after each chunk, in tokens."""
        tokens = self.as_tokens(tokens)
        if tokens.shape[1] == 0:
            raise ValueError("empty prompt: at least one token is needed")
        check_progress(progress)
        announce_cost(self, tokens.shape[1], "reading a prompt of", ("kv_cache", "memory_state"))
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

    def needle_ids(self, tokens: Tokens, span: tuple[int, int]) -> tuple[Tensor, int, int]:
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

    def capture(self, tokens: Tokens, names: Sequence[str]) -> dict[str, Tensor]:
        """The hooks `names` over the whole input (batch 1), streamed, as [pos, ...] float64 tensors."""
        self.check_hook_names(names)
        parts: dict[str, list[Tensor]] = {name: [] for name in names}

        def keep(value: Tensor, hook) -> None:
            parts[hook.name].append(value[0].detach().double().cpu())

        with self.evaluating(), torch.no_grad(), self.hooks(fwd_hooks=[(name, keep) for name in names]):
            for _ in self.stream(tokens):
                pass
        return {name: torch.cat(values) for name, values in parts.items()}

    def trace_floats_per_token(self) -> int:
        """The numbers a default trace keeps per token: each default hook's per-token size after its reducer (a
        'mean' or 'norm' drops the trailing axis), read from a one-token forward once."""
        if "_trace_floats" in self.__dict__:
            return self.__dict__["_trace_floats"]
        reducers, sizes = self.default_trace_reducers(), {}

        def size(value: Tensor, hook: HookPoint) -> None:
            per_token, name = value[0, 0], str(hook.name)
            reduced = reducers[name] != "none" and per_token.dim() > 0
            sizes[name] = per_token.numel() // (per_token.shape[-1] if reduced else 1)

        with self.evaluating(), torch.no_grad(), self.hooks(fwd_hooks=[(name, size) for name in reducers]):
            self(torch.zeros(1, 1, dtype=torch.long, device=self.device))
        self.__dict__["_trace_floats"] = sum(sizes.values())
        return self.__dict__["_trace_floats"]

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

    def num_parameters(self, trainable_only: bool = False) -> int:
        seen, total = set(), 0
        for p in self.parameters():
            if id(p) in seen or (trainable_only and not p.requires_grad):
                continue
            seen.add(id(p))
            total += p.numel()
        return total


def next_token_loss(logits: Tensor, tokens: Tensor, pad_id: int) -> Tensor:
    """Mean cross-entropy of predicting tokens[t+1] from position t, padding excluded."""
    if tokens.shape[1] < 2:
        return logits.new_zeros(())
    return F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), tokens[:, 1:].reshape(-1), ignore_index=pad_id)
