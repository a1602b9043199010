"""Training data drawn from the probe generators, and the tokenizer the zoo shares.

Every training sample comes from the same generators the probes use (`memviz_probes.passkey`, `memviz_probes.ruler`,
`memviz_probes.babilong`, `memviz_probes.facts`), seeded from a separate namespace ("train", data seed,
step, rank, index), so no training sample is ever a probe sample and a given step always
sees the same batch: resuming regenerates exactly the data the run would have seen.

A sample is the prompt followed by its answer and eos. Its loss weights are `text_weight`
(or `prompt_weight` where set) on the prompt's tokens and `answer_weight` on the answer's, so a small model is pushed
towards the retrieval the probes measure while still modelling the background text.
With `drill` > 0, qa1/qa2 samples go on after the answer with more questions on the same
story (bAbI's own format asks several): each answer is one more retrieval to learn from,
and many have an answer other than the last room mentioned. `max_facts` is a second
curriculum, over story size: a qa story with more facts than the stage allows is redrawn,
so a model first meets two- and three-fact stories, where binding a name to its room is
learnt quickly, before stories of ten moves.

The `text` task is language modelling on real English: a window of a training document of one of
`corpora` (`memviz_probes.texts`, the held-out documents never read), every token weighted `text_weight`.
`passkey_haystacks` puts the pass key's filler in other backgrounds (the plays' training split, the
papers' repeated "The grass is green." filler), one drawn per sample.

The `reread` task is the re-reading probe's layout (`memviz_probes.reread`) drawn from the training split of
`corpora` only: filler, a passage of P tokens from another document, d tokens of filler, the passage again, `length`
tokens in all. P is `reread_passage` (at most a quarter of the example) and d is log-uniform in `reread_distances`
(at most what the example leaves), so short and long distances are drawn alike. The second reading's tokens 2..P are
weighted `answer_weight`, as the pass key's answer is (its first token follows filler and cannot be copied); the
rest is a memory task's prompt (`prompt_weight`, or `text_weight`).

The `copy` task teaches copying in view, which re-reading past a window builds on (an induction circuit): blocks of
`copy_block` training tokens, each read again after `copy_gap` tokens of training text from elsewhere. A share
`copy_shuffled` of the blocks is put in a random order, so their own words do not predict them and only copying
does. A repeat's tokens 2..b are weighted `answer_weight`, the rest as a memory task's prompt.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import torch

from memviz.tokenizer import SPECIALS, BPETokenizer, ByteTokenizer, Tokenizer, load_tokenizer
from memviz_probes import babilong, facts, passkey, ruler, texts
from memviz_probes.common import take_filler
from memviz_probes.haystack import ProceduralHaystack, RepeatedHaystack, make_haystack
from training.fields import check_schedule, check_types

LONG_TASKS = ("passkey", *babilong.TASKS, *ruler.TASKS)
OTHER_TASKS = ("facts", "text", "reread", "copy")


@dataclass
class DataConfig:
    mix: dict[str, float] = field(default_factory=lambda: {"passkey": 1.0})
    curriculum: list[list[int]] = field(default_factory=lambda: [[0, 512]])  # [from_step, max_len]
    min_len_frac: float = 0.5  # a batch's length is drawn from [min_len_frac * max_len, max_len]
    text_weight: float = 1.0
    prompt_weight: float | None = None  # a memory task's prompt tokens (filler, needle, question); None: text_weight
    answer_weight: float = 5.0
    drill: int = 0  # qa1/qa2: up to this many more questions on the same story after the answer
    max_facts: list[list[int]] = field(default_factory=list)  # [from_step, most facts a qa story has]; [] = any
    names: str = "babi"  # bAbI vocabulary for qa tasks
    haystack: str = "procedural"  # BABILong's and RULER's essay background: "procedural", "shakespeare" or a text file
    kb_seed: int = 0  # facts: which knowledge base
    n_entities: int = 1000
    # share of batches whose length is rounded down to a multiple of `align_to` tokens: the
    # prompt then ends at a segment boundary and the answer is read from memory alone, the
    # case a probe at a length of whole segments measures (see README, pass key)
    aligned_frac: float = 0.0
    align_to: int = 64
    # [from_step, n]: every batch continues n tokens of procedural filler, which only the frozen
    # part of the model reads (LongMem's backbone fills the bank with them once: `backbone_prefill`),
    # so the bank a batch searches holds n tokens of distractors, as at a million tokens; [] = none
    prefix_tokens: list[list[int]] = field(default_factory=list)
    corpora: dict[str, float] = field(
        default_factory=lambda: {"shakespeare": 1.0}
    )  # the text task's corpora and weights
    passkey_haystacks: list[str] = field(
        default_factory=list
    )  # the pass key's fillers, one drawn a sample; [] = procedural
    reread_passage: int = 300  # reread: tokens of the passage read twice (at most a quarter of the example)
    reread_distances: list[int] = field(default_factory=lambda: [64, 16384])  # reread: [shortest, longest] d
    copy_block: list[int] = field(default_factory=lambda: [8, 32])  # copy: [shortest, longest] block read twice
    copy_gap: list[int] = field(default_factory=lambda: [0, 16])  # copy: [shortest, longest] text between readings
    copy_shuffled: float = 0.5  # copy: share of blocks read in a random order
    seed: int = 1

    def __post_init__(self) -> None:
        check_types(self, "data.")
        unknown = sorted(set(self.mix) - set(LONG_TASKS) - set(OTHER_TASKS))
        if unknown:
            raise ValueError(f"unknown data tasks {unknown}; tasks are {[*LONG_TASKS, *OTHER_TASKS]}")
        if (
            not isinstance(self.corpora, dict)
            or not self.corpora
            or not all(isinstance(w, (int, float)) and w >= 0 for w in self.corpora.values())
            or sum(self.corpora.values()) <= 0
        ):
            raise ValueError(
                f"data.corpora maps corpus names or paths to non-negative weights with a positive sum, "
                f"got {self.corpora!r}"
            )
        if self.mix.get("text") or self.mix.get("reread") or self.mix.get("copy"):
            for corpus in self.corpora:
                try:
                    texts.documents(corpus, "train")
                except ValueError as exc:
                    raise ValueError(f"data.corpora: {exc}") from exc
        if not isinstance(self.passkey_haystacks, list) or not all(isinstance(h, str) for h in self.passkey_haystacks):
            raise ValueError(
                f"data.passkey_haystacks is a list of background names or text files, got {self.passkey_haystacks!r}"
            )
        for name in self.passkey_haystacks:
            if name == "shakespeare":
                raise ValueError(
                    "data.passkey_haystacks: 'shakespeare' holds the held-out plays; training reads 'shakespeare_train'"
                )
            try:
                make_haystack(name, 0)
            except ValueError as exc:
                raise ValueError(f"data.passkey_haystacks: {exc}") from exc
        if not isinstance(self.reread_passage, int) or self.reread_passage < 2:
            raise ValueError(f"data.reread_passage must be a whole number of tokens >= 2, got {self.reread_passage!r}")
        shortest_d, longest_d = (self.reread_distances + [0, 0])[:2]
        if len(self.reread_distances) != 2 or not 1 <= shortest_d <= longest_d:
            raise ValueError(
                f"data.reread_distances is [shortest, longest] tokens between the readings, 1 <= shortest <= "
                f"longest, got {self.reread_distances!r}"
            )
        for name, least in (("copy_block", 2), ("copy_gap", 0)):
            bounds = getattr(self, name)
            if (
                not isinstance(bounds, list)
                or len(bounds) != 2
                or not all(isinstance(b, int) for b in bounds)
                or not least <= bounds[0] <= bounds[1]
            ):
                raise ValueError(
                    f"data.{name} is [shortest, longest] whole numbers of tokens, {least} <= shortest <= longest, "
                    f"got {bounds!r}"
                )
        if not isinstance(self.copy_shuffled, (int, float)) or not 0 <= self.copy_shuffled <= 1:
            raise ValueError(f"data.copy_shuffled must lie in [0, 1], got {self.copy_shuffled!r}")
        if not self.mix or not all(0 <= w < math.inf for w in self.mix.values()) or sum(self.mix.values()) <= 0:
            raise ValueError(f"data.mix needs finite non-negative weights with a positive sum, got {self.mix!r}")
        if not self.curriculum or any(len(c) != 2 or c[1] <= 0 for c in self.curriculum):
            raise ValueError("data.curriculum is a list of [from_step, max_len] with max_len > 0")
        if any(len(c) != 2 or c[1] < 1 for c in self.max_facts):
            raise ValueError("data.max_facts is a list of [from_step, n] with n >= 1")
        for name in ("curriculum", "max_facts", "prefix_tokens"):
            check_schedule(getattr(self, name), f"data.{name}")
        if self.drill < 0:
            raise ValueError(f"data.drill must be >= 0, got {self.drill}")
        if self.n_entities < 1:  # checked with or without facts in the mix: the card records it
            raise ValueError(f"data.n_entities must be a number of people >= 1, got {self.n_entities}")
        if any(task in ruler.TASKS or task in babilong.TASKS for task in self.mix):
            try:
                make_haystack(self.haystack, 0)  # a missing file or uninstalled texts fail before training
            except ValueError as exc:
                raise ValueError(f"data.haystack: {exc}") from exc
        if any(len(c) != 2 or not isinstance(c[1], int) or c[1] < 0 for c in self.prefix_tokens):
            raise ValueError("data.prefix_tokens is a list of [from_step, n] with n a whole number of tokens >= 0")
        if self.prompt_weight is not None and (
            not isinstance(self.prompt_weight, (int, float)) or not 0 <= self.prompt_weight < math.inf
        ):
            raise ValueError(
                f"data.prompt_weight must be a finite non-negative number or null, got {self.prompt_weight!r}"
            )
        for name in ("text_weight", "answer_weight"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ValueError(f"data.{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        if not (self.text_weight or self.answer_weight or self.prompt_weight):
            raise ValueError(
                "data.text_weight, data.answer_weight and data.prompt_weight are all 0: no token is trained"
            )
        try:
            babilong.vocabulary(self.names)
        except ValueError as exc:
            raise ValueError(f"data.{exc}") from exc
        if not 0 < self.min_len_frac <= 1:
            raise ValueError(f"data.min_len_frac must lie in (0, 1], got {self.min_len_frac}")
        if not 0 <= self.aligned_frac <= 1 or not isinstance(self.align_to, int) or self.align_to < 1:
            raise ValueError(
                f"data.aligned_frac must lie in [0, 1] and data.align_to be a positive integer, "
                f"got {self.aligned_frac!r} and {self.align_to!r}"
            )
        shortest = min(c[1] for c in self.curriculum)
        if self.aligned_frac and self.align_to > shortest:
            raise ValueError(
                f"data.align_to ({self.align_to}) is longer than the curriculum's shortest max_len ({shortest}): "
                "an aligned batch would be longer than its stage allows"
            )

    def max_len(self, step: int) -> int:
        return stage(self.curriculum, step)

    def facts_limit(self, step: int) -> int | None:
        return stage(self.max_facts, step) if self.max_facts else None

    def prefix_at(self, step: int) -> int:
        return stage(self.prefix_tokens, step) if self.prefix_tokens else 0


def stage(schedule: list[list[int]], step: int) -> int:
    """The value of the last [from_step, value] stage that has started (the first before any)."""
    value = schedule[0][1]
    for start, v in schedule:
        if step >= start:
            value = v
    return value


@dataclass
class Example:
    tokens: list[int]
    weights: list[float]  # weight of predicting tokens[t] from position t-1 (weights[0] unused)


def tokenizer_corpus(seed: int = 0, n_docs: int = 6000) -> Iterator[str]:
    """Text covering every generator, for training the shared BPE."""
    rng = random.Random(f"tokenizer-corpus-{seed}")
    sentences = ProceduralHaystack(seed).sentences()
    kb_docs = facts.documents(facts.KnowledgeBase(0, 2000), seed)
    for i in range(n_docs):
        yield " ".join(next(sentences) for _ in range(8))
        story = babilong.make_story(babilong.TASKS[i % 5], rng, "varied" if i % 2 else "babi")
        yield " ".join(story.facts) + babilong.question_suffix(story.question) + " " + story.answer + "."
        yield passkey.INSTRUCTION + " " + passkey.needle(rng.randrange(10000, 100000)) + "\n" + passkey.QUESTION
        yield next(kb_docs)


def english_tokenizer_corpus(seed: int = 0, piece_chars: int = 2000) -> Iterator[str]:
    """The training split of every built-in corpus in pieces, then the task formats (generators, the
    papers' filler, RULER's needles): the English tokenizer's text, no held-out document in it."""
    for corpus in texts.CORPORA:
        for doc in texts.documents(corpus, "train"):
            for start in range(0, len(doc.text), piece_chars):
                yield doc.text[start : start + piece_chars]
    yield from tokenizer_corpus(seed, n_docs=1500)
    rng = random.Random(f"tokenizer-corpus-english-{seed}")
    for _ in range(300):
        yield " ".join(RepeatedHaystack.SENTENCES)
        task = rng.choice(["niah_single_1", "niah_single_3", "niah_multikey_3", "vt"])
        sample = ruler.make_sample(ByteTokenizer(), task, 1000, seed=rng.randrange(2**31), haystack="procedural")
        yield sample.prompt + " " + ", ".join(sample.meta["answers"])


