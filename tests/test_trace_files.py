"""Trace files (memviz.trace_files): a saved trace loads whole, and a file that is truncated, corrupt, too large
for its header or does not fit its input is refused naming the path."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

import numpy as np
import pytest

import memviz
from memviz import Trace
from tests.conftest import refused_within_memory, small_model


@pytest.fixture(scope="module")
def saved_trace(tmp_path_factory):
    model = small_model("sliding_window", window=8)
    return memviz.trace(model, "hello there, general", evidence=[[2, 5]]).save(tmp_path_factory.mktemp("t") / "t.npz")


def rewritten(saved: Path, out: Path, **changes) -> Path:
    """The trace file `saved` with arrays or meta fields replaced (meta fields by a callable on the meta dict)."""
    with np.load(saved) as data:
        payload = {k: data[k] for k in data.files}
    meta = json.loads(bytes(payload["meta_json"]).decode())
    if "meta" in changes:
        changes.pop("meta")(meta)
    payload["meta_json"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    payload.update(changes)
    np.savez(out, **payload)
    return out


INSIDE = r"is not \[start, stop\) inside its 20 tokens"

TRACE_FILE_CASES = {
    "evidence past the end": (
        dict(meta=lambda m: m["meta"].update(evidence=[[3, 999999999]])),
        rf"evidence span \[3, 999999999\] {INSIDE}",
    ),
    "answer past the end": (
        dict(meta=lambda m: m["meta"].update(answer=[20, 40])),
        rf"answer span \[20, 40\] {INSIDE}",
    ),
    "negative token ids": (dict(tokens=np.array([-1] + [5] * 19, dtype=np.int32)), r"token ids range over \[-1, 5\]"),
    "token ids past the vocabulary": (
        dict(tokens=np.array([2**40] + [5] * 19, dtype=np.int64)),
        "outside the vocabulary's 259",
    ),
    "NaN token ids": (
        dict(tokens=np.array([np.nan] + [5.0] * 19)),
        "tokens must be a 1-D array of integer ids, declared float64",
    ),
    "2-D tokens": (
        dict(tokens=np.zeros((20, 2), dtype=np.int32)),
        r"tokens must be a 1-D array of integer ids, declared int32 \(20, 2\)",
    ),
    "a 0-d array": (dict(**{"array:loss": np.float32(1.0)}), r"array 'loss' declares shape \(\)"),
    "meta a list": (dict(meta_json=np.frombuffer(b"[1, 2]", dtype=np.uint8)), "meta_json is not an object"),
    "a short vocabulary": (
        dict(meta=lambda m: m.update(vocab=dict(list(m["vocab"].items())[:2]))),
        r"token ids \[.*\] have no entry in its vocabulary of 2",
    ),
}


@pytest.mark.parametrize("case", sorted(TRACE_FILE_CASES))
def test_a_trace_file_that_does_not_fit_its_input_is_refused_naming_the_file(case, saved_trace, tmp_path):
    from memviz.trace_files import TraceFileError

    changes, named = TRACE_FILE_CASES[case]
    path = rewritten(saved_trace, tmp_path / "bad.npz", **changes)
    with pytest.raises(TraceFileError, match=rf"bad.npz: .*{named}"):
        memviz.Trace.load(path)


def test_a_trace_file_with_a_crc_error_names_the_file(saved_trace, tmp_path):
    data = bytearray(saved_trace.read_bytes())
    start = data.index(b"meta_json") + 40  # inside the meta member's compressed bytes
    data[start : start + 8] = bytes(8)
    path = tmp_path / "crc.npz"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"crc.npz: not a memviz trace file"):
        memviz.Trace.load(path)


def test_a_saved_trace_still_loads_whole(saved_trace):
    loaded = memviz.Trace.load(saved_trace)
    assert loaded.meta["evidence"] == [[2, 5]] and len(loaded) == 20 and loaded.token_text(0, 2) == ["h", "e"]


def test_trace_files_that_are_truncated_bombs_or_objects_name_the_path(tmp_path, model):
    saved = memviz.trace(model, "hello there").save(tmp_path / "t.npz")
    truncated = tmp_path / "truncated.npz"
    truncated.write_bytes(saved.read_bytes()[:100])
    with pytest.raises(ValueError, match="truncated.npz"):
        Trace.load(truncated)
    bomb = tmp_path / "bomb.npz"
    with zipfile.ZipFile(bomb, "w", compression=zipfile.ZIP_DEFLATED) as z:
        z.writestr("tokens.npy", b"\x00" * (600 * 2**20))
    with pytest.raises(ValueError, match="bomb.npz"):
        Trace.load(bomb)
    objects = tmp_path / "objects.npz"
    np.savez(objects, tokens=np.array([object()], dtype=object))
    with pytest.raises(ValueError, match="objects.npz"):
        Trace.load(objects)


def test_a_trace_file_declaring_a_huge_array_is_refused_from_its_header(tmp_path):
    import io
    import zipfile

    path = tmp_path / "huge.npz"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (2**20, 1024)})
    tokens, meta = io.BytesIO(), io.BytesIO()
    np.save(tokens, np.zeros(1000, dtype=np.int32))
    np.save(meta, np.frombuffer(json.dumps({"names": ["x"], "vocab": None, "meta": {}}).encode(), dtype=np.uint8))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("tokens.npy", tokens.getvalue())
        archive.writestr("meta_json.npy", meta.getvalue())
        archive.writestr("array:x.npy", header.getvalue() + bytes(2**26))  # declares 4 GiB; its first 64 MiB
    message = refused_within_memory("trace file", path)
    assert message.startswith(f"{path}: array 'x' declares shape (1048576, 1024), not one row per token of its 1,000")


CALL_CASES = {
    "a trace file that is no path": (lambda m: Trace.load(None), ValueError, "trace file must be a path, got None"),
    "a trace saved where nothing can be written": (
        lambda m: memviz.trace(m, "hello").save("/proc/nope.npz"),
        OSError,
        "cannot write /proc/nope.npz",
    ),
}


@pytest.mark.parametrize("case", sorted(CALL_CASES))
def test_a_bad_call_is_one_error_naming_the_argument(case, model):
    call, error, named = CALL_CASES[case]
    with pytest.raises(error, match=named):
        call(model)


def test_a_trace_file_that_would_unpack_too_far_is_refused_unread(tmp_path, monkeypatch):
    import memviz.trace_files

    model = small_model("sliding_window", window=8)
    path = memviz.trace(model, "hello there " * 20).save(tmp_path / "t.npz")
    monkeypatch.setattr(memviz.trace_files, "MAX_TRACE_FILE_BYTES", 1000)
    with pytest.raises(ValueError, match=r"t.npz: unpacks to .* nothing was read"):
        memviz.Trace.load(path)
    truncated = tmp_path / "cut.npz"
    truncated.write_bytes(path.read_bytes()[:200])
    with pytest.raises(ValueError, match="cut.npz: not a memviz trace file"):
        memviz.Trace.load(truncated)
