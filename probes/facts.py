"""Factual recall: a seeded synthetic knowledge base, a corpus stating it, and a question probe.

This is the probe for memory layers, whose paper's claim is factual recall. Each entity has
an invented name (so no prior knowledge helps), a birth year, a home city and an occupation.
The corpus states each fact in several phrasings, including the question form the probe
asks; the probe asks

    Question: Where does Velmora Quistan live?
    Answer:

and a prediction is correct when its first sentence, stripped, is the attribute's value.
The knowledge base is fixed by (kb_seed, n_entities); which facts the probe asks and how
the corpus is shuffled take their own seeds.
"""

from __future__ import annotations

import random
from argparse import Namespace
from collections.abc import Iterator
from dataclasses import dataclass

import pandas as pd

from memviz.protocol import MemoryModel
from memviz_probes.common import Sample, SampleProgress, check_n, run_samples
from memviz_probes.registry import PageParts, Probe, Widget, keywords, register_probe

SYLLABLES = """ka lo mi ra ven tor sul qui bel dar fen gor hal is jun kel mor nal os pel
rin sev tal ul vor wen xan yel zor bri cla dro fla gri plo stra tre vel mar nor""".split()
CITIES = """Ashford Brackmoor Caldera Dunmere Elsworth Fennick Galloway Hartwell Islebrook
Jorvik Kestrel Larkspur Marrowby Northam Oakhollow Pendle Quarrystone Redfern Saltcombe
Thornbury Umberly Valemont Westerly Yarrowdale Zennor Amberley Bellhaven Coldridge Dovecote
Emberton Foxley Glenhurst Highmoor Ivybridge Juniper Kingsmere Lowmarsh Millbrook Netherby
Ottery Pinecrest Queensferry Rookwood Stonehaven Tidewell Upton Violetmere Wrenfield""".split()
JOBS = """baker sculptor navigator brewer tailor cartographer jeweler astronomer beekeeper
bookbinder glassblower locksmith mason miller optician perfumer saddler shipwright stonecutter
tanner violinist weaver watchmaker archivist botanist chemist engraver falconer ferrier
herbalist illustrator lutist mapmaker organist printer puppeteer roofer surveyor thatcher""".split()
#: the most people a knowledge base holds (training's data.n_entities cap too)
MAX_ENTITIES = 1_000_000
ATTRIBUTES = ("birth_year", "city", "job")

STATEMENTS = {
    "birth_year": ("{name} was born in {value}.", "The birth year of {name} is {value}."),
    "city": ("{name} lives in {value}.", "The home of {name} is {value}."),
    "job": ("{name} works as a {value}.", "By trade, {name} is a {value}."),
}
QUESTIONS = {
    "birth_year": "When was {name} born?",
    "city": "Where does {name} live?",
    "job": "What does {name} do for a living?",
}


@dataclass(frozen=True)
class Entity:
    name: str
    birth_year: str
    city: str
    job: str


class KnowledgeBase:
    """`n_entities` invented people with three attributes each, fixed by `kb_seed`."""

    def __init__(self, kb_seed: int = 0, n_entities: int = 1000) -> None:
        if not isinstance(n_entities, int) or isinstance(n_entities, bool) or not 0 < n_entities <= MAX_ENTITIES:
            raise ValueError(f"n_entities must be a whole number of people in 1..{MAX_ENTITIES:,}, got {n_entities!r}")
        if not isinstance(kb_seed, int) or isinstance(kb_seed, bool):
            raise ValueError(f"kb_seed must be a whole number, got {kb_seed!r}")
        self.kb_seed, self.n_entities = kb_seed, n_entities
        rng = random.Random(f"kb-{kb_seed}")
        names: set[str] = set()
        entities: list[Entity] = []
        while len(entities) < n_entities:
            first = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
            last = "".join(rng.choice(SYLLABLES) for _ in range(rng.randint(2, 3))).capitalize()
            name = f"{first} {last}"
            if name in names:
                continue
            names.add(name)
            entities.append(Entity(name, str(rng.randint(1700, 1999)), rng.choice(CITIES), rng.choice(JOBS)))
        self.entities = entities

    def facts(self) -> Iterator[tuple[Entity, str]]:
        for entity in self.entities:
            for attribute in ATTRIBUTES:
                yield entity, attribute

    @property
    def n_facts(self) -> int:
        return self.n_entities * len(ATTRIBUTES)


def qa_text(entity: Entity, attribute: str) -> str:
    return f"Question: {QUESTIONS[attribute].format(name=entity.name)}\nAnswer: {getattr(entity, attribute)}."


