"""The re-reading probe: a passage read twice, its loss at each reading, against a copying model whose losses are
known in closed form and against the language-modelling probe's own loss on the same tokens laid out by hand."""

from __future__ import annotations

import contextlib
import math
import random

import numpy as np
import pandas as pd
import pytest
import torch

import memviz
from memviz.tokenizer import ByteTokenizer
from memviz_probes import lm, reread
from memviz_probes.__main__ import main
from memviz_probes.registry import get_probe
from tests.conftest import small_model

VOCAB = 256
#: a copying model matches this many tokens before it copies the one that followed them
MATCH = 6


class Copier:
    """A model that copies from its context: where the last `MATCH` tokens occurred before within its `window`
    (the match and the token after it inside the window), all its probability but e^-30 goes to the token that
    followed them; elsewhere it predicts uniformly. Its loss is ln 256 a token where it finds nothing and ~0 where
    it copies right."""

    family = "copier"
    device = torch.device("cpu")

    def __init__(self, window: int | None = None) -> None:
        self.tokenizer, self.window = ByteTokenizer(), window

    def evaluating(self):
        return contextlib.nullcontext()

    def stream(self, tokens, chunk_len=None, state=None):
        ids = tokens[0].tolist()
        logits = torch.zeros(1, len(ids), VOCAB, dtype=torch.float64)
        for t in range(MATCH - 1, len(ids)):
            earliest = MATCH - 1 if self.window is None else max(MATCH - 1, t - self.window + MATCH)
            for j in range(t - 1, earliest - 1, -1):
                if ids[j - MATCH + 1 : j + 1] == ids[t - MATCH + 1 : t + 1]:
                    logits[0, t, ids[j + 1]] = 30.0
                    break
        for start in range(0, len(ids), 64):
            yield start, logits[:, start : start + 64], None


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Two documents of random letters (any 6 letters in a row occur once): a passage from one, filler from the
    other."""
    folder = tmp_path_factory.mktemp("corpus")
    rng = random.Random(0)
    for name, size in (("alpha", 1500), ("beta", 2500)):
        (folder / f"{name}.txt").write_text("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(size)))
    return str(folder)


def test_a_copier_reads_the_second_time_free_while_its_window_reaches_the_first(corpus):
    kw = dict(distances=[20, 400], n=3, seed=1, passage_len=100, lead=150, corpus=corpus, split="all")
    df = reread.compare({"all": Copier(), "window 250": Copier(window=250)}, **kw)
    unmatched_share = (MATCH - 1) / (100 - 1)  # the second reading's first tokens follow filler, not the passage
    assert np.allclose(df["first"], math.log(VOCAB))
    everything = df[df["model"] == "all"]
    assert np.allclose(everything["second"], unmatched_share * math.log(VOCAB), atol=1e-6)
    assert np.allclose(everything["change"], unmatched_share - 1, atol=1e-6)
    window = df[df["model"] == "window 250"].set_index(["distance", "passage"])
    assert np.allclose(window.loc[20, "change"], unmatched_share - 1, atol=1e-6)  # 20 + 100 tokens back: seen
    assert (window.loc[400, "change"] == 0).all()  # 400 tokens back, past its window: read as the first time
    assert (df["tokens"] == 150 + 2 * 100 + df["distance"]).all()
    assert set(df["filler"]) | set(df["document"]) == {"alpha", "beta"} and (df["filler"] != df["document"]).all()
    table = reread.summary(df)
    assert table.loc[("window 250", 400), "change"] == 0 and table.loc[("all", 20), "passages"] == 3


def layout(corpus: str, row, lead: int, passage: int) -> list[int]:
    """A row's sample as token ids built from the documents' own bytes: lead, passage, filler, passage."""
    docs = {d.name: list(d.text.encode()) for d in lm.select(corpus, "all", None)}
    text, fill = docs[row.document], docs[row.filler]
    part = text[row.start : row.start + passage]
    after = row.filler_start + lead
    return fill[row.filler_start : after] + part + fill[after : after + row.distance] + part


def test_both_readings_are_the_language_model_probes_loss_on_the_same_tokens(corpus):
    # float64: a float32 model's loss at a token moves by ~1e-11 with the length of the run on some CPUs' kernels
    model = small_model("sliding_window", window=16, seed=3).double()
    lead, passage = 40, 50
    df = reread.run(model, distances=[30, 120], n=2, seed=5, passage_len=passage, lead=lead, corpus=corpus, split="all")
    for row in df.itertuples():
        ids = layout(corpus, row, lead, passage)
        losses = lm.token_losses(model, ids)
        second_start = lead + passage + row.distance
        assert row.tokens == len(ids)
        assert row.first == pytest.approx(losses[lead : lead + passage - 1].mean(), rel=1e-12)
        assert row.second == pytest.approx(losses[second_start : second_start + passage - 1].mean(), rel=1e-12)
        alone = lm.token_losses(model, ids[: lead + passage])  # the first reading, nothing after it read
        assert row.first == pytest.approx(alone[lead:].mean(), rel=1e-12)
        assert row.change == pytest.approx(row.second / row.first - 1)
    first = df.groupby("passage")["first"]
    assert (first.max() - first.min()).abs().max() < 1e-12  # one passage, one first reading, whatever the distance


def test_passages_are_drawn_by_seed_from_different_places(corpus):
    kw = dict(distances=[64], n=6, passage_len=100, lead=50, corpus=corpus, split="all")
    once, again, other = (reread.run(Copier(), seed=s, **kw) for s in (0, 0, 1))
    places = ["document", "start", "filler", "filler_start"]
    assert once[places].equals(again[places])
    assert not once[places].equals(other[places]) and once["start"].nunique() == 6


def test_the_figure_draws_the_change_against_distance_and_dashes_the_control(corpus):
    df = pd.DataFrame(
        {
            "model": ["memory"] * 2 + ["window"] * 2,
            "distance": [64, 4096] * 2,
            "first": [4.0, 4.0, 4.0, 4.0],
            "second": [1.0, 3.0, 4.0, 4.0],
            "control": [False, False, True, True],
        }
    )
    fig = reread.curve(df)
    assert [t.name for t in fig.data] == ["memory", "window (control)"] and fig.layout.xaxis.type == "log"
    assert list(fig.data[0].y) == [-0.75, -0.25] and list(fig.data[0].x) == [64, 4096]
    assert fig.data[0].line.dash == "solid" and fig.data[1].line.dash == "dash"
    named = reread.curve(df.replace({"window": "window (control)"}), controls=["memory"])
    assert [t.name for t in named.data] == ["memory (control)", "window (control)"]  # named a control once


def test_the_registered_probe_runs_from_the_command_line(corpus, folder, tmp_path, capsys):
    out, other = tmp_path / "out", memviz.save(small_model("sliding_window", window=8, seed=1), tmp_path / "other")
    argv = ["reread", str(folder), str(other), "--distances", "16", "48", "--n", "2", "--passage-len", "40"]
    argv += ["--lead", "20", "--corpus", corpus, "--split", "all", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    df = pd.read_csv(out / "reread.csv")
    assert len(df) == 2 * 2 * 2 and set(df["distance"]) == {16, 48} and "change" in capsys.readouterr().out
    assert "Re-reading" in (out / "reread.html").read_text()
    table = get_probe("reread").run_with(
        Copier(), distances=[16], n=1, passage_len=40, lead=20, corpus=corpus, split="all"
    )
    assert table["model"].tolist() == ["model"] and table["change"].iloc[0] < -0.8


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(distances=[0]), r"distances must be a whole number of tokens in 1\.\.1,048,576, got 0"),
        (dict(distances=[]), "distances must name at least one distance"),
        (dict(distances=[64, 64]), "distances gives 64 more than once"),
        (dict(distances=64), "distances must be a list"),
        (dict(passage_len=5000), r"passage_len \(5,000 tokens\) is longer than every document"),
        (dict(passage_len=1), "passage_len must be a whole number of tokens in 2"),
        (dict(lead=-1), "lead must be a whole number of tokens in 0"),
        (dict(distances=[2400]), r"lead \+ the longest of distances need 2,500 tokens of another document"),
        (dict(n=0), "n must be a positive integer"),
        (dict(corpus=""), "corpus must name a corpus"),
        (dict(split="heldout"), "no heldout documents"),
    ],
)
def test_bad_arguments_are_named(corpus, kwargs, named):
    kw = dict(distances=[64], n=1, passage_len=100, lead=100, corpus=corpus, split="all") | kwargs
    with pytest.raises(ValueError, match=named):
        reread.run(Copier(), **kw)


def test_a_corpus_of_one_held_out_document_is_refused_with_why():
    with pytest.raises(ValueError, match=r"botchan holds one document \(chapter_11\).*choose a corpus of several"):
        reread.run(Copier(), distances=[64], n=1, corpus="botchan")


def test_a_summary_of_nothing_is_refused():
    with pytest.raises(ValueError, match="summary needs the rows of reread.run"):
        reread.summary(pd.DataFrame())


class Recorder(Copier):
    """The copier, keeping every sample it reads."""

    def __init__(self) -> None:
        super().__init__()
        self.read: list[list[int]] = []

    def stream(self, tokens, chunk_len=None, state=None):
        self.read.append(tokens[0].tolist())
        return super().stream(tokens, chunk_len, state)


def test_a_shuffled_passage_is_the_same_permutation_at_both_readings_and_only_copying_lowers_it(corpus):
    lead, passage = 60, 100
    kw = dict(distances=[20, 300], n=3, seed=4, passage_len=passage, lead=lead, corpus=corpus, split="all")
    recorder = Recorder()
    df = reread.run(recorder, order="shuffled", **kw)
    assert (df["order"] == "shuffled").all() and len(recorder.read) == len(df)
    for row, ids in zip(df.itertuples(), recorder.read):
        written = layout(corpus, row, lead, passage)  # the same sample with the passage as written
        second = lead + passage + row.distance
        first_reading, second_reading = ids[lead : lead + passage], ids[second : second + passage]
        assert first_reading == second_reading and sorted(first_reading) == sorted(written[lead : lead + passage])
        assert first_reading != written[lead : lead + passage]
        assert ids[:lead] == written[:lead] and ids[lead + passage : second] == written[lead + passage : second]
    orders = [ids[lead : lead + passage] for ids in recorder.read]
    assert orders[0] == orders[3] and orders[0] != orders[1]  # one order a passage, whatever the distance
    unmatched_share = (MATCH - 1) / (passage - 1)
    assert np.allclose(df["change"], unmatched_share - 1, atol=1e-6)  # the copier copies a shuffled passage alike
    again = reread.run(Recorder(), order="shuffled", **kw)
    assert again.equals(df)
    with pytest.raises(ValueError, match=r"order must be one of \['text', 'shuffled'\], got 'reversed'"):
        reread.run(Copier(), order="reversed", **kw)


def numpy_oracle(ids: list[int], key_dims: int, rule: str, context: int, value_dims: int) -> np.ndarray:
    """The oracle memory token by token in float64: write (key of the context ending at t - 1, value of ids[t]),
    then read with the key of the context ending at t and name the nearest value's token."""
    keys, values, tokens, token_of = reread.oracle_vectors(ids, key_dims, value_dims, context)
    keys, values, tokens, token_of = keys.double().numpy(), values.double().numpy(), tokens.numpy(), token_of.numpy()
    memory = np.zeros((key_dims, value_dims))
    predicted = [-1]
    for t in range(1, len(ids) - 1):
        k, v = keys[t - 1], values[token_of[t]]
        memory += np.outer(k, v if rule == "additive" else v - memory.T @ k)
        predicted.append(int(tokens[np.argmax(values @ (memory.T @ keys[t]))]))
    return np.array(predicted)


