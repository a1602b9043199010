"""Background text for long-context probes: procedural English-like sentences, or a local file.

`ProceduralHaystack(seed)` draws each sentence independently from many templates and word
lists, so there is no cycle or count a model could exploit. Its vocabulary never contains
digits, the words of the pass-key needle, nor any bAbI actor, room, object or direction, so
the background can never answer a probe by accident. `FileHaystack(path)` reads any local
plain-text file (a public-domain book, say) and yields its sentences from a seeded offset.
"""

from __future__ import annotations

import os
import random
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol

from memviz.files import check_regular_file
from memviz_probes.registry import Widget

ADJECTIVES = """quiet bright narrow ancient gentle restless silver hollow distant crowded humble
steady patient curious golden pale crooked heavy tender brittle sudden calm wide rusty woven
lonely busy frozen warm hidden faded noble simple clever wild modest honest fragile swift
sleepy loud dusty polished weathered slender humid cheerful rough smooth amber violet crimson
bitter sweet sturdy shallow deep grand tiny vast muddy orderly careless eager weary proud""".split()

NOUNS = """river lantern market valley tower meadow harbor bridge orchard village forest
mountain library carriage window letter melody painter sailor merchant farmer weaver baker
teacher traveler shepherd scholar blacksmith poet fisherman florist potter carpenter
festival storm cloud candle ribbon basket wagon mirror compass clock journal banner fountain
chapel windmill cottage pathway island lighthouse canyon glacier prairie workshop garment
quilt violin drum feather pebble shell acorn lantern tapestry ladder barrel kettle""".split()

PLACE_NOUNS = """the old mill, the high ridge, the riverbank, the town square, the quiet chapel,
the harbor wall, the hilltop, the forest edge, the market stalls, the stone bridge, the orchard
gate, the lighthouse steps, the upper meadow, the dusty road, the far shore, the village well,
the workshop door, the winding lane, the frozen lake, the narrow gorge""".replace("\n", " ").split(", ")

VERBS_PAST = """watched carried painted followed admired repaired described remembered noticed
gathered polished borrowed wrapped lifted crossed visited studied measured sketched praised
guarded cleaned mended traded collected opened folded arranged""".split()

VERBS_INTRANSITIVE = """wandered rested lingered sang laughed waited drifted shimmered
murmured glowed trembled faded settled hurried paused listened whistled dozed""".split()

ADVERBS = """slowly quietly carefully gladly softly briskly patiently calmly suddenly gently
proudly eagerly silently boldly lazily warmly""".split()

PEOPLE = """the painter, the sailor, an old weaver, a young farmer, the baker, a tired traveler,
the shepherd, a scholar, the blacksmith, a wandering poet, the fisherman, a florist,
the potter, the carpenter, a merchant, the teacher, a musician, the innkeeper, a quiet monk,
the ferryman, a clockmaker, the miller, a cartographer, the lamplighter""".replace("\n", " ").split(", ")

TIMES = """at dawn, before the rain, after supper, in the late afternoon, during the festival,
under the evening sky, on a windy morning, when the bells rang, long ago, that autumn,
in early spring, beneath the stars, as the fog lifted, before the harvest""".replace("\n", " ").split(", ")

WEATHER = """the wind was cold, the sky was grey, the air smelled of pine, the sun was low,
the rain had stopped, the clouds moved slowly, the snow lay thin, the fog was thick,
the night was clear, the morning was mild""".replace("\n", " ").split(", ")

TEMPLATES = [
    "{Person} {verb} the {adj} {noun} near {place}.",
    "The {adj} {noun} {verb_i} {adverb} {time}.",
    "{Time}, {person} {verb} a {adj} {noun}.",
    "Nobody {verb} the {noun} that stood by {place}.",
    "{Person} {verb_i} by the {adj} {noun} and {verb} it {adverb}.",
    "It was said that {person} once {verb} a {noun} as {adj} as a {noun2}.",
    "{Weather}, and {person} {verb_i} {adverb}.",
    "Beyond {place} there was a {adj} {noun} and a {adj2} {noun2}.",
    "The {noun} and the {noun2} {verb_i} together {time}.",
    "{Person} kept a {adj} {noun} beside a {adj2} {noun2}.",
    "{Time}, the {adj} {noun} {verb_i} near {place}.",
    "Some say the {noun} was {adj}, others say it was {adj2}.",
    "{Person} walked past {place} and {verb} the {noun}.",
    "A {adj} {noun} {verb_i} while {person} {verb} the {noun2}.",
    "There was nothing {adj} about the {noun}, yet {person} {verb} it {adverb}.",
    "{Weather} when {person} reached {place}.",
    "The story of the {adj} {noun} was told {time}.",
    "{Person} {adverb} {verb} every {noun} in the {adj} {noun2}.",
    "Near {place}, the {noun2} {verb_i} and the {noun} stayed {adj}.",
    "Everyone agreed that the {noun} looked {adj} {time}.",
    "{Person} asked {person2} about the {adj} {noun}.",
    "{Person2} {verb} the {noun} while {person} {verb_i}.",
    "The {adj} {noun2} was older than the {noun} near {place}.",
    "In the {adj} {noun}, {person} {verb} a {adj2} {noun2}.",
    "{Time}, {weather}.",
    "The {noun} {verb_i} {adverb}, and the {noun2} {verb_i2} too.",
]