def documents(kb: KnowledgeBase, seed: int) -> Iterator[str]:
    """An endless stream of short training documents, each stating a few facts of one entity
    in random phrasings and order (always including the question form)."""
    rng = random.Random(f"facts-corpus-{seed}")
    while True:
        entity = rng.choice(kb.entities)
        parts = []
        for attribute in rng.sample(ATTRIBUTES, len(ATTRIBUTES)):
            value = getattr(entity, attribute)
            if rng.random() < 0.5:
                parts.append(qa_text(entity, attribute))
            else:
                parts.append(rng.choice(STATEMENTS[attribute]).format(name=entity.name, value=value))
        yield "\n".join(parts)


def make_sample(tokenizer, entity: Entity, attribute: str) -> Sample:
    prompt = f"Question: {QUESTIONS[attribute].format(name=entity.name)}\nAnswer:"
    return Sample(
        prompt=prompt,
        answer=getattr(entity, attribute),
        length=0,
        n_tokens=len(tokenizer.encode(prompt)),
        meta={"entity": entity.name, "attribute": attribute},
    )


def score(prediction: str, sample: Sample) -> bool:
    return prediction.split(".")[0].strip().lower() == sample.answer.lower()


def knowledge_base_of(model: MemoryModel, kb_seed: int | None = None, n_entities: int | None = None) -> KnowledgeBase:
    """The knowledge base the model was trained on, as its card names it (`model.facts`; the default one where it
    names none) unless given; ValueError naming the card's field where it holds something else than a knowledge
    base's seed and size."""
    trained = model.facts
    seed, size = (0, 1000) if trained is None else trained
    try:
        return KnowledgeBase(seed if kb_seed is None else kb_seed, size if n_entities is None else n_entities)
    except ValueError as exc:
        named_by_card = trained is not None and (
            (kb_seed is None and "kb_seed" in str(exc)) or (n_entities is None and "n_entities" in str(exc))
        )
        if not named_by_card:
            raise
        folder = model.card.get("path")  # memviz.load notes the checkpoint's folder; a model built in memory has none
        where = f"{folder}/card.json" if folder else "the model's card.json"
        raise ValueError(f"{where}: facts.{exc}") from exc


def run(
    model: MemoryModel,
    n: int = 100,
    seed: int = 0,
    kb_seed: int | None = None,
    n_entities: int | None = None,
    progress: bool | SampleProgress = True,
) -> pd.DataFrame:
    """Ask `n` facts drawn (by `seed`) from the knowledge base the model was trained on (named
    in its card unless given; every fact when `n` is more than it holds). One row per fact: entity, attribute,
    answer, prediction, correct."""
    check_n(n)
    kb = knowledge_base_of(model, kb_seed, n_entities)
    facts = list(kb.facts())
    picks = random.Random(f"facts-probe-{seed}").sample(range(len(facts)), min(n, len(facts)))
    jobs = [
        (
            {"entity": facts[i][0].name, "attribute": facts[i][1]},
            lambda e=facts[i][0], a=facts[i][1]: make_sample(model.tokenizer, e, a),
        )
        for i in picks
    ]
    return run_samples(model, jobs, score, max_new_tokens=8, progress=progress, desc="facts")


def bar(df: pd.DataFrame, title: str = "Factual recall"):
    """Accuracy per attribute as a bar chart."""
    import plotly.express as px

    if df.empty:
        raise ValueError("no probe results to plot")
    table = df.groupby("attribute", as_index=False)["correct"].mean()
    fig = px.bar(table, x="attribute", y="correct", range_y=[0, 1], title=title, labels={"correct": "accuracy"})
    fig.update_yaxes(tickformat=".0%")
    return fig


def untrained(model: MemoryModel) -> str | None:
    """What to say before asking a model whose card names no knowledge base (it should score about nothing)."""
    if model.facts is not None:
        return None
    return (
        "its card names no facts knowledge base (card.json 'facts'): the model was not trained on facts, so it is "
        "asked the default one (kb_seed 0, 1,000 people) and should score about nothing"
    )


def run_probe(model: MemoryModel, args: Namespace) -> pd.DataFrame:
    """`run` on the registered arguments (the command line's and the Probes page's run)."""
    return run(model, **keywords(args, "n", "seed", "progress"))


register_probe(
    Probe(
        name="facts",
        summary="factual recall on the model's knowledge base",
        run=run_probe,
        figure=bar,
        summary_table=lambda df: df.groupby("attribute")["correct"].mean(),
        requires=untrained,
        page=PageParts(
            caption="Questions on the invented people of the knowledge base the model was trained on (its card "
            "names it): a model trained on facts recalls them, any other scores about nothing.",
            n=Widget("number", "facts_n", "Facts asked", default=30, bounds=(1, 3000)),
        ),
        order=60,
    )
)
