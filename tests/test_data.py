"""Training batches: reproducible per step, weighted towards the answer, and short passkey
prompts (a curriculum's start) drop the instruction so needle and question fit one window."""

import random
import re

import pytest
import torch

from memviz.tokenizer import ByteTokenizer
from memviz_probes import passkey, texts
from tests.conftest import train_config
from training.config import TrainConfig
from training.data import DataConfig, TaskSampler


def sampler(**data) -> TaskSampler:
    return TaskSampler(ByteTokenizer(), DataConfig(mix={"passkey": 1.0}, text_weight=0.1, answer_weight=5.0, **data))


def test_a_step_always_sees_the_same_batch_and_other_steps_differ():
    s = sampler(curriculum=[[0, 400]])
    a, b, c = s.batch(3, 4), s.batch(3, 4), s.batch(4, 4)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    assert not torch.equal(a[0][:, :50], c[0][:, :50])


def test_weights_put_the_answer_above_the_prompt():
    s = sampler()
    example = s.example(random.Random(0), 400)
    text = ByteTokenizer().decode(example.tokens)
    answer = text.rsplit(passkey.QUESTION, 1)[1]
    n_answer = len(ByteTokenizer().encode(answer)) + 1  # and eos
    assert example.weights[-n_answer:] == [5.0] * n_answer
    assert set(example.weights[1:-n_answer]) == {0.1} and example.weights[0] == 0.0


def test_short_passkey_prompts_drop_the_instruction_long_ones_keep_it():
    s = sampler()
    rng = random.Random(1)
    short = ByteTokenizer().decode(s.example(rng, s.passkey_full_len - 1).tokens)
    long = ByteTokenizer().decode(s.example(rng, s.passkey_full_len + 40).tokens)
    assert passkey.INSTRUCTION not in short and "The pass key is" in short
    assert long.startswith(passkey.INSTRUCTION)


def test_drill_asks_more_questions_on_the_same_story_and_weights_their_answers():
    tok = ByteTokenizer()
    drilled = TaskSampler(tok, DataConfig(mix={"qa1": 1.0}, text_weight=0.1, answer_weight=5.0, drill=3))
    plain = TaskSampler(tok, DataConfig(mix={"qa1": 1.0}, text_weight=0.1, answer_weight=5.0))
    asked = []
    for seed in range(20):
        example = drilled.example(random.Random(seed), 300)
        text = tok.decode(example.tokens)
        blocks = text.split("\nQuestion: ")
        story, qa = blocks[0], blocks[1:]
        # the plain sampler draws the same story and first question, then stops after its answer
        plain_text = tok.decode(plain.example(random.Random(seed), 300).tokens)
        assert plain_text == story + "\nQuestion: " + qa[0]
        names = [b.split("?")[0].removeprefix("Where is ") for b in qa]
        assert len(set(names)) == len(names) <= 4
        facts = [f.strip() + "." for f in story.split(".") if f.strip()]
        for block, name in zip(qa, names):
            answer = block.split("Answer: ")[1].rstrip(".")
            last_move = [f for f in facts if f.startswith(name + " ") and " to the " in f][-1]
            assert last_move.endswith(f" the {answer}.")
        answered = sum(w == 5.0 for w in example.weights)
        assert answered == sum(len(tok.encode(" " + b.split("Answer: ")[1])) for b in qa) + 1  # and eos
        asked.append(len(qa))
    assert max(asked) == 4 and min(asked) >= 1


def test_max_facts_limits_story_size_by_stage_and_leaves_other_recipes_alone():
    tok = ByteTokenizer()
    staged = TaskSampler(tok, DataConfig(mix={"qa1": 1.0}, curriculum=[[0, 300]], max_facts=[[0, 2], [5, 4]]))
    plain = TaskSampler(tok, DataConfig(mix={"qa1": 1.0}, curriculum=[[0, 300]]))

    def facts_per_story(sampler, step):
        return [
            tok.decode(row.tolist()).split("\nQuestion:")[0].count(" to the ") for row in sampler.batch(step, 16)[0]
        ]

    assert max(facts_per_story(staged, 0)) <= 2
    assert max(facts_per_story(staged, 5)) <= 4 and max(facts_per_story(staged, 5)) > 2
    assert max(facts_per_story(plain, 0)) > 4  # without a schedule stories keep their full size


