"""What memviz reads back from a model's card (`card.json`: how it was trained and what it scores).

A card is a free-form record for people, except for the fields here, whose schema memviz checks when a checkpoint
loads: `facts`, the knowledge base a model was trained to recall ({"kb_seed": int, "n_entities": int}), written by
training when its data mixes in facts and asked by the facts probe and the app's knowledge-base questions.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, NamedTuple


class TrainedFacts(NamedTuple):
    """The knowledge base a model was trained on: `memviz_probes.facts.KnowledgeBase(kb_seed, n_entities)`."""

    kb_seed: int
    n_entities: int


def trained_facts(card: Mapping[str, Any], where: str = "the model's card.json") -> TrainedFacts | None:
    """The card's `facts`, or None for a model not trained on a knowledge base; ValueError naming `where` and the
    field when it holds something else than a knowledge base's seed and size."""
    facts = card.get("facts")
    if facts is None:
        return None
    if not isinstance(facts, dict):
        raise ValueError(f"{where}: facts must be an object with kb_seed and n_entities, got {facts!r:.60}")
    values = {"kb_seed": facts.get("kb_seed", 0), "n_entities": facts.get("n_entities", 1000)}
    for field, value in values.items():
        if not isinstance(value, int) or isinstance(value, bool) or value < (1 if field == "n_entities" else 0):
            raise ValueError(f"{where}: facts.{field} must be a whole number, got {value!r:.60}")
    return TrainedFacts(**values)
