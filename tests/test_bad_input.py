"""Bad input, one case a row: each gives one error of its layer's type (CheckpointError for
checkpoint folders, ConfigError for model configs, ValueError / KeyError for traces, probes and
training configs) whose message names the file or the field, and nothing is lost or left behind."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import zipfile
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from safetensors.torch import save_file

import memviz
from memviz import CheckpointError, ConfigError, ModelConfig, Trace
from memviz_probes import babilong, lm, passkey, texts
from tests.conftest import small_model
from training.config import TrainConfig


@pytest.fixture(scope="module")
def model():
    return small_model("sliding_window", window=8)


@pytest.fixture
def folder(tmp_path, model):
    return memviz.save(model, tmp_path / "ckpt")


def edit_config(folder: Path, **fields) -> Path:
    config = json.loads((folder / "config.json").read_text())
    config.update(fields)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def edit_weights(folder: Path, change) -> Path:
    from safetensors.torch import load_file

    weights = load_file(folder / "model.safetensors")
    change(weights)
    save_file(weights, folder / "model.safetensors")
    return folder


# ----- checkpoint folders: CheckpointError naming the file and the field -------------------------
CHECKPOINT_CASES = {
    "missing folder": (lambda f: f.parent / "nowhere", "nowhere"),
    "config not JSON": (lambda f: (f / "config.json").write_text("{oops") and f, "config.json"),
    "config a list": (lambda f: (f / "config.json").write_text("[1, 2]") and f, "config.json"),
    "config missing": (lambda f: (f / "config.json").unlink() or f, "config.json"),
    "unknown family": (lambda f: edit_config(f, family="nonsense"), "nonsense"),
    "n_layers 1e6": (lambda f: edit_config(f, n_layers=10**6), "n_layers|parameters"),
    "d_model 8192 x 1000 layers": (lambda f: edit_config(f, d_model=8192, n_layers=1000), "parameters"),
    "string rope_base": (lambda f: edit_config(f, rope_base="big"), "rope_base"),
    "negative rope_base": (lambda f: edit_config(f, rope_base=-5.0), "rope_base"),
    "zero norm_eps": (lambda f: edit_config(f, norm_eps=0.0), "norm_eps"),
    "infinite embed_scale": (lambda f: edit_config(f, embed_scale=math.inf), "embed_scale"),
    "unknown config field": (lambda f: edit_config(f, colour="red"), "colour"),
    "unknown memory option": (lambda f: edit_config(f, memory={"slots": 4}), "slots"),
    "weights garbage": (lambda f: (f / "model.safetensors").write_bytes(b"\x00" * 64) and f, "model.safetensors"),
    "weights missing": (lambda f: (f / "model.safetensors").unlink() or f, "model.safetensors"),
    "weights int8": (
        lambda f: edit_weights(f, lambda w: w.update({k: v.to(torch.int8) for k, v in w.items()})),
        "int8|dtype",
    ),
    "weights bool": (lambda f: edit_weights(f, lambda w: w.update({k: v > 0 for k, v in w.items()})), "bool|dtype"),
    "weights NaN": (lambda f: edit_weights(f, lambda w: w["embed.weight"].fill_(math.nan)), "embed.weight"),
    "a tensor missing": (
        lambda f: edit_weights(f, lambda w: w.pop("unembed.weight", None) or w.pop("embed.weight")),
        "embed.weight",
    ),
    "a tensor of another shape": (
        lambda f: edit_weights(f, lambda w: w.update({"embed.weight": torch.zeros(3, 3)})),
        "embed.weight",
    ),
    "card a list": (lambda f: (f / "card.json").write_text("[]") and f, "card.json"),
    "card a symlink out of the folder": (lambda f: symlink_out(f, "card.json"), "card.json: a symlink out"),
    "weights a symlink out of the folder": (
        lambda f: symlink_out(f, "model.safetensors"),
        "model.safetensors: a symlink out",
    ),
    "tokenizer not JSON": (lambda f: (f / "tokenizer.json").write_text("{") and f, "tokenizer.json"),
}


def symlink_out(folder: Path, name: str) -> Path:
    """`name` moved out of the folder (a well-formed file still) and linked back in."""
    outside = folder.parent / f"outside-{name}"
    if (folder / name).exists():
        (folder / name).rename(outside)
    else:
        outside.write_text("{}")
    (folder / name).symlink_to(outside)
    return folder


@pytest.mark.parametrize("case", sorted(CHECKPOINT_CASES))
def test_a_bad_checkpoint_is_one_checkpoint_error_naming_the_file_or_field(case, folder):
    spoil, named = CHECKPOINT_CASES[case]
    path = spoil(folder)
    with pytest.raises(CheckpointError, match=named):
        memviz.load(path)


# ----- model configs and calls: ConfigError / ValueError naming the field -----------------------
CONFIG_CASES = {
    "negative d_model": (dict(d_model=-4), "d_model"),
    "odd d_head": (dict(d_model=30, n_heads=2), "d_head"),
    "string n_layers": (dict(n_layers="four"), "n_layers"),
    "NaN rope_base": (dict(rope_base=math.nan), "rope_base"),
    "negative norm_eps": (dict(norm_eps=-1e-5), "norm_eps"),
    "window of zero": (dict(attention={"kind": "window", "span": 0}), "span"),
    "unknown attention kind": (dict(attention={"kind": "sideways", "span": 8}), "sideways"),
    "a window of 1e30 tokens": (
        dict(attention={"kind": "window", "span": 10**30}),
        "window attention needs a span, a whole number of tokens from 1 to 16,777,216, got 1" + "0" * 30,
    ),
    "a segment of a billion tokens": (
        dict(segment_len=10**9),
        "config field 'segment_len' must be a whole number of tokens from 1 to 16,777,216 or null, got 1000000000",
    ),
}


@pytest.mark.parametrize("case", sorted(CONFIG_CASES))
def test_a_nonsense_config_is_one_config_error_naming_the_field(case):
    fields, named = CONFIG_CASES[case]
    with pytest.raises(ConfigError, match=named):
        memviz.build_model(ModelConfig(family="sliding_window", **{"vocab_size": 259, **fields}))


def test_a_path_the_system_cannot_take_and_a_card_nested_past_reason_are_named(tmp_path, folder):
    for path, why in ((tmp_path / ("x" * 300), "File name too long"), ("~nosuchuser_memviz/x", "home directory")):
        with pytest.raises(CheckpointError, match=f"not a usable path \\(.*{why}"):
            memviz.load(path)
    deep: object = 1
    for _ in range(900):
        deep = [deep]
    (folder / "card.json").write_text(json.dumps({"probe_scores": deep}))
    with pytest.raises(CheckpointError, match="card.json: nested more than 64 levels deep"):
        memviz.load(folder)


def test_load_overrides_name_the_option(folder):
    with pytest.raises(CheckpointError, match="bank_size"):
        memviz.load(folder, bank_size=4)


def test_figures_refuse_no_columns_and_a_trace_whose_meta_names_another_family(model):
    from memviz.viz import family_figures

    trace = memviz.trace(model, "hello there")
    for width in (0, -3, 2.5):
        with pytest.raises(ValueError, match="width must be a whole number"):
            family_figures(trace, width=width)
    trace.meta["family"] = "lm2"
    with pytest.raises(ValueError, match="names the lm2 family but holds none of its memory hooks"):
        family_figures(trace)


@pytest.mark.parametrize("device", ["cuda:99", "tpu", 3.5, "meta", "xpu"])
def test_a_device_this_machine_cannot_run_is_named(folder, device):
    with pytest.raises(ValueError, match=f"device '?{device}"):
        memviz.load(folder, device=device)


CALL_CASES = {
    "trace of bytes": (lambda m: memviz.trace(m, b"some bytes"), TypeError, "not bytes"),
    "trace of nothing": (lambda m: memviz.trace(m, ""), ValueError, "empty"),
    "trace of None": (lambda m: memviz.trace(m, None), TypeError, "a sequence of token ids, got NoneType"),
    "trace with an answer of one int": (lambda m: memviz.trace(m, "hi", answer=7), TypeError, "got int"),
    "trace with answer ids outside the vocabulary": (
        lambda m: memviz.trace(m, "hi", answer=[99_999]),
        ValueError,
        "99999",
    ),
    "pass key in an empty-named filler": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5], n=1, haystack=""),
        ValueError,
        "haystack: an empty name",
    ),
    "language modelling on an empty corpus name": (lambda m: lm.run(m, corpus=""), ValueError, "corpus must name"),
    "language modelling on no documents": (
        lambda m: lm.run(m, documents=[]),
        ValueError,
        "documents must be a non-empty list",
    ),
    "trace of unknown hooks": (
        lambda m: memviz.trace(m, "hello", names=["blocks.9.hook_nothing"]),
        KeyError,
        "blocks.9.hook_nothing",
    ),
    "trace beyond the token limit": (
        lambda m: memviz.trace(m, "x" * 2000, max_tokens=1000),
        ValueError,
        "trace limit of 1,000",
    ),
    "generate a negative count": (lambda m: m.generate("hi", max_new_tokens=-1), ValueError, "max_new_tokens"),
    "generate a trillion tokens": (lambda m: m.generate("hi", max_new_tokens=10**12), ValueError, "max_new_tokens"),
    "token ids outside the vocabulary": (
        lambda m: m(torch.tensor([[0, 999]])),
        ValueError,
        r"token ids must lie in \[0, 259\), got range \[0, 999\]",
    ),
    "a state that is no state": (lambda m: next(m.stream([1, 2, 3], 2, state="abc")), TypeError, "got str"),
    "another family's state": (
        lambda m: next(m.stream([1, 2, 3], 2, state=small_model("lm2", window=8).init_state())),
        ValueError,
        "LM2BlockState.*sliding_window model's has 2 of \\['LocalCache'\\]",
    ),
    "pass key with no lengths": (
        lambda m: passkey.run(m, lengths=[], depths=[0.5], n=1),
        ValueError,
        r"lengths and depths need at least one value each, got lengths=\[\]",
    ),
    "pass key shorter than its needle": (
        lambda m: passkey.run(m, lengths=[20], depths=[0.5], n=1),
        ValueError,
        "length 20",
    ),
    "pass key depth 2": (
        lambda m: passkey.run(m, lengths=[256], depths=[2.0], n=1),
        ValueError,
        r"depth must lie in \[0, 1\] .*got 2.0",
    ),
    "pass key n 0": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5], n=0),
        ValueError,
        "n must be a positive integer, got 0",
    ),
    "BABILong tasks as one string": (
        lambda m: babilong.run(m, tasks="qa1", lengths=[256], n=1),
        ValueError,
        "tasks must be a list, got 'qa1'",
    ),
    "BABILong unknown task": (
        lambda m: babilong.run(m, tasks=["qa9"], lengths=[256], n=1),
        ValueError,
        "unknown task 'qa9'; tasks are",
    ),
    "token ids that are floats": (
        lambda m: lm.token_losses(m, [1.5, 2.7]),
        ValueError,
        "tokens must be whole-number token ids, got torch.float32",
    ),
    "no tokens to score": (lambda m: lm.token_losses(m, []), ValueError, "a document needs at least 2 tokens"),
    "zero bins an octave": (
        lambda m: lm.by_position(lm.run(m, "botchan", max_tokens=20), per_octave=0),
        ValueError,
        "per_octave must be a whole number of bins >= 1, got 0",
    ),
    "a summary of nothing": (lambda m: lm.summary(pd.DataFrame()), ValueError, "summary needs the rows of lm.run"),
    "a comparison of no models": (lambda m: lm.compare({}), ValueError, "compare needs at least one model"),
    "held-out names as one string": (
        lambda m: texts.documents("botchan", "heldout", held_out="chapter_11"),
        ValueError,
        "held_out must be a list of document names, got 'chapter_11'",
    ),
    "a haystack that is a number": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5], n=1, haystack=123),
        ValueError,
        r"haystack must be a background's name \(.*\) or a text file's path, got 123",
    ),
    "a shard of none": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5], n=1, shard=(0, 0)),
        ValueError,
        r"shard must be \(index, count\) with 0 <= index < count, got \(0, 0\)",
    ),
    "a shard past the count": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5], n=1, shard=(3, 2)),
        ValueError,
        r"shard must be .*got \(3, 2\)",
    ),
    "a cache of a hook the model lacks": (
        lambda m: m.run_with_cache("hello", names_filter=["blocks.0.hook_resid_pots"]),
        KeyError,
        r"unknown hook names \['blocks.0.hook_resid_pots'\]; the nearest are \['blocks.0.hook_resid_post'",
    ),
    "a hook on a name the model lacks": (
        lambda m: m.run_with_hooks("hello", fwd_hooks=[("nope", lambda value, hook: value)]),
        KeyError,
        r"unknown hook names \['nope'\]",
    ),
    "a trace file that is no path": (lambda m: Trace.load(None), ValueError, "trace file must be a path, got None"),
    "a trace saved where nothing can be written": (
        lambda m: memviz.trace(m, "hello").save("/proc/nope.npz"),
        OSError,
        "cannot write /proc/nope.npz",
    ),
    "a length given twice": (
        lambda m: passkey.run(m, lengths=[256, 512, 256], depths=[0.5], n=1),
        ValueError,
        r"lengths gives 256 more than once \(each would run again\)",
    ),
    "a depth given twice": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5, 0.5], n=1),
        ValueError,
        "depths gives 0.5 more than once",
    ),
    "BABILong data file missing": (
        lambda m: babilong.run(m, tasks=["qa1"], lengths=[256], n=1, data_path="/nowhere/qa1.json"),
        ValueError,
        "BABILong data path /nowhere/qa1.json does not exist",
    ),
}


@pytest.mark.parametrize("case", sorted(CALL_CASES))
def test_a_bad_call_is_one_error_naming_the_argument(case, model):
    call, error, named = CALL_CASES[case]
    with pytest.raises(error, match=named):
        call(model)


def test_babilong_rows_with_lists_or_nulls_name_the_file_and_field(tmp_path, model):
    rows = tmp_path / "qa1.json"
    rows.write_text(json.dumps([{"input": ["a list"], "question": None, "target": "kitchen"}]))
    with pytest.raises(ValueError, match=f"{rows}.*(input|question)"):
        babilong.run(model, tasks=["qa1"], lengths=[256], n=1, data_path=rows)
    lines = tmp_path / "qa1.jsonl"
    lines.write_text('{"input": "a", "question": "b", "target": "c"}\n\n{"input": oops}\n')
    with pytest.raises(ValueError, match=f"{lines}: cannot read BABILong data \\(line 3: Expecting value \\(column 11"):
        babilong.run(model, tasks=["qa1"], lengths=[256], n=1, data_path=lines)
    rows.write_text("[" * 200_000 + "]" * 200_000)  # nested past Python's stack
    with pytest.raises(ValueError, match=f"{rows}: cannot read BABILong data"):
        babilong.run(model, tasks=["qa1"], lengths=[256], n=1, data_path=rows)


def test_a_pipe_for_a_config_and_a_looping_card_link_are_named_not_read(folder):
    (folder / "card.json").unlink()
    (folder / "card.json").symlink_to("card.json")
    with pytest.raises(CheckpointError, match=r"card\.json: a symlink that leads nowhere"):
        memviz.load(folder)
    (folder / "card.json").unlink()
    (folder / "config.json").unlink()
    os.mkfifo(folder / "config.json")  # read, it would never end
    with pytest.raises(CheckpointError, match=r"config\.json: not a regular file"):
        memviz.load(folder)


# ----- trace files ------------------------------------------------------------------------------
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


# ----- training configs: ValueError naming the field --------------------------------------------
def train_config(**changes) -> dict:
    config = {
        "name": "t",
        "model": {"family": "sliding_window", "d_model": 32, "n_layers": 2, "n_heads": 2},
        "data": {"mix": {"passkey": 1.0}, "curriculum": [[0, 256]]},
        "optim": {"steps": 10, "batch_size": 2, "lr": 1e-3},
        "eval": {"passkey_lengths": [256]},
        "out": "runs/unused",
    }
    for dotted, value in changes.items():
        section, _, key = dotted.rpartition(".")
        (config[section] if section else config)[key] = value
    return config


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
    "an unknown task": ({"data.mix": {"qa9": 1.0}}, r"unknown data tasks \['qa9'\]; tasks are"),
    "a negative drill": ({"data.drill": -1}, "data.drill must be >= 0, got -1"),
    "max_facts of none": ({"data.max_facts": [[0, 0]]}, r"data.max_facts is a list of \[from_step, n\] with n >= 1"),
    "memory_value_lr infinite": (
        {"optim.memory_value_lr": float("inf")},
        "optim.memory_value_lr must be a finite number > 0, got inf",
    ),
    "a NaN task weight": (
        {"data.mix": {"passkey": float("nan")}},
        "data.mix needs finite non-negative weights with a positive sum",
    ),
    "save_every 0": ({"save_every": 0}, "save_every must be a positive number of steps, got 0"),
    "a length of 100k x batch 64": (
        {"data.curriculum": [[0, 100_000]], "optim.batch_size": 64},
        "data.curriculum's longest length 100,000 x optim.batch_size 64",
    ),
    "an eval grid of 5e7 samples": ({"eval.n": 50_000_000}, "the eval grid asks for 150,000,000 samples"),
    "a billion people": ({"data.n_entities": 10**9}, "data.n_entities 1,000,000,000 is over the cap"),
    "an unknown field": ({"optim.speed": "fast"}, r"unknown optim fields \['speed'\]"),
    "precision float16": ({"optim.precision": "float16"}, "optim.precision"),
    "a seed past 64 bits": ({"seed": 2**70}, "^seed must lie in"),
    "a negative data seed": ({"data.seed": -1}, "data.seed must lie in"),
    "a knowledge base seed past 64 bits": ({"data.kb_seed": 2**64}, "data.kb_seed"),
    "a BPE of no ids": ({"tokenizer": "bpe-english:0"}, "tokenizer 'bpe-english:0'.*from 259"),
    "a BPE of 'abc' ids": ({"tokenizer": "bpe:abc"}, "tokenizer 'bpe:abc'.*whole number"),
    "a BPE of a billion ids": ({"tokenizer": "bpe:1000000000"}, "to 1,048,576"),
}

#: fields of the wrong type or order, matched literally
TYPED_CASES = {
    "curriculum steps not increasing": ({"data.curriculum": [[5, 160], [0, 1000]]}, "data.curriculum's steps"),
    "curriculum from a negative step": ({"data.curriculum": [[-1, 160]]}, "data.curriculum's steps"),
    "an eval length given twice": (
        {"eval.passkey_lengths": [256, 256]},
        "eval.passkey_lengths gives 256 more than once",
    ),
    "an eval depth given twice": ({"eval.passkey_depths": [0.5, 0.5]}, "eval.passkey_depths gives 0.5 more than once"),
    "a curriculum from step 100": (
        {"data.curriculum": [[100, 256]]},
        "data.curriculum must start at step 0 (the first entry holds until the next), got [100]",
    ),
    "max_facts steps not increasing": ({"data.max_facts": [[10, 2], [10, 3]]}, "data.max_facts's steps"),
    "eval.every -1": ({"eval.every": -1}, "eval.every"),
    "eval.passkey_depths 2": ({"eval.passkey_depths": [2.0]}, "eval.passkey_depths"),
    "eval.passkey_lengths 0": ({"eval.passkey_lengths": [0]}, "eval.passkey_lengths"),
    "threads -1": ({"threads": -1}, "threads"),
    "optim.lr a string": ({"optim.lr": "big"}, "optim.lr must be a number"),
    "optim.warmup a float": ({"optim.warmup": 1.5}, "optim.warmup must be a whole number"),
    "optim.betas one number": ({"optim.betas": 0.9}, "optim.betas must be a list of 2 numbers"),
    "data.min_len_frac a string": ({"data.min_len_frac": "0.5"}, "data.min_len_frac must be a number"),
    "data.mix a list": ({"data.mix": ["passkey"]}, "data.mix must be a mapping"),
    "data.curriculum of strings": ({"data.curriculum": [["0", "256"]]}, "data.curriculum must be a list of lists"),
    "data.drill true": ({"data.drill": True}, "data.drill must be a whole number"),
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
    "data.text_weight NaN": ({"data.text_weight": float("nan")}, "data.text_weight must be a finite number >= 0"),
    "data.answer_weight -5": ({"data.answer_weight": -5.0}, "data.answer_weight must be a finite number >= 0"),
    "data.prompt_weight inf": ({"data.prompt_weight": float("inf")}, "data.prompt_weight must be a finite"),
    "every loss weight 0": (
        {"data.text_weight": 0.0, "data.answer_weight": 0.0},
        "data.text_weight, data.answer_weight and data.prompt_weight are all 0",
    ),
    "babilong tasks without lengths": (
        {"eval.babilong_tasks": ["qa1"]},
        "eval.babilong_tasks and eval.babilong_lengths go",
    ),
    "data.names unknown": ({"data.names": "xyz"}, "data.names must be one of ['babi', 'varied'], got 'xyz'"),
    "data.align_to past the curriculum": (
        {"data.align_to": 4096, "data.aligned_frac": 1.0},
        "data.align_to (4096) is longer than the curriculum's shortest max_len",
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


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"model": {"family": "sliding_window", "d_model": -3}}, "model: config field 'd_model' must be"),
        ({"model": {"family": "sliding_window", "bogus": 1}}, r"model: unknown config fields \['bogus'\]"),
        ({"init_from": "/nonexistent"}, "init_from: /nonexistent"),
    ],
)
def test_a_model_section_or_start_the_trainer_refuses_names_its_field(changes, named, tmp_path):
    from training import Trainer

    cfg = TrainConfig.from_dict({**train_config(out=str(tmp_path / "run")), **changes})
    with pytest.raises(ValueError, match=named):
        Trainer(cfg, progress=False)
    assert not (tmp_path / "run").exists()


# ----- the command lines: exit 2 and one line naming the file or field --------------------------
ROOT = Path(__file__).resolve().parent.parent


COMMAND_CASES = [
    "training config",
    "training config missing",
    "training config a folder",
    "training export into its run",
    "training export empty",
    "training threads 100000",
    "evaluate",
    "evaluate a huge grid",
    "probes",
    "probes threads",
    "probes threads 100000",
]


@pytest.mark.parametrize("case", COMMAND_CASES)
def test_the_command_lines_exit_2_with_one_line(case, tmp_path):
    config = tmp_path / "bad.train.json"
    config.write_text(json.dumps(train_config(**{"optim.steps": -5})))
    good = tmp_path / "good.train.json"
    good.write_text(json.dumps(train_config(out=str(tmp_path / "run"))))
    command, named = {
        "training config": (["-m", "training", "--config", str(config)], "optim.steps"),
        "training config missing": (["-m", "training", "--config", str(tmp_path / "none.json")], "none.json"),
        "training config a folder": (["-m", "training", "--config", str(tmp_path)], str(tmp_path)),
        "training export into its run": (
            ["-m", "training", "--config", str(good), "--export", str(tmp_path / "run" / "checkpoints")],
            "is the run folder",
        ),
        "training export empty": (["-m", "training", "--config", str(good), "--export", ""], "--export: an empty"),
        "training threads 100000": (["-m", "training", "--config", str(good), "--threads", "100000"], "--threads"),
        "probes threads 100000": (
            ["-m", "memviz_probes", "passkey", "infini_english_16k", "--lengths", "512", "--threads", "100000"],
            "--threads",
        ),
        "evaluate": (["-m", "training.evaluate", str(tmp_path / "nowhere")], "nowhere"),
        "evaluate a huge grid": (["-m", "training.evaluate", "sliding_window", "--n", "100000000"], "samples, over"),
        "probes": (["-m", "memviz_probes", "passkey", str(tmp_path / "nowhere"), "--lengths", "512"], "nowhere"),
        "probes threads": (
            ["-m", "memviz_probes", "passkey", "infini_english_16k", "--lengths", "512", "--threads", "0"],
            "--threads",
        ),
    }[case]
    out = subprocess.run(
        [sys.executable, "-W", "ignore", *command], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 2, out.stderr
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and named in lines[0], out.stderr


def test_generate_decodes_nothing_from_non_finite_logits():
    model = small_model("infini", segment_len=8)
    with torch.no_grad():
        model.blocks[1].mlp.W_down.weight[0, 0] = float("nan")  # the state and logits become NaN from the first token
    with pytest.raises(memviz.NonFiniteError, match=r"logits at the prompt's last token \(position 9\) are not finite"):
        model.generate("0123456789", max_new_tokens=4)


@pytest.mark.parametrize("family", ["infini", "lm2", "longmem", "gated_deltanet"])
def test_needle_hold_refuses_a_span_outside_the_input(family):
    from tests.conftest import FAMILY_CONFIGS, small_model

    model = small_model(family, **FAMILY_CONFIGS[family])
    ids = list(range(40))
    model.needle_hold(ids, (np.int64(3), 8))  # NumPy's integers are whole numbers too
    for span in [(10, 2), (-5, -1), (5, 10**6), (1.5, 3), (4, 4), 7]:
        with pytest.raises(ValueError, match=r"span .* inside the input's 40 tokens"):
            model.needle_hold(ids, span)
