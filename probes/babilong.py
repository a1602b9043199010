"""BABILong-style probes: bAbI stories qa1-qa5 hidden in long background text.

Stories follow the bAbI rules (Weston et al. 2015):
  qa1 single supporting fact   four actors move between six rooms; "Where is Mary?"
  qa2 two supporting facts     actors also pick up and drop objects; "Where is the milk?"
  qa3 three supporting facts   "Where was the apple before the office?"
  qa4 two-argument relations   "The office is north of the kitchen."; "What is north of the kitchen?"
  qa5 three-argument relations "Fred gave the apple to Bill."; "Who gave the apple to Bill?"
`names="babi"` uses bAbI's own actors, rooms and objects; `names="varied"` draws from larger
pools (and more verb templates) so a probe can defeat shortcuts learned on the originals.

As in BABILong (Kuratov et al. 2024), the story's sentences are spread, in order, over
random sentence boundaries of the background. The prompt is

    <context>
    Question: <question>
    Answer:

and answers are scored by BABILong's rule: lowercase, keep the first sentence, drop task
labels that the question mentions; correct when the target is the only label left.
`load` reads the released BABILong files (JSON/JSONL lists or parquet with `input`,
`question`, `target`) from a local path.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import pandas as pd

from probes.common import Sample, accuracy_heatmap, check_length, check_n, run_samples, sample_rng, spans_of, take_filler
from probes.haystack import make_haystack

TASKS = ("qa1", "qa2", "qa3", "qa4", "qa5")
DIRECTIONS = ("north", "south", "east", "west")
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}


@dataclass(frozen=True)
class Vocabulary:
    actors: tuple[str, ...]
    givers: tuple[str, ...]  # qa5's actors
    rooms: tuple[str, ...]
    objects: tuple[str, ...]
    move: tuple[str, ...]
    grab: tuple[str, ...]
    drop: tuple[str, ...]
    give: tuple[str, ...]


BABI = Vocabulary(
    actors=("Mary", "John", "Daniel", "Sandra"),
    givers=("Bill", "Fred", "Jeff", "Mary"),
    rooms=("bathroom", "bedroom", "garden", "hallway", "kitchen", "office"),
    objects=("apple", "football", "milk"),
    move=("{a} moved to the {r}.", "{a} went to the {r}.", "{a} journeyed to the {r}.", "{a} travelled to the {r}.", "{a} went back to the {r}."),
    grab=("{a} picked up the {o} there.", "{a} got the {o} there.", "{a} grabbed the {o} there.", "{a} took the {o} there."),
    drop=("{a} dropped the {o}.", "{a} put down the {o}.", "{a} discarded the {o}.", "{a} left the {o}."),
    give=("{a} gave the {o} to {b}.", "{a} handed the {o} to {b}.", "{a} passed the {o} to {b}."),
)

VARIED = Vocabulary(
    actors=("Mary", "John", "Daniel", "Sandra", "Alice", "Omar", "Priya", "Tomas", "Greta", "Kenji", "Lucia", "Ravi"),
    givers=("Bill", "Fred", "Jeff", "Mary", "Nora", "Hugo", "Ines", "Yusuf"),
    rooms=("bathroom", "bedroom", "garden", "hallway", "kitchen", "office", "cellar", "attic", "studio", "pantry", "balcony", "library"),
    objects=("apple", "football", "milk", "umbrella", "notebook", "lamp", "scarf", "kettle"),
    move=BABI.move + ("{a} walked to the {r}.", "{a} ran to the {r}.", "{a} headed to the {r}.", "{a} hurried to the {r}."),
    grab=BABI.grab + ("{a} lifted the {o} there.", "{a} collected the {o} there."),
    drop=BABI.drop + ("{a} set down the {o}.", "{a} abandoned the {o}."),
    give=BABI.give + ("{a} offered the {o} to {b}.", "{a} brought the {o} to {b}."),
)
VOCABULARIES = {"babi": BABI, "varied": VARIED}


def task_labels(task: str, names: str = "babi") -> list[str]:
    vocab = vocabulary(names)
    check_task(task)
    if task == "qa5":
        return [*vocab.givers, *vocab.objects]
    return list(vocab.rooms)


def check_task(task: str) -> None:
    if task not in TASKS:
        raise ValueError(f"unknown task {task!r}; tasks are {list(TASKS)}")


def vocabulary(names: str) -> Vocabulary:
    if names not in VOCABULARIES:
        raise ValueError(f"names must be one of {sorted(VOCABULARIES)}, got {names!r}")
    return VOCABULARIES[names]


@dataclass
class Story:
    facts: list[str]
    question: str
    answer: str
    supporting: list[int]  # indices into facts
    more: list[tuple[str, str]] = field(default_factory=list)  # other (question, answer) pairs the story settles


class World:
    """Tracks who is where and who holds what while a story is generated."""

    def __init__(self, rng: random.Random, vocab: Vocabulary, actors: Sequence[str]) -> None:
        self.rng, self.vocab, self.actors = rng, vocab, list(actors)
        self.where: dict[str, tuple[str, int]] = {}  # actor -> (room, fact index)
        self.holder: dict[str, tuple[str, int]] = {}  # object -> (actor, fact index of grab/give)
        self.dropped: dict[str, tuple[str, int]] = {}  # object -> (room, fact index)
        self.trail: dict[str, list[tuple[str, int]]] = {o: [] for o in vocab.objects}
        self.facts: list[str] = []

    def say(self, template: str, **slots: str) -> int:
        self.facts.append(template.format(**slots))
        return len(self.facts) - 1

    def move(self, actor: str) -> None:
        here = self.where.get(actor, (None, -1))[0]
        room = self.rng.choice([r for r in self.vocab.rooms if r != here])
        i = self.say(self.rng.choice(self.vocab.move), a=actor, r=room)
        self.where[actor] = (room, i)
        for obj, (who, _) in self.holder.items():
            if who == actor:
                self.trail[obj].append((room, i))

    def grab(self, actor: str, obj: str) -> None:
        i = self.say(self.rng.choice(self.vocab.grab), a=actor, o=obj)
        self.holder[obj] = (actor, i)
        self.dropped.pop(obj, None)
        room = self.where[actor][0]
        if not self.trail[obj] or self.trail[obj][-1][0] != room:
            self.trail[obj].append((room, i))

    def drop(self, obj: str) -> None:
        actor, _ = self.holder.pop(obj)
        i = self.say(self.rng.choice(self.vocab.drop), a=actor, o=obj)
        self.dropped[obj] = (self.where[actor][0], i)

    def step_objects(self) -> None:
        """One random event among moves, grabs and drops that the world allows."""
        placed = [a for a in self.actors if a in self.where]
        free = [o for o in self.vocab.objects if o not in self.holder]
        held = list(self.holder)
        choice = self.rng.random()
        if placed and free and choice < 0.3:
            self.grab(self.rng.choice(placed), self.rng.choice(free))
        elif held and choice < 0.4:
            self.drop(self.rng.choice(held))
        else:
            self.move(self.rng.choice(self.actors))


def story_qa1(rng: random.Random, vocab: Vocabulary) -> Story:
    world = World(rng, vocab, vocab.actors)
    for _ in range(rng.randint(2, 10)):
        world.move(rng.choice(vocab.actors))
    actor = rng.choice(sorted(world.where))
    room, i = world.where[actor]
    more = [(f"Where is {a}?", r) for a, (r, _) in sorted(world.where.items()) if a != actor]
    return Story(world.facts, f"Where is {actor}?", room, [i], more)


def story_qa2(rng: random.Random, vocab: Vocabulary) -> Story:
    while True:
        world = World(rng, vocab, vocab.actors)
        for _ in range(rng.randint(6, 16)):
            world.step_objects()
        known = [o for o in vocab.objects if o in world.holder or o in world.dropped]
        if known:
            break
    obj = rng.choice(known)

    def room_of(o: str) -> str:
        return world.where[world.holder[o][0]][0] if o in world.holder else world.dropped[o][0]

    more = [(f"Where is the {o}?", room_of(o)) for o in known if o != obj]
    if obj in world.holder:
        actor, i_grab = world.holder[obj]
        room, i_move = world.where[actor]
        return Story(world.facts, f"Where is the {obj}?", room, sorted({i_grab, i_move}), more)
    room, i_drop = world.dropped[obj]
    return Story(world.facts, f"Where is the {obj}?", room, [i_drop], more)


def story_qa3(rng: random.Random, vocab: Vocabulary) -> Story:
    while True:
        world = World(rng, vocab, vocab.actors)
        for _ in range(rng.randint(8, 20)):
            world.step_objects()
        moved = [o for o, t in world.trail.items() if len(t) >= 2]
        if moved:
            break
    obj = rng.choice(moved)
    (before, i_before), (now, i_now) = world.trail[obj][-2], world.trail[obj][-1]
    return Story(world.facts, f"Where was the {obj} before the {now}?", before, sorted({i_before, i_now}))


def story_qa4(rng: random.Random, vocab: Vocabulary) -> Story:
    a, b, c = rng.sample(vocab.rooms, 3)
    d1, d2 = rng.choice(DIRECTIONS), rng.choice(DIRECTIONS)
    facts = [f"The {a} is {d1} of the {b}.", f"The {c} is {d2} of the {a}."]
    rng.shuffle(facts)
    first = facts.index(f"The {a} is {d1} of the {b}.")
    if rng.random() < 0.5:
        return Story(facts, f"What is {d1} of the {b}?", a, [first])
    return Story(facts, f"What is the {a} {d1} of?", b, [first])


def story_qa5(rng: random.Random, vocab: Vocabulary) -> Story:
    people = list(vocab.givers)
    world = World(rng, vocab, people)
    gives: list[tuple[str, str, str, int]] = []

    def give(obj: str, giver: str) -> None:
        receiver = rng.choice([p for p in world.where if p != giver])
        i = world.say(rng.choice(vocab.give), a=giver, o=obj, b=receiver)
        world.holder[obj] = (receiver, i)
        gives.append((giver, obj, receiver, i))

    for _ in range(rng.randint(6, 14)):
        holders = [(o, a) for o, (a, _) in world.holder.items()]
        if holders and len(world.where) > 1 and rng.random() < 0.45:
            give(*rng.choice(holders))
        else:
            world.step_objects()
    while not gives:
        while len(world.where) < 2:
            world.move(rng.choice(people))
        holders = [(o, a) for o, (a, _) in world.holder.items()]
        if holders:
            give(*rng.choice(holders))
        else:
            world.grab(rng.choice(sorted(world.where)), rng.choice(vocab.objects))
    giver, obj, receiver, i = gives[-1]
    kind = rng.randrange(4)
    if kind == 0:
        return Story(world.facts, f"Who gave the {obj} to {receiver}?", giver, [i])
    if kind == 1:
        return Story(world.facts, f"Who did {giver} give the {obj} to?", receiver, [i])
    if kind == 2:
        return Story(world.facts, f"What did {giver} give to {receiver}?", obj, [i])
    return Story(world.facts, f"Who received the {obj}?", receiver, [i])


GENERATORS: dict[str, Callable[[random.Random, Vocabulary], Story]] = {
    "qa1": story_qa1, "qa2": story_qa2, "qa3": story_qa3, "qa4": story_qa4, "qa5": story_qa5,
}


def make_story(task: str, rng: random.Random, names: str = "babi") -> Story:
    check_task(task)
    return GENERATORS[task](rng, vocabulary(names))


def question_suffix(question: str) -> str:
    return f"\nQuestion: {question}\nAnswer:"


def make_sample(tokenizer, task: str, length: int, story: Story, haystack=None, seed: int = 0, names: str = "babi") -> Sample:
    """Spread the story's facts in order over random sentence boundaries of the background."""
    rng = random.Random(f"babilong-placement-{seed}")
    suffix = question_suffix(story.question)
    fixed = len(tokenizer.encode(" ".join(story.facts) + suffix)) + 1
    check_length(length, fixed, f"{task} story and question")
    filler = take_filler(tokenizer, make_haystack(haystack, seed).sentences(), length - fixed)
    slots = sorted(rng.randint(0, len(filler)) for _ in story.facts)
    pieces: list[str] = []
    fact_pieces: list[int] = []
    f = 0
    for boundary in range(len(filler) + 1):
        while f < len(story.facts) and slots[f] == boundary:
            fact_pieces.append(len(pieces))
            pieces.append((" " if pieces else "") + story.facts[f])
            f += 1
        if boundary < len(filler):
            pieces.append((" " if pieces else "") + filler[boundary])
    pieces.append(suffix)
    prompt = "".join(pieces)
    supporting = {fact_pieces[i] for i in story.supporting}
    return Sample(
        prompt=prompt,
        answer=story.answer,
        length=length,
        n_tokens=len(tokenizer.encode(prompt)),
        evidence=spans_of(tokenizer, pieces, supporting),
        meta={
            "task": task,
            "question": story.question,
            "labels": task_labels(task, names),
            "facts": story.facts,
            "supporting": story.supporting,
        },
    )


