"""Type checks for a training config's fields, read from each dataclass's annotations, so a value of the
wrong type is refused by its field's name (`data.min_len_frac must be a number, got '0.5'`), not by the
Python error it would cause later."""

from __future__ import annotations

import dataclasses
import re
from typing import Any

SIMPLE = {
    "int": ("a whole number", lambda v: isinstance(v, int) and not isinstance(v, bool)),
    "float": ("a number", lambda v: isinstance(v, (int, float)) and not isinstance(v, bool)),
    "bool": ("true or false", lambda v: isinstance(v, bool)),
    "str": ("a string", lambda v: isinstance(v, str)),
    "Any": ("anything", lambda v: True),
}


def split_args(inner: str) -> list[str]:
    """'str, list[int]' -> ['str', 'list[int]'] (commas inside brackets kept)."""
    parts, depth, current = [], 0, ""
    for ch in inner:
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
            continue
        depth += (ch == "[") - (ch == "]")
        current += ch
    return [*parts, current.strip()]


def describe(kind: str) -> str:
    """A type annotation in words."""
    if " | None" in kind:
        return f"{describe(kind.replace(' | None', ''))} or null"
    match = re.fullmatch(r"(list|dict|tuple)\[(.*)\]", kind)
    if match is None:
        return SIMPLE.get(kind, (kind,))[0]
    outer, args = match.group(1), split_args(match.group(2))
    if outer == "list":
        return f"a list of {plural(describe(args[0]))}"
    if outer == "dict":
        return f"a mapping of names to {plural(describe(args[1]))}"
    return f"a list of {len(args)} {plural(describe(args[0]))}"


def plural(words: str) -> str:
    return {
        "a whole number": "whole numbers",
        "a number": "numbers",
        "a string": "strings",
        "true or false": "booleans",
    }.get(words, words.replace("a list of", "lists of", 1))


def fits(value: Any, kind: str) -> bool:
    """Whether `value` (as JSON gives it) has the annotated type `kind`."""
    if " | None" in kind:
        return value is None or fits(value, kind.replace(" | None", ""))
    match = re.fullmatch(r"(list|dict|tuple)\[(.*)\]", kind)
    if match is None:
        return SIMPLE[kind][1](value) if kind in SIMPLE else True
    outer, args = match.group(1), split_args(match.group(2))
    if outer == "list":
        return isinstance(value, list) and all(fits(v, args[0]) for v in value)
    if outer == "dict":
        return isinstance(value, dict) and all(fits(k, args[0]) and fits(v, args[1]) for k, v in value.items())
    return isinstance(value, (list, tuple)) and len(value) == len(args) and all(fits(v, a) for v, a in zip(value, args))


def check_types(config: Any, prefix: str = "") -> None:
    """Raise ValueError naming the first field of dataclass `config` whose value is not of its annotated type."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        if dataclasses.is_dataclass(value) or not isinstance(f.type, str):
            continue
        if not fits(value, f.type):
            raise ValueError(f"{prefix}{f.name} must be {describe(f.type)}, got {value!r}")
        if (f.name == "seed" or f.name.endswith("_seed")) and isinstance(value, int) and not 0 <= value < 2**63:
            raise ValueError(f"{prefix}{f.name} must lie in [0, 2**63) (torch's seeds are 64-bit), got {value!r}")


def check_schedule(schedule: list[list[int]], field_name: str) -> None:
    """A [from_step, value] schedule starts at step 0 (its first entry is used from there whatever it says) and its
    steps increase."""
    steps = [entry[0] for entry in schedule]
    if any(s < 0 for s in steps) or any(b <= a for a, b in zip(steps, steps[1:])):
        raise ValueError(
            f"{field_name}'s steps must be >= 0 and increasing, got {steps} (a stage that starts "
            "before the one above it would replace it from its start)"
        )
    if steps and steps[0] != 0:
        raise ValueError(f"{field_name} must start at step 0 (the first entry holds until the next), got {steps}")
