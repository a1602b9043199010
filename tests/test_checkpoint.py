import json
import os
from pathlib import Path

import pytest
import torch

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
