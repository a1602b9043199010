"""What every probe shares: samples laid out in tokens, filler assembly, the run loop, figures.

A probe sample is a prompt (the model continues it), the answer, and the token spans of the
evidence (the needle, the supporting facts) so figures can mark them. Lengths are counted
in the model's own tokens: filler sentences are added until the next one would overshoot,
so a sample is never longer than asked and short of it by less than one sentence.
"""

from __future__ import annotations

import numbers
import random
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import pandas as pd

from memviz.protocol import MemoryModel
from memviz.running import NonFiniteError
from memviz_probes.registry import Arg, Widget


@dataclass
class Sample:
    prompt: str
    answer: str
    length: int  # requested length in tokens
    n_tokens: int  # actual prompt length in tokens
    evidence: list[tuple[int, int]] = field(default_factory=list)  # token spans [start, end)
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def reply(self) -> str:
        """The answer as the model writes it after the prompt: " 29717", with its leading space
        unless the prompt ends in one."""
        return self.answer if self.prompt[-1:].isspace() else f" {self.answer}"


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


#: the longest prompt a probe builds, in tokens (a trace's limit too)
MAX_PROBE_LENGTH = 1 << 22
#: the most samples one probe run asks
MAX_PROBE_SAMPLES = 200_000


def as_list(values: Any, name: str) -> list:
    """`values` (a list, tuple, range or array) as a list; ValueError naming `name` for one value or a string."""
    if isinstance(values, (str, bytes, dict)) or not hasattr(values, "__iter__"):
        raise ValueError(f"{name} must be a list, got {values!r:.60}")
    return list(values)


def check_lengths(lengths: Any, name: str = "lengths") -> list[int]:
    """A non-empty list of prompt lengths, whole numbers of tokens in 1..MAX_PROBE_LENGTH."""
    lengths = as_list(lengths, name)
    if not lengths:
        raise ValueError(f"{name} needs at least one value")
    for length in lengths:
        if (
            not isinstance(length, numbers.Integral)
            or isinstance(length, bool)
            or not 0 < int(length) <= MAX_PROBE_LENGTH
        ):
            raise ValueError(f"{name} are whole numbers of tokens in 1..{MAX_PROBE_LENGTH:,}, got {length!r}")
    values = [int(length) for length in lengths]
    check_no_repeats(values, name)
    return values


#: the grids' prompt lengths, on the command line (--lengths, required) and the Probes page
LENGTHS = Arg(
    "lengths",
    int,
    nargs="+",
    required=True,
    widget=Widget(
        "multiselect",
        "lengths",
        "Lengths (tokens)",
        options=(256, 512, 1024, 2048, 4096, 8192, 16384, 32768, 65536),
        default=(256, 512),
        noun="length",
        tokens=True,
    ),
)


def check_depths(depths: Any, name: str = "depths") -> list[float]:
    """A non-empty list of depths, fractions of the prompt in [0, 1]."""
    depths = as_list(depths, name)
    if not depths:
        raise ValueError(f"{name} needs at least one value")
    for depth in depths:
        if not isinstance(depth, numbers.Real) or isinstance(depth, bool) or not 0 <= float(depth) <= 1:
            raise ValueError(f"depth must lie in [0, 1] ({name} are fractions of the prompt), got {depth!r}")
    values = [float(depth) for depth in depths]
    check_no_repeats(values, name)
    return values


def check_no_repeats(values: list, name: str) -> None:
    """ValueError naming the values `name` gives more than once: a grid would run each of their cells again."""
    if twice := sorted({v for v in values if values.count(v) > 1}):
        raise ValueError(f"{name} gives {', '.join(map(str, twice))} more than once (each would run again)")


def check_grid_size(samples: int) -> None:
    """A run's cells x samples, against MAX_PROBE_SAMPLES, before any sample is made."""
    if samples > MAX_PROBE_SAMPLES:
        raise ValueError(
            f"this grid asks for {samples:,} samples, over the {MAX_PROBE_SAMPLES:,} a probe run may; "
            "ask fewer lengths, depths or n"
        )


def check_length(length: int, minimum: int, what: str) -> None:
    if not isinstance(length, int) or isinstance(length, bool) or length <= 0:
        raise ValueError(f"length must be a positive integer number of tokens, got {length!r}")
    if length > MAX_PROBE_LENGTH:
        raise ValueError(f"length {length:,} is over the probes' limit of {MAX_PROBE_LENGTH:,} tokens")
    if length < minimum:
        raise ValueError(f"length {length} is shorter than the {what} itself ({minimum} tokens)")


def check_n(n: int) -> None:
    if not isinstance(n, int) or isinstance(n, bool) or n <= 0:
        raise ValueError(f"n must be a positive integer, got {n!r}")


#: a probe run's progress: (samples done, with the share of the prompt read in the one being run; samples in all)
SampleProgress = Callable[[float, int], None]
#: the steps a sample's own progress is reported in, so that a long prompt moves a bar without flooding it
PROMPT_STEPS = 50

SAMPLE_COLUMNS = ("n_tokens", "answer", "prediction", "correct", "diverged", "evidence")  # after the keys


def check_shard(shard) -> tuple[int, int]:
    """`shard` (i, n): the i-th of n parts of a grid, 0 <= i < n; ValueError naming it otherwise."""
    if (
        not isinstance(shard, tuple | list)
        or len(shard) != 2
        or not all(isinstance(v, int) and not isinstance(v, bool) for v in shard)
        or not 0 <= shard[0] < shard[1]
    ):
        raise ValueError(f"shard must be (index, count) with 0 <= index < count, got {shard!r}")
    return shard[0], shard[1]