SLOT = re.compile(r"\{(\w+)\}")


def _fill(rng: random.Random, template: str) -> str:
    def pick(name: str) -> str:
        base = name.lower().rstrip("2")
        pool = {
            "adj": ADJECTIVES,
            "noun": NOUNS,
            "place": PLACE_NOUNS,
            "verb": VERBS_PAST,
            "verb_i": VERBS_INTRANSITIVE,
            "adverb": ADVERBS,
            "person": PEOPLE,
            "time": TIMES,
            "weather": WEATHER,
        }[base]
        word = rng.choice(pool)
        return word[0].upper() + word[1:] if name[0].isupper() else word

    return SLOT.sub(lambda m: pick(m.group(1)), template)


class Haystack(Protocol):
    def sentences(self) -> Iterator[str]: ...


class ProceduralHaystack:
    """Endless, seeded, English-like filler sentences."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed

    def sentences(self) -> Iterator[str]:
        rng = random.Random(f"haystack-{self.seed}")
        while True:
            yield _fill(rng, rng.choice(TEMPLATES))


#: the largest text file read as a haystack (a shelf of novels; the whole file is held as sentences)
MAX_HAYSTACK_FILE_BYTES = 64 * 2**20


class FileHaystack:
    """Sentences of a local plain-text file, cycling from a seeded starting sentence."""

    SENTENCE_END = re.compile(r"(?<=[.!?])\s+")

    def __init__(self, path: str | Path, seed: int = 0) -> None:
        from memviz_probes.texts import read_utf8

        path = Path(path).expanduser()
        check_regular_file(path, MAX_HAYSTACK_FILE_BYTES, "haystack file")
        text = read_utf8(path, "haystack file")
        self.items = [s for s in (" ".join(p.split()) for p in self.SENTENCE_END.split(text)) if s]
        if not self.items:
            raise ValueError(f"haystack file {path} holds no sentences")
        self.seed = seed

    def sentences(self) -> Iterator[str]:
        i = random.Random(f"file-haystack-{self.seed}").randrange(len(self.items))
        while True:
            yield self.items[i]
            i = (i + 1) % len(self.items)


class RepeatedHaystack:
    """The pass-key papers' filler (Landmark attention, Infini-attention): the same five sentences over and over."""

    SENTENCES = (
        "The grass is green.",
        "The sky is blue.",
        "The sun is yellow.",
        "Here we go.",
        "There and back again.",
    )

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed  # every seed gives the same text: the filler carries no information

    def sentences(self) -> Iterator[str]:
        while True:
            yield from self.SENTENCES


BACKGROUNDS = ("shakespeare", "procedural", "grass")  # the built-in backgrounds by name, real text first
#: how the Probes page asks for the background of the probes whose haystack is real text unless told
BACKGROUND = Widget(
    "selectbox",
    "haystack",
    "Background",
    options=BACKGROUNDS,
    help="Shakespeare's plays (real English, as PG19 and essays are in the papers) or the procedural sentences the "
    "shipped qa1 samples were trained on",
)


def make_haystack(haystack: str | Path | None, seed: int) -> Haystack:
    """None or 'procedural' gives the generator, 'shakespeare' the plays the set-up installs
    (`memviz_probes.texts`; 'shakespeare_train' without the held-out plays, what training reads), 'grass'
    the papers' repeated filler; anything else is a path to a text file."""
    if haystack is None or haystack == "procedural":
        return ProceduralHaystack(seed)
    if not isinstance(haystack, str | os.PathLike):
        raise ValueError(
            f"haystack must be a background's name ({', '.join(BACKGROUNDS)}) or a text file's path, got {haystack!r}"
        )
    if haystack in ("shakespeare", "shakespeare_train"):
        from memviz_probes.texts import ShakespeareHaystack

        return ShakespeareHaystack(seed, split="train" if haystack == "shakespeare_train" else "all")
    if haystack == "grass":
        return RepeatedHaystack(seed)
    if not str(haystack).strip():  # Path("") is the working folder
        raise ValueError(f"haystack: an empty name; give a background ({', '.join(BACKGROUNDS)}) or a text file")
    if not Path(haystack).expanduser().exists():  # a misspelt name, most likely: say what the names are
        raise ValueError(
            f"haystack {str(haystack)[:200]!r} does not exist: neither a background "
            f"({', '.join(BACKGROUNDS)}, shakespeare_train) nor a file"
        )
    return FileHaystack(haystack, seed)
