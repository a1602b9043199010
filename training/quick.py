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


def quick_config(family: str, task: str, steps: int, name: str, out: str | Path, seed: int = 0) -> TrainConfig:
    """A small training run of `family` on one probe task (its registered `quick` preset)."""
    presets = quick_families()
    if family not in presets:
        raise ValueError(f"quick training supports the families {sorted(presets)}, got {family!r}")
    if task not in QUICK_LENGTHS:
        raise ValueError(f"quick training supports the tasks {sorted(QUICK_LENGTHS)}, got {task!r}")
    model = {"family": family, "d_model": 64, "n_layers": 2, "n_heads": 2, **presets[family]}
    eval_cfg = {"passkey": {"passkey_lengths": [QUICK_LENGTHS["passkey"]]}, "qa1": {"babilong_tasks": ["qa1"], "babilong_lengths": [320]},
                "facts": {"facts": 20}}[task]
    return TrainConfig.from_dict({
        "name": name, "model": model, "tokenizer": "byte", "out": str(out), "seed": seed, "save_every": 50, "log_every": 5,
        "data": {"mix": {task: 1.0}, "curriculum": [[0, QUICK_LENGTHS[task]]], "min_len_frac": 0.9, "n_entities": 50},
        "optim": {"steps": steps, "batch_size": 8, "lr": 3e-3, "warmup": min(50, max(1, steps // 10))},
        "eval": {**eval_cfg, "final_n": 5},
    })