#: the most ids a learnt tokenizer may have
MAX_BPE_VOCAB = 2**20


def bpe_vocab_size(spec: str) -> int:
    """The N of a 'bpe:N' or 'bpe-english:N' tokenizer spec: a whole number that holds the 256 bytes
    and the special tokens, up to MAX_BPE_VOCAB."""
    kind, _, size = spec.partition(":")
    least = 256 + len(SPECIALS)
    if not size.isdigit() or not least <= int(size) <= MAX_BPE_VOCAB:
        raise ValueError(
            f"tokenizer {spec!r}: the vocabulary size after '{kind}:' must be a whole number from {least} (the 256 "
            f"bytes and {len(SPECIALS)} special tokens) to {MAX_BPE_VOCAB:,}"
        )
    return int(size)


def build_tokenizer(spec: str, out_dir: Path | None = None) -> Tokenizer:
    """'byte', 'bpe:<vocab size>' (trained on the generators' text), 'bpe-english:<vocab size>' (on the
    real-text corpora's training split and the task formats), or a tokenizer.json path."""
    if spec == "byte":
        return ByteTokenizer()
    if spec.startswith("bpe:"):
        return BPETokenizer.train(tokenizer_corpus(), vocab_size=bpe_vocab_size(spec))
    if spec.startswith("bpe-english:"):
        return BPETokenizer.train(english_tokenizer_corpus(), vocab_size=bpe_vocab_size(spec))
    path = Path(spec)
    if not path.is_file():
        raise ValueError(f"tokenizer {spec!r} is not 'byte', 'bpe:N', 'bpe-english:N' nor a tokenizer.json file")
    try:
        return load_tokenizer(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"tokenizer {spec}: {exc}") from exc