def seeded_sample(tokenizer, task: str, length: int, seed: int, index: int, haystack=None, names: str = "babi") -> Sample:
    rng = sample_rng("babilong", task, seed, length, index, names)
    story = make_story(task, rng, names)
    return make_sample(tokenizer, task, length, story, haystack, seed=rng.randrange(2**31), names=names)


def first_sentence(output: str) -> str:
    return output.lower().split(".")[0]


def compare_answers(target: str, output: str, question: str, labels: Sequence[str]) -> bool:
    """BABILong's rule: the target must be the only task label in the output's first sentence,
    not counting labels that the question itself mentions."""
    output = first_sentence(output)
    labels = {label.lower() for label in labels}
    in_question = {label for label in labels if label in question.lower()}
    in_output = {label for label in labels if label in output} - in_question
    return in_output == {target.lower()}


def load(data_path: str | Path, task: str, length: str | int | None = None) -> list[dict]:
    """Rows {input, question, target} of a released BABILong file, or of the file for `task`
    (and `length`, e.g. '1k') found under a folder."""
    check_task(task)
    path = Path(data_path).expanduser()
    if not path.exists():
        raise ValueError(f"BABILong data path {path} does not exist")
    if path.is_dir():
        path = find_file(path, task, length)
    try:
        if path.suffix == ".parquet":
            rows = pd.read_parquet(path).to_dict("records")
        elif path.suffix == ".jsonl":
            rows = [json.loads(line) for line in path.read_text(encoding="utf-8").splitlines() if line.strip()]
        else:
            data = json.loads(path.read_text(encoding="utf-8"))
            rows = data if isinstance(data, list) else data.get(task, data.get("data"))
    except (OSError, ValueError, UnicodeDecodeError) as exc:
        raise ValueError(f"{path}: cannot read BABILong data ({exc})") from exc
    if not isinstance(rows, list) or not rows:
        raise ValueError(f"{path}: expected a non-empty list of samples")
    missing = [k for k in ("input", "question", "target") if not all(isinstance(r, dict) and k in r for r in rows)]
    if missing:
        raise ValueError(f"{path}: samples lack the fields {missing}")
    return [{"input": str(r["input"]), "question": str(r["question"]), "target": str(r["target"])} for r in rows]


