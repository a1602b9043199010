"""RULER's synthetic tasks (probes/ruler.py) against an independent solver that reads each
prompt's text alone: every generated sample has the answer the solver finds, an oracle model
built on the solver scores 100%, a silent one 0%, and the grid is the same over 1 and 2 processes."""

import re
from collections import Counter

import pandas as pd
import pytest
import torch

from memviz.tokenizer import ByteTokenizer
from memviz_probes import ruler

TOK = ByteTokenizer()
LENGTH = 2048  # long enough for every task's template in bytes (cwe's list of 10 x 6 words is the longest)


def solve(prompt: str) -> list[str]:
    """The answers, read from the prompt's text: the question names what to find."""
    if prompt.startswith("Memorize and track"):
        value = re.search(r"assigned the value (\d+) in the text above", prompt).group(1)
        direct = re.findall(r"VAR ([A-Z]+) = (\d+)\b", prompt)
        links = re.findall(r"VAR ([A-Z]+) = VAR ([A-Z]+)", prompt)
        found = [name for name, v in direct if v == value]
        grew = True
        while grew:
            new = [a for a, b in links if b in found and a not in found]
            found += new
            grew = bool(new)
        return found
    if prompt.startswith("Below is a numbered list"):
        words = re.findall(r"\d+\. ([a-z]+)", prompt.split("\nQuestion:")[0])
        return [w for w, _ in Counter(words).most_common(10)]
    if prompt.startswith("Read the following coded text"):
        text = prompt.split("coded words. ", 1)[1].split("\nQuestion:")[0]
        counts = Counter(w for w in text.split() if w != "...")
        return [w for w, _ in counts.most_common(3)]
    question = re.search(
        r"What (?:is|are all) the special magic \w+ for (.+?) mentioned in the provided text\?", prompt
    ).group(1)
    keys = re.split(r", and |, ", question)
    needles = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", prompt)
    return [value for key in keys for k, value in needles if k == key]


class SolverModel:
    """A stand-in model that answers with the solver (or says nothing, `silent`); module-level so
    that worker processes can unpickle it."""

    def __init__(self, silent: bool = False) -> None:
        self.tokenizer, self.card, self.silent = TOK, {}, silent

    def generate(self, prompt: str, max_new_tokens: int = 16, progress=None) -> str:
        return "" if self.silent else " " + ", ".join(solve(prompt)) + "."


@pytest.mark.parametrize("task", sorted(ruler.TASKS))
def test_the_solver_agrees_with_every_generated_answer(task):
    for i in range(150):
        sample = ruler.seeded_sample(TOK, task, LENGTH, seed=7, index=i)
        assert sample.n_tokens + ruler.TASKS[task].budget <= LENGTH, (task, i)
        assert sorted(solve(sample.prompt)) == sorted(sample.meta["answers"]), (task, i)
        for a, b in sample.evidence:  # the evidence spans are the asked needles / chain statements
            text = TOK.decode(TOK.encode(sample.prompt)[a:b])
            assert any(answer in text for answer in sample.meta["answers"]) or "VAR" in text, (task, i, text)


def test_samples_fill_their_length_follow_the_depth_and_differ_by_seed():
    for task in ruler.SINGLE_NEEDLE:
        for length in (1024, 4096):
            for depth in (0.0, 0.5, 1.0):
                sample = ruler.seeded_sample(TOK, task, length, seed=0, index=0, depth=depth)
                assert length - 200 <= sample.n_tokens + ruler.TASKS[task].budget <= length
                ((a, b),) = sample.evidence  # bytes: a token is a character of this ASCII prompt
                start, stop = sample.prompt.index("\n") + 1, sample.prompt.rindex("\n")  # the haystack, needle included
                assert abs((a - start) / (stop - start - (b - a)) - depth) < 0.1, (task, length, depth)
    one = ruler.seeded_sample(TOK, "niah_single_2", 1024, seed=0, index=0)
    assert one.prompt == ruler.seeded_sample(TOK, "niah_single_2", 1024, seed=0, index=0).prompt
    assert one.prompt != ruler.seeded_sample(TOK, "niah_single_2", 1024, seed=1, index=0).prompt


def test_scoring_is_rulers_string_match_all():
    sample = ruler.seeded_sample(TOK, "niah_multivalue", LENGTH, seed=0, index=0)
    answers = sample.meta["answers"]
    assert ruler.score(" " + ", ".join(answers), sample) == 1.0
    assert ruler.score(" " + answers[0].upper() + " and " + answers[2], sample) == 0.5
    assert ruler.score(" nothing", sample) == 0.0


