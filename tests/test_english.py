"""Real English text: the corpora and their held-out split, the English tokenizer, the language-modelling
training task and probe, the papers' pass-key filler, and a Titans memory that stays bounded."""

from __future__ import annotations

import itertools
import math
import random
import warnings

import numpy as np
import pandas as pd
import pytest
import torch

from memviz.state import tensors_of
from memviz.tokenizer import ByteTokenizer, load_tokenizer
from memviz_probes import lm, passkey, texts
from memviz_probes.haystack import make_haystack
from tests.conftest import FAMILY_CONFIGS, scrambled, small_model
from training.data import DataConfig, TaskSampler

ENGLISH_TOKENIZER = "training/tokenizers/english-4096.json"


def test_the_corpora_split_into_whole_held_out_documents():
    plays, novel = texts.documents("shakespeare"), texts.documents("botchan")
    assert len(plays) == 42 and {"hamlet", "tempest"} <= {d.name for d in plays}
    assert [d.name for d in novel] == ["preface", *(f"chapter_{i}" for i in range(1, 12))]
    assert "Project Gutenberg" not in "".join(d.text for d in novel)  # header, licence and notes cut off
    assert novel[-1].text.rstrip().endswith("--(THE END)--") and novel[1].text.startswith("CHAPTER I")
    for corpus in texts.CORPORA:
        train, held = texts.documents(corpus, "train"), texts.documents(corpus, "heldout")
        assert [d.name for d in held] == list(texts.HELD_OUT[corpus])
        assert not {d.name for d in train} & {d.name for d in held} and len(train) + len(held) == len(
            texts.documents(corpus)
        )
    assert (texts.BOTCHAN_FOLDER / "LICENSE").exists() and "Apache" in (texts.BOTCHAN_FOLDER / "LICENSE").read_text()


def test_the_training_haystack_leaves_the_held_out_plays_out():
    held = "".join(d.text for d in texts.documents("shakespeare", "heldout"))
    only_held = sorted(set(texts.sentences()) - set(texts.sentences(exclude=("hamlet", "tempest"))))
    assert only_held and all(s.split()[0] in held for s in only_held[:50])
    train = make_haystack("shakespeare_train", 3).sentences()
    assert not set(itertools.islice(train, 20000)) & set(only_held)


@pytest.mark.parametrize(
    "corpus, message",
    [
        ("missing", r"corpus '.*missing' is neither a built-in corpus"),
        ("empty", r"corpus .*empty holds no text"),
        ("latin1.txt", r"corpus file .*latin1.txt is not UTF-8 text"),
    ],
)
def test_a_bad_corpus_path_is_one_clear_error_naming_it(tmp_path, corpus, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "blank.txt").write_text("  \n")
    (tmp_path / "latin1.txt").write_bytes("caf\xe9 au lait".encode("latin-1"))
    with pytest.raises(ValueError, match=message):
        texts.documents(str(tmp_path / corpus))
    with pytest.raises(ValueError, match="data.corpora: " + message):
        DataConfig(mix={"text": 1.0}, corpora={str(tmp_path / corpus): 1.0})


def test_a_held_out_name_not_in_the_corpus_is_named(tmp_path):
    (tmp_path / "a.txt").write_text("One document.")
    assert [d.name for d in texts.documents(str(tmp_path), "heldout", held_out=["a"])] == ["a"]
    with pytest.raises(ValueError, match=r"held-out document\(s\) \['hamlett'\] are not in corpus 'shakespeare'"):
        texts.documents("shakespeare", "heldout", held_out=["hamlett"])
    with pytest.raises(ValueError, match=r"document\(s\) \['macbeth'\] are not in the heldout split"):
        lm.run(small_model(), documents=["macbeth"])


def test_a_corpus_file_edited_or_removed_is_read_again_not_served_from_the_cache(tmp_path):
    path = tmp_path / "notes.txt"
    path.write_text("first version")
    assert texts.documents(str(path))[0].text.strip() == "first version"
    path.write_text("the SECOND version, longer")
    assert texts.documents(str(path))[0].text.strip() == "the SECOND version, longer"
    (tmp_path / "more.txt").write_text("another")
    assert [d.name for d in texts.documents(str(tmp_path))] == ["more", "notes"]
    path.unlink()
    with pytest.raises(ValueError, match="neither a built-in corpus"):
        texts.documents(str(path))


def test_a_document_cut_to_the_token_cap_says_so_and_one_cut_on_request_does_not(tmp_path, monkeypatch):
    (tmp_path / "long.txt").write_text("words and more words. " * 40)
    model = small_model()
    monkeypatch.setattr(lm, "MAX_TOKENS", 64)
    with pytest.warns(UserWarning, match=r"long: 880 tokens, scored on its first 64 \(pass max_tokens to choose\)"):
        assert lm.run(model, str(tmp_path), split="all")["tokens"].tolist() == [64]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert lm.run(model, tmp_path, split="all", max_tokens=32)["tokens"].tolist() == [32]  # a Path too