@pytest.mark.parametrize("rule", ["additive", "delta"])
@pytest.mark.parametrize("context", [1, 2])
def test_the_oracle_memory_predicts_as_its_recurrence_in_numpy(rule, context):
    rng = random.Random(f"{rule}{context}")
    ids = [rng.randrange(7) for _ in range(90)]  # 7 tokens: contexts recur
    predicted = reread.oracle_predictions(ids, 12, rule, context=context, value_dims=16)
    assert predicted.shape == (89,) and predicted[0] == -1
    assert (predicted == numpy_oracle(ids, 12, rule, context, 16)).all()
    keys, _, _, _ = reread.oracle_vectors(ids, 12, 16, context)
    same = [t for t in range(context, 90) if ids[t - context + 1 : t + 1] == ids[:context]]
    assert same and all(torch.equal(keys[t], keys[context - 1]) for t in same)  # one key a context


def test_the_memory_ceiling_recalls_a_passage_its_keys_hold_and_loses_it_to_filler(corpus):
    kw = dict(n=2, seed=3, passage_len=60, lead=40, corpus=corpus, split="all", context=4)
    df = reread.memory_ceiling(Copier(window=8), key_dims=[8, 2048], distances=[4, 1200], **kw)
    assert len(df) == 2 * 2 * 2 * 2 and set(df["rule"]) == {"additive", "delta"}
    cell = df.groupby(["rule", "key_dims", "distance"])[["recall_first", "recall", "change"]].mean()
    for rule in ("additive", "delta"):
        # 2,048 dimensions hold ~100 contexts' pairs: every token whose 4-token context lies in the passage is named
        assert cell.loc[(rule, 2048, 4), "recall"] >= (60 - 4) / (60 - 1) - 1e-9
        assert cell.loc[(rule, 8, 1200), "recall"] < 0.15  # 8 hold next to nothing of 1,300 writes
    assert (cell["recall_first"] < 0.1).all()  # random letters: a first reading has nothing to copy
    # the copier's loss is ln 256 at every token past its 8-token window: each reading costs that on what is not named
    assert np.allclose(df["first"], math.log(VOCAB) * (1 - df["recall_first"]))
    assert np.allclose(df["second"], math.log(VOCAB) * (1 - df["recall"]))
    assert np.allclose(df["change"], df["second"] / df["first"] - 1)


