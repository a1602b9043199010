"""Training configs (training.config): a field that TrainConfig, its optim or its eval section refuses is named
in one ValueError, and so is a config file that is no JSON object or no text."""

from __future__ import annotations

import re

import pytest

from tests.conftest import train_config
from training.config import TrainConfig

TRAIN_CASES = {
    "min_lr_frac -5": (
        {"optim.min_lr_frac": -5},
        r"optim.min_lr_frac \(the last step's share of lr\) must lie in \[0, 1\], got -5",
    ),
    "steps -5": ({"optim.steps": -5}, "optim.steps must be a positive integer, got -5"),
    "steps 0": ({"optim.steps": 0}, "optim.steps must be a positive integer, got 0"),
    "batch_size 0": ({"optim.batch_size": 0}, "optim.batch_size must be a positive integer, got 0"),
    "lr negative": ({"optim.lr": -1e-3}, "optim needs a finite lr > 0.*got lr -0.001"),
    "lr infinite": ({"optim.lr": float("inf")}, "optim needs a finite lr > 0.*got lr inf"),
    "memory_value_lr 0": ({"optim.memory_value_lr": 0}, "optim.memory_value_lr must be a finite number > 0, got 0"),
    "an unknown top-level field": ({"colour": 1}, r"unknown training config fields \['colour'\]"),
    "memory_value_lr infinite": (
        {"optim.memory_value_lr": float("inf")},
        "optim.memory_value_lr must be a finite number > 0, got inf",
    ),
    "save_every 0": ({"save_every": 0}, "save_every must be a positive number of steps, got 0"),
    "a length of 100k x batch 64": (
        {"data.curriculum": [[0, 100_000]], "optim.batch_size": 64},
        "data.curriculum's longest length 100,000 x optim.batch_size 64",
    ),
    "an eval grid of 5e7 samples": ({"eval.n": 50_000_000}, "the eval grid asks for 150,000,000 samples"),
    "a billion people": ({"data.n_entities": 10**9}, "data.n_entities 1,000,000,000 is over the cap"),
    "no people, facts not in the mix": (
        {"data.n_entities": 0},
        r"data\.n_entities must be a number of people >= 1, got 0",
    ),
    "an unknown field": ({"optim.speed": "fast"}, r"unknown optim fields \['speed'\]"),
    "precision float16": ({"optim.precision": "float16"}, "optim.precision"),
    "a seed past 64 bits": ({"seed": 2**70}, "^seed must lie in"),
    "a BPE of no ids": ({"tokenizer": "bpe-english:0"}, "tokenizer 'bpe-english:0'.*from 259"),
    "a BPE of 'abc' ids": ({"tokenizer": "bpe:abc"}, "tokenizer 'bpe:abc'.*whole number"),
    "a BPE of a billion ids": ({"tokenizer": "bpe:1000000000"}, "to 1,048,576"),
}

#: fields of the wrong type or order, matched literally
TYPED_CASES = {
    "an eval length given twice": (
        {"eval.passkey_lengths": [256, 256]},
        "eval.passkey_lengths gives 256 more than once",
    ),
    "an eval depth given twice": ({"eval.passkey_depths": [0.5, 0.5]}, "eval.passkey_depths gives 0.5 more than once"),
    "eval.every -1": ({"eval.every": -1}, "eval.every"),
    "eval.passkey_depths 2": ({"eval.passkey_depths": [2.0]}, "eval.passkey_depths"),
    "eval.passkey_lengths 0": ({"eval.passkey_lengths": [0]}, "eval.passkey_lengths"),
    "threads -1": ({"threads": -1}, "threads"),
    "optim.lr a string": ({"optim.lr": "big"}, "optim.lr must be a number"),
    "optim.warmup a float": ({"optim.warmup": 1.5}, "optim.warmup must be a whole number"),
    "optim.betas one number": ({"optim.betas": 0.9}, "optim.betas must be a list of 2 numbers"),
    "eval.lm 'yes'": ({"eval.lm": "yes"}, "eval.lm must be true or false"),
    "eval.n 1.5": ({"eval.n": 1.5}, "eval.n must be a whole number"),
    "tokenizer a number": ({"tokenizer": 5}, "tokenizer must be a string"),
    "name a number": ({"name": 5}, "name must be a string"),
    "optim a number": ({"optim": 5}, "optim must be a mapping"),
    "optim.clip NaN": ({"optim.clip": float("nan")}, "clip > 0, got lr 0.001, warmup 100 and clip nan"),
    "optim.weight_decay inf": (
        {"optim.weight_decay": float("inf")},
        "got weight_decay inf and betas (0.9, 0.95)",
    ),
    "babilong tasks without lengths": (
        {"eval.babilong_tasks": ["qa1"]},
        "eval.babilong_tasks and eval.babilong_lengths go",
    ),
    "eval grid 1000 x 1000 x 50": (
        {
            "eval.passkey_lengths": list(range(1, 1001)),
            "eval.passkey_depths": [i / 1000 for i in range(1000)],
            "eval.n": 50,
        },
        "the eval grid asks for 50,000,000 samples",
    ),
}
TRAIN_CASES |= {case: (changes, re.escape(message)) for case, (changes, message) in TYPED_CASES.items()}


@pytest.mark.parametrize("case", sorted(TRAIN_CASES))
def test_a_nonsense_training_config_names_the_field(case):
    changes, named = TRAIN_CASES[case]
    with pytest.raises(ValueError, match=named):
        TrainConfig.from_dict(train_config(**changes))


def test_a_config_file_that_is_no_object_or_no_text_is_named(tmp_path):
    path = tmp_path / "run.train.json"
    for content, said in (("[1, 2]", "got list"), ("null", "got NoneType"), ("7", "got int")):
        path.write_text(content)
        with pytest.raises(ValueError, match=f"training config {path}: a training config is a JSON object.*{said}"):
            TrainConfig.load(path)
    path.write_bytes(b"\xff\xfe{}")
    with pytest.raises(ValueError, match=f"training config {path}: cannot read it as UTF-8 text"):
        TrainConfig.load(path)
    with pytest.raises(ValueError, match=f"training config {tmp_path}: cannot read it"):
        TrainConfig.load(tmp_path)
