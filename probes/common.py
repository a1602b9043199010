"""What every probe shares: samples laid out in tokens, filler assembly, the run loop, figures.

A probe sample is a prompt (the model continues it), the answer, and the token spans of the
evidence (the needle, the supporting facts) so figures can mark them. Lengths are counted
in the model's own tokens: filler sentences are added until the next one would overshoot,
so a sample is never longer than asked and short of it by less than one sentence.
"""
from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Any, Callable, Iterable, Iterator, Sequence

import pandas as pd


@dataclass
class Sample:
    prompt: str
    answer: str
    length: int  # requested length in tokens
    n_tokens: int  # actual prompt length in tokens
    evidence: list[tuple[int, int]] = field(default_factory=list)  # token spans [start, end)
    meta: dict[str, Any] = field(default_factory=dict)


def sample_rng(*parts: Any) -> random.Random:
    """A generator seeded by a readable tuple: the same parts always give the same stream."""
    return random.Random("|".join(map(str, parts)))


def take_filler(tokenizer, sentences: Iterator[str], budget: int) -> list[str]:
    """Sentences whose token count (each with its leading space) adds up to at most `budget`."""
    picked, used = [], 0
    for sentence in sentences:
        cost = len(tokenizer.encode(" " + sentence))
        if used + cost > budget:
            break
        picked.append(sentence)
        used += cost
    return picked


def spans_of(tokenizer, pieces: Sequence[str], marked: Iterable[int]) -> list[tuple[int, int]]:
    """Token spans of the pieces at indices `marked` within "".join(pieces)."""
    marked = set(marked)
    spans = []
    for i in sorted(marked):
        before = "".join(pieces[:i])
        start = len(tokenizer.encode(before)) if before else 0
        spans.append((start, len(tokenizer.encode(before + pieces[i]))))
    return spans


def check_length(length: int, minimum: int, what: str) -> None:
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise ValueError(f"length must be a positive integer number of tokens, got {length!r}")
    if length < minimum:
        raise ValueError(f"length {length} is shorter than the {what} itself ({minimum} tokens)")


def check_n(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"n must be a positive integer, got {n!r}")


def run_samples(
    model,
    jobs: Sequence[tuple[dict[str, Any], Callable[[], Sample]]],
    score: Callable[[str, Sample], bool],
    max_new_tokens: int,
    progress: bool | Callable[[int, int], None] = True,
    desc: str = "probe",
) -> pd.DataFrame:
    """Generate greedily for each sample and score it; one row per sample."""
    from tqdm.auto import tqdm

    rows = []
    bar = tqdm(total=len(jobs), desc=desc, disable=progress is not True, leave=False)
    for i, (keys, make) in enumerate(jobs):
        sample = make()
        prediction = model.generate(sample.prompt, max_new_tokens=max_new_tokens)
        rows.append(
            {
                **keys,
                "n_tokens": sample.n_tokens,
                "answer": sample.answer,
                "prediction": prediction,
                "correct": bool(score(prediction, sample)),
                "evidence": sample.evidence,
            }
        )
        bar.update(1)
        if callable(progress):
            progress(i + 1, len(jobs))
    bar.close()
    return pd.DataFrame(rows)


RED_TO_GREEN = [[0.0, "#d73027"], [0.5, "#fee08b"], [1.0, "#1a9850"]]


def accuracy_heatmap(df: pd.DataFrame, rows: str, cols: str, title: str, row_label: str, col_label: str):
    """Mean `correct` per (row, col) as a red-to-green heatmap with the accuracy written in."""
    import plotly.graph_objects as go

    if df.empty:
        raise ValueError("no probe results to plot")
    table = df.pivot_table(index=rows, columns=cols, values="correct", aggfunc="mean").sort_index()
    counts = df.pivot_table(index=rows, columns=cols, values="correct", aggfunc="size").reindex_like(table)
    z = table.to_numpy(dtype=float)
    text = [[f"{v:.0%}" if v == v else "" for v in row] for row in z]
    fig = go.Figure(
        go.Heatmap(
            z=z,
            x=[str(c) for c in table.columns],
            y=[str(r) for r in table.index],
            zmin=0,
            zmax=1,
            colorscale=RED_TO_GREEN,
            text=text,
            texttemplate="%{text}",
            customdata=counts.to_numpy(),
            hovertemplate=f"{col_label} %{{x}}<br>{row_label} %{{y}}<br>accuracy %{{z:.0%}} of %{{customdata}}<extra></extra>",
            colorbar={"title": "accuracy", "tickformat": ".0%"},
        )
    )
    fig.update_layout(title=title, xaxis_title=col_label, yaxis_title=row_label, xaxis_type="category", yaxis_type="category")
    return fig
