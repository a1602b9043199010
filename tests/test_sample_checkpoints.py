"""The shipped zoo: every sample loads, its card matches its recipe, and the contrast the zoo
exists to show holds when measured afresh (not read from the card): each long-context memory
sample finds a pass key that its sliding-window control, with the same window, cannot reach,
and Memory+ recalls facts that a dense model of the same compute has not stored."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

import memviz
from memviz_probes import facts, passkey
from training import TrainConfig

ROOT = Path(__file__).resolve().parent.parent / "sample_checkpoints"
SAMPLES = sorted(p.name for p in ROOT.iterdir() if (p / "config.json").exists())
#: folders whose weights left the tree (their card stays, naming the commit that holds them)
RETIRED = sorted(
    p.parent
    for p in [*ROOT.glob("*/card.json"), *ROOT.parent.glob("families/*/sample*/card.json")]
    if not (p.parent / "config.json").exists()
)
CARD_FIELDS = {"train_command", "train_config", "steps", "wall_time_s", "machine", "probe_scores", "parameters"}


def test_the_zoo_ships_a_memory_model_and_its_control():
    assert {
        "infini_long",
        "lm2_english_16k",
        "titans_english_16k",
        "longmem_english",
        "sliding_window",
        "memory_plus_english",
        "memory_plus_shared",
        "dense",
        "dense_english",
        "gated_deltanet_english_16k",
        "longmem_long",
        "infini_english_16k",
        "sliding_window_english",
    } <= set(SAMPLES)


@pytest.mark.parametrize("folder", RETIRED, ids=lambda p: p.name)
def test_a_retired_sample_names_the_commit_that_holds_its_weights(folder):
    """A retired sample keeps only its card; `retired.restore` brings the weights back from git history
    (checked when this is a git checkout with that history), and loading it says so."""
    card = json.loads((folder / "card.json").read_text())
    relative = folder.relative_to(ROOT.parent).as_posix()
    assert card["retired"]["restore"] == f"git checkout {card['retired']['commit']} -- {relative}"
    assert sorted(p.name for p in folder.iterdir()) == ["card.json"]
    with pytest.raises(memviz.CheckpointError, match="retired"):
        memviz.load(folder)
    if shutil.which("git") and (ROOT.parent / ".git").exists():
        tree = subprocess.run(
            ["git", "ls-tree", "--name-only", card["retired"]["commit"], f"{relative}/"],
            cwd=ROOT.parent,
            capture_output=True,
            text=True,
        )
        if (
            "not a tree object" not in tree.stderr and "bad object" not in tree.stderr.lower()
        ):  # a shallow clone lacks it
            assert {f"{relative}/{n}" for n in ("config.json", "model.safetensors", "tokenizer.json")} <= set(
                tree.stdout.split()
            )


@pytest.mark.parametrize("name", SAMPLES)
def test_each_sample_loads_and_its_card_matches_its_recipe(name):
    model = memviz.load(ROOT / name)
    card = json.loads((ROOT / name / "card.json").read_text())
    assert CARD_FIELDS <= set(card)
    recipe_path = ROOT / f"{name}.train.json"
    assert f"--config sample_checkpoints/{name}.train.json" in card["train_command"]
    recipe = TrainConfig.load(recipe_path).to_dict()
    trained = TrainConfig.from_dict(card["train_config"]).to_dict()
    for section in ("model", "data", "optim", "seed", "init_from"):
        assert trained[section] == recipe[section], f"{name}: card and recipe differ in {section}"
    assert model.family == recipe["model"]["family"]
    assert model.num_parameters() == card["parameters"]


STAGED = [name for name in SAMPLES if TrainConfig.load(ROOT / f"{name}.train.json").init_from is not None]


def tracked(path: str) -> bool:
    """Whether `path` (from the project's root) is in git: what a fresh clone has, unlike an ignored `runs/` folder
    (outside a git checkout: whether it is there)."""
    if not (shutil.which("git") and (ROOT.parent / ".git").exists()):
        return (ROOT.parent / path).exists()
    return (
        subprocess.run(["git", "ls-files", "--error-unmatch", path], cwd=ROOT.parent, capture_output=True).returncode
        == 0
    )


@pytest.mark.parametrize("name", STAGED)
def test_a_sample_trained_in_stages_is_reproduced_by_its_cards_command_alone(name):
    """A recipe that starts from another checkpoint (`init_from`) starts from a sample in git (shipped,
    or retired with a card that says how to restore it), or from one that its card's command exports
    before the recipe's own stage runs."""
    init_from = TrainConfig.load(ROOT / f"{name}.train.json").init_from
    if tracked(f"{init_from}/card.json"):
        return
    command = json.loads((ROOT / name / "card.json").read_text())["train_command"]
    stage = f"--export {init_from} "
    assert stage in command, f"{name} starts from {init_from}, which neither ships nor is trained by {command!r}"
    assert command.index(stage) < command.index(f"--config sample_checkpoints/{name}.train.json")


#: samples whose memory carries a key two windows back, where the control cannot see it (what a memory reset at
#: the question does: `benchmarks/passkey_diagnostics.py`)
LONG_CONTEXT_MEMORY = ("infini_long", "lm2_english_16k", "titans_english_16k", "longmem_english")


@pytest.fixture(scope="module")
def passkey_two_windows_back():
    """Pass key at 256 tokens with the needle at depth 0.1 or 0.5, at least two 64-token windows
    (segments) before the question: (exact share, mean leading digits right) per sample."""

    def measure(name):
        df = passkey.run(memviz.load(ROOT / name), [256], [0.1, 0.5], n=8, seed=7, progress=False)
        return float(df["correct"].mean()), float(df["leading_digits"].mean())

    return {name: measure(name) for name in [*LONG_CONTEXT_MEMORY, "sliding_window"]}


def test_the_control_cannot_reach_a_needle_two_windows_back(passkey_two_windows_back):
    exact, digits = passkey_two_windows_back["sliding_window"]
    assert exact <= 0.3 and digits <= 2.5, (exact, digits)


@pytest.mark.parametrize("name", LONG_CONTEXT_MEMORY)
def test_each_memory_sample_reads_the_key_from_its_memory(name, passkey_two_windows_back):
    exact, digits = passkey_two_windows_back[name]
    control_exact, control_digits = passkey_two_windows_back["sliding_window"]
    assert exact >= 0.8 and exact >= control_exact + 0.5, (exact, control_exact)
    assert digits >= 4.5 and digits >= control_digits + 2.5, (digits, control_digits)


def facts_recall(model, hooks=()) -> float:
    """Recall of 100 facts of the 2000 people the model learnt, on a fresh probe seed."""
    with model.hooks(fwd_hooks=list(hooks)):
        return float(facts.run(model, n=100, seed=9, progress=False)["correct"].mean())


def test_memory_plus_recalls_twice_the_facts_of_a_dense_model_of_the_same_compute():
    """Memory+ keeps the facts in its value table: with either memory layer's top-k weights zeroed,
    recall collapses. memory_plus_shared has two memory layers reading one value pool (the paper's
    sharing); the dense model was trained alike on the same tokens (the retired memory_plus, one layer,
    recalled 96.5% against it)."""
    memory_plus, dense = memviz.load(ROOT / "memory_plus_shared"), memviz.load(ROOT / "dense")
    with_memory, dense_recall = facts_recall(memory_plus), facts_recall(dense)
    assert with_memory >= 0.8 and with_memory >= 2 * dense_recall, (with_memory, dense_recall)
    for layer in memory_plus.memory_layers:
        silenced = facts_recall(memory_plus, memory_plus.silence_hooks(layer))
        assert silenced <= 0.1, (layer, silenced)
    assert memory_plus.memory_layers == [0, 1]
    assert all(memory_plus.blocks[layer].mlp.values is memory_plus.values for layer in (0, 1))


def test_memory_plus_english_reads_english_and_recalls_its_facts_mostly_from_its_values():
    """The English memory-layer sample recalls its facts (the issue's bar: 90%); zeroing its top-k
    weights takes most of them away (the 4-layer backbone keeps about a sixth, docs/samples.md)."""
    model = memviz.load(ROOT / "memory_plus_english")
    assert facts_recall(model) >= 0.9
    assert facts_recall(model, model.silence_hooks(1)) <= 0.4


#: samples trained to keep a pass key far past the first stages' lengths (docs/long_context.md, docs/samples.md)
LONG_RANGE = ("infini_long", "longmem_long", "titans_english_16k", "lm2_english_16k")


@pytest.fixture(scope="module")
def passkey_at_4k():
    """Pass key at 4096 tokens, needle at depth 0.1 or 0.5 (thousands of tokens before the
    question, 30-60 windows back), on a fresh seed: the exact share per sample."""

    def measure(name):
        return float(
            passkey.run(memviz.load(ROOT / name), [4096], [0.1, 0.5], n=4, seed=13, progress=False)["correct"].mean()
        )

    return {name: measure(name) for name in [*LONG_RANGE, "sliding_window"]}


@pytest.mark.parametrize("name", LONG_RANGE)
def test_a_long_range_sample_keeps_the_key_at_4k_where_the_control_cannot(name, passkey_at_4k):
    assert passkey_at_4k[name] >= 0.75 and passkey_at_4k["sliding_window"] <= 0.25, passkey_at_4k


#: the English samples: memory samples beside the controls trained on the same data (docs/samples.md)
ENGLISH = sorted(n for n in SAMPLES if "_english" in n)  # gated_deltanet_english_16k: a later stage of one
ENGLISH_CONTROL = "sliding_window_english"


@pytest.fixture(scope="module")
def english_reading():
    """Bits per byte on the first 4,096 tokens of held-out Hamlet and The Tempest, and the pass key at 2,048
    tokens (depths 0.25 / 0.75, 4 keys each, procedural filler: in the plays the memories mostly lose it,
    docs/samples.md), each measured afresh."""
    from memviz_probes import lm

    def measure(name):
        model = memviz.load(ROOT / name)
        bits = lm.summary(lm.run(model, "shakespeare", max_tokens=4096))["bits_per_byte"].item()
        key = passkey.run(model, [2048], [0.25, 0.75], n=4, seed=23, progress=False)["correct"].mean()
        return bits, float(key)

    return {name: measure(name) for name in ENGLISH}


@pytest.mark.parametrize("name", ENGLISH)
def test_an_english_sample_reads_held_out_english_as_well_as_its_control(name, english_reading):
    """At most 2.3 bits a byte on held-out Shakespeare (a uniform byte guess is 8, the old samples 10) and no
    more than 5% above the sliding-window control trained on the same data."""
    bits, control = english_reading[name][0], english_reading[ENGLISH_CONTROL][0]
    assert bits <= 2.3 and bits <= 1.05 * control, (bits, control)


#: the English samples whose memory spans the input (the controls and the memory layers' facts samples have none)
LONG_FAMILIES = {"infini", "lm2", "titans", "longmem", "gated_deltanet"}
ENGLISH_LONG = [n for n in ENGLISH if json.loads((ROOT / n / "config.json").read_text())["family"] in LONG_FAMILIES]


@pytest.mark.parametrize("name", ENGLISH_LONG)
def test_an_english_memory_sample_keeps_a_pass_key_its_control_loses(name, english_reading):
    key, control = english_reading[name][1], english_reading[ENGLISH_CONTROL][1]
    assert key >= control + 0.375 and control <= 0.125, (key, control)


def test_longmem_english_reread_reads_a_held_out_passage_again_from_its_memory():
    """The sample taught to re-read (docs/rereading.md): a 300-token held-out passage read again 1k, 4k and 16k
    tokens after its first reading, far past the 64-token window, costs at least 20% less the second time at 4k and
    16k (the issue's target); its sliding-window control, trained on the same text, reads both alike (within 2%).
    Measured afresh on a seed the docs' tables did not use."""
    from memviz_probes import reread

    models = {"sample": memviz.load(ROOT / "longmem_english_reread"), "control": memviz.load(ROOT / ENGLISH_CONTROL)}
    distances = [1024, 4096, 16384]
    change = reread.summary(reread.compare(models, distances=distances, n=4, seed=31))["change"]
    assert change["sample", 1024] <= -0.3 and change["sample", 4096] <= -0.2 and change["sample", 16384] <= -0.2, change
    assert all(abs(change["control", d]) <= 0.02 for d in distances), change


def test_longmem_english_reread_answers_mqar_past_its_window_untrained():
    """Associative recall from a copying backbone (docs/mqar.md): of the MQAR queries 64 or more tokens after their
    pair, past the window, the sample drilled to copy answers far above chance (1 / 8) among the stored values, its
    control below it. Neither was trained on MQAR; a seed the docs' tables did not use."""
    from memviz_probes import mqar

    past_window = {}
    for name in ("longmem_english_reread", ENGLISH_CONTROL):
        df = mqar.run(memviz.load(ROOT / name), [1024], [8], n=20, seed=8, progress=False)
        far = df[df["distance"] >= 64]
        assert len(far) >= 50, len(far)
        past_window[name] = float(far["correct_among_values"].mean())
    assert past_window["longmem_english_reread"] >= 0.25 and past_window[ENGLISH_CONTROL] <= 0.2, past_window