def test_the_english_tokenizer_reads_english_in_several_bytes_a_token_and_digits_one_each():
    tok = load_tokenizer(ENGLISH_TOKENIZER)
    hamlet = texts.documents("shakespeare", "heldout")[0].text
    assert tok.vocab_size == 4096 and len(hamlet.encode()) / len(tok.encode(hamlet)) > 2.7
    assert tok.token_strings(tok.encode(" 71432"))[1:] == list("71432") and tok.decode(tok.encode(hamlet)) == hamlet


def test_text_windows_come_from_the_training_split_only():
    tok = load_tokenizer(ENGLISH_TOKENIZER)
    sampler = TaskSampler(
        tok,
        DataConfig(
            mix={"text": 1.0},
            corpora={"shakespeare": 1.0, "botchan": 1.0},
            curriculum=[[0, 128]],
            min_len_frac=1.0,
            seed=5,
        ),
    )
    train = [d.text for c in texts.CORPORA for d in texts.documents(c, "train")]
    held = [d.text for c in texts.CORPORA for d in texts.documents(c, "heldout")]
    rng = random.Random(0)
    for _ in range(20):
        window = sampler.corpus.window(rng, 64)
        text = tok.decode(window[1:-1])  # whole tokens inside: no byte-level piece cut at the edges
        assert len(window) == 64 and any(text in t for t in train) and not any(text in t for t in held)
    tokens, weights = sampler.batch(3, 2)
    assert tokens.shape == (2, 128) and (weights[:, 1:] == 1.0).all() and (weights[:, 0] == 0).all()


def test_a_memory_tasks_prompt_has_its_own_weight_beside_the_texts():
    tok = load_tokenizer(ENGLISH_TOKENIZER)
    cfg = DataConfig(
        mix={"passkey": 1.0},
        passkey_haystacks=["shakespeare_train"],
        curriculum=[[0, 300]],
        min_len_frac=1.0,
        text_weight=1.0,
        prompt_weight=0.1,
        answer_weight=5.0,
    )
    example = TaskSampler(tok, cfg).example(random.Random(0), 300)
    answer = tok.decode([t for t, w in zip(example.tokens, example.weights) if w == 5.0][:-1]).strip()
    assert set(example.weights[1:]) == {0.1, 5.0} and answer.isdigit() and len(answer) == 5
    assert DataConfig(mix={"passkey": 1.0}).prompt_weight is None  # older recipes: the prompt takes text_weight


def test_the_papers_pass_key_filler_repeats_five_sentences():
    sample = passkey.make_sample(ByteTokenizer(), 600, 0.5, 12345, haystack="grass")
    body = sample.prompt[len(passkey.INSTRUCTION) : sample.prompt.index("The pass key is")]
    assert body.strip().startswith(
        "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. The grass"
    )
    assert "12345" in sample.prompt and sample.n_tokens <= 600


class Uniform:
    """A stand-in model whose every prediction is uniform over its vocabulary."""

    def __init__(self, tokenizer):
        self.tokenizer, self.device = tokenizer, torch.device("cpu")

    def evaluating(self):
        return torch.no_grad()

    def stream(self, tokens, chunk_len=None):
        for start in range(0, tokens.shape[1], 100):
            yield start, torch.zeros(1, min(100, tokens.shape[1] - start), self.tokenizer.vocab_size), None


def test_bits_per_byte_of_a_uniform_model_is_its_vocabulary_over_the_bytes(tmp_path):
    """A uniform byte model scores log2(259) bits on every byte, a multi-byte character cut by max_tokens too;
    a uniform BPE model log2(4096) bits on every token, so its bits per byte is that over the bytes a token."""
    (tmp_path / "doc.txt").write_text("Bernardo. Who's there? Nay, answer me: stand, and unfold yourself. café " * 20)
    byte = lm.run(Uniform(ByteTokenizer()), corpus=str(tmp_path), split="all")
    assert byte["bits_per_byte"].item() == pytest.approx(math.log2(259), rel=1e-12)
    cut = lm.run(
        Uniform(ByteTokenizer()), corpus=str(tmp_path), split="all", max_tokens=71
    )  # ends inside the é of café
    assert cut["bytes"].item() == 70 and cut["bits_per_byte"].item() == pytest.approx(math.log2(259), rel=1e-12)
    tok = load_tokenizer(ENGLISH_TOKENIZER)
    df = lm.run(Uniform(tok), corpus=str(tmp_path), split="all")
    n_tokens = len(tok.encode((tmp_path / "doc.txt").read_text().strip() + "\n"))
    assert df["tokens"].item() == n_tokens and 2.5 < df["bytes"].item() / n_tokens < 5
    assert df["bits_per_byte"].item() == pytest.approx((n_tokens - 1) * math.log2(4096) / df["bytes"].item(), rel=1e-12)
    assert np.allclose(df["losses"].item(), math.log(tok.vocab_size))


