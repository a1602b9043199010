"""The released BABILong files (JSON/JSONL lists or parquet with `input`, `question`,
`target`) read from a local path, as samples."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from memviz.files import check_regular_file
from memviz.tracing import MAX_CHARS_PER_TOKEN
from memviz_probes.babilong.samples import question_suffix
from memviz_probes.babilong.stories import check_task, task_labels
from memviz_probes.common import Sample

#: the largest released file read (the 1M-token split of one task is about 400 MB)
MAX_DATA_FILE_BYTES = 2**30


def json_lines(text: str) -> list:
    """One JSON value a non-blank line; a line that is none is a ValueError naming its line number in the file."""
    rows = []
    for number, line in enumerate(text.splitlines(), 1):
        if line.strip():
            try:
                rows.append(json.loads(line))
            except json.JSONDecodeError as exc:
                raise ValueError(f"line {number}: {exc.msg} (column {exc.colno})") from exc
    return rows


def load(data_path: str | Path, task: str, length: str | int | None = None) -> list[dict]:
    """Rows {input, question, target} of a released BABILong file, or of the file for `task`
    (and `length`, e.g. '1k') found under a folder."""
    check_task(task)
    path = Path(data_path).expanduser()
    if not path.exists():
        raise ValueError(f"BABILong data path {path} does not exist")
    if path.is_dir():
        path = find_file(path, task, length)
    check_regular_file(path, MAX_DATA_FILE_BYTES, "BABILong data file")
    try:
        if path.suffix == ".parquet":
            rows = pd.read_parquet(path).to_dict("records")
        elif path.suffix == ".jsonl":
            rows = json_lines(path.read_text(encoding="utf-8"))
        else:
            data = json.loads(path.read_text(encoding="utf-8"))
            rows = (
                data if isinstance(data, list) else data.get(task, data.get("data")) if isinstance(data, dict) else None
            )
    except (OSError, ValueError, RecursionError) as exc:  # RecursionError: JSON nested past Python's stack
        raise ValueError(f"{path}: cannot read BABILong data ({exc})") from exc
    if not isinstance(rows, list) or not rows:
        raise ValueError(
            f"{path}: expected a non-empty list of samples (or an object holding one under "
            f"{task!r} or 'data'), got {type(rows).__name__ if rows is not None else type(data).__name__}"
        )
    missing = [k for k in ("input", "question", "target") if not all(isinstance(r, dict) and k in r for r in rows)]
    if missing:
        raise ValueError(f"{path}: samples lack the fields {missing}")
    for i, row in enumerate(rows):
        wrong = [k for k in ("input", "question", "target") if not isinstance(row[k], str)]
        if wrong:
            raise ValueError(
                f"{path}: sample {i}'s fields {wrong} must be text, got {[type(row[k]).__name__ for k in wrong]}"
            )
        blank = [k for k in ("question", "target") if not row[k].strip()]
        if blank:  # an empty target would score every answer as right
            raise ValueError(f"{path}: sample {i}'s fields {blank} are empty")
    if isinstance(length, int):
        longest = max(range(len(rows)), key=lambda i: len(rows[i]["input"]))
        if len(rows[longest]["input"]) > MAX_CHARS_PER_TOKEN * length:
            raise ValueError(
                f"{path}: sample {longest}'s input has {len(rows[longest]['input']):,} characters, more "
                f"than a prompt of {length:,} tokens can hold ({MAX_CHARS_PER_TOKEN} a token): not a "
                f"length-{length_label(length)} file"
            )
    return [{"input": r["input"], "question": r["question"], "target": r["target"]} for r in rows]


def find_file(folder: Path, task: str, length: str | int | None) -> Path:
    label = length_label(length) if length is not None else None
    found = []
    for p in sorted(folder.rglob("*")):
        if p.suffix not in (".json", ".jsonl", ".parquet") or not p.is_file():
            continue
        parts = [part.lower() for part in p.relative_to(folder).with_suffix("").parts]
        words = {w for part in parts for w in part.replace("-", "_").split("_")}
        if task in words and (label is None or label in words):
            found.append(p)
    if not found:
        raise ValueError(f"no BABILong file for {task}{' at ' + label if label else ''} under {folder}")
    return found[0]


def length_label(length: str | int) -> str:
    if isinstance(length, str):
        return length.lower()
    return f"{length // 1000}k" if length >= 1000 and length % 1000 == 0 else str(length)


def released_sample(tokenizer, row: dict, task: str, length) -> Sample:
    prompt = row["input"] + question_suffix(row["question"])
    return Sample(
        prompt=prompt,
        answer=row["target"],
        length=length,
        n_tokens=len(tokenizer.encode(prompt)),
        meta={"task": task, "question": row["question"], "labels": task_labels(task)},
    )
