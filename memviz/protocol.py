"""The contract every model in memviz keeps: what load, trace, figures, interventions, probes, training and the
app may ask of a model, and the types it answers in.

`MemoryModel` is what every model offers: its description, tokenizer and card, a typed state, a forward over a
chunk, streaming, prefill and greedy generation, TransformerLens' hooks. memviz's own transformer
(`memviz.model.MemoryLM`) and the released models' adapter (`memviz.models.released.ReleasedLM`) both keep it
through `memviz.running.StreamingLM`. What only some families can do is declared once, on the family
(`memviz.registry.Family`), and asked of the registry, which hands the model back typed with the capability
(`ReadsOut`, `HoldsNeedle`).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch
from torch import Tensor
from transformer_lens.hook_points import HookPoint

from memviz.card import TrainedFacts
from memviz.state import State, map_tensors, tensors_of
from memviz.tokenizer import Tokenizer

#: a long run's progress: called with (done, total), e.g. the prompt's tokens read so far and all of them
Progress = Callable[[int, int], None]
#: token ids as a model takes them: text (through its tokenizer), a [batch, pos] or [pos] tensor, or a list
Tokens = str | Tensor | Sequence[int] | Sequence[Sequence[int]]


class HookDoc(NamedTuple):
    """A hook's entry in the hook table (docs/hooks.md, `python -m memviz hooks`). `nan_means_none`: the hook
    writes NaN where an entry is empty (LongMem's score of a chunk not retrieved), so a trace does not read its NaN
    as the model's numbers stopping being finite."""

    shape: str
    what: str
    nan_means_none: bool = False


@dataclass
class ModelState:
    """What a model carries from one chunk to the next: the position reached, per layer that
    layer's state (local caches, memory matrices, slot banks, neural-memory weights), and
    `shared`, state that belongs to no one layer (LongMem's bank and its side network's caches).
    Each part is typed (`memviz.state`): its `Memory` fields are what reset and patch replace. `owner` says
    whose it is, as the model that made it names itself (`StreamingLM.state_owner`: its family and architecture;
    "" for a state built by hand): a model refuses a state another architecture made, and one that does not fit
    its own (`StreamingLM.check_state`)."""

    pos: int
    layers: list[State] = field(default_factory=list)
    shared: State = None
    owner: str = ""

    def map(self, fn: Callable[[Tensor], Tensor]) -> ModelState:
        """This state with `fn` applied to every tensor it holds (a `StateValue` is kept as it is)."""
        return ModelState(self.pos, map_tensors(fn, self.layers), map_tensors(fn, self.shared), self.owner)

    def __str__(self) -> str:
        tensors = list(tensors_of([self.layers, self.shared]))
        dtypes = sorted({str(t.dtype).removeprefix("torch.") for t in tensors if t.is_floating_point()})
        return (
            f"ModelState of {self.owner or 'an unnamed model'} at position {self.pos:,}: {len(self.layers)} layers, "
            f"{', '.join(dtypes) or 'no floats'}, {self.nbytes():,} bytes"
        )

    def detach(self) -> ModelState:
        return self.map(lambda t: t.detach())

    def clone(self) -> ModelState:
        return self.map(lambda t: t.clone())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in tensors_of([self.layers, self.shared]))