def test_aligned_batches_end_on_a_segment_boundary_and_other_recipes_keep_their_lengths():
    def lengths(s):
        return [s.draw_length(7, random.Random(i)) for i in range(400)]

    plain = lengths(sampler(curriculum=[[0, 256]], min_len_frac=0.3))
    aligned = lengths(sampler(curriculum=[[0, 256]], min_len_frac=0.3, aligned_frac=1.0))
    half = lengths(sampler(curriculum=[[0, 256]], min_len_frac=0.3, aligned_frac=0.5))
    assert set(aligned) == {64, 128, 192, 256}
    assert sum(n % 64 != 0 for n in plain) > 380 and min(plain) >= 76 and max(plain) <= 256
    assert plain == [random.Random(i).randint(76, 256) for i in range(400)], "no extra draw unless asked"
    assert 150 < sum(n % 64 == 0 for n in half) < 250
    for bad in ({"aligned_frac": 1.5}, {"aligned_frac": 0.5, "align_to": 0}):
        with pytest.raises(ValueError, match="data.aligned_frac must lie in"):
            DataConfig(**bad)


@pytest.mark.parametrize("task", ["niah_single_2", "vt"])
def test_ruler_tasks_train_on_their_answers_after_the_answer_prefix(task):
    """A RULER sample in the mix is its prompt (ending on RULER's answer prefix) and then its
    answers, weighted as answers; the answers are the ones an independent reading finds."""
    from tests.test_ruler import solve

    tok = ByteTokenizer()
    s = TaskSampler(tok, DataConfig(mix={task: 1.0}, text_weight=0.1, answer_weight=5.0))
    example = s.example(random.Random(3), 2048)
    text = tok.decode(example.tokens[:-1])
    prompt, prefix, answer = text.rpartition("they are: " if task == "vt" else "mentioned in the provided text is")
    assert answer.strip(" .").split(", ") == solve(prompt + prefix)
    n_answer = len(tok.encode(answer)) + 1
    assert example.weights[-n_answer:] == [5.0] * n_answer and set(example.weights[1:-n_answer]) == {0.1}


@pytest.fixture(scope="module")
def rereader() -> TaskSampler:
    cfg = DataConfig(
        mix={"reread": 1.0},
        corpora={"shakespeare": 1.0},
        reread_passage=50,
        reread_distances=[64, 1000],
        prompt_weight=0.1,
        answer_weight=5.0,
    )
    return TaskSampler(ByteTokenizer(), cfg)


def test_a_reread_example_holds_its_passage_twice_at_the_drawn_distance_and_weights_the_second_reading(rereader):
    distances = []
    for seed in range(30):
        example = rereader.example(random.Random(seed), 1200)
        tokens, passage = example.tokens, example.tokens[-50:]
        at = [i for i in range(len(tokens) - 49) if tokens[i : i + 50] == passage]
        assert len(tokens) == len(example.weights) == 1200 and at[-1] == 1150 and len(at) == 2
        distances.append(1150 - (at[0] + 50))
        expected = random.Random(seed)
        expected.choices(["reread"], [1.0])  # the task's draw, then the layout's
        assert rereader.reread_layout(expected, 1200) == (50, distances[-1])
        # the second reading's tokens 2..50 are the answer; its first follows filler and is prompt, as all before it
        assert example.weights == [0.0] + [0.1] * 1150 + [5.0] * 49
    assert 64 <= min(distances) < 200 and 500 < max(distances) <= 1000  # log-uniform over the whole range


def test_a_reread_example_reads_the_training_split_only(monkeypatch):
    """With every play but two held out, no piece of an example is held-out text: passage and filler both come
    from the two plays left to train on."""
    plays = [d.name for d in texts.documents("shakespeare")]
    monkeypatch.setitem(texts.HELD_OUT, "shakespeare", tuple(p for p in plays if p not in ("macbeth", "othello")))
    cfg = DataConfig(mix={"reread": 1.0}, corpora={"shakespeare": 1.0}, reread_passage=64, reread_distances=[64, 900])
    s = TaskSampler(ByteTokenizer(), cfg)
    held_out = [d.text.encode() for d in texts.documents("shakespeare", "heldout")]
    training = b"\0".join(d.text.encode() for d in texts.documents("shakespeare", "train"))
    assert len(held_out) == len(plays) - 2
    for seed in range(20):
        example = bytes(s.example(random.Random(seed), 1200).tokens)
        passage, pieces = example[-64:], [example[i : i + 64] for i in range(0, 1136, 64)]
        assert passage in training and example.count(passage) == 2
        assert not any(piece in doc for piece in [passage, *pieces] for doc in held_out)