@pytest.mark.parametrize("family", ["infini", "titans", "gated_deltanet", "lm2"])
def test_streamed_token_losses_equal_a_one_pass_cross_entropy(family):
    model = scrambled(small_model(family, **FAMILY_CONFIGS[family])).double()
    ids = torch.randint(0, 256, (1, 150), generator=torch.Generator().manual_seed(7))
    with torch.no_grad():
        logits = model(ids)
    expected = torch.nn.functional.cross_entropy(logits[0, :-1], ids[0, 1:], reduction="none").numpy()
    for chunk in (None, 7, 64):
        assert np.allclose(lm.token_losses(model, ids[0].tolist(), chunk_len=chunk), expected, rtol=1e-10, atol=1e-10)


def test_loss_against_position_bins_every_token_once():
    rng = np.random.default_rng(0)
    frame = pd.DataFrame({"model": ["a", "a", "b"], "losses": [rng.random(1000), rng.random(300), rng.random(700)]})
    table = lm.by_position(frame)
    for name, n in (("a", 1300), ("b", 700)):
        part = table[table["model"] == name]
        assert part["tokens"].sum() == n and (part["start"].iloc[1:].values == part["end"].iloc[:-1].values).all()
        total = sum(x.sum() for x in frame[frame["model"] == name]["losses"])
        assert (part["nats"] * part["tokens"]).sum() == pytest.approx(total)
    fig = lm.position_curve(table, window=64)
    assert [t.name for t in fig.data] == ["a", "b"]


def diverging_titans(**memory):
    """A Titans MAC model whose rates sit at their largest (eta, theta) and smallest (alpha) and whose keys and
    values are large: the case where an unbounded parametrisation lets the memory grow without end."""
    model = small_model("titans", segment_len=16, memory={"variant": "mac", **memory})
    with torch.no_grad():
        for block in model.blocks:
            block.memory.W_rates.bias.copy_(torch.tensor([12.0, 12.0, -12.0]))
            block.memory.W_V.weight.mul_(40)
    return model


def memory_norms(model, ids):
    """The largest entry of any state tensor after each chunk of 64 tokens."""
    return [
        max(float(t.abs().max()) for t in tensors_of(state.layers) if t.numel())
        for _, _, state in model.stream(ids, chunk_len=64)
    ]


def test_a_titans_memory_with_bounded_rates_stays_finite_where_the_papers_diverges():
    ids = torch.tensor(
        [[5, 6, 7, 8] * 256]
    )  # 1,024 tokens of one repeated phrase: the same key, written again and again
    with torch.no_grad():
        bounded = memory_norms(diverging_titans(theta_max=(1 - 0.9) / 16, eta_max=0.9), ids)  # (1 - eta_max) / chunk
        unbounded = memory_norms(diverging_titans(), ids)
    assert all(math.isfinite(n) for n in bounded) and max(bounded) < 1e4
    assert not all(math.isfinite(n) and n < 1e4 for n in unbounded)


def test_training_refuses_the_held_out_plays_and_unknown_backgrounds_before_it_starts():
    from training.config import EvalConfig

    with pytest.raises(ValueError, match="data.passkey_haystacks: 'shakespeare' holds the held-out plays"):
        DataConfig(mix={"passkey": 1.0}, passkey_haystacks=["shakespeare"])
    with pytest.raises(ValueError, match="eval.passkey_haystacks: haystack 'gras' does not exist: neither a"):
        EvalConfig(passkey_haystacks=["gras"])
    with pytest.raises(ValueError, match="eval.passkey_haystacks must be a list"):
        EvalConfig(passkey_haystacks="grass")
    with pytest.raises(ValueError, match="data.prompt_weight must be a finite non-negative number"):
        DataConfig(prompt_weight=-1)


def test_a_probe_scores_a_diverged_sample_wrong_and_goes_on():
    from memviz import NonFiniteError
    from memviz_probes.common import run_samples

    class Diverging:
        tokenizer = ByteTokenizer()

        def generate(self, prompt, max_new_tokens, progress=None):
            if "71432" in prompt:
                raise NonFiniteError("logits are not finite")
            return " " + prompt.split("The pass key is ")[1][:5]

    jobs = [
        ({"i": i}, lambda key=key: passkey.make_sample(ByteTokenizer(), 300, 0.5, key))
        for i, key in enumerate([12345, 71432, 55555])
    ]
    df = run_samples(Diverging(), jobs, passkey.score, max_new_tokens=8, progress=False)
    assert df["correct"].tolist() == [True, False, True] and df["diverged"].tolist() == [False, True, False]