@dataclass
class Readout:
    """A memory read at `position` decomposed over the tokens that wrote it
    (`ReadsOut.memory_readout`): per layer (`blocks.{l}`), `parts` [source position, head, d]
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


#: rows of the unembedding a read path widens to float64 at once
UNEMBED_BLOCK = 8192


@dataclass
class ReadPath:
    """How the memory reads at token `position` reach its logits, each step frozen at that token as TransformerLens
    freezes a norm's scale for direct logit attribution, so that the path is linear and a read's parts add up:
    `layers[blocks.{l}]` [head, d_read, d_model] maps a read [head, d_read] (in `Readout`'s terms) to what the layer
    adds to the residual stream (its read norm's scale and gates, its mix, its output projection); `final_scale`
    [d_model] is the final norm's scale at the token (its weight over the residual's RMS); `unembed` [vocab,
    d_model], in the model's dtype (a released model's can be GBs). On the CPU; the rest float64, and so are the
    logits."""

    position: int
    layers: dict[str, Tensor]
    final_scale: Tensor
    unembed: Tensor

    def residual(self, layer: str, reads: Tensor) -> Tensor:
        """What reads [n, head, d_read] at `layer` add to the residual stream: [n, d_model]."""
        if layer not in self.layers:
            raise KeyError(f"no read path for {layer!r}; the memory layers are {list(self.layers)}")
        path = self.layers[layer]
        if reads.shape[1:] != path.shape[:2]:
            raise ValueError(
                f"reads at {layer} are [n, head, d_read] = [n, {path.shape[0]}, {path.shape[1]}], "
                f"got {list(reads.shape)}"
            )
        return torch.einsum("nhd,hdm->nm", reads.double(), path)

    def logits(self, layer: str, reads: Tensor) -> Tensor:
        """The logits reads [n, head, d_read] at `layer` give alone, through the frozen path: [n, vocab]."""
        return self.unembedded(self.residual(layer, reads))

    def unembedded(self, residual: Tensor, rows: Tensor | None = None) -> Tensor:
        """Residual-stream vectors [n, d_model] through the frozen final norm and the unembedding (its `rows` only,
        or all of it), in float64 a block of the vocabulary at a time: [n, vocab or rows]."""
        x = residual.double() * self.final_scale
        W = self.unembed if rows is None else self.unembed[rows]
        return torch.cat([x @ block.double().T for block in W.split(UNEMBED_BLOCK)], dim=1)

    def centre(self) -> Tensor:
        """The unembedding's mean row [d_model] (float64): a logit minus the vocabulary's mean logit is what
        (row - centre) gives."""
        return self.unembed.sum(0, dtype=torch.float64) / self.unembed.shape[0]


class ModelDescription(Protocol):
    """What every model's `cfg` says (memviz's `ModelConfig`, a released model's `ReleasedConfig`)."""

    @property
    def name(self) -> str: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def d_model(self) -> int: ...
    @property
    def n_layers(self) -> int: ...
    @property
    def segment_len(self) -> int | None: ...

    def to_dict(self) -> dict[str, Any]: ...
    def to_json(self) -> str: ...


