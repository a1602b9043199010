"""Quick runs from the app or a notebook: a small model of a family (its registered `quick`
preset, byte tokenizer) trained on one probe task for a few hundred steps."""
from __future__ import annotations

from pathlib import Path
from typing import Any

import memviz
from training.config import TrainConfig


def quick_families() -> dict[str, dict[str, Any]]:
    """{family: its quick preset} for every registered family that has one."""
    return {f.name: dict(f.quick) for f in memviz.families() if f.quick is not None}


QUICK_LENGTHS = {"passkey": 320, "qa1": 320, "facts": 128}


QUICK_LR = 3e-3


def quick_config(family: str, task: str, steps: int, name: str, out: str | Path, seed: int = 0,
                 lr: float | None = None, length: int | None = None) -> TrainConfig:
    """A small training run of `family` on one probe task (its registered `quick` preset: model
    config fields, and "lr" where the family needs another than QUICK_LR). `lr` and `length` (the
    training sequences' tokens; the task's QUICK_LENGTHS by default) override the preset's."""
    presets = quick_families()
    if family not in presets:
        raise ValueError(f"quick training supports the families {sorted(presets)}, got {family!r}")
    if task not in QUICK_LENGTHS:
        raise ValueError(f"quick training supports the tasks {sorted(QUICK_LENGTHS)}, got {task!r}")
    preset = dict(presets[family])
    preset_lr = preset.pop("lr", QUICK_LR)
    lr = preset_lr if lr is None else lr
    length = QUICK_LENGTHS[task] if length is None else length
    model = {"family": family, "d_model": 64, "n_layers": 2, "n_heads": 2, **preset}
    eval_cfg = {"passkey": {"passkey_lengths": [max(length, QUICK_LENGTHS["passkey"])]},
                "qa1": {"babilong_tasks": ["qa1"], "babilong_lengths": [max(length, 320)]}, "facts": {"facts": 20}}[task]
    return TrainConfig.from_dict({
        "name": name, "model": model, "tokenizer": "byte", "out": str(out), "seed": seed, "save_every": 50, "log_every": 5,
        "data": {"mix": {task: 1.0}, "curriculum": [[0, int(length)]], "min_len_frac": 0.9, "n_entities": 50},
        "optim": {"steps": steps, "batch_size": 8, "lr": lr, "warmup": min(50, max(1, steps // 10))},
        "eval": {**eval_cfg, "final_n": 5},
    })


def quick_lr(family: str) -> float:
    """The learning rate a family's quick run uses unless told otherwise."""
    return quick_families()[family].get("lr", QUICK_LR)
