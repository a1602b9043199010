"""titans-pytorch's `MemoryAsContextTransformer` (0.5.x) as memviz family `titans_pytorch`.

The peer's model runs as it is (its weights under `peer.`); memviz adds HookPoints that carry,
for each layer with a `NeuralMemory` (`blocks.{l}.memory.`, l counted from 0), what the peer
computes while storing (Behrouz et al., arXiv 2501.00663, eqs. 9-14, as titans-pytorch writes them):

  hook_loss      [batch, pos, head]  ||M_0(k_t) - v_t||^2 / d, the memory's loss (eq. 12) against
                                     the weights it starts the pass with (the peer takes every
                                     chunk's gradient at those weights, TTT's minibatch form)
  hook_theta     [batch, pos, head]  the step size theta_t (sigmoid(x_t w) * max_lr)
  hook_eta       [batch, pos, head]  the momentum's decay eta (sigmoid, one per chunk, eq. 10)
  hook_alpha     [batch, pos, head]  the forgetting gate alpha (sigmoid, one per chunk, eq. 13)
  hook_surprise  [batch, pos, head]  the chunk's momentary surprise ||sum_t theta_t grad l_t(M_0)||,
                                     the update before momentum and decay (one per chunk)
  hook_retrieved [batch, pos, d_model]  M*(q_t), what the memory returns to the residual stream

Positions are tokens: the peer's long-term memory tokens (appended to every segment) are left
out. Tokens of an unfinished last chunk are not stored yet; their store quantities are NaN. The
peer has no cache for chunks of many tokens (its cache decodes one token at a time), so the
adapter's state is the input so far and each chunk reruns the peer on it: a streamed run equals
one pass, at quadratic cost; inputs are capped at `max_len` tokens. The peer's state cannot be
edited at a segment, so no reset / patch intervention is offered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import torch
from torch import Tensor, nn
from transformer_lens.hook_points import HookPoint

from memviz import ConfigError, MemoryLM, register_family
from memviz.config import ModelConfig
from memviz.models.titans import LOSS, RATES, SURPRISE, titans_figures
from memviz.options import check_positive
from memviz.protocol import HookDoc, ModelState

from . import PeerError, require

RETRIEVED = "blocks.{l}.memory.hook_retrieved"
STORE_HOOKS = ("loss", "theta", "eta", "alpha", "surprise")


@dataclass
class MACOptions:
    """`MemoryAsContextTransformer`'s keyword arguments other than those the config holds
    (num_tokens = vocab_size, dim = d_model, depth = n_layers, heads = n_heads,
    dim_head = d_head, segment_len = segment_len); the peer's names and defaults."""

    neural_memory_segment_len: int | None = None
    neural_mem_gate_attn_output: bool = False
    neural_memory_add_value_residual: bool = False
    num_longterm_mem_tokens: int = 0
    num_persist_mem_tokens: int = 0
    neural_memory_batch_size: int | None = None
    neural_memory_qkv_receives_diff_views: bool = False
    ff_mult: int = 4
    num_residual_streams: int = 4
    neural_memory_kwargs: dict[str, Any] = field(default_factory=dict)
    neural_memory_layers: list[int] | None = None  # 1-based, as the peer counts
    sliding_window_attn: bool = False
    neural_mem_weight_residual: bool = False
    max_len: int = 8192  # the longest input the adapter runs (each chunk reruns the input so far)

    def __post_init__(self) -> None:
        check_positive(ff_mult=self.ff_mult, num_residual_streams=self.num_residual_streams, max_len=self.max_len)


class MemoryHooks(nn.Module):
    """The HookPoints of one peer `NeuralMemory` (module docstring)."""

    def __init__(self) -> None:
        super().__init__()
        for name in (*STORE_HOOKS, "retrieved"):
            setattr(self, f"hook_{name}", HookPoint())


class LayerHooks(nn.Module):
    """`blocks.{l}`: the memory's hooks where the peer's layer l has a `NeuralMemory`."""

    def __init__(self, has_memory: bool) -> None:
        super().__init__()
        if has_memory:
            self.memory = MemoryHooks()


