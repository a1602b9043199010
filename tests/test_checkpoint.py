import json
import math
import os
import re
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import memviz
from memviz.checkpoint import SAMPLE_DIR, CheckpointError, load, resolve
from tests.conftest import random_ids, scrambled, small_model


@pytest.fixture
def saved(tmp_path):
    model = scrambled(small_model("sliding_window", window=16))
    path = memviz.save(model, tmp_path / "ckpt", card={"note": "test"})
    return model, path


def test_save_then_load_gives_identical_logits(saved):
    model, path = saved
    loaded = memviz.load(path)
    ids = random_ids(50)
    assert torch.equal(model(ids), loaded(ids))
    assert loaded.card["note"] == "test" and loaded.cfg == model.cfg
    assert sorted(p.name for p in path.iterdir()) == ["card.json", "config.json", "model.safetensors", "tokenizer.json"]


def test_half_precision_save_is_close_and_small(tmp_path):
    model = small_model("transformer")
    full = memviz.save(model, tmp_path / "f32") / "model.safetensors"
    half = memviz.save(model, tmp_path / "f16", dtype="float16") / "model.safetensors"
    assert half.stat().st_size < 0.6 * full.stat().st_size
    ids = random_ids(20)
    torch.testing.assert_close(memviz.load(half.parent)(ids), model(ids), atol=1e-3, rtol=1e-3)


def test_missing_folder_and_files(saved, tmp_path):
    _, path = saved
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        memviz.load(tmp_path / "nowhere")
    (path / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match=r"model\.safetensors: missing"):
        memviz.load(path)


def test_a_sample_in_a_family_folder_loads_by_its_project_path_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    folder = SAMPLE_DIR.parent / "families" / "gated_deltanet" / "sample_ruler"
    assert resolve("families/gated_deltanet/sample_ruler") == folder
    assert resolve("families/gated_deltanet/sample_16k") == folder.parent / "sample_16k"  # retired: its card
    assert resolve("families/gated_deltanet") == Path("families/gated_deltanet")  # no checkpoint there
    with pytest.raises(CheckpointError, match="no such checkpoint folder"):
        load("families/gated_deltanet")
    with pytest.raises(CheckpointError, match="a file, not a checkpoint folder"):
        load(folder / "config.json")


@pytest.mark.parametrize(
    "path, message",
    [("", "an empty checkpoint path"), ("  ", "an empty checkpoint path"), (None, "not NoneType"), (3, "not int")],
)
def test_an_empty_or_wrongly_typed_path_is_named_not_read_as_the_working_folder(path, message):
    with pytest.raises(CheckpointError, match=message):
        load(path)


def test_corrupt_safetensors(saved):
    _, path = saved
    weights = path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(CheckpointError, match=r"model\.safetensors: not a readable safetensors file"):
        memviz.load(path)


def test_a_weights_file_larger_than_its_model_is_refused_unread(saved, monkeypatch):
    _, path = saved
    weights = path / "model.safetensors"
    with weights.open("ab") as fh:  # a file far larger than the config's model (sparse: no disk used)
        fh.truncate(weights.stat().st_size + (64 << 20))
    read = []
    monkeypatch.setattr(memviz.checkpoint, "read_weights", lambda p: read.append(p))
    with pytest.raises(
        CheckpointError, match=r"model\.safetensors: .* more than the config's model can hold.*nothing was read"
    ):
        memviz.load(path)
    assert read == []


def test_a_card_that_is_not_an_object_is_one_clear_error(saved):
    _, path = saved
    (path / "card.json").write_text("[1, 2]")
    with pytest.raises(CheckpointError, match=r"card\.json: a card must be a JSON object, got list"):
        memviz.load(path)


def test_pickle_in_place_of_weights_is_rejected(saved):
    import pickle

    _, path = saved
    (path / "model.safetensors").write_bytes(pickle.dumps({"embed.weight": [1, 2, 3]}))
    with pytest.raises(CheckpointError, match="not a readable safetensors file"):
        memviz.load(path)


def test_unknown_family_and_bad_config(saved):
    _, path = saved
    config = path / "config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "family": "hyperdrive"}))
    with pytest.raises(CheckpointError, match=r"config\.json: unknown model family 'hyperdrive'"):
        memviz.load(path)
    config.write_text("{broken")
    with pytest.raises(CheckpointError, match=r"config\.json: config is not valid JSON"):
        memviz.load(path)


def test_mismatched_shapes(saved):
    _, path = saved
    config = path / "config.json"
    data = json.loads(config.read_text())
    config.write_text(json.dumps({**data, "d_mlp": 96}))
    with pytest.raises(
        CheckpointError,
        match=r"model\.safetensors: tensor 'blocks\.0\.mlp\.W_down\.weight' has shape \(32, 64\) but the config's "
        r"model needs \(32, 96\)",
    ):
        memviz.load(path)
    config.write_text(json.dumps({**data, "n_layers": 3}))
    with pytest.raises(CheckpointError, match="weights do not match the config's model: missing"):
        memviz.load(path)


def test_corrupt_tokenizer_and_card(saved):
    _, path = saved
    (path / "card.json").write_text("[unclosed")
    with pytest.raises(CheckpointError, match=r"card\.json: not valid JSON"):
        memviz.load(path)
    (path / "card.json").write_text("{}")
    (path / "tokenizer.json").write_bytes(b"\xff\xfe")
    with pytest.raises(CheckpointError, match=r"tokenizer\.json"):
        memviz.load(path)


