import json
import random
import re
from pathlib import Path

import pytest

import memviz
from memviz.tokenizer import BPETokenizer, ByteTokenizer, load_tokenizer
from tests.conftest import BPE_TOKENIZER, refused_within_memory


def random_text(rng: random.Random, n: int) -> str:
    """Arbitrary Unicode: ASCII, Latin, CJK, emoji and astral planes, controls, no surrogates."""
    out = []
    for _ in range(n):
        block = rng.choice([(0, 0x7F), (0x80, 0x7FF), (0x800, 0xD7FF), (0xE000, 0xFFFF), (0x10000, 0x10FFFF)])
        out.append(chr(rng.randint(*block)))
    return "".join(out)


@pytest.fixture(scope="module")
def bpe():
    rng = random.Random(0)
    corpus = [f"The pass key is {rng.randrange(10**5)}. Mary went to the kitchen." for _ in range(300)]
    return BPETokenizer.train(corpus, vocab_size=300)


def test_byte_tokenizer_round_trips_arbitrary_unicode():
    tok = ByteTokenizer()
    rng = random.Random(1)
    for _ in range(200):
        text = random_text(rng, rng.randint(0, 40))
        ids = tok.encode(text)
        assert ids == list(text.encode("utf-8"))
        assert tok.decode(ids) == text


def test_byte_tokenizer_round_trips_arbitrary_bytes():
    tok = ByteTokenizer()
    data = bytes(random.Random(2).randrange(256) for _ in range(5000))
    assert tok.decode_bytes(tok.encode_bytes(data)) == data


def test_special_ids_are_never_produced_by_text():
    tok = ByteTokenizer()
    ids = tok.encode("<eos><pad><bos>")
    assert max(ids) < tok.text_vocab_size
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (256, 257, 258)
    assert tok.token_strings([65, tok.eos_id]) == ["A", "<eos>"]


def test_bpe_round_trips_unicode_and_splits_digits(bpe):
    rng = random.Random(3)
    for _ in range(100):
        text = random_text(rng, rng.randint(1, 30))
        assert bpe.decode(bpe.encode(text)) == text
    key_ids = bpe.encode(" 71432")
    assert [bpe.decode([i]) for i in key_ids][-5:] == list("71432")
    # merges learned from the corpus make common text shorter than bytes
    assert len(bpe.encode("Mary went to the kitchen.")) < len("Mary went to the kitchen.") // 2


def test_tokenizers_save_and_load(tmp_path, bpe):
    for tok in (ByteTokenizer(), bpe):
        folder = tmp_path / tok.kind
        folder.mkdir()
        loaded = load_tokenizer(tok.save(folder))
        assert type(loaded) is type(tok) and loaded.vocab_size == tok.vocab_size
        assert loaded.encode("The pass key is 12345.") == tok.encode("The pass key is 12345.")


def test_load_tokenizer_rejects_garbage(tmp_path):
    bad = tmp_path / "tokenizer.json"
    bad.write_text("{not json")
    with pytest.raises(ValueError, match="not valid JSON"):
        load_tokenizer(bad)
    bad.write_text('{"kind": "mystery"}')
    with pytest.raises(ValueError, match="not a byte or BPE tokenizer"):
        load_tokenizer(bad)


@pytest.mark.parametrize("bad", [-1, "vocab_size", 10**9])
def test_an_id_outside_the_vocabulary_is_refused_by_name(bpe, bad):
    for tok in (ByteTokenizer(), bpe):
        i = tok.vocab_size if bad == "vocab_size" else bad
        ids = [tok.encode("A")[0], tok.eos_id, i]
        for read in (tok.decode, tok.token_strings, tok.byte_length):
            with pytest.raises(ValueError, match=rf"token id {i} at position 2 is outside .*0\.\.{tok.vocab_size - 1}"):
                read(ids)
        assert tok.decode(ids[:2]) == "A"  # a special stands for no text and is no error


def test_decode_takes_ids_of_any_integer_type_and_refuses_text_floats_and_bools(bpe):
    import numpy as np
    import torch

    tok = ByteTokenizer()
    assert tok.decode([65, np.int64(66), torch.tensor(67)]) == tok.decode(torch.tensor([65, 66, 67])) == "ABC"
    with pytest.raises(TypeError, match="ids must be token ids, not a str: encode the text first"):
        bpe.decode("65")
    numpy_true = re.escape(repr(np.True_))  # np.True_ from NumPy 2, True before
    cases = [(1.5, "1.5, not a whole number"), (True, "True, a bool"), (np.True_, f"{numpy_true}, a bool")]
    for bad, why in (*cases, (None, "None, not a whole number")):
        for read in (tok.decode, bpe.decode, bpe.token_strings):
            with pytest.raises(TypeError, match=f"token id at position 1 is {why}"):
                read([65, bad])


def bpe_checkpoint(model, tmp_path, edit):
    folder = memviz.save(model, tmp_path / "bpe")
    data = json.loads((folder / "tokenizer.json").read_text())
    edit(data["model"]["vocab"])
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_a_tokenizer_whose_tokens_share_ids_or_leave_the_vocabulary_is_refused_naming_the_file(bpe_model, tmp_path):
    def share(vocab):
        for token in list(vocab)[100:140]:
            vocab[token] = 5

    def past(vocab):
        vocab[list(vocab)[100]] = len(vocab) + 50

    with pytest.raises(
        memviz.CheckpointError, match=r"bpe/tokenizer.json: 41 tokens share 1 id \(id 5: .*each token needs its own id"
    ):
        memviz.load(bpe_checkpoint(bpe_model, tmp_path / "a", share))
    with pytest.raises(
        memviz.CheckpointError, match=r"bpe/tokenizer.json: .*token ids \[1071\] .* lie outside the vocabulary"
    ):
        memviz.load(bpe_checkpoint(bpe_model, tmp_path / "b", past))


@pytest.mark.parametrize(
    "case, named", [("a folder", "is a folder"), ("a device", "is not a regular file"), ("missing", "does not exist")]
)
def test_a_tokenizer_path_that_is_not_a_file_is_refused_naming_it(case, named, tmp_path):
    from memviz.tokenizer import load_tokenizer

    path = {"a folder": tmp_path, "a device": Path("/dev/zero"), "missing": tmp_path / "none.json"}[case]
    with pytest.raises(ValueError, match=f"tokenizer file {re.escape(str(path))} {named}"):
        load_tokenizer(path)


def test_ten_megabytes_of_one_emoji_are_refused_before_tokenizing():
    assert "input has 10,485,760 tokens (one a UTF-8 byte), over the trace limit of 4,000,000" in refused_within_memory(
        "emoji"
    )


@pytest.mark.skipif(not BPE_TOKENIZER.is_file(), reason="the BPE sample's tokenizer is not here")
def test_a_long_text_over_the_trace_limit_is_refused_while_counting_its_tokens():
    assert "more tokens in its first" in refused_within_memory("long text", BPE_TOKENIZER)


CALL_CASES = {
    "trace beyond the token limit": (
        lambda m: memviz.trace(m, "x" * 2000, max_tokens=1000),
        ValueError,
        "trace limit of 1,000",
    ),
}


@pytest.mark.parametrize("case", sorted(CALL_CASES))
def test_a_bad_call_is_one_error_naming_the_argument(case, model):
    call, error, named = CALL_CASES[case]
    with pytest.raises(error, match=named):
        call(model)
