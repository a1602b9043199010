"""MQAR: the generator's sequences read back token by token, the scorer against oracles built from the tokens alone,
the linear-memory capacity curve against numpy, and the released architectures' tiny random models at chance."""

from __future__ import annotations

import contextlib
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

import memviz
from memviz.protocol import ModelState
from memviz.tokenizer import load_tokenizer
from memviz_probes import mqar
from memviz_probes.__main__ import main

ROOT = Path(__file__).resolve().parent.parent
ENGLISH = ROOT / "sample_checkpoints" / "infini_english_16k"
#: short words for the tiny models' tokenizers, none of them in the procedural filler
ANIMALS = " ".join("ox ant bee cow elk emu fox gnu hen jay owl pig ram yak cat dog eel bat rat ape".split() * 3)


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(ENGLISH / "tokenizer.json")


class TokenModel:
    """A stand-in model whose logits at each position come from `choose(tokens, position)` (one id gets 1, the rest
    0), streamed in chunks of 100 tokens as a model's stream is."""

    family = "sliding_window"  # a registered family without a matrix memory
    device = torch.device("cpu")

    def __init__(self, tokenizer, choose):
        self.tokenizer, self.choose = tokenizer, choose

    def evaluating(self):
        return contextlib.nullcontext()

    def stream(self, tokens, chunk_len=None, state=None):
        ids = tokens[0].tolist()
        for start in range(0, len(ids), 100):
            logits = torch.zeros(1, min(100, len(ids) - start), self.tokenizer.vocab_size)
            for i in range(logits.shape[1]):
                logits[0, i, self.choose(ids, start + i)] = 1.0
            yield start, logits, ModelState(pos=start + logits.shape[1])


def induction(ids: list[int], position: int) -> int:
    """The token that followed this position's token where it first appeared (itself if it never did)."""
    first = ids.index(ids[position])
    return ids[first + 1] if first < position else ids[position]


def test_a_sample_is_zoologys_layout_in_single_token_words(tokenizer):
    sample = mqar.seeded_sample(tokenizer, length=512, pairs=16, seed=3, index=2)
    keys, values = mqar.word_pools(tokenizer)
    assert sample.length == 512 and sample.pairs == 16
    assert sample.tokens[:32] == [t for pair in zip(sample.keys, sample.values) for t in pair]
    assert len(set(sample.keys)) == 16 and len(set(sample.values)) == 16
    assert set(sample.keys) <= set(keys) and set(sample.values) <= set(values) and not set(keys) & set(values)
    for token in sample.keys + sample.values:
        piece = tokenizer.decode([token])
        assert piece.startswith(" ") and piece[1:].isalpha() and tokenizer.encode(piece) == [token]
    positions = [p for p, _ in sample.queries]
    assert sorted(pair for _, pair in sample.queries) == list(range(16))  # every key queried once
    assert positions == sorted(positions) and all(p >= 32 and (p - 32) % 2 == 0 for p in positions)
    assert all(sample.tokens[p] == sample.keys[pair] for p, pair in sample.queries)
    filler = [t for p, t in enumerate(sample.tokens[32:], start=32) if p not in positions]
    assert len(filler) == 512 - 32 - 16 and not set(filler) & set(sample.keys + sample.values)
    again = mqar.seeded_sample(tokenizer, length=512, pairs=16, seed=3, index=2)
    assert again.tokens == sample.tokens
    assert mqar.seeded_sample(tokenizer, length=512, pairs=16, seed=3, index=3).tokens != sample.tokens


def test_the_query_gaps_follow_zoologys_power_law(tokenizer):
    """With a = 0.01 most queries sit in the first slots after the pairs; with a = 1 they spread evenly."""

    def mean_gap(power_a):
        gaps = [
            (p - 8) // 2
            for i in range(40)
            for p, _ in mqar.seeded_sample(tokenizer, 1024, 4, 0, i, power_a=power_a).queries
        ]
        return np.mean(gaps)

    assert mean_gap(0.01) < 120 < 200 < mean_gap(1.0)  # evenly over 508 slots: a mean near 254
    weights = mqar.gap_weights(4, 0.5)
    assert np.allclose(weights, np.array([1, 2**-0.5, 3**-0.5, 4**-0.5]) / sum([1, 2**-0.5, 3**-0.5, 4**-0.5]))


def test_an_oracle_that_reads_the_tokens_scores_every_query(tokenizer):
    df = mqar.run(TokenModel(tokenizer, induction), lengths=[256, 300], pairs=[4, 16], n=3, progress=False)
    assert len(df) == 3 * 2 * (4 + 16) and df["correct"].all() and df["correct_among_values"].all()
    assert (df["answer"] == df["prediction"]).all() and not df["diverged"].any()
    assert set(df["state_size"]) == {0} and set(df["pair_bound"]) == {0}
    row = df.iloc[0]
    sample = mqar.seeded_sample(tokenizer, row["length"], row["pairs"], 0, row["sample"])
    position, pair = sample.queries[row["query"]]
    assert row["position"] == position and row["distance"] == position - 2 * pair - 1
    assert row["key"] == tokenizer.decode([sample.keys[pair]])
    assert row["answer"] == tokenizer.decode([sample.values[pair]])


