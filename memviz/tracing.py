"""Tracing: run a long input through a model, keeping chosen hooks as numpy arrays over the whole input.

`trace(model, text)` feeds the input chunk by chunk, carrying the model's memory state, and
records each requested hook from every chunk, so memory use grows with what is kept (a few
numbers per token) and never with the activations of the whole input. Every trace also
keeps `loss`: the per-token negative log-likelihood of the next token.

Large per-token vectors (LM2 gates, Infini per-head outputs) can be reduced while tracing
(`"mean"` or `"norm"` over their trailing axis); families name sensible reductions for their
default hooks.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import numpy as np
import torch
import torch.nn.functional as F

from memviz.protocol import MemoryModel, Progress
from memviz.registry import get_family
from memviz.running import announce_cost
from memviz.trace import Trace, bad_rows

REDUCERS = ("none", "mean", "norm")
MAX_TRACE_TOKENS = 4_000_000
#: a text longer than this many characters a token is refused before it is tokenized (no
#: tokenizer here makes tokens longer than a few dozen characters)
MAX_CHARS_PER_TOKEN = 64


class Rows:
    """Arrays joined along their first axis as they come, into one buffer that doubles when full: thousands of
    small kept pieces would sit between a stream's freed activations and hold their pages (`memviz.heap`).
    `capacity` is a first guess at the rows in all."""

    def __init__(self, capacity: int) -> None:
        self.capacity, self.count = capacity, 0
        self.buffer: np.ndarray | None = None

    def append(self, piece: np.ndarray) -> None:
        buffer = self.buffer
        if buffer is None:
            buffer = np.empty((max(self.capacity, len(piece)), *piece.shape[1:]), piece.dtype)
        if piece.shape[1:] != buffer.shape[1:]:
            raise ValueError(f"a kept piece of shape {piece.shape} does not join rows of {buffer.shape[1:]}")
        if piece.dtype != buffer.dtype:  # as np.concatenate promotes (an int64 piece after int32 ones)
            buffer = buffer.astype(np.result_type(buffer.dtype, piece.dtype))
        if self.count + len(piece) > len(buffer):
            grown = np.empty((max(2 * len(buffer), self.count + len(piece)), *buffer.shape[1:]), buffer.dtype)
            grown[: self.count] = buffer[: self.count]
            buffer = grown
        buffer[self.count : self.count + len(piece)] = piece
        self.buffer, self.count = buffer, self.count + len(piece)

    def joined(self) -> np.ndarray:
        if self.buffer is None:
            raise ValueError("nothing was kept")
        return self.buffer[: self.count]


def reduce_tensor(t: torch.Tensor, how: str) -> torch.Tensor:
    if how == "mean":
        return t.float().mean(-1)
    if how == "norm":
        return t.float().norm(dim=-1)
    return t


def to_numpy(t: torch.Tensor) -> np.ndarray:
    t = t.detach().cpu()
    if t.is_floating_point():
        return t.float().numpy()
    if t.dtype == torch.bool:
        return t.numpy()
    return t.to(torch.int64).numpy().astype(np.int32 if t.abs().max() < 2**31 else np.int64)


def finite_rows(logits: torch.Tensor) -> torch.Tensor:
    """Whether each row of [positions, vocab] is all finite. A row's sum is finite exactly when its
    entries are, unless finite entries overflow it; only then is each entry checked (an entry-wise
    isfinite over a large vocabulary is many times slower than a sum)."""
    finite = torch.isfinite(logits.sum(-1))
    if not finite.all():
        finite = torch.isfinite(logits).all(-1)
    return finite


def next_token_losses(logits: torch.Tensor, targets: torch.Tensor, rows: int = 16) -> torch.Tensor:
    """-log softmax(logits)[target] per position ([positions, vocab], [positions]) in float32, a few rows
    at a time so that no [positions, vocab] copy is made."""
    losses = [
        -F.log_softmax(part.float(), dim=-1).gather(1, want[:, None])[:, 0]
        for part, want in zip(logits.split(rows), targets.split(rows))
    ]
    return torch.cat(losses) if losses else logits.new_zeros(0, dtype=torch.float32)


def non_finite_summary(
    arrays: Mapping[str, np.ndarray], logits_finite: np.ndarray, nan_means_none: Iterable[str] = ()
) -> dict[str, dict[str, int]]:
    """{name: {"first": the first token where it is not finite, "count": at how many tokens}} for the logits and
    each floating-point array that is not finite somewhere (the last token's loss, which has no next token, aside;
    in the arrays named in `nan_means_none`, only infinities)."""
    bad = {"logits": ~logits_finite}
    empty_is_nan = set(nan_means_none)
    for name, values in arrays.items():
        if np.issubdtype(values.dtype, np.floating):
            kept = values[:-1] if name == "loss" else values
            bad[name] = bad_rows(kept, name in empty_is_nan)
    return {name: {"first": int(b.argmax()), "count": int(b.sum())} for name, b in bad.items() if b.any()}


def token_ids(values) -> list[int]:
    """`values` (a sequence, array or tensor of whole numbers) as a list of ints; ValueError naming the first that is
    not one."""
    import numbers

    if isinstance(values, (str, bytes, bytearray)) or not isinstance(values, (torch.Tensor, np.ndarray, Iterable)):
        raise TypeError(f"expected text (a str) or a sequence of token ids, got {type(values).__name__}")
    ids = values.tolist() if isinstance(values, (torch.Tensor, np.ndarray)) else list(values)
    bad = next((v for v in ids if not isinstance(v, numbers.Integral) or isinstance(v, bool)), None)
    if bad is not None:
        raise ValueError(f"token ids must be whole numbers, got {bad!r} at position {ids.index(bad)}")
    return [int(v) for v in ids]


def checked_evidence(evidence, n_tokens: int) -> list[list[int]]:
    """`evidence` as [[start, stop], ...], each a span of whole token positions inside the input (ValueError
    naming the span otherwise)."""
    import numbers

    spans = []
    for span in evidence:
        pair = list(span) if isinstance(span, (list, tuple, np.ndarray)) else []
        if (
            len(pair) != 2
            or not all(isinstance(x, numbers.Integral) and not isinstance(x, bool) for x in pair)
            or not 0 <= pair[0] <= pair[1] <= n_tokens
        ):
            raise ValueError(
                f"evidence span {str(span)[:60]} is not [start, stop) of token positions inside the "
                f"input's {n_tokens:,} tokens"
            )
        spans.append([int(pair[0]), int(pair[1])])
    return spans


def resolve_names(model: MemoryModel, names) -> dict[str, str]:
    """Normalise `names` (None, a list, or {name: reducer}) to {name: reducer}."""
    if names is None:
        names = model.default_trace_reducers()
    elif isinstance(names, str):
        names = {names: "none"}
    elif not isinstance(names, Mapping):
        names = {n: "none" for n in names}
    model.check_hook_names(names)
    bad = {n: r for n, r in names.items() if r not in REDUCERS}
    if bad:
        raise ValueError(f"reducers must be one of {REDUCERS}, got {bad}")
    return dict(names)


@torch.no_grad()
def trace(
    model: MemoryModel,
    text: str | Sequence[int],
    names=None,
    chunk_len: int | None = None,
    progress: Progress | None = None,
    max_tokens: int = MAX_TRACE_TOKENS,
    evidence: Sequence[Sequence[int]] = (),
    answer: str | Sequence[int] | None = None,
) -> Trace:
    """Run `text` (a string or token ids) through `model` chunk by chunk and keep `names`.
    `evidence` (token spans, e.g. a probe sample's needle) is kept for figures to mark. An
    `answer` (e.g. a probe sample's, " 12345") is appended to the input, teacher-forced, and
    its span kept, so the loss over the answer's tokens shows how well the model predicts it."""
    if isinstance(text, (bytes, bytearray)):
        raise TypeError("trace takes a str or a sequence of token ids, not bytes: decode the text first")
    if not isinstance(max_tokens, (int, np.integer)) or isinstance(max_tokens, bool) or max_tokens < 1:
        raise ValueError(f"max_tokens must be a positive whole number of tokens, got {max_tokens!r}")
    if isinstance(text, str) and len(text) > max_tokens * MAX_CHARS_PER_TOKEN:
        raise ValueError(
            f"input has {len(text):,} characters, more than {max_tokens:,} tokens can hold "
            f"(the trace limit); nothing was tokenized"
        )
    ids = (
        model.tokenizer.encode_within(text, max_tokens, limit="trace limit")
        if isinstance(text, str)
        else token_ids(text)
    )
    if not ids:
        raise ValueError("empty input: there is nothing to trace")
    answer_ids = (
        [] if answer is None else model.tokenizer.encode(answer) if isinstance(answer, str) else token_ids(answer)
    )
    answer_span = [len(ids), len(ids) + len(answer_ids)] if answer_ids else None
    ids = ids + answer_ids
    if len(ids) > max_tokens:
        raise ValueError(f"input has {len(ids):,} tokens, over the trace limit of {max_tokens:,}")
    evidence = checked_evidence(evidence, len(ids))
    reducers = resolve_names(model, names)
    announce_cost(model, len(ids), "tracing")
    buffers: dict[str, Rows] = {}

    def capture(tensor: torch.Tensor, hook) -> None:
        piece = to_numpy(reduce_tensor(tensor[0], reducers[hook.name]))
        if hook.name not in buffers:  # room for as many rows from every chunk (stream has checked chunk_len)
            buffers[hook.name] = Rows(-(-len(ids) // int(chunk_len or model.chunk_len)) * len(piece))
        buffers[hook.name].append(piece)

    all_ids = torch.tensor(ids, dtype=torch.long)
    losses = np.full(len(ids), np.nan, dtype=np.float32)
    logits_finite = np.ones(len(ids), dtype=bool)
    with model.evaluating(), model.hooks(fwd_hooks=[(n, capture) for n in reducers]):
        for start, logits, _ in model.stream(all_ids, chunk_len):
            end = start + logits.shape[1]
            logits_finite[start:end] = finite_rows(logits[0]).cpu().numpy()
            targets = all_ids[start + 1 : end + 1].to(logits.device)
            losses[start : start + len(targets)] = next_token_losses(logits[0, : len(targets)], targets).cpu().numpy()
            del logits  # the next chunk's forward should not hold two chunks of [chunk, vocab] logits
            if progress is not None:
                progress(end, len(ids))
    silent = [n for n in reducers if n not in buffers]
    if silent:
        raise ValueError(f"hooks that never fired over the input, so nothing to keep: {', '.join(silent)}")
    arrays = {n: buffers[n].joined() for n in reducers}
    arrays["loss"] = losses
    nan_means_none = model.nan_means_none(arrays)
    present = sorted(set(ids))  # the text of the ids the trace holds, not of a whole (250k-token) vocabulary
    vocab = dict(zip(present, model.tokenizer.token_strings(present)))
    meta = {
        "family": model.family,
        "model": model.cfg.name or model.card.get("name", ""),
        "vocab_size": model.cfg.vocab_size,
        "reducers": reducers,
        "chunk_len": model.chunk_len if chunk_len is None else chunk_len,
        # each held token's UTF-8 bytes, what `Trace.loss_summary` divides by for bits a byte
        "token_bytes": {str(i): model.tokenizer.byte_length([i]) for i in present},
        "evidence": evidence,
        "answer": answer_span,  # [start, stop) of the appended answer's tokens, or None
        # what the family's figures need that the arrays do not say (a saved trace plots alone)
        "figure_settings": get_family(model.family).figure_settings(model),
        # the kept quantities whose NaN marks an empty entry, and where the logits and each kept quantity first
        # stop being finite: {name: {"first", "count"}}
        "nan_means_none": nan_means_none,
        "non_finite": non_finite_summary(arrays, logits_finite, nan_means_none),
    }
    return Trace(np.asarray(ids, dtype=np.int32), arrays, vocab, meta)
