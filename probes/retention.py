"""Retention over distance: how long a memory keeps one write.

A pass key is written once, `distance` tokens before the question; only the distance changes:

    <instruction> <about `prefix` tokens of filler> <needle> <`distance` tokens of filler>
    What is the pass key? The pass key is

Sweeping the distance on a log scale (64 tokens to 1M) gives one curve per model: accuracy
against how far back the write lies. A model without memory falls to chance once the
distance passes its attention window; a memory that lasts stays up. Scoring is the pass-key
probe's (the first integer of the greedy continuation equals the key), and the generator is
the pass-key probe's needle and filler, seeded apart from it ("retention", seed, distance, i).
"""

from __future__ import annotations

from argparse import Namespace
from collections.abc import Mapping, Sequence
from typing import Any

import pandas as pd

from memviz.protocol import MemoryModel
from memviz_probes.common import (
    Sample,
    SampleProgress,
    as_list,
    check_grid_size,
    check_n,
    run_samples,
    sample_rng,
    spans_of,
    take_filler,
)
from memviz_probes.haystack import make_haystack
from memviz_probes.passkey import INSTRUCTION, QUESTION, leading_digits, needle, score
from memviz_probes.registry import Arg, PageParts, Probe, Widget, keywords, register_probe

#: 64 tokens to 1M on a log scale (powers of four)
DISTANCES = (64, 256, 1024, 4096, 16384, 65536, 262144, 1048576)
MAX_DISTANCE = 1 << 22


def make_sample(tokenizer, distance: int, key: int, prefix: int = 32, haystack=None, seed: int = 0) -> Sample:
    """The needle, then `distance` tokens (at most; short by less than a sentence) of filler,
    then the question. `meta["distance"]` is the number of tokens actually between them."""
    sentences = make_haystack(haystack, seed).sentences()
    before = take_filler(tokenizer, sentences, prefix)
    after = take_filler(tokenizer, sentences, distance)
    pieces = [INSTRUCTION, *(" " + s for s in before), " " + needle(key), *(" " + s for s in after), "\n" + QUESTION]
    prompt = "".join(pieces)
    spans = spans_of(tokenizer, pieces, [len(before) + 1])
    n_tokens = len(tokenizer.encode(prompt))
    question_start = n_tokens - len(tokenizer.encode("\n" + QUESTION))
    return Sample(
        prompt=prompt,
        answer=str(key),
        length=n_tokens,
        n_tokens=n_tokens,
        evidence=spans,
        meta={"distance": question_start - spans[0][1]},
    )


def seeded_sample(tokenizer, distance: int, seed: int, index: int, prefix: int = 32, haystack=None) -> Sample:
    rng = sample_rng("retention", seed, distance, index)
    key = rng.randrange(10000, 100000)
    return make_sample(tokenizer, distance, key, prefix, haystack, seed=rng.randrange(2**31))


def check_distances(distances: Sequence[int]) -> list[int]:
    distances = as_list(distances, "distances")
    if not distances:
        raise ValueError("give at least one distance")
    for d in distances:
        if not isinstance(d, int) or isinstance(d, bool) or not 0 < d <= MAX_DISTANCE:
            raise ValueError(f"distances are whole numbers of tokens in 1..{MAX_DISTANCE}, got {d!r}")
    return distances