def test_a_model_that_always_names_the_first_value_scores_one_in_pairs(tokenizer):
    df = mqar.run(TokenModel(tokenizer, lambda ids, p: ids[1]), lengths=[512], pairs=[2, 8, 32], n=2, progress=False)
    by_pairs = df.groupby("pairs")[["correct", "correct_among_values"]].mean()
    assert np.allclose(by_pairs["correct"], [1 / 2, 1 / 8, 1 / 32])
    assert np.allclose(by_pairs["correct_among_values"], [1 / 2, 1 / 8, 1 / 32])


def test_logits_that_stop_being_finite_score_a_diverged_wrong_answer(tokenizer):
    class Diverging(TokenModel):
        def stream(self, tokens, chunk_len=None, state=None):
            for start, logits, state in super().stream(tokens):
                yield start, logits if start == 0 else logits * float("nan"), state

    df = mqar.run(Diverging(tokenizer, induction), lengths=[512], pairs=[4], n=4, progress=False)
    late = df["position"] >= 100
    assert late.any() and (~late).any()
    assert df.loc[late, "diverged"].all() and not df.loc[late, "correct"].any()
    assert df.loc[~late, "correct"].all() and not df.loc[~late, "diverged"].any()


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (dict(pairs=[0]), "pairs are whole numbers of key-value pairs >= 1, got 0"),
        (dict(pairs=[2.5]), "pairs are whole numbers of key-value pairs >= 1, got 2.5"),
        (dict(pairs=[4000]), "pairs 4000 is more than the tokenizer's 876 single-token key words"),
        (dict(pairs=[4, 4]), "pairs gives 4 more than once"),
        (dict(lengths=[60], pairs=[16]), r"length 60 is too short for 16 pairs: MQAR needs 4 x pairs = 64 tokens"),
        (dict(lengths=[0]), "lengths are whole numbers of tokens"),
        (dict(power_a=0), r"power_a is the gaps' power-law exponent in \(0, 1\], got 0"),
        (dict(n=0), "n must be a positive integer, got 0"),
    ],
)
def test_bad_arguments_name_the_argument(tokenizer, kwargs, named):
    model = TokenModel(tokenizer, induction)
    with pytest.raises(ValueError, match=named):
        mqar.run(model, **{"lengths": [512], "pairs": [4], "n": 1, "progress": False, **kwargs})


def test_a_tokenizer_without_single_token_words_is_refused():
    from memviz.tokenizer import ByteTokenizer

    with pytest.raises(ValueError, match="pairs 4 is more than the tokenizer's 0 single-token key words"):
        mqar.run(TokenModel(ByteTokenizer(), induction), lengths=[64], pairs=[4], n=1, progress=False)


def numpy_recall(keys: np.ndarray, values: np.ndarray, rule: str) -> float:
    """Write the pairs one by one into S [d_k, d_v] (S += k v^T, or S += k (v - S^T k)^T), read S^T k_i and decode
    it as the stored value of largest inner product."""
    memory = np.zeros((keys.shape[1], values.shape[1]))
    for k, v in zip(keys, values):
        memory += np.outer(k, v if rule == "additive" else v - memory.T @ k)
    decoded = np.argmax((keys @ memory) @ values.T, axis=1)
    return float(np.mean(decoded == np.arange(len(keys))))


@pytest.mark.parametrize("rule", mqar.RULES)
def test_the_operators_recall_matches_numpy(rule):
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh draws every run, named when one fails
    rng = np.random.default_rng(seed)
    for count, key_dims in [(3, 8), (8, 8), (24, 8), (40, 16)]:
        keys = rng.standard_normal((5, count, key_dims))
        keys /= np.linalg.norm(keys, axis=-1, keepdims=True)
        values = rng.standard_normal((5, count, 12))
        got = mqar.recall_accuracy(torch.from_numpy(keys), torch.from_numpy(values), rule)
        want = [numpy_recall(k, v, rule) for k, v in zip(keys, values)]
        assert np.allclose(got.numpy(), want), (seed, count, key_dims)


def test_orthonormal_keys_up_to_d_k_are_recalled_exactly_and_random_ones_interfere_past_it():
    keys = torch.linalg.qr(torch.randn(32, 32, dtype=torch.float64))[0].T[None]  # 32 orthonormal keys in 32 dims
    values = torch.randn(1, 32, 32, dtype=torch.float64)
    for rule in mqar.RULES:
        assert mqar.recall_accuracy(keys, values, rule).item() == 1.0
    curve = mqar.capacity_curve(key_dims=16, trials=16).set_index(["rule", "pairs"])["accuracy"]
    for rule in mqar.RULES:  # 1/8 of d_k pairs come back, 8 d_k pairs mostly do not
        assert curve[rule, 2] > 0.95 and curve[rule, 128] < 0.3 and curve[rule, 16] > curve[rule, 64]
    assert mqar.capacity_curve(key_dims=4, pairs=[2, 8], trials=2)["load"].tolist() == [0.5, 0.5, 2.0, 2.0]