def test_reread_filler_comes_from_the_other_documents_however_small(tmp_path):
    """A filler draw never lands on the passage's own document, so a corpus whose other document is tiny still
    fills the distance (drawing and discarding the passage's document could go on for ever)."""
    (tmp_path / "big.txt").write_text("A long document of many words. " * 4000)
    (tmp_path / "tiny.txt").write_text("Short note. ")
    cfg = DataConfig(
        mix={"reread": 1.0}, corpora={str(tmp_path): 1.0}, reread_passage=64, reread_distances=[2000, 3000]
    )
    example = TaskSampler(ByteTokenizer(), cfg).example(random.Random(0), 4096)
    tokens = bytes(example.tokens)
    assert len(tokens) == 4096 and tokens[-64:] in tokens[:-64]
    assert b"Short note." in tokens  # the filler: the tiny document, again and again


def test_reread_needs_two_training_documents(tmp_path):
    (tmp_path / "one.txt").write_text("One document only. " * 100)
    with pytest.raises(ValueError, match="data.corpora: the reread task draws its filler from another document"):
        TaskSampler(ByteTokenizer(), DataConfig(mix={"reread": 1.0}, corpora={str(tmp_path / "one.txt"): 1.0}))


def copied_blocks(example, longest: int, gap: int) -> list[tuple[bytes, int]]:
    """(block, tokens between its readings) for every run of answer-weighted tokens, found by looking back for the
    run and the prompt token before it (the repeat's first token) within `gap` tokens of text; the example's cut
    last repeat is looked for as far back as a whole block's."""
    tokens, weights, found = bytes(example.tokens), example.weights, []
    t = 1
    while t < len(tokens):
        if weights[t] != 5.0:
            t += 1
            continue
        end = t
        while end < len(tokens) and weights[end] == 5.0:
            end += 1
        block = tokens[t - 1 : end]
        reach = (longest if end == len(tokens) else len(block)) + gap
        lags = [lag for lag in range(len(block), reach + 1) if tokens[t - 1 - lag : end - lag] == block]
        assert lags, f"the answer run at {t} repeats nothing within {gap} tokens"
        found.append((block, lags[0] - len(block)))
        t = end
    return found


@pytest.mark.parametrize("shuffled", [0.0, 1.0])
def test_a_copy_example_repeats_blocks_of_training_text_after_a_short_gap(shuffled):
    cfg = DataConfig(
        mix={"copy": 1.0},
        corpora={"shakespeare": 1.0},
        copy_block=[12, 24],
        copy_gap=[0, 10],
        copy_shuffled=shuffled,
        prompt_weight=0.1,
        answer_weight=5.0,
    )
    s = TaskSampler(ByteTokenizer(), cfg)
    training = b"\0".join(d.text.encode() for d in texts.documents("shakespeare", "train"))
    blocks, gaps = [], []
    for seed in range(20):
        example = s.example(random.Random(seed), 600)
        assert len(example.tokens) == len(example.weights) == 600 and example.weights[0] == 0.0
        assert set(example.weights[1:]) == {0.1, 5.0}
        found = copied_blocks(example, longest=24, gap=10)
        assert len(found) >= 600 // (2 * 24 + 10) - 1  # every block of the example but a cut last one is read again
        blocks += [block for block, _ in found[:-1]]
        gaps += [gap for _, gap in found[:-1]]
        assert all(12 <= len(block) <= 24 for block, _ in found[:-1])
    assert min(gaps) == 0 and max(gaps) == 10  # the text between the readings spans copy_gap
    in_text = sum(block in training for block in blocks) / len(blocks)
    if shuffled:
        assert in_text < 0.1  # a shuffled block is not a piece of the plays
    else:
        assert in_text == 1.0


COPY_CASES = {
    "a copy block of 1": ({"copy_block": [1, 8]}, r"data.copy_block is \[shortest, longest\] whole numbers"),
    "copy blocks the wrong way": ({"copy_block": [32, 8]}, "data.copy_block is"),
    "a copy block of one value": ({"copy_block": [8]}, "data.copy_block is"),
    "a negative copy gap": (
        {"copy_gap": [-1, 4]},
        r"data.copy_gap is \[shortest, longest\] whole numbers of tokens, 0",
    ),
    "a copy share above 1": ({"copy_shuffled": 1.5}, r"data.copy_shuffled must lie in \[0, 1\], got 1.5"),
}