class TokenisedCorpus:
    """The training split of weighted corpora, each document tokenised once, read as random windows."""

    def __init__(self, tokenizer: Tokenizer, corpora: dict[str, float]) -> None:
        self.names = [name for name, w in corpora.items() if w > 0]
        self.weights = [corpora[name] for name in self.names]
        self.docs = {name: [tokenizer.encode(d.text) for d in texts.documents(name, "train")] for name in self.names}

    def document(self, rng: random.Random) -> tuple[str, int]:
        """A document's (corpus, index), its corpus drawn by weight and the document in proportion to its length."""
        name = rng.choices(self.names, self.weights)[0]
        docs = self.docs[name]
        return name, rng.choices(range(len(docs)), [len(d) for d in docs])[0]

    def window(self, rng: random.Random, length: int) -> list[int]:
        """`length` tokens from a random place (documents drawn in proportion to their length); a document
        shorter than that is given whole."""
        name, index = self.document(rng)
        doc = self.docs[name][index]
        start = rng.randrange(max(1, len(doc) - length + 1))
        return doc[start : start + length]

    def filler(self, rng: random.Random, length: int, avoid: tuple[str, int]) -> list[int]:
        """`length` tokens of windows of documents other than `avoid`, one after another, each document drawn as
        `document` draws (its corpus's weight, its share of that corpus's tokens) among the others only."""
        others = [(n, i) for n in self.names for i in range(len(self.docs[n])) if (n, i) != avoid]
        weights = [
            self.weights[self.names.index(n)] * len(self.docs[n][i]) / sum(map(len, self.docs[n])) for n, i in others
        ]
        tokens: list[int] = []
        while len(tokens) < length:
            name, index = rng.choices(others, weights)[0]
            doc = self.docs[name][index]
            start = rng.randrange(max(1, len(doc) - (length - len(tokens)) + 1))
            tokens += doc[start : start + length - len(tokens)]
        return tokens