def run(
    model: MemoryModel,
    distances: Sequence[int] = DISTANCES[:5],
    n: int = 10,
    seed: int = 0,
    prefix: int = 32,
    haystack=None,
    progress: bool | SampleProgress = True,
) -> pd.DataFrame:
    """One row per sample: distance (asked), gap (tokens really between needle and question),
    length, answer, prediction, correct, leading_digits (and n_tokens, evidence)."""
    check_n(n)
    distances = check_distances(distances)
    check_grid_size(len(distances) * n)
    if not isinstance(prefix, int) or prefix < 0:
        raise ValueError(f"prefix must be a non-negative number of tokens, got {prefix!r}")
    samples: dict[tuple[int, int], Sample] = {}

    def make(distance: int, i: int) -> Sample:
        samples[distance, i] = seeded_sample(model.tokenizer, distance, seed, i, prefix, haystack)
        return samples[distance, i]

    jobs = [({"distance": d, "sample": i}, lambda d=d, i=i: make(d, i)) for d in distances for i in range(n)]
    df = run_samples(model, jobs, score, max_new_tokens=8, progress=progress, desc="retention")
    df["gap"] = [samples[d, i].meta["distance"] for d, i in zip(df["distance"], df["sample"])]
    df["length"] = df["n_tokens"]
    df["depth"] = [samples[d, i].evidence[0][0] / samples[d, i].n_tokens for d, i in zip(df["distance"], df["sample"])]
    df["leading_digits"] = [leading_digits(p, a) for p, a in zip(df["prediction"], df["answer"])]
    return df


def compare(
    models: Mapping[str, MemoryModel],
    distances: Sequence[int] = DISTANCES[:5],
    n: int = 10,
    seed: int = 0,
    progress: bool | SampleProgress = True,
    **kw: Any,
) -> pd.DataFrame:
    """`run` for each named model on the same samples, with a `model` column."""
    frames = [
        run(model, distances, n, seed, progress=progress, **kw).assign(model=name) for name, model in models.items()
    ]
    return pd.concat(frames, ignore_index=True)


def curve(df: pd.DataFrame, title: str = "Retention: pass key against distance"):
    """Accuracy against distance (log scale), one line per model, the sample count on hover."""
    import plotly.graph_objects as go

    if df.empty:
        raise ValueError("no retention results to plot")
    if "model" not in df:
        df = df.assign(model="model")
    fig = go.Figure()
    for name, group in df.groupby("model", sort=False):
        table = group.groupby("distance")["correct"].agg(["mean", "size"]).sort_index()
        fig.add_trace(
            go.Scatter(
                x=table.index,
                y=table["mean"],
                mode="lines+markers",
                name=str(name),
                customdata=table["size"],
                hovertemplate="distance %{x:,} tokens<br>accuracy %{y:.0%} of "
                "%{customdata}<extra>%{fullData.name}</extra>",
            )
        )
    fig.update_layout(
        title=title,
        xaxis_title="tokens between the needle and the question (log scale)",
        yaxis_title="pass key retrieved",
        yaxis_tickformat=".0%",
        yaxis_range=[-0.03, 1.03],
        legend_title="model",
    )
    fig.update_xaxes(type="log")
    return fig


def run_probe(model: MemoryModel, args: Namespace) -> pd.DataFrame:
    """`compare` over every checkpoint given, on the registered arguments (the command line's and the Probes
    page's run)."""
    return compare(args.models, **keywords(args, "distances", "n", "seed", "haystack", "progress"))


register_probe(
    Probe(
        name="retention",
        summary="pass key against the distance to the question, per checkpoint",
        run=run_probe,
        figure=curve,
        summary_table=lambda df: df.pivot_table(index="model", columns="distance", values="correct", sort=False),
        args=(
            Arg(
                "distances",
                int,
                nargs="+",
                default=DISTANCES[:5],
                widget=Widget(
                    "multiselect",
                    "rt_distances",
                    "Distances (tokens)",
                    options=DISTANCES,
                    default=(64, 256, 1024, 4096),
                    noun="distance",
                    tokens=True,
                ),
            ),
            Arg("haystack", help="the filler: procedural (the default), grass, shakespeare, or a plain-text file"),
        ),
        several=True,
        page=PageParts(
            caption="A pass key written once, then `distance` tokens of filler, then the question: how far back "
            "each memory still finds it. A model without memory falls to chance past its attention window.",
            n=Widget("number", "rt_n", "Samples per distance", default=5, bounds=(1, 200)),
            seed=Widget("number", "rt_seed", "Seed", default=0, bounds=(0, 10_000)),
            run_key="run_retention",
            beside_key="rt_models",
            summary=True,
        ),
        order=40,
    )
)
