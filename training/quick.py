"""Quick runs from the app or a notebook: a small model of a family (its registered `quick`
preset, byte tokenizer) trained on one probe task for a few hundred steps."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import memviz
from training.config import TrainConfig


def quick_families() -> dict[str, dict[str, Any]]:
    """{family: its quick preset} for every registered family that has one."""
    return {f.name: dict(f.quick) for f in memviz.families() if f.quick is not None and f.from_config}


QUICK_LENGTHS = {"passkey": 320, "qa1": 320, "facts": 128}


QUICK_LR = 3e-3


def quick_config(
    family: str,
    task: str,
    steps: int,
    name: str,
    out: str | Path,
    seed: int = 0,
    lr: float | None = None,
    length: int | None = None,
    curriculum: Sequence[Sequence[int]] | None = None,
) -> TrainConfig:
    """A small training run of `family` on one probe task (its registered `quick` preset: model
    config fields, and "lr" where the family needs another than QUICK_LR). `lr` and `length` (the
    training sequences' tokens; the task's QUICK_LENGTHS by default) override the preset's; a
    `curriculum` [[from_step, length], ...] lets the length grow during the run instead."""
    presets = quick_families()
    if family not in presets:
        raise ValueError(f"quick training supports the families {sorted(presets)}, got {family!r}")
    if task not in QUICK_LENGTHS:
        raise ValueError(f"quick training supports the tasks {sorted(QUICK_LENGTHS)}, got {task!r}")
    preset = dict(presets[family])
    preset_lr = preset.pop("lr", QUICK_LR)
    lr = preset_lr if lr is None else lr
    length = QUICK_LENGTHS[task] if length is None else length
    stages = [[int(a), int(b)] for a, b in curriculum] if curriculum else [[0, int(length)]]
    length = max(b for _, b in stages)
    model = {"family": family, "d_model": 64, "n_layers": 2, "n_heads": 2, **preset}
    evals: dict[str, dict[str, Any]] = {  # each task's probe grid
        "passkey": {"passkey_lengths": [max(length, QUICK_LENGTHS["passkey"])]},
        "qa1": {"babilong_tasks": ["qa1"], "babilong_lengths": [max(length, 320)]},
        "facts": {"facts": 20},
    }
    eval_cfg = evals[task]
    return TrainConfig.from_dict(
        {
            "name": name,
            "model": model,
            "tokenizer": "byte",
            "out": str(out),
            "seed": seed,
            "save_every": 50,
            "log_every": 5,
            "data": {"mix": {task: 1.0}, "curriculum": stages, "min_len_frac": 0.9, "n_entities": 50},
            "optim": {"steps": steps, "batch_size": 8, "lr": lr, "warmup": min(50, max(1, steps // 10))},
            "eval": {**eval_cfg, "final_n": 5},
        }
    )


def parse_curriculum(text: str, shortest: int = 64, longest: int = 4096) -> list[list[int]]:
    """ "0:256, 150:1024" -> [[0, 256], [150, 1024]]: from each step on, sequences of up to that
    many tokens. The first stage starts at step 0, steps increase, lengths lie in [shortest, longest]."""
    stages = []
    for part in (p.strip() for p in text.split(",") if p.strip()):
        step, sep, length = part.partition(":")
        if not sep or not step.strip().isdigit() or not length.strip().isdigit():
            raise ValueError(f"curriculum: {part!r} is not step:length (e.g. 0:256, 150:1024)")
        stages.append([int(step), int(length)])
    if not stages:
        raise ValueError("curriculum: give at least one step:length stage, e.g. 0:256")
    if stages[0][0] != 0:
        raise ValueError(f"curriculum: the first stage must start at step 0, not {stages[0][0]}")
    if any(b[0] <= a[0] for a, b in zip(stages, stages[1:])):
        raise ValueError("curriculum: the steps must increase from stage to stage")
    bad = [length for _, length in stages if not shortest <= length <= longest]
    if bad:
        raise ValueError(f"curriculum: lengths must lie in [{shortest}, {longest}] tokens, got {bad[0]}")
    return stages


def quick_lr(family: str) -> float:
    """The learning rate a family's quick run uses unless told otherwise."""
    return quick_families()[family].get("lr", QUICK_LR)
