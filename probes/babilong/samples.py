"""A story hidden in long background text, as in BABILong (Kuratov et al. 2024): its facts
spread in order over random sentence boundaries of the haystack, then the question."""

from __future__ import annotations

import random
import re
from collections.abc import Iterable, Iterator

from memviz_probes.babilong.stories import Story, make_story, task_labels, vocabulary
from memviz_probes.common import Sample, check_length, sample_rng, spans_of, take_filler
from memviz_probes.haystack import ProceduralHaystack, make_haystack

BACKGROUND = "shakespeare"  # the default haystack: real English prose, as PG19 is in the paper


def question_suffix(question: str) -> str:
    return f"\nQuestion: {question}\nAnswer:"


def unrelated(sentences: Iterable[str], names: str) -> Iterator[str]:
    """The background's sentences that name none of the stories' people, places or things, so that
    a real text (where "Mary" or "the garden" may well occur) never looks like a story fact or
    holds a second answer. Not applied to the procedural background, whose sentences never take a
    story's form and whose samples the recorded scores were measured on."""
    vocab = vocabulary(names)
    words = sorted({w.lower() for w in (*vocab.actors, *vocab.givers, *vocab.rooms, *vocab.objects)})
    mentions = re.compile(r"\b(?:" + "|".join(words) + r")\b", re.IGNORECASE)
    return (s for s in sentences if not mentions.search(s))


def make_sample(
    tokenizer, task: str, length: int, story: Story, haystack=None, seed: int = 0, names: str = "babi"
) -> Sample:
    """Spread the story's facts in order over random sentence boundaries of the background
    (`haystack`: None for Shakespeare's plays, "procedural", or a text file's path)."""
    rng = random.Random(f"babilong-placement-{seed}")
    suffix = question_suffix(story.question)
    fixed = len(tokenizer.encode(" ".join(story.facts) + suffix)) + 1
    check_length(length, fixed, f"{task} story and question")
    background = make_haystack(BACKGROUND if haystack is None else haystack, seed)
    sentences = (
        background.sentences()
        if isinstance(background, ProceduralHaystack)
        else unrelated(background.sentences(), names)
    )
    filler = take_filler(tokenizer, sentences, length - fixed)
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


def seeded_sample(
    tokenizer, task: str, length: int, seed: int, index: int, haystack=None, names: str = "babi"
) -> Sample:
    rng = sample_rng("babilong", task, seed, length, index, names)
    story = make_story(task, rng, names)
    return make_sample(tokenizer, task, length, story, haystack, seed=rng.randrange(2**31), names=names)