class MemoryModel(Protocol):
    """What every model offers (module docstring). Tokens are text, a list of ids or a [batch, pos] tensor;
    hooks are laid out [batch, pos, ...] under the names of `hook_dict` (docs/hooks.md)."""

    @property
    def family(self) -> str: ...
    @property
    def cfg(self) -> ModelDescription: ...
    @property
    def card(self) -> dict[str, Any]: ...
    @property
    def facts(self) -> TrainedFacts | None:
        """The knowledge base the model was trained on (its card's `facts`, `memviz.card`), or None."""
        ...

    @property
    def tokenizer(self) -> Tokenizer: ...
    @property
    def hook_dict(self) -> dict[str, HookPoint]: ...
    @property
    def memory_hooks(self) -> Mapping[str, str]:
        """Generic hook names (a layer's index as {l}) a trace keeps by default, each with its reducer."""
        ...

    @property
    def device(self) -> torch.device: ...
    @property
    def dtype(self) -> torch.dtype: ...
    @property
    def chunk_len(self) -> int:
        """Tokens a streamed run feeds at once."""
        ...

    @property
    def attention_span(self) -> int | None:
        """Tokens a token's local attention sees at most (a window or a segment); None where it sees every earlier
        token."""
        ...

    @property
    def segment(self) -> int | None:
        """Tokens between two of the boundaries where reset and patch act (`memviz.interventions`); None for a
        model without segments."""
        ...

    # ----- state and running
    def init_state(self, batch_size: int = 1) -> ModelState: ...
    def as_tokens(self, tokens: Tokens) -> Tensor: ...
    def __call__(
        self, tokens: Tokens, state: ModelState | None = None, return_type: str = "logits", return_state: bool = False
    ) -> Any:
        """A chunk's logits (or loss), with the new state last when `return_state`."""
        ...

    def stream(
        self, tokens: Tokens, chunk_len: int | None = None, state: ModelState | None = None
    ) -> Iterator[tuple[int, Tensor, ModelState]]: ...
    def prefill(
        self, tokens: Tokens, state: ModelState | None = None, progress: Progress | None = None
    ) -> tuple[Tensor, ModelState]: ...
    def generate(self, prompt: str, max_new_tokens: int = 16, progress: Progress | None = None) -> str: ...
    def generate_ids(
        self,
        prompt_ids: Sequence[int],
        max_new_tokens: int = 16,
        state: ModelState | None = None,
        progress: Progress | None = None,
    ) -> list[int]: ...
    def evaluating(self) -> AbstractContextManager[None]:
        """Eval mode, and the model this thread's, for the block."""
        ...

    def cost(self, n_tokens: int) -> dict[str, int]:
        """Bytes a run over `n_tokens` holds beyond the weights, by part."""
        ...

    # ----- hooks
    def hooks(
        self,
        fwd_hooks: Iterable[Any] = (),
        bwd_hooks: Iterable[Any] = (),
        reset_hooks_end: bool = True,
        clear_contexts: bool = False,
    ) -> AbstractContextManager[Any]: ...
    def run_with_cache(self, *args: Any, **kwargs: Any) -> Any: ...
    def run_with_hooks(self, *args: Any, **kwargs: Any) -> Any: ...
    def check_hook_names(self, names: Iterable[str]) -> None: ...
    def capture(self, tokens: Tokens, names: Sequence[str]) -> dict[str, Tensor]: ...
    def default_trace_reducers(self) -> dict[str, str]: ...
    def nan_means_none(self, names: Iterable[str]) -> list[str]: ...

    # ----- torch
    def num_parameters(self, trainable_only: bool = False) -> int: ...
    def named_parameters(self) -> Iterator[tuple[str, torch.nn.Parameter]]: ...
    def state_dict(self) -> dict[str, Any]: ...


class ReadsOut(MemoryModel, Protocol):
    """A model whose family declares `readout`: a memory read decomposed exactly over the tokens that wrote it."""

    def memory_readout(self, tokens: Tokens, position: int) -> Readout | None:
        """The read at token `position` of `tokens` as a sum over writes; None for a setting without such a read
        (Titans' MLP memory)."""
        ...


class ReadsThrough(MemoryModel, Protocol):
    """A model whose family declares `read_lens`: the path from its memory's reads to its logits at a token."""

    def read_path(self, tokens: Tokens, position: int) -> ReadPath | None:
        """The frozen path (`ReadPath`) at token `position` of `tokens`; None for a setting whose read does not reach
        the residual stream linearly (an output gate on the bank, not the read)."""
        ...


class FillsPrefix(MemoryModel, Protocol):
    """A model whose family declares `prefix_capacity`: a memory its frozen weights write, which training may fill
    with filler no trained weight touched (`data.prefix_tokens`)."""

    def backbone_prefill(self, tokens: Tensor) -> ModelState:
        """The state after `tokens` as the frozen backbone leaves it."""
        ...


class HoldsNeedle(MemoryModel, Protocol):
    """A model whose family declares `needle_hold`: how much of a span's writes its memory still holds."""

    def needle_hold(self, tokens: Tokens, span: tuple[int, int]) -> dict[str, np.ndarray] | None:
        """{label: array [pos] in [0, 1]} at every token, streaming the input once; None for a setting without
        a memory the span writes."""
        ...
