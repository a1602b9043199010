"""Trace files: a `memviz.trace.Trace` written as an .npz of plain arrays and JSON (no pickles), and read back
with every declared size and span checked before it is trusted, so a corrupt, truncated or hostile file is one
`TraceFileError` naming the file and what is wrong, and nothing is allocated for it past its caps.
"""

from __future__ import annotations

import io
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from memviz.files import check_regular_file

#: the most a trace file may unpack to, read from its zip headers before any array is
MAX_TRACE_FILE_BYTES = 8 * 2**30
#: the most a trace file may take on disk
MAX_TRACE_DISK_BYTES = 8 * 2**30
#: the most the JSON of a trace file's meta and vocabulary may take
MAX_TRACE_META_BYTES = 256 * 2**20


class TraceFileError(ValueError):
    """A trace file that cannot be read as one; the message names the file and what is wrong."""


def trace_bytes(
    tokens: np.ndarray,
    arrays: Mapping[str, np.ndarray],
    vocab: Mapping[int, str] | None,
    meta: Mapping[str, Any] | None,
) -> bytes:
    """A trace as an .npz (no pickles): each array under `array:<name>`, the token ids, and the names, vocabulary
    and meta as JSON bytes."""
    header = {"meta": meta, "vocab": vocab, "names": list(arrays)}
    payload: dict[str, Any] = {f"array:{n}": a for n, a in arrays.items()}
    payload["tokens"] = tokens
    payload["meta_json"] = np.frombuffer(json.dumps(header).encode("utf-8"), dtype=np.uint8)
    buffer = io.BytesIO()
    np.savez_compressed(buffer, **payload)
    return buffer.getvalue()


def read_trace_file(
    path: str | Path,
) -> tuple[np.ndarray, dict[str, np.ndarray], dict[int, str] | None, dict[str, Any] | None]:
    """A trace file's (tokens, arrays, vocabulary, meta). Before any array is read: the file is a regular one,
    its unpacked size (from the zip headers) is under the cap, and every array's declared shape and type (from its
    .npy header) fits a trace of its tokens; after: the tokens lie in the vocabulary and the evidence and answer
    spans in the input. Any failure is one TraceFileError naming the file."""
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
    return tokens, arrays, vocab, meta.get("meta")


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
