"""Training batches: reproducible per step, weighted towards the answer, and short passkey
prompts (a curriculum's start) drop the instruction so needle and question fit one window."""

import random

import pytest
import torch

from memviz.tokenizer import ByteTokenizer
from memviz_probes import passkey
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
