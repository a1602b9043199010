"""A trace: the hooks a run kept over a whole input as numpy arrays (`memviz.tracing.trace` makes one), with its
tokens, vocabulary and meta; what figures read, pooled for display, saved and loaded (`memviz.trace_files`).
"""

from __future__ import annotations

import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pandas as pd

from memviz.files import atomic_write_bytes
from memviz.trace_files import read_trace_file, trace_bytes


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


#: rows `Trace.series` averages at a time
SERIES_ROWS = 1 << 14


@dataclass
class Pooled:
    """A trace array pooled along positions (`Trace.pool`): `values[i]` summarises tokens
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

    def series(self, name: str, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Array `name` over positions [start, stop) as one float per token: itself for [pos], else the mean over its
        other axes (heads, slots, channels), NaN entries left out; what timelines draw and `peaks` ranks."""
        start, stop = position_window(start, stop, len(self))
        values = self[name][start:stop]
        if values.ndim == 1:
            return values.astype(np.float64)
        flat = values.reshape(len(values), -1)
        out = np.empty(len(values), dtype=np.float64)
        with warnings.catch_warnings():  # a token with no value (NaN in every column) stays NaN
            warnings.simplefilter("ignore", RuntimeWarning)
            for a in range(0, len(flat), SERIES_ROWS):  # a block at a time: no float64 copy of a whole wide array
                out[a : a + SERIES_ROWS] = np.nanmean(flat[a : a + SERIES_ROWS], axis=1, dtype=np.float64)
        return out

    def peaks(self, name: str, k: int = 10, lowest: bool = False, apart: int = 1, context: int = 6) -> pd.DataFrame:
        """The `k` tokens where `series(name)` is highest (`lowest`: lowest, for a decay or gate whose dips are the
        events), each at least `apart` tokens from a higher-ranked one (so one spike over several tokens is one
        row), with the token's text and `context` tokens of text either side: columns rank, position, value,
        token, before, after. The loss at position p is that of predicting token p + 1, so a loss row names the token
        predicted (at p + 1, whose words before it end with the one that predicted it); the last token predicts
        nothing and is ranked without it."""
        for label, number, least in (("k", k, 1), ("apart", apart, 1), ("context", context, 0)):
            if isinstance(number, bool) or not isinstance(number, (int, np.integer)) or number < least:
                raise ValueError(f"{label} must be a whole number, at least {least}, got {number!r}")
        values = self.series(name)
        finite = np.flatnonzero(np.isfinite(values))
        order = finite[np.argsort(values[finite] if lowest else -values[finite], kind="stable")]
        taken: list[int] = []
        for position in order.tolist():
            if len(taken) == k:
                break
            if apart == 1 or all(abs(position - other) >= apart for other in taken):
                taken.append(position)
        shift = 1 if name == "loss" else 0  # a loss row is its predicted token's
        rows = [
            {
                "rank": rank,
                "position": position + shift,
                "value": float(values[position]),
                "token": self.token_text(position + shift, position + shift + 1)[0],
                "before": "".join(self.token_text(max(0, position + shift - context), position + shift)),
                "after": "".join(self.token_text(position + shift + 1, position + shift + 1 + context)),
            }
            for rank, position in enumerate(taken, start=1)
        ]
        return pd.DataFrame(rows, columns=["rank", "position", "value", "token", "before", "after"])

    def loss_summary(self, start: int = 0, stop: int | None = None) -> dict[str, float | int | None]:
        """The next-token loss over positions [start, stop): `tokens` scored (the last token predicts nothing),
        `mean_nats` a token, and `bits_per_byte` (summed nats / ln 2 over the UTF-8 bytes of the tokens predicted,
        as the language-modelling probe divides; None for a trace kept before it recorded its tokens' bytes)."""
        start, stop = position_window(start, stop, len(self))
        loss = self["loss"][start:stop].astype(np.float64)
        scored = np.flatnonzero(np.isfinite(loss))
        if len(scored) == 0:
            return {"tokens": 0, "mean_nats": None, "bits_per_byte": None}
        nats = float(loss[scored].sum())
        sizes = self.meta.get("token_bytes")
        n_bytes = 0
        if isinstance(sizes, dict):
            ids, counts = np.unique(self.tokens[start + 1 + scored], return_counts=True)
            n_bytes = int(sum(int(sizes[str(i)]) * int(c) for i, c in zip(ids.tolist(), counts.tolist())))
        return {
            "tokens": len(scored),
            "mean_nats": nats / len(scored),
            "bits_per_byte": nats / np.log(2) / n_bytes if n_bytes else None,
        }

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
        """The .npz (no pickles) that `save` writes (`memviz.trace_files.trace_bytes`)."""
        return trace_bytes(self.tokens, self.arrays, self.vocab, self.meta)

    def save(self, path: str | Path) -> Path:
        """Write an .npz that `Trace.load` (and `memviz.Trace.load`) reads back."""
        atomic_write_bytes(path, self.to_bytes())
        return Path(path)

    @classmethod
    def load(cls, path: str | Path) -> Trace:
        """Read a trace file, checked before and after its arrays are read (`memviz.trace_files.read_trace_file`);
        any failure is one TraceFileError naming the file."""
        return cls(*read_trace_file(path))


def position_window(start: int, stop: int | None, n_tokens: int) -> tuple[int, int]:
    """[start, stop) within a trace of `n_tokens` (stop None or past the end: the end); ValueError naming the range
    where it is empty or starts before 0."""
    stop = n_tokens if stop is None else min(stop, n_tokens)
    if start < 0:
        raise ValueError(f"position range [{start}, {stop}) starts before 0 (a trace of {n_tokens} tokens)")
    if not start < stop:
        raise ValueError(f"empty position range [{start}, {stop}) for a trace of {n_tokens} tokens")
    return start, stop
