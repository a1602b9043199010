"""The bAbI story simulator (Weston et al. 2015): vocabularies, a world of actors, rooms and
objects, and one generator per task (qa1-qa5), each returning a `Story`."""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

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
    move=(
        "{a} moved to the {r}.",
        "{a} went to the {r}.",
        "{a} journeyed to the {r}.",
        "{a} travelled to the {r}.",
        "{a} went back to the {r}.",
    ),
    grab=(
        "{a} picked up the {o} there.",
        "{a} got the {o} there.",
        "{a} grabbed the {o} there.",
        "{a} took the {o} there.",
    ),
    drop=("{a} dropped the {o}.", "{a} put down the {o}.", "{a} discarded the {o}.", "{a} left the {o}."),
    give=("{a} gave the {o} to {b}.", "{a} handed the {o} to {b}.", "{a} passed the {o} to {b}."),
)

VARIED = Vocabulary(
    actors=("Mary", "John", "Daniel", "Sandra", "Alice", "Omar", "Priya", "Tomas", "Greta", "Kenji", "Lucia", "Ravi"),
    givers=("Bill", "Fred", "Jeff", "Mary", "Nora", "Hugo", "Ines", "Yusuf"),
    rooms=(
        "bathroom",
        "bedroom",
        "garden",
        "hallway",
        "kitchen",
        "office",
        "cellar",
        "attic",
        "studio",
        "pantry",
        "balcony",
        "library",
    ),
    objects=("apple", "football", "milk", "umbrella", "notebook", "lamp", "scarf", "kettle"),
    move=BABI.move
    + ("{a} walked to the {r}.", "{a} ran to the {r}.", "{a} headed to the {r}.", "{a} hurried to the {r}."),
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
    "qa1": story_qa1,
    "qa2": story_qa2,
    "qa3": story_qa3,
    "qa4": story_qa4,
    "qa5": story_qa5,
}


def make_story(task: str, rng: random.Random, names: str = "babi") -> Story:
    check_task(task)
    return GENERATORS[task](rng, vocabulary(names))