def find_file(folder: Path, task: str, length: str | int | None) -> Path:
    label = length_label(length) if length is not None else None
    found = []
    for p in sorted(folder.rglob("*")):
        if p.suffix not in (".json", ".jsonl", ".parquet") or not p.is_file():
            continue
        parts = [part.lower() for part in p.relative_to(folder).with_suffix("").parts]
        words = {w for part in parts for w in part.replace("-", "_").split("_")}
        if task in words and (label is None or label in words):
            found.append(p)
    if not found:
        raise ValueError(f"no BABILong file for {task}{' at ' + label if label else ''} under {folder}")
    return found[0]


def length_label(length: str | int) -> str:
    if isinstance(length, str):
        return length.lower()
    return f"{length // 1000}k" if length >= 1000 and length % 1000 == 0 else str(length)


def released_sample(tokenizer, row: dict, task: str, length) -> Sample:
    prompt = row["input"] + question_suffix(row["question"])
    return Sample(
        prompt=prompt,
        answer=row["target"],
        length=length,
        n_tokens=len(tokenizer.encode(prompt)),
        meta={"task": task, "question": row["question"], "labels": task_labels(task)},
    )


def run(
    model,
    tasks: Sequence[str],
    lengths: Sequence[int],
    n: int = 10,
    seed: int = 0,
    data_path: str | Path | None = None,
    haystack=None,
    names: str = "babi",
    progress: bool | Callable[[int, int], None] = True,
) -> pd.DataFrame:
    """One row per sample: task, length, answer, prediction, correct (depth is the position of
    the last supporting fact, as a fraction of the prompt, for generated samples)."""
    check_n(n)
    tasks, lengths = list(tasks), list(lengths)
    if not tasks or not lengths:
        raise ValueError("give at least one task and one length")
    for task in tasks:
        check_task(task)
    vocabulary(names)
    jobs = []
    for task in tasks:
        for length in lengths:
            if data_path is not None:
                rows = load(data_path, task, length)
                picks = random.Random(f"babilong-pick-{seed}").sample(range(len(rows)), min(n, len(rows)))
                for i in picks:
                    jobs.append(({"task": task, "length": length, "sample": i},
                                 lambda row=rows[i], task=task, length=length: released_sample(model.tokenizer, row, task, length)))
            else:
                for i in range(n):
                    jobs.append(({"task": task, "length": length, "sample": i},
                                 lambda task=task, length=length, i=i: seeded_sample(model.tokenizer, task, length, seed, i, haystack, names)))
    df = run_samples(model, jobs, score, max_new_tokens=6, progress=progress, desc="babilong")
    df["depth"] = [(spans[-1][1] / max(1, nt)) if spans else float("nan") for spans, nt in zip(df["evidence"], df["n_tokens"])]
    return df


def score(prediction: str, sample: Sample) -> bool:
    return compare_answers(sample.answer, prediction, sample.meta["question"], sample.meta["labels"])


def heatmap(df: pd.DataFrame, title: str = "BABILong-style QA"):
    """Rows task, columns length, colour accuracy (red to green)."""
    return accuracy_heatmap(df, rows="task", cols="length", title=title, row_label="task", col_label="length (tokens)")
