"""Trace a long input through a model, keeping chosen hooks as numpy arrays over the whole input.

`trace(model, text)` feeds the input chunk by chunk, carrying the model's memory state, and
records each requested hook from every chunk, so memory use grows with what is kept (a few
numbers per token) and never with the activations of the whole input. Every trace also
keeps `loss`: the per-token negative log-likelihood of the next token.

Large per-token vectors (LM2 gates, Infini per-head outputs) can be reduced while tracing
(`"mean"` or `"norm"` over their trailing axis); families name sensible reductions for their
default hooks.
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from memviz.files import atomic_write_bytes, check_regular_file
from memviz.model import Progress
from memviz.registry import get_family

REDUCERS = ("none", "mean", "norm")
MAX_TRACE_TOKENS = 4_000_000
#: a text longer than this many characters a token is refused before it is tokenized (no
#: tokenizer here makes tokens longer than a few dozen characters)
MAX_CHARS_PER_TOKEN = 64
#: the most a trace file may unpack to, read from its zip headers before any array is
MAX_TRACE_FILE_BYTES = 8 * 2**30
#: the most a trace file may take on disk
MAX_TRACE_DISK_BYTES = 8 * 2**30


class TraceFileError(ValueError):
    """A trace file that cannot be read as one; the message names the file and what is wrong."""


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


def first_non_blank(texts: Sequence[str]) -> int:
    """The index of the first text that is not whitespace (the last one where all are): where an answer's content
    begins, past a leading space the tokenizer writes as a token of its own."""
    return next((i for i, text in enumerate(texts) if text.strip()), len(texts) - 1)


def bad_rows(values: np.ndarray, nan_means_none: bool = False) -> np.ndarray:
    """Whether each position of [pos, ...] floats holds an entry that is NaN or infinite (infinite only, where NaN
    marks an empty entry)."""
    flat = values.reshape(len(values), int(np.prod(values.shape[1:])))  # -1 cannot size a trace of no rows
    return (np.isinf(flat) if nan_means_none else ~np.isfinite(flat)).any(1)


def first_non_finite(values: np.ndarray, nan_means_none: bool = False) -> int | None:
    """The first position [pos, ...] where any entry is NaN or infinite; None where all are finite (or integer)."""
    if not np.issubdtype(values.dtype, np.floating) or len(values) == 0:
        return None
    bad = bad_rows(values, nan_means_none)
    return int(bad.argmax()) if bad.any() else None


@dataclass
class Pooled:
    """A trace array max-pooled along positions: `values[i]` summarises tokens
    `positions[i] .. positions[i] + bin_size - 1` (true token positions)."""

    positions: np.ndarray
    values: np.ndarray
    bin_size: int


def bin_size(n: int, width: int) -> int:
    """Tokens a column when `n` positions are pooled to at most `width` columns (a whole number, at least 1)."""
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise ValueError(f"width must be a whole number of columns, at least 1, got {width!r}")
    return max(1, -(-n // width))


class Trace:
    """Per-token arrays over a whole input: `trace.tokens`, `trace.names`, `trace[name]`."""

    def __init__(
        self,
        tokens: np.ndarray,
        arrays: Mapping[str, np.ndarray],
        vocab: Sequence[str] | Mapping[int, str] | None = None,
        meta: dict | None = None,
    ) -> None:
        self.tokens = np.asarray(tokens, dtype=np.int32)
        if self.tokens.ndim != 1:
            raise ValueError(f"trace tokens must be 1-D, got shape {self.tokens.shape}")
        self.arrays = dict(arrays)
        for name, arr in self.arrays.items():
            if arr.ndim == 0 or arr.shape[0] != len(self.tokens):
                raise ValueError(
                    f"trace array {name!r} has shape {arr.shape}, not one row per token of {len(self.tokens)}"
                )
        #: token id -> its text: the whole vocabulary, or (as `trace` keeps it) only the ids the trace holds
        self.vocab = (
            None
            if vocab is None
            else {int(i): v for i, v in (vocab.items() if isinstance(vocab, Mapping) else enumerate(vocab))}
        )
        self.meta = dict(meta or {})

    @property
    def names(self) -> list[str]:
        return list(self.arrays)

    def __getitem__(self, name: str) -> np.ndarray:
        if name not in self.arrays:
            raise KeyError(f"{name!r} is not in this trace; it holds {self.names}")
        return self.arrays[name]

    def __contains__(self, name: object) -> bool:
        return name in self.arrays

    def __len__(self) -> int:
        return len(self.tokens)

    @property
    def read_position(self) -> int:
        """The token where the answer's first token that is not blank is predicted (an appended `answer`,
        `trace(..., answer=...)`: a pass key's " 12345" is read for its "1", not for the space token before it),
        else the last token."""
        answer = self.meta.get("answer")
        if not answer:
            return len(self) - 1
        first, stop = answer
        return first + first_non_blank(self.token_text(first, stop)) - 1

    def non_finite_from(self, name: str) -> int | None:
        """The first token where array `name` is not finite (NaN or infinite), or None. The last token's loss has
        no next token and is left out."""
        values = self[name]
        empty_is_nan = self.meta.get("nan_means_none")
        return first_non_finite(
            values[:-1] if name == "loss" else values, isinstance(empty_is_nan, list) and name in empty_is_nan
        )

    @property
    def diverged_at(self) -> int | None:
        """The first token whose logits were not finite (the model diverged there), as recorded while tracing."""
        entry = self.meta.get("non_finite", {}).get("logits")
        return entry["first"] if entry else None

    def token_text(self, start: int = 0, stop: int | None = None) -> list[str]:
        ids = self.tokens[start:stop]
        if self.vocab is None:
            return [str(int(i)) for i in ids]
        return [self.vocab[int(i)] for i in ids]

    def pool(
        self, name: str, width: int = 1500, start: int = 0, stop: int | None = None, reduce: str = "max"
    ) -> Pooled:
        """Pool positions [start, stop) down to at most `width` columns.

        'max' keeps spikes (the default for display), 'min' dips (a decay whose low values are the
        events), 'mean' averages, 'first' subsamples (for index arrays, where neither max nor mean
        means anything)."""
        arr = self[name]
        start, stop = position_window(start, stop, len(arr))
        window = arr[start:stop]
        size = bin_size(len(window), width)
        n_bins = -(-len(window) // size)
        positions = start + np.arange(n_bins) * size
        if size == 1:
            return Pooled(positions, window.copy(), 1)
        if reduce == "first":
            return Pooled(positions, window[::size].copy(), size)
        pad = n_bins * size - len(window)
        data = window.astype(np.float32)
        if pad:  # NaN: ignored as an empty entry is
            data = np.concatenate([data, np.full((pad, *data.shape[1:]), np.nan, dtype=np.float32)])
        data = data.reshape(n_bins, size, *data.shape[1:])
        if reduce in ("max", "min"):
            extreme, worst = (np.max, -np.inf) if reduce == "max" else (np.min, np.inf)
            values = extreme(np.where(np.isnan(data), worst, data), axis=1)
            values[values == worst] = np.nan  # a bin of empty entries only
        elif reduce == "mean":
            with warnings.catch_warnings():  # a bin of only empty (NaN) entries stays NaN, said once by the figure
                warnings.simplefilter("ignore", RuntimeWarning)
                values = np.nanmean(data, axis=1)
        else:
            raise ValueError(f"reduce must be 'max', 'min', 'mean' or 'first', got {reduce!r}")
        return Pooled(positions, values, size)

    def to_bytes(self) -> bytes:
        """The .npz (no pickles) that `save` writes."""
        import io

        meta = {"meta": self.meta, "vocab": self.vocab, "names": self.names}
        payload: dict[str, Any] = {f"array:{n}": a for n, a in self.arrays.items()}
        payload["tokens"] = self.tokens
        payload["meta_json"] = np.frombuffer(json.dumps(meta).encode("utf-8"), dtype=np.uint8)
        buffer = io.BytesIO()
        np.savez_compressed(buffer, **payload)
        return buffer.getvalue()

    def save(self, path: str | Path) -> Path:
        """Write an .npz that `Trace.load` (and `memviz.Trace.load`) reads back."""
        atomic_write_bytes(path, self.to_bytes())
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace file. Before any array is read: the file is a regular one, its unpacked size (from the zip
        headers) is under the cap, and every array's declared shape and type (from its .npy header) fits a trace of
        its tokens; after: the tokens lie in the vocabulary and the evidence and answer spans in the input. Any
        failure is one ValueError naming the file."""
        import zipfile
        import zlib

        check_regular_file(path, MAX_TRACE_DISK_BYTES, "trace file")
        try:
            with zipfile.ZipFile(Path(path)) as archive:
                unpacked = sum(info.file_size for info in archive.infolist())
                if unpacked > MAX_TRACE_FILE_BYTES:
                    raise TraceFileError(
                        f"unpacks to {unpacked:,} bytes, over the {MAX_TRACE_FILE_BYTES:,} a trace file "
                        "may hold; nothing was read"
                    )
                check_declared_arrays(
                    {info.filename.removesuffix(".npy"): npy_header(archive, info) for info in archive.infolist()}
                )
            with np.load(Path(path), allow_pickle=False) as data:
                meta = json.loads(bytes(data["meta_json"]).decode("utf-8"))
                if not isinstance(meta, dict) or not isinstance(meta.get("names"), list):
                    raise TraceFileError("its meta_json is not an object with a list of 'names'")
                missing = [n for n in meta["names"] if not isinstance(n, str) or f"array:{n}" not in data.files]
                if missing:
                    raise TraceFileError(f"names {missing[:3]} have no array")
                arrays = {n: data[f"array:{n}"] for n in meta["names"]}
                tokens = data["tokens"]
            vocab = check_contents(tokens, meta.get("vocab"), meta.get("meta"))
        except TraceFileError as exc:
            raise TraceFileError(f"{path}: {exc}") from exc
        except (
            OSError,
            ValueError,
            KeyError,
            TypeError,
            json.JSONDecodeError,
            RecursionError,  # JSON nested past Python's stack
            EOFError,
            UnicodeDecodeError,
            zipfile.BadZipFile,
            zlib.error,
        ) as exc:
            raise TraceFileError(f"{path}: not a memviz trace file ({exc})") from exc
        return cls(tokens, arrays, vocab, meta.get("meta"))