def test_a_memorys_bound_is_d_k_a_head_and_its_size_the_numbers_it_holds():
    assert mqar.capacity_bound([4, 32, 32]) == 128 and mqar.capacity_bound([16, 128]) == 16
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        mqar.capacity_bound([32])
    model = memviz.load(ENGLISH)
    df = mqar.run(model, lengths=[64], pairs=[4], n=1, progress=False)
    cfg = model.cfg
    assert (df["state_size"] == cfg.n_layers * cfg.n_heads * cfg.d_head**2).all()  # M [d_head, d_head] a head
    assert (df["pair_bound"] == cfg.n_heads * cfg.d_head).all()


@pytest.mark.parametrize("model_type", ["qwen3_5_text", "bamba", "xlstm"])
def test_released_architectures_tiny_random_models_recall_at_chance(model_type, tmp_path):
    """A random model holds no pairing: among the stored values it is right about 1 / pairs of the time, and over
    the whole vocabulary no more often than that."""
    from memviz.models.released.tiny import tiny_checkpoint

    torch.set_num_threads(1)  # their matrices are too small to share out (the suite's fixture sets 2 back)
    hf = tiny_checkpoint(tmp_path, model_type, text=ANIMALS)
    model = memviz.load(tmp_path)
    df = mqar.run(model, lengths=[64], pairs=[4], n=60, progress=False)
    among, spread = df["correct_among_values"].mean(), 3 * (0.25 * 0.75 / len(df)) ** 0.5
    assert abs(among - 0.25) < spread and df["correct"].mean() < 0.1  # over ~4k tokens, a value is rarely the top
    if model_type == "qwen3_5_text":  # Gated DeltaNet's S [heads, d_k, d_v] in each linear-attention layer
        c = hf.config
        layers = c.layer_types.count("linear_attention")
        per_layer = c.linear_num_value_heads * c.linear_key_head_dim * c.linear_value_head_dim
        assert df["state_size"].iloc[0] == layers * per_layer
        assert df["pair_bound"].iloc[0] == c.linear_num_value_heads * c.linear_key_head_dim


def test_the_figure_and_summary_hold_each_models_accuracy(tokenizer):
    df = mqar.compare(
        {"oracle": TokenModel(tokenizer, induction), "first": TokenModel(tokenizer, lambda ids, p: ids[1])},
        lengths=[256, 512],
        pairs=[2, 8],
        n=1,
        progress=False,
    )
    table = mqar.summary(df)
    assert table.loc["oracle"].to_numpy().min() == 1.0
    assert np.allclose(table.loc["first"]["correct"].to_numpy(), [[1 / 2, 1 / 8, 1 / 2, 1 / 8]])
    fig = mqar.figure(df)
    lines = {(t.name, t.xaxis): list(t.y) for t in fig.data if t.name and t.name.startswith("first")}
    assert lines == {("first (no matrix memory)", "x"): [0.5, 0.125], ("first (no matrix memory)", "x2"): [0.5, 0.125]}
    reference = [t for t in fig.data if t.name.startswith("linear memory")]
    assert {t.name for t in reference} == {"linear memory d_k=32, additive rule", "linear memory d_k=32, delta rule"}
    with pytest.raises(ValueError, match="score must be"):
        mqar.figure(df, score="accuracy")
    with pytest.raises(ValueError, match="summary needs"):
        mqar.summary(pd.DataFrame())


def test_the_command_line_runs_mqar_over_a_sample_and_its_control(tmp_path, capsys):
    control = ROOT / "sample_checkpoints" / "sliding_window_english"
    argv = ["mqar", str(ENGLISH), str(control), "--lengths", "64", "--pairs", "2", "4", "--n", "1", "--threads", "1"]
    assert main([*argv, "--out", str(tmp_path), "--no-progress"]) == 0
    df = pd.read_csv(tmp_path / "mqar.csv")
    assert set(df["model"]) == {str(ENGLISH), str(control)} and len(df) == 2 * (2 + 4)
    assert "MQAR" in (tmp_path / "mqar.html").read_text()


def test_the_csv_escapes_control_characters_so_each_query_stays_one_line(tmp_path):
    df = pd.DataFrame({"key": [" dog", " cat"], "answer": [" ox", " elk"], "prediction": ["\r", "a\nb"]})
    mqar.csv_rows(df).to_csv(tmp_path / "rows.csv", index=False)
    back = pd.read_csv(tmp_path / "rows.csv")
    assert back["prediction"].tolist() == ["\\x0d", "a\\x0ab"] and back["key"].tolist() == [" dog", " cat"]