def token_positions(n_tokens: int, segment_len: int, n_longterm: int) -> Tensor:
    """Where each token sits in the peer's sequence, which appends `n_longterm` memory tokens to
    every full segment of `segment_len` tokens."""
    i = torch.arange(n_tokens)
    return i + (i // segment_len) * n_longterm


class StoreRecorder:
    """What one `NeuralMemory` computes while storing, recorded by wrapping its `store_memories`
    and its per-chunk gradient function and by forward hooks on its gate projections."""

    def __init__(self, memory: nn.Module) -> None:
        self.memory = memory
        self.per_token: dict[str, list[Tensor]] = {"loss": [], "theta": []}
        self.per_chunk: dict[str, list[Tensor]] = {"eta": [], "alpha": [], "surprise": []}
        self.retrieved: Tensor | None = None

    @contextlib.contextmanager
    def attached(self) -> Iterator[StoreRecorder]:
        mem = self.memory
        store, grad_fn, forward = mem.store_memories, mem.per_sample_grad_fn, mem.forward

        def recording_store(*args, **kwargs):
            out = store(*args, **kwargs)
            loss, lr = out[2]  # [batch, head, tokens stored]
            self.per_token["loss"].append(loss.detach())
            self.per_token["theta"].append(lr.detach())
            return out

        def recording_grad(*args):
            grads, loss = grad_fn(*args)
            squares = sum(g.detach().flatten(1).pow(2).sum(1) for g in grads.values())  # [(batch head chunk)]
            self.per_chunk["surprise"].append(squares.sqrt())
            return grads, loss

        def gate(name: str, first_order: bool):
            def hook(module, inputs, output):
                value = torch.sigmoid(output.detach())
                self.per_chunk[name].append((value[0] if first_order else value).flatten())  # [(batch head chunk)]

            return hook

        def recording_forward(*args, **kwargs):  # the transformer calls mem.forward, which module hooks miss
            out = forward(*args, **kwargs)
            self.retrieved = out[0].detach()
            return out

        handles = [mem.to_decay_factor.register_forward_hook(gate("alpha", False))]
        if mem.to_momentum is not None:
            handles.append(mem.to_momentum.register_forward_hook(gate("eta", True)))
        mem.store_memories, mem.per_sample_grad_fn, mem.forward = recording_store, recording_grad, recording_forward
        try:
            yield self
        finally:
            del mem.store_memories, mem.forward  # the class's methods again
            mem.per_sample_grad_fn = grad_fn
            for handle in handles:
                handle.remove()

    def arrays(self, batch: int, length: int) -> dict[str, Tensor]:
        """Each quantity as [batch, peer position, head] over `length` positions (NaN where the
        peer stored nothing yet); chunk quantities repeated over their chunk's tokens."""
        heads, chunk = self.memory.heads, self.memory.store_chunk_size
        out = {}
        for name, parts in {**self.per_token, **self.per_chunk}.items():
            if not parts:  # a memory without momentum has no eta
                continue
            if name in self.per_token:
                values = torch.cat(parts, -1)  # [batch, head, stored]
            else:
                values = torch.cat([p.reshape(batch, heads, -1) for p in parts], -1).repeat_interleave(chunk, -1)
            full = values.new_full((batch, heads, length), float("nan"))
            n = min(length, values.shape[-1])
            full[..., :n] = values[..., :n]
            out[name] = full.transpose(1, 2)
        return out


@register_family(
    "titans_pytorch",
    summary="titans-pytorch 0.5's MemoryAsContextTransformer (an adapter): its neural "
    "memories' loss, surprise and eta / theta / alpha under memviz's Titans hook names",
    figures=titans_figures,
    interventions={},
    quick={
        "segment_len": 32,
        "memory": {
            "num_longterm_mem_tokens": 4,
            "num_residual_streams": 1,
            "neural_memory_kwargs": {"heads": 2, "dim_head": 32},
        },
    },
    tiny={
        "segment_len": 8,
        "memory": {
            "num_longterm_mem_tokens": 2,
            "num_persist_mem_tokens": 2,
            "num_residual_streams": 1,
            "neural_memory_kwargs": {"heads": 2, "dim_head": 16},
        },
    },
)
class TitansPytorchLM(MemoryLM):
    """A titans-pytorch `MemoryAsContextTransformer` run as a memviz model (module docstring)."""

    Options = MACOptions
    memory_hooks = {SURPRISE: "none", LOSS: "none", **{name: "none" for name in RATES.values()}}
    hook_docs = {
        LOSS: HookDoc(
            "[batch, pos, head]",
            "the peer memory's loss `||M_0(k_t) - v_t||^2 / d` at the weights it starts the pass with (NaN in an "
            "unfinished last chunk)",
        ),
        RATES["theta"]: HookDoc("[batch, pos, head]", "the peer's step size `theta_t`"),
        RATES["eta"]: HookDoc("[batch, pos, head]", "the peer's momentum decay (one value a chunk)"),
        RATES["alpha"]: HookDoc("[batch, pos, head]", "the peer's forgetting gate (one value a chunk)"),
        SURPRISE: HookDoc(
            "[batch, pos, head]", "the chunk's momentary surprise `||sum_t theta_t grad l_t||` (one value a chunk)"
        ),
        RETRIEVED: HookDoc("[batch, pos, d_model]", "what the peer's memory returns to the residual stream"),
    }

    def default_attention(self) -> dict | None:
        return {"kind": "segment", "span": self.cfg.segment_len} if self.cfg.segment_len else None

    def check_config(self) -> None:
        if not self.cfg.segment_len:
            raise ConfigError("titans_pytorch needs config.segment_len (the peer's segment_len)")
        layers = self.options.neural_memory_layers
        if layers is not None and any(not 1 <= i <= self.cfg.n_layers for i in layers):
            raise ConfigError(
                f"titans_pytorch neural_memory_layers {layers} must lie in 1..{self.cfg.n_layers} (the peer counts "
                "from 1)"
            )

    def peer_kwargs(self) -> dict[str, Any]:
        cfg, options = self.cfg, asdict(self.options)
        options.pop("max_len")
        if options["neural_memory_layers"] is not None:
            options["neural_memory_layers"] = tuple(options["neural_memory_layers"])
        return dict(
            num_tokens=cfg.vocab_size,
            dim=cfg.d_model,
            depth=cfg.n_layers,
            heads=cfg.n_heads,
            dim_head=cfg.d_head,
            segment_len=cfg.segment_len,
            **options,
        )

    def build_embeddings(self) -> None:
        """The peer has its own embedding and unembedding."""

    def build(self) -> None:
        titans = require("titans-pytorch", "titans_pytorch")
        try:
            self.peer = titans.MemoryAsContextTransformer(**self.peer_kwargs())
        except (AssertionError, TypeError, ValueError) as exc:
            raise ConfigError(f"titans-pytorch refused these settings: {exc or type(exc).__name__}") from exc
        own_storage(self.peer)
        self.memories = [layer[4] for layer in self.peer.layers]
        for mem in self.memories:  # the template the per-head memory_model_parameters were repeated from;
            if mem is not None:  # the peer's forward never reads it, so it is frozen, not decayed
                mem.memory_model.requires_grad_(False)
        self.memory_layers = [i for i, mem in enumerate(self.memories) if mem is not None]
        self.blocks = nn.ModuleList(LayerHooks(mem is not None) for mem in self.memories)

    def reset_parameters(self) -> None:
        """The peer initialises itself."""

    def init_state(self, batch_size: int = 1) -> ModelState:
        tokens = torch.zeros(batch_size, 0, dtype=torch.long, device=self.device)
        return ModelState(0, [{"tokens": tokens}], owner=self.state_owner)

    @property
    def chunk_len(self) -> int:
        return self.options.max_len

    @property
    def measured_tokens(self) -> int:
        """What `cost` streams to measure the state: the `max_len` tokens the peer runs at most, whose ids the
        state keeps (it reruns the input so far for each chunk)."""
        return self.options.max_len

    def run(self, tokens: Tensor, state: ModelState):
        seen = torch.cat([state.layers[0]["tokens"], tokens], 1)
        if seen.shape[1] > self.options.max_len:
            raise ValueError(
                f"the titans_pytorch adapter runs at most {self.options.max_len} tokens (memory option "
                f"max_len; the peer reruns the input so far for each chunk), got {seen.shape[1]}"
            )
        recorders = [StoreRecorder(self.memories[layer]) for layer in self.memory_layers]
        with contextlib.ExitStack() as stack:
            for recorder in recorders:
                stack.enter_context(recorder.attached())
            logits = self.peer(seen)
        n, batch = tokens.shape[1], tokens.shape[0]
        positions = token_positions(seen.shape[1], self.cfg.segment_len, self.options.num_longterm_mem_tokens)[-n:]
        length = int(positions[-1]) + 1
        for layer, recorder in zip(self.memory_layers, recorders):
            hooks = self.blocks[layer].memory
            for name, values in recorder.arrays(batch, length).items():
                getattr(hooks, f"hook_{name}")(values[:, positions])
            hooks.hook_retrieved(recorder.retrieved[:, positions])
        return logits[:, -n:], [{"tokens": seen}], None


def own_storage(module: nn.Module) -> None:
    """Give every parameter that is a broadcast view (a stride of 0: the peer repeats a
    NeuralMemory's initial weights over heads with einops' `repeat`) storage of its own, same values,
    so that `load_state_dict` and optimisers can write it."""
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None and 0 in param.stride() and param.numel() > 1:
                sub._parameters[name] = nn.Parameter(param.detach().clone(), requires_grad=param.requires_grad)


def adapt_mac(module: nn.Module | dict[str, Tensor], tokenizer=None, **kwargs: Any) -> TitansPytorchLM:
    """A memviz model of a titans-pytorch `MemoryAsContextTransformer`, given as the module or
    its state dict, with the keyword arguments it was built with (`num_tokens`, `dim`, `depth`,
    `segment_len`, ...; the peer does not keep them, and a checkpoint needs them to rebuild it).
    The weights are copied; a mismatch names the parameters that differ. `tokenizer`: a
    `memviz.tokenizer.Tokenizer` of num_tokens ids (memviz's byte tokenizer for 259)."""
    titans = require("titans-pytorch", "titans_pytorch")
    if isinstance(module, nn.Module):
        if not isinstance(module, titans.MemoryAsContextTransformer):
            raise PeerError(
                f"adapt_mac takes a titans_pytorch.MemoryAsContextTransformer or its state dict, "
                f"not a {type(module).__module__}.{type(module).__name__}"
            )
        weights = module.state_dict()
    elif isinstance(module, dict):
        weights = module
    else:
        raise PeerError(f"adapt_mac takes a MemoryAsContextTransformer or its state dict, not {type(module).__name__}")
    given = dict(kwargs)
    missing = [k for k in ("num_tokens", "dim", "depth", "segment_len") if k not in given]
    if missing:
        raise PeerError(f"adapt_mac needs the keyword arguments the model was built with; missing {missing}")
    known = set(MACOptions.__dataclass_fields__) - {"max_len"} | {
        "num_tokens",
        "dim",
        "depth",
        "segment_len",
        "heads",
        "dim_head",
    }
    unknown = sorted(set(given) - known)
    if unknown:
        raise PeerError(
            f"adapt_mac does not know the arguments {unknown} (a module argument such as "
            f"neural_memory_model cannot be saved in a checkpoint); it knows {sorted(known)}"
        )
    dim, heads = given.pop("dim"), given.pop("heads", 8)
    cfg = ModelConfig(
        family="titans_pytorch",
        vocab_size=given.pop("num_tokens"),
        d_model=dim,
        n_layers=given.pop("depth"),
        n_heads=heads,
        d_head=given.pop("dim_head", 64),
        segment_len=given.pop("segment_len"),
        memory=given,
    )
    model = TitansPytorchLM(cfg, tokenizer=tokenizer)
    load_peer_weights(model.peer, weights, "MemoryAsContextTransformer built with these arguments")
    return model.eval()


def load_peer_weights(peer: nn.Module, weights: dict[str, Tensor], what: str) -> None:
    """Copy `weights` into `peer`, or raise PeerError naming the parameters that do not fit."""
    ours = peer.state_dict()
    missing = sorted(set(ours) - set(weights))
    unexpected = sorted(set(weights) - set(ours))
    shapes = sorted(k for k in set(ours) & set(weights) if ours[k].shape != weights[k].shape)
    if missing or unexpected or shapes:
        raise PeerError(
            f"the weights do not fit a {what}: missing {missing[:5]}, unexpected {unexpected[:5]}, "
            f"other shapes {shapes[:5]}"
        )
    peer.load_state_dict(weights)