#: the most the JSON of a trace file's meta and vocabulary may take
MAX_TRACE_META_BYTES = 256 * 2**20


def npy_header(archive, info) -> tuple[tuple[int, ...], np.dtype]:
    """The shape and dtype a zipped .npy member declares, read from its header alone."""
    with archive.open(info) as fh:
        version = np.lib.format.read_magic(fh)
        read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
        shape, _, dtype = read(fh)
    return tuple(shape), dtype


def check_declared_arrays(declared: Mapping[str, tuple[tuple[int, ...], np.dtype]]) -> None:
    """What a trace file's .npy headers declare fits a trace: 1-D integer tokens, a 1-D byte string of meta
    under its cap, and every array of numbers one row per token (ValueError naming the array otherwise)."""
    for required in ("tokens", "meta_json"):
        if required not in declared:
            raise TraceFileError(f"it holds no {required!r} array")
    shape, dtype = declared["tokens"]
    if len(shape) != 1 or dtype.kind not in "iu":
        raise TraceFileError(f"its tokens must be a 1-D array of integer ids, declared {dtype} {shape}")
    n_tokens = shape[0]
    shape, dtype = declared["meta_json"]
    if len(shape) != 1 or dtype != np.uint8 or shape[0] > MAX_TRACE_META_BYTES:
        raise TraceFileError(
            f"its meta_json must be up to {MAX_TRACE_META_BYTES:,} bytes of JSON, declared {dtype} {shape}"
        )
    for name, (shape, dtype) in declared.items():
        if name in ("tokens", "meta_json"):
            continue
        if not name.startswith("array:") or dtype.kind not in "biuf":
            raise TraceFileError(f"{name!r} is not a trace array of numbers (declared {dtype})")
        if len(shape) == 0 or shape[0] != n_tokens:
            raise TraceFileError(
                f"array {name.removeprefix('array:')!r} declares shape {shape}, not one row per token "
                f"of its {n_tokens:,}; nothing was read"
            )