def test_an_oracle_scores_everything_and_a_silent_model_nothing():
    kwargs = dict(tasks=sorted(ruler.TASKS), lengths=[LENGTH], n=2, seed=3, progress=False)
    perfect, silent = ruler.run(SolverModel(), **kwargs), ruler.run(SolverModel(silent=True), **kwargs)
    assert (
        len(perfect) == 2 * len(ruler.TASKS) and (perfect["correct"] == 1.0).all() and (silent["correct"] == 0.0).all()
    )
    assert perfect["answer"].tolist() == silent["answer"].tolist()
    fig = ruler.heatmap(perfect)
    assert list(fig.data[0].y) == sorted(ruler.TASKS) and list(fig.data[0].x) == [str(LENGTH)]


def test_a_single_task_over_depths_draws_the_needle_in_a_haystack_grid():
    df = ruler.run(SolverModel(), ["niah_single_1"], [1024, 2048], depths=[0.0, 0.5, 1.0], n=2, progress=False)
    heat = ruler.heatmap(df.assign(correct=df["length"] < 2000)).data[0]
    assert list(heat.y) == ["0", "50", "100"] and list(heat.x) == ["1024", "2048"]  # depth (%) down, length across
    assert heat.zmin == 0 and heat.zmax == 1 and heat.z[0][0] == 1.0 and heat.z[0][1] == 0.0
    assert (heat.customdata == 2).all()  # the cell count, on hover


def test_the_grid_is_the_same_over_one_and_two_processes():
    from tests.conftest import small_model

    model = small_model("sliding_window", window=16)
    kwargs = dict(tasks=["niah_single_1", "vt"], lengths=[512, 640], depths=[0.5], n=3, seed=1, progress=False)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the workers run one thread each: the same arithmetic
    try:
        alone = ruler.run(model, **kwargs)
    finally:
        torch.set_num_threads(threads)
    spread = ruler.run(model, **kwargs, workers=2)
    pd.testing.assert_frame_equal(alone, spread)
    oracle = ruler.run(SolverModel(), **kwargs, workers=2)
    assert (oracle["correct"] == 1.0).all() and oracle["answer"].tolist() == alone["answer"].tolist()


def test_a_shard_past_the_grid_has_no_rows_and_the_gathered_grid_is_whole():
    from memviz_probes import passkey
    from memviz_probes.common import merge_shards
    from tests.conftest import small_model

    model = small_model("sliding_window", window=16)
    kwargs = dict(lengths=[256], depths=[0.5], n=1, seed=0, progress=False)
    alone = passkey.run(model, **kwargs)
    parts = [passkey.run(model, **kwargs, shard=(i, 2)) for i in range(2)]
    assert len(parts[0]) == 1 and parts[1].empty
    pd.testing.assert_frame_equal(merge_shards(parts), alone)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tasks=["niah_single_9"], lengths=[1024]), "unknown RULER task 'niah_single_9'"),
        (dict(tasks=["cwe"], lengths=[300]), "shorter than task cwe's template"),
        (dict(tasks=["niah_single_1"], lengths=[40]), "shorter than task niah_single_1's template"),
        (dict(tasks=["niah_single_1"], lengths=[1024], depths=[1.5]), r"depth must lie in \[0, 1\]"),
        (dict(tasks=["niah_single_1"], lengths=[1024], workers=0), "workers must be a positive number"),
        (dict(tasks=["niah_single_1"], lengths=[1024], workers=10_000), "cores; give at most"),
        (dict(tasks=[], lengths=[1024]), "need at least one value each"),
        (dict(tasks=["niah_single_2"], lengths=[1024], haystack="/no/such/book.txt"), "does not exist"),
        (
            dict(tasks=["niah_single_1", "vt"], lengths=[1024], haystack="procedural"),
            r"haystack 'procedural' is the essay background, and none of tasks \['niah_single_1', 'vt'\] reads one",
        ),
    ],
)
def test_bad_input_gets_one_clear_error(kwargs, message):
    with pytest.raises(ValueError, match=message):
        ruler.run(SolverModel(), progress=False, **kwargs)


def test_the_essay_haystack_is_shakespeare_by_default_and_procedural_on_request():
    from memviz_probes import texts

    plays = set(texts.sentences())
    default = ruler.seeded_sample(TOK, "niah_single_2", LENGTH, seed=0, index=0)
    procedural = ruler.seeded_sample(TOK, "niah_single_2", LENGTH, seed=0, index=0, haystack="procedural")
    in_plays = [s for s in plays if s in default.prompt]
    assert len(in_plays) >= 5 and not any(s in procedural.prompt for s in in_plays)
