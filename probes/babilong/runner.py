"""Run a model over generated or released samples and score it by BABILong's rule:
lowercase, keep the first sentence, drop task labels that the question mentions; correct when
the target is the only label left."""

from __future__ import annotations

import random
from argparse import Namespace
from collections.abc import Callable, Sequence
from functools import partial
from pathlib import Path
from typing import Any

import pandas as pd

from memviz.protocol import MemoryModel
from memviz_probes.babilong.released import load, released_sample
from memviz_probes.babilong.samples import seeded_sample
from memviz_probes.babilong.stories import TASKS, check_task, vocabulary
from memviz_probes.common import (
    LENGTHS,
    Sample,
    SampleProgress,
    accuracy_heatmap,
    as_list,
    check_grid_size,
    check_lengths,
    check_n,
    run_samples,
)
from memviz_probes.haystack import BACKGROUND
from memviz_probes.registry import Arg, Probe, Widget, keywords, register_probe


def first_sentence(output: str) -> str:
    return output.lower().split(".")[0]


def compare_answers(target: str, output: str, question: str, labels: Sequence[str]) -> bool:
    """BABILong's rule: the target must be the only task label in the output's first sentence,
    not counting labels that the question itself mentions."""
    output = first_sentence(output)
    lowered = {label.lower() for label in labels}
    in_question = {label for label in lowered if label in question.lower()}
    in_output = {label for label in lowered if label in output} - in_question
    return in_output == {target.lower()}


def run(
    model: MemoryModel,
    tasks: Sequence[str],
    lengths: Sequence[int],
    n: int = 10,
    seed: int = 0,
    data_path: str | Path | None = None,
    haystack=None,
    names: str = "babi",
    progress: bool | SampleProgress = True,
) -> pd.DataFrame:
    """One row per sample: task, length, answer, prediction, correct (depth is the position of
    the last supporting fact, as a fraction of the prompt, for generated samples)."""
    check_n(n)
    tasks, lengths = as_list(tasks, "tasks"), as_list(lengths, "lengths")
    if not tasks or not lengths:
        raise ValueError("give at least one task and one length")
    if data_path is None:
        lengths = check_lengths(lengths)
    check_grid_size(len(tasks) * len(lengths) * n)
    for task in tasks:
        check_task(task)
    vocabulary(names)
    jobs: list[tuple[dict[str, Any], Callable[[], Sample]]] = []
    for task in tasks:
        for length in lengths:
            if data_path is not None:
                rows = load(data_path, task, length)
                picks = random.Random(f"babilong-pick-{seed}").sample(range(len(rows)), min(n, len(rows)))
                for i in picks:
                    jobs.append(
                        (
                            {"task": task, "length": length, "sample": i},
                            partial(released_sample, model.tokenizer, rows[i], task, length),
                        )
                    )
            else:
                for i in range(n):
                    jobs.append(
                        (
                            {"task": task, "length": length, "sample": i},
                            partial(seeded_sample, model.tokenizer, task, length, seed, i, haystack, names),
                        )
                    )
    df = run_samples(model, jobs, score, max_new_tokens=6, progress=progress, desc="babilong")
    df["depth"] = [
        (spans[-1][1] / max(1, nt)) if spans else float("nan") for spans, nt in zip(df["evidence"], df["n_tokens"])
    ]
    return df


def score(prediction: str, sample: Sample) -> bool:
    return compare_answers(sample.answer, prediction, sample.meta["question"], sample.meta["labels"])


def heatmap(df: pd.DataFrame, title: str = "BABILong-style QA"):
    """Rows task, columns length, colour accuracy (red to green)."""
    return accuracy_heatmap(df, rows="task", cols="length", title=title, row_label="task", col_label="length (tokens)")


def run_probe(model: MemoryModel, args: Namespace) -> pd.DataFrame:
    """`run` on the registered arguments (the command line's and the Probes page's run)."""
    return run(model, **keywords(args, "tasks", "lengths", "n", "seed", "data_path", "haystack", "progress"))


register_probe(
    Probe(
        name="babilong",
        summary="bAbI qa1-qa5 hidden in background text",
        run=run_probe,
        figure=heatmap,
        summary_table=lambda df: df.pivot_table(index="task", columns="length", values="correct"),
        args=(
            LENGTHS,
            Arg(
                "tasks",
                nargs="+",
                default=("qa1",),
                widget=Widget("multiselect", "tasks", "Tasks", options=tuple(TASKS), default=("qa1",), noun="task"),
            ),
            Arg("data_path", help="released BABILong files (JSON/JSONL/parquet) instead of generated samples"),
            Arg(
                "haystack",
                help="the background: shakespeare (the default), procedural, or a plain-text file",
                widget=BACKGROUND,
            ),
        ),
        order=20,
    )
)