def test_failed_save_leaves_the_previous_checkpoint_intact(saved, monkeypatch):
    model, path = saved
    before = (path / "model.safetensors").read_bytes()

    def explode(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr("os.fsync", explode)
    with pytest.raises(OSError, match="disk full"):
        memviz.save(model, path)
    assert (path / "model.safetensors").read_bytes() == before
    assert not [p for p in path.iterdir() if p.name.endswith(".tmp")]


KILLED_SAVER = """
import sys, torch, memviz
from memviz import ModelConfig
torch.manual_seed(1)
cfg = ModelConfig(family="transformer", d_model=48, n_layers=2, n_heads=2, d_mlp=96, vocab_size=259)
model = memviz.build_model(cfg)
print("ready", flush=True)
while True:
    memviz.save(model, sys.argv[1])
    print("saved", flush=True)
"""


def test_a_save_killed_at_any_moment_leaves_a_whole_checkpoint(tmp_path):
    """`memviz.save` over a good checkpoint, killed with SIGKILL part-way, many times: the folder always loads,
    as the old model or the new one, never new weights beside the old config; a file the save did not write stays."""
    import signal
    import subprocess
    import sys
    import time

    folder = tmp_path / "ckpt"
    memviz.save(small_model("transformer"), folder)
    (folder / "notes.txt").write_text("mine")
    script = tmp_path / "saver.py"
    script.write_text(KILLED_SAVER)
    widths = set()
    # (whole saves to wait for, then a delay): kills inside the first save, and inside a later one
    for saves, delay in [(0, 0.0), (0, 0.01), (0, 0.03), (0, 0.05), (0, 0.08), (1, 0.0), (1, 0.02), (2, 0.05)]:
        proc = subprocess.Popen([sys.executable, str(script), str(folder)], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        for _ in range(saves):
            assert proc.stdout.readline().strip() == "saved"
        time.sleep(delay)
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        widths.add(memviz.load(folder).cfg.d_model)
        assert (folder / "notes.txt").read_text() == "mine"
    assert widths <= {32, 48} and 48 in widths  # 48: at least the kills after a whole save
    memviz.save(small_model("transformer"), folder)  # the next save clears what the killed ones left beside it
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckpt")] == []


@pytest.mark.parametrize("can_exchange", [True, False])
def test_a_save_keeps_the_files_and_links_it_did_not_write_and_follows_a_linked_folder(
    tmp_path, monkeypatch, can_exchange
):
    from memviz import files

    if not can_exchange:  # a file system without renameat2's exchange: the two renames
        monkeypatch.setattr(files, "exchange", lambda a, b: False)
    target = tmp_path / "real"
    memviz.save(small_model("transformer"), target)
    (target / "notes.txt").write_text("mine")
    (target / "plots").mkdir()
    (target / "plots" / "a.txt").write_text("a")
    (target / "elsewhere").symlink_to(tmp_path)
    (tmp_path / "link").symlink_to(target)
    memviz.save(small_model("transformer", d_model=48, d_mlp=96), tmp_path / "link")
    assert (tmp_path / "link").is_symlink() and memviz.load(tmp_path / "link").cfg.d_model == 48
    assert (target / "notes.txt").read_text() == "mine" and (target / "plots" / "a.txt").read_text() == "a"
    assert (target / "elsewhere").is_symlink() and os.readlink(target / "elsewhere") == str(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["link", "real"]
    with pytest.raises(ValueError, match="notes.txt exists and is not a folder: nothing written over it"):
        memviz.save(small_model("transformer"), target / "notes.txt")
    assert (target / "notes.txt").read_text() == "mine"


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


@pytest.mark.parametrize("device", ["cuda:99", "tpu", 3.5, "meta", "xpu"])
def test_a_device_this_machine_cannot_run_is_named(folder, device):
    with pytest.raises(ValueError, match=f"device '?{device}"):
        memviz.load(folder, device=device)


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


def test_a_card_over_its_size_cap_or_not_a_file_is_refused_naming_it(tmp_path, monkeypatch):
    import memviz.checkpoint as checkpoint

    folder = memviz.save(small_model("sliding_window", window=8), tmp_path / "ckpt")
    card = folder / "card.json"
    card.unlink()
    os.mkfifo(card)  # a reader of a pipe waits for a writer: it must not be opened
    with pytest.raises(memviz.CheckpointError, match=f"{re.escape(str(card))}: card file .* is not a regular file"):
        memviz.load(folder)
    card.unlink()
    card.write_text(json.dumps({"note": "x" * 200}))
    monkeypatch.setattr(checkpoint, "MAX_CARD_FILE_BYTES", 100)
    with pytest.raises(memviz.CheckpointError, match=f"{re.escape(str(card))}: card file .* over the 100"):
        memviz.load(folder)


def test_a_folder_holding_no_checkpoint_is_answered_as_a_missing_one(tmp_path):
    """The Model page, and memviz.load, do not tell whether a folder exists: a folder holding none of a checkpoint's
    files (a home folder) gets the message of a folder that is not there; a checkpoint with a file missing is named."""
    (tmp_path / "notes.txt").write_text("a user's own file")
    said = []
    for path in (tmp_path, tmp_path / "nowhere"):
        with pytest.raises(CheckpointError, match="no such checkpoint folder") as refused:
            memviz.load(path)
        said.append(str(refused.value).replace(str(path), "<folder>"))
    assert said[0] == said[1]
    (tmp_path / "tokenizer.json").write_text("{}")
    with pytest.raises(CheckpointError, match=r"config\.json: missing"):
        memviz.load(tmp_path)
    (tmp_path / "config.json").write_text('{"d_model": ')
    with pytest.raises(CheckpointError, match=r"config\.json: .*JSON"):
        memviz.load(tmp_path)