class TaskSampler:
    """Draws training examples of a given length from the configured task mix."""

    def __init__(self, tokenizer: Tokenizer, cfg: DataConfig) -> None:
        self.tokenizer, self.cfg = tokenizer, cfg
        self.tasks = [t for t, w in cfg.mix.items() if w > 0]
        self.weights = [cfg.mix[t] for t in self.tasks]
        self.kb = facts.KnowledgeBase(cfg.kb_seed, cfg.n_entities) if "facts" in self.tasks else None
        reads_text = any(task in self.tasks for task in ("text", "reread", "copy"))
        self.corpus = TokenisedCorpus(tokenizer, cfg.corpora) if reads_text else None
        if "reread" in self.tasks and self.corpus is not None and sum(map(len, self.corpus.docs.values())) < 2:
            raise ValueError(
                "data.corpora: the reread task draws its filler from another document than the passage's, "
                "and the corpora's training split holds one"
            )
        prompt = passkey.INSTRUCTION + " " + passkey.needle(10000) + "\n" + passkey.QUESTION
        self.passkey_full_len = len(tokenizer.encode(prompt)) + 16  # room for some filler

    def example(self, rng: random.Random, length: int, max_facts: int | None = None) -> Example:
        """A sample of a task drawn from the mix; a sample that cannot fit `length` (a long
        story early in the curriculum) is redrawn, task included."""
        last = None
        for _ in range(50):
            task = rng.choices(self.tasks, self.weights)[0]
            if task == "facts":
                return self.facts_example(rng, length)
            if task == "text":
                assert self.corpus is not None  # "text" is in the mix, so __init__ tokenised its corpora
                tokens = self.corpus.window(rng, length)
                return Example(tokens, [0.0] + [self.cfg.text_weight] * (len(tokens) - 1))
            if task == "reread":
                return self.reread_example(rng, length)
            if task == "copy":
                return self.copy_example(rng, length)
            try:
                sample, answer, drills = self.long_sample(task, rng, length, max_facts)
                break
            except ValueError as exc:
                last = exc
                continue
        else:
            limit = f" and at most {max_facts} facts a story (data.max_facts)" if max_facts else ""
            raise ValueError(
                f"data.curriculum length {length}{limit} is too short for the tasks {self.tasks} "
                f"(the last of 50 draws: {last})"
            )
        tokens = self.tokenizer.encode(sample.prompt)
        prompt_weight = self.cfg.text_weight if self.cfg.prompt_weight is None else self.cfg.prompt_weight
        weights = [0.0] + [prompt_weight] * (len(tokens) - 1)
        for question, reply in [("", answer), *drills]:
            q, a = self.tokenizer.encode(question), self.tokenizer.encode(reply)
            tokens += q + a
            weights += [prompt_weight] * len(q) + [self.cfg.answer_weight] * len(a)
        return Example(tokens + [self.tokenizer.eos_id], weights + [self.cfg.answer_weight])

    def reread_layout(self, rng: random.Random, length: int) -> tuple[int, int]:
        """(P, d) of a `length`-token reread example: P = `reread_passage`, at most length // 4; d log-uniform in
        `reread_distances`, each end at most length - 2P."""
        passage = min(self.cfg.reread_passage, length // 4)
        if passage < 2:
            raise ValueError(f"a reread example needs at least 8 tokens (two readings of 2), got a length of {length}")
        room = length - 2 * passage
        shortest, longest = (min(d, room) for d in self.cfg.reread_distances)
        distance = round(math.exp(rng.uniform(math.log(shortest), math.log(longest))))
        return passage, min(max(distance, shortest), longest)

    def reread_example(self, rng: random.Random, length: int) -> Example:
        """Filler, a passage, d tokens of filler, the passage again (`length` tokens, the training split only); the
        second reading's tokens 2..P weighted `answer_weight`."""
        assert self.corpus is not None  # "reread" is in the mix, so __init__ tokenised its corpora
        passage_len, distance = self.reread_layout(rng, length)
        source = self.corpus.document(rng)
        doc = self.corpus.docs[source[0]][source[1]]
        start = rng.randrange(max(1, len(doc) - passage_len + 1))
        passage = doc[start : start + passage_len]
        before = length - 2 * len(passage) - distance
        filler = self.corpus.filler(rng, before + distance, avoid=source)
        tokens = filler[:before] + passage + filler[before:] + passage
        prompt_weight = self.cfg.text_weight if self.cfg.prompt_weight is None else self.cfg.prompt_weight
        weights = [0.0] + [prompt_weight] * (len(tokens) - len(passage)) + [self.cfg.answer_weight] * (len(passage) - 1)
        return Example(tokens, weights)

    def copy_example(self, rng: random.Random, length: int) -> Example:
        """`length` tokens of blocks each read twice, a few tokens of text between (the training split only); the
        second reading's tokens 2..b weighted `answer_weight`. A block drawn from a document shorter than its length
        is that whole document."""
        assert self.corpus is not None  # "copy" is in the mix, so __init__ tokenised its corpora
        prompt_weight = self.cfg.text_weight if self.cfg.prompt_weight is None else self.cfg.prompt_weight
        tokens: list[int] = []
        weights: list[float] = []
        while len(tokens) < length:
            block = self.corpus.window(rng, rng.randint(*self.cfg.copy_block))
            if rng.random() < self.cfg.copy_shuffled:
                rng.shuffle(block)
            gap = self.corpus.window(rng, rng.randint(*self.cfg.copy_gap))
            tokens += block + gap + block
            weights += [prompt_weight] * (len(block) + len(gap) + 1) + [self.cfg.answer_weight] * (len(block) - 1)
        return Example(tokens[:length], [0.0] + weights[1:length])

    def long_sample(self, task: str, rng: random.Random, length: int, max_facts: int | None = None):
        if task == "passkey":
            key, seed = rng.randrange(10000, 100000), rng.randrange(2**31)
            # lengths the instruction leaves no room in (the start of a curriculum) drop it, so
            # needle and question can share one attention window or segment
            instruction = passkey.INSTRUCTION if length >= self.passkey_full_len else ""
            haystack = (
                rng.choice(self.cfg.passkey_haystacks) if self.cfg.passkey_haystacks else None
            )  # drawn only when asked
            sample = passkey.make_sample(
                self.tokenizer, length, rng.random(), key, haystack=haystack, seed=seed, instruction=instruction
            )
            return sample, " " + sample.answer, []
        if task in ruler.TASKS:  # RULER's prompt ends on its answer prefix; the answers follow it
            sample = ruler.make_sample(
                self.tokenizer, task, length, seed=rng.randrange(2**31), haystack=self.cfg.haystack
            )
            return sample, ("" if sample.prompt.endswith(" ") else " ") + ", ".join(sample.meta["answers"]) + ".", []
        story = self.story(task, rng, max_facts)
        sample = babilong.make_sample(
            self.tokenizer,
            task,
            length,
            story,
            haystack=self.cfg.haystack,
            seed=rng.randrange(2**31),
            names=self.cfg.names,
        )
        drills = []
        if self.cfg.drill and story.more:  # drawn only when asked, so other recipes keep their data
            drills = [
                (babilong.question_suffix(q), f" {a}.")
                for q, a in rng.sample(story.more, min(self.cfg.drill, len(story.more)))
            ]
        return sample, " " + sample.answer + ".", drills

    def story(self, task: str, rng: random.Random, max_facts: int | None) -> babilong.Story:
        """A story of `task`, redrawn until it has at most `max_facts` facts."""
        for _ in range(1000):
            story = babilong.make_story(task, rng, self.cfg.names)
            if max_facts is None or len(story.facts) <= max_facts:
                return story
        raise ValueError(f"no {task} story of at most {max_facts} facts in 1000 draws")

    def facts_example(self, rng: random.Random, length: int) -> Example:
        assert self.kb is not None  # drawn only for a mix with "facts", for which __init__ drew the knowledge base
        docs = facts.documents(self.kb, rng.randrange(2**31))
        tokens: list[int] = []
        while len(tokens) < length:
            tokens += self.tokenizer.encode(next(docs) + "\n\n")
        tokens = tokens[:length]
        return Example(tokens, [0.0] + [self.cfg.text_weight] * (len(tokens) - 1))

    def prefix(self, n: int, batch_size: int) -> torch.Tensor:
        """[batch_size, n] token ids of procedural filler, another text a row, the same every call."""
        rows = []
        for row in range(batch_size):
            rng = random.Random(f"train-prefix|{self.cfg.seed}|{row}")
            sentences = make_haystack("procedural", rng.randrange(2**31)).sentences()
            rows.append(self.tokenizer.encode(" ".join(take_filler(self.tokenizer, sentences, n + 64)))[:n])
        return torch.tensor(rows, dtype=torch.long)

    def draw_length(self, step: int, rng: random.Random) -> int:
        """A batch's prompt length: uniform in [min_len_frac, 1] x the curriculum's length, and
        with probability `aligned_frac` rounded down to whole `align_to` segments."""
        max_len = self.cfg.max_len(step)
        length = rng.randint(max(1, int(self.cfg.min_len_frac * max_len)), max_len)
        if self.cfg.aligned_frac and rng.random() < self.cfg.aligned_frac:  # drawn only when asked
            length = max(self.cfg.align_to, length // self.cfg.align_to * self.cfg.align_to)
        return length

    def step_rng(self, step: int, rank: int = 0) -> random.Random:
        """The generator a step's batch is drawn from (its length first), the same on every run."""
        return random.Random(f"train|{self.cfg.seed}|{step}|{rank}")

    def step_length(self, step: int, rank: int = 0) -> int:
        """The prompt length `batch(step, ..., rank)` draws, without drawing the batch."""
        return self.draw_length(step, self.step_rng(step, rank))

    def batch(self, step: int, batch_size: int, rank: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """(tokens [B, T], weights [B, T]) for this step and rank, padded on the right."""
        rng = self.step_rng(step, rank)
        length = self.draw_length(step, rng)
        max_facts = self.cfg.facts_limit(step)
        examples = [self.example(rng, length, max_facts) for _ in range(batch_size)]
        width = max(len(e.tokens) for e in examples)
        tokens = torch.full((batch_size, width), self.tokenizer.pad_id, dtype=torch.long)
        weights = torch.zeros(batch_size, width)
        for i, e in enumerate(examples):
            tokens[i, : len(e.tokens)] = torch.tensor(e.tokens)
            weights[i, : len(e.weights)] = torch.tensor(e.weights)
        return tokens, weights