def run_samples(
    model: MemoryModel,
    jobs: Sequence[tuple[dict[str, Any], Callable[[], Sample]]],
    score: Callable[[str, Sample], bool | float],
    max_new_tokens: int | Callable[[dict[str, Any]], int],
    progress: bool | SampleProgress = True,
    desc: str = "probe",
    shard: tuple[int, int] = (0, 1),
) -> pd.DataFrame:
    """Generate greedily for each sample and score it; one row per sample (`diverged`: the model's logits stopped
    being finite, scored wrong). `max_new_tokens` may
    depend on the job's keys. With `shard` (i, n) only jobs i, i + n, ... run, each row with its
    job index in "job" (`run_in_workers` puts the shards back in order). A callable `progress` hears of a
    memviz model's long prompt as it is read, in PROMPT_STEPS steps, not only when its sample is done (a
    duck-typed stand-in, a test's oracle, only of its samples)."""
    from tqdm.auto import tqdm

    index, count = check_shard(shard)
    picked = [(j, keys, make) for j, (keys, make) in enumerate(jobs) if j % count == index]
    rows = []
    bar = tqdm(total=len(picked), desc=desc, disable=progress is not True, leave=False)
    for i, (j, keys, make) in enumerate(picked):
        sample = make()
        budget = max_new_tokens(keys) if callable(max_new_tokens) else max_new_tokens
        try:
            reading = prompt_progress(progress, i, len(picked)) if callable(progress) else None
            prediction = model.generate(sample.prompt, max_new_tokens=budget, progress=reading)
            diverged = False
        except NonFiniteError:  # the model's state diverged on this input: a wrong answer, marked
            prediction, diverged = "", True
        result = score(prediction, sample)
        rows.append(
            {
                **({"job": j} if count > 1 else {}),
                **keys,
                "n_tokens": sample.n_tokens,
                "answer": sample.answer,
                "prediction": prediction,
                "correct": result if isinstance(result, float) else bool(result),
                "diverged": diverged,
                "evidence": sample.evidence,
            }
        )
        bar.update(1)
        if callable(progress):
            progress(i + 1, len(picked))
    bar.close()
    columns = [*(["job"] if count > 1 else []), *(jobs[0][0] if jobs else {}), *SAMPLE_COLUMNS]
    return pd.DataFrame(rows, columns=columns)  # the columns of a shard past the grid too, which has no rows


def prompt_progress(progress: SampleProgress, done: int, total: int) -> Callable[[int, int], None]:
    """A prompt's tokens read, as the share of one sample after `done` of `total`, at most PROMPT_STEPS times."""
    reported = 0

    def read(tokens: int, prompt: int) -> None:
        nonlocal reported
        step = tokens * PROMPT_STEPS // prompt
        if reported < step < PROMPT_STEPS:  # the sample's end is reported once it is scored
            reported = step
            progress(done + step / PROMPT_STEPS, total)

    return read


def check_workers(workers: int) -> None:
    """A positive number of processes, at most one a core (more only wait on each other, each holding the model)."""
    import os

    if not isinstance(workers, int) or isinstance(workers, bool) or workers < 1:
        raise ValueError(f"workers must be a positive number of processes, got {workers!r}")
    cores = os.cpu_count() or 1
    if workers > cores:
        raise ValueError(f"workers: {workers} processes on this machine's {cores} cores; give at most {cores}")


def run_in_workers(run: Callable[..., pd.DataFrame], model: MemoryModel, workers: int, **kwargs: Any) -> pd.DataFrame:
    """A probe's grid split over `workers` processes (spawned, each with the model, one share of
    the cores in torch threads and every `workers`-th sample), gathered in the order of a
    single-process run: the same DataFrame."""
    import multiprocessing
    import os
    from concurrent.futures import ProcessPoolExecutor

    check_workers(workers)
    threads = max(1, (os.cpu_count() or 1) // workers)
    with ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=set_threads, initargs=(threads,)
    ) as pool:
        parts = list(pool.map(run_shard, [(run, model, kwargs, (i, workers)) for i in range(workers)]))
    return merge_shards(parts)


def merge_shards(parts: list[pd.DataFrame]) -> pd.DataFrame:
    """Shards' rows (each with its job index) in the order of a single-process run; a shard past the
    grid's last sample has none."""
    filled = [part for part in parts if len(part)] or parts[:1]  # each shard has the grid's columns (run_samples)
    return pd.concat(filled).sort_values("job").drop(columns="job").reset_index(drop=True)


def set_threads(threads: int) -> None:
    import torch

    torch.set_num_threads(threads)


def run_shard(job: tuple) -> pd.DataFrame:
    run, model, kwargs, shard = job
    return run(model, **kwargs, progress=False, shard=shard)


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
            hovertemplate=f"{col_label} %{{x}}<br>{row_label} %{{y}}<br>accuracy %{{z:.0%}} of "
            f"%{{customdata}}<extra></extra>",
            colorbar={"title": "accuracy", "tickformat": ".0%"},
        )
    )
    fig.update_layout(
        title=title, xaxis_title=col_label, yaxis_title=row_label, xaxis_type="category", yaxis_type="category"
    )
    return fig