@pytest.mark.parametrize("fields,message", COPY_CASES.values(), ids=COPY_CASES.keys())
def test_bad_copy_settings_are_named(fields, message):
    with pytest.raises(ValueError, match=message):
        DataConfig(mix={"copy": 1.0}, corpora={"shakespeare": 1.0}, **fields)


def test_a_tokenizer_file_that_is_no_tokenizer_is_named_before_training(tmp_path):
    from training.data import build_tokenizer

    (tmp_path / "bin.json").write_bytes(b"\xff\xfe binary")
    with pytest.raises(ValueError, match=f"tokenizer {tmp_path / 'bin.json'}: not UTF-8 text"):
        build_tokenizer(str(tmp_path / "bin.json"))


TRAIN_CASES = {
    "an unknown task": ({"data.mix": {"qa9": 1.0}}, r"unknown data tasks \['qa9'\]; tasks are"),
    "a negative drill": ({"data.drill": -1}, "data.drill must be >= 0, got -1"),
    "max_facts of none": ({"data.max_facts": [[0, 0]]}, r"data.max_facts is a list of \[from_step, n\] with n >= 1"),
    "a NaN task weight": (
        {"data.mix": {"passkey": float("nan")}},
        "data.mix needs finite non-negative weights with a positive sum",
    ),
    "a negative data seed": ({"data.seed": -1}, "data.seed must lie in"),
    "a knowledge base seed past 64 bits": ({"data.kb_seed": 2**64}, "data.kb_seed"),
    "a reread distance of 0": ({"data.reread_distances": [0, 64]}, r"data.reread_distances is \[shortest, longest\]"),
    "reread distances the wrong way": ({"data.reread_distances": [64, 32]}, "data.reread_distances is"),
    "reread distances of one value": ({"data.reread_distances": [64]}, "data.reread_distances is"),
    "a reread passage of 1": ({"data.reread_passage": 1}, "data.reread_passage must be a whole number of tokens >= 2"),
}

#: fields of the wrong type or order, matched literally
TYPED_CASES = {
    "curriculum steps not increasing": ({"data.curriculum": [[5, 160], [0, 1000]]}, "data.curriculum's steps"),
    "curriculum from a negative step": ({"data.curriculum": [[-1, 160]]}, "data.curriculum's steps"),
    "a curriculum from step 100": (
        {"data.curriculum": [[100, 256]]},
        "data.curriculum must start at step 0 (the first entry holds until the next), got [100]",
    ),
    "max_facts steps not increasing": ({"data.max_facts": [[10, 2], [10, 3]]}, "data.max_facts's steps"),
    "data.min_len_frac a string": ({"data.min_len_frac": "0.5"}, "data.min_len_frac must be a number"),
    "data.mix a list": ({"data.mix": ["passkey"]}, "data.mix must be a mapping"),
    "data.curriculum of strings": ({"data.curriculum": [["0", "256"]]}, "data.curriculum must be a list of lists"),
    "data.drill true": ({"data.drill": True}, "data.drill must be a whole number"),
    "data.text_weight NaN": ({"data.text_weight": float("nan")}, "data.text_weight must be a finite number >= 0"),
    "data.answer_weight -5": ({"data.answer_weight": -5.0}, "data.answer_weight must be a finite number >= 0"),
    "data.prompt_weight inf": ({"data.prompt_weight": float("inf")}, "data.prompt_weight must be a finite"),
    "every loss weight 0": (
        {"data.text_weight": 0.0, "data.answer_weight": 0.0},
        "data.text_weight, data.answer_weight and data.prompt_weight are all 0",
    ),
    "data.names unknown": ({"data.names": "xyz"}, "data.names must be one of ['babi', 'varied'], got 'xyz'"),
    "data.align_to past the curriculum": (
        {"data.align_to": 4096, "data.aligned_frac": 1.0},
        "data.align_to (4096) is longer than the curriculum's shortest max_len",
    ),
}
TRAIN_CASES = TRAIN_CASES | {case: (changes, re.escape(message)) for case, (changes, message) in TYPED_CASES.items()}


@pytest.mark.parametrize("case", sorted(TRAIN_CASES))
def test_a_nonsense_training_config_names_the_field(case):
    changes, named = TRAIN_CASES[case]
    with pytest.raises(ValueError, match=named):
        TrainConfig.from_dict(train_config(**changes))