def test_the_memory_ceiling_weighs_each_token_by_the_controls_loss_on_it(corpus):
    kw = dict(key_dims=[2048], distances=[4], n=2, seed=3, passage_len=60, lead=40, corpus=corpus, split="all")
    df = reread.memory_ceiling(Copier(), context=4, **kw)
    # The copier pays ln 256 on the second reading's tokens 2..6 only (its match needs 6 tokens), ~0 after. Of those
    # five the oracle names tokens 5 and 6, whose 4-token contexts lie in the passage: 3 of the 59 tokens still cost.
    assert np.allclose(df["second"], 3 * math.log(VOCAB) / 59, atol=1e-9) and (df["recall"] > 0.9).all()
    assert np.allclose(df["first"], math.log(VOCAB) * (1 - df["recall_first"]))  # random letters: nothing to copy


@pytest.mark.parametrize("rule", ["additive", "delta"])
def test_the_oracle_memory_reads_nothing_from_a_sequence_too_short_to_write(rule):
    assert reread.oracle_predictions([], 8, rule).shape == (0,)
    assert reread.oracle_predictions([5, 6], 8, rule).tolist() == [-1]
    with pytest.raises(ValueError, match="rule must be one of"):
        reread.oracle_predictions([5, 6, 7], 8, "hebbian")


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(key_dims=[0]), "key_dims must be a whole number of at least 1, got 0"),
        (dict(key_dims=[100_000]), "key_dims must be at most 65,536"),
        (dict(key_dims=list(range(1, 25_002)), n=8), "this grid asks for 400,016 samples"),
        (dict(key_dims=[]), "key_dims must name at least one"),
        (dict(key_dims=[8, 8]), "key_dims gives 8 more than once"),
        (dict(rules=["hebbian"]), "rules must be one of"),
        (dict(context=0), "context must be a whole number of at least 1"),
        (dict(value_dims=1.5), "value_dims must be a whole number"),
        (dict(distances=[0]), "distances must be a whole number of tokens"),
    ],
)
def test_the_memory_ceiling_names_a_bad_argument(corpus, kwargs, named):
    kw = dict(key_dims=[8], distances=[16], n=1, passage_len=40, lead=20, corpus=corpus, split="all") | kwargs
    with pytest.raises(ValueError, match=named):
        reread.memory_ceiling(Copier(), **kw)