def check_contents(tokens: np.ndarray, vocab, meta) -> dict[int, str] | None:
    """A trace file's tokens inside its vocabulary (below 2**31 without one) and each with its text, and its
    evidence and answer spans [start, stop) inside the input (ValueError naming the field otherwise); returns the
    vocabulary as {id: text}. A file's vocab is a list of every token's text, or {id: text} for the ids it holds."""
    if meta is not None and not isinstance(meta, dict):
        raise TraceFileError(f"its meta must be an object, got {type(meta).__name__}")
    meta = meta or {}
    if isinstance(vocab, list):
        vocab = dict(enumerate(vocab))
    elif isinstance(vocab, dict):
        if not all(key.isdigit() for key in vocab):
            raise TraceFileError("its vocab's keys must be token ids")
        vocab = {int(key): text for key, text in vocab.items()}
    elif vocab is not None:
        raise TraceFileError("its vocab must be a list of token strings or an object of them by token id")
    if vocab is not None and not all(isinstance(text, str) for text in vocab.values()):
        raise TraceFileError("its vocab must hold token strings")
    size = meta.get("vocab_size", len(vocab) if vocab is not None else 2**31)
    if not isinstance(size, int) or isinstance(size, bool) or size < 1:
        raise TraceFileError(f"its vocab_size must be a positive integer, got {size!r}")
    if len(tokens):
        lo, hi = int(tokens.min()), int(tokens.max())
        if lo < 0 or hi >= size:
            raise TraceFileError(
                f"token ids range over [{lo}, {hi}], outside the "
                + (f"vocabulary's {size:,} ids" if vocab is not None else "int32 ids a trace holds")
            )
        unnamed = sorted(set(np.unique(tokens).tolist()) - set(vocab)) if vocab is not None else []
        if unnamed:
            raise TraceFileError(f"token ids {unnamed[:5]} have no entry in its vocabulary of {len(vocab):,}")
    spans = meta.get("evidence", [])
    answer = meta.get("answer")
    for field_name, span in [
        *(("evidence", s) for s in (spans if isinstance(spans, list) else [spans])),
        *((("answer", answer),) if answer is not None else ()),
    ]:
        if (
            not isinstance(span, list)
            or len(span) != 2
            or not all(isinstance(x, int) and not isinstance(x, bool) for x in span)
            or not 0 <= span[0] <= span[1] <= len(tokens)
            or (field_name == "answer" and span[0] < 1)
        ):
            raise TraceFileError(
                f"its {field_name} span {str(span)[:60]} is not [start, stop) inside its {len(tokens):,} tokens"
            )
    return vocab


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


def position_window(start: int, stop: int | None, n_tokens: int) -> tuple[int, int]:
    """[start, stop) within a trace of `n_tokens` (stop None or past the end: the end); ValueError naming the range
    where it is empty or starts before 0."""
    stop = n_tokens if stop is None else min(stop, n_tokens)
    if start < 0:
        raise ValueError(f"position range [{start}, {stop}) starts before 0 (a trace of {n_tokens} tokens)")
    if not start < stop:
        raise ValueError(f"empty position range [{start}, {stop}) for a trace of {n_tokens} tokens")
    return start, stop


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


def resolve_names(model, names) -> dict[str, str]:
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
    model,
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
