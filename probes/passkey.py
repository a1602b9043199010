"""Pass-key retrieval (the Landmark-attention / Infini-attention format).

    There is important info hidden inside a lot of irrelevant text. Find it and memorize it.
    I will quiz you about the important information there.  <filler>  The pass key is 71432.
    Remember it. 71432 is the pass key.  <filler>
    What is the pass key? The pass key is

The needle sits at a sentence boundary at fraction `depth` of the filler; `length` is the
whole prompt in the model's tokens. A prediction is correct when the first integer in the
greedy continuation equals the key.
"""

from __future__ import annotations

import re
from argparse import Namespace
from collections.abc import Sequence

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
    check_length,
    check_lengths,
    check_n,
    check_workers,
    run_in_workers,
    run_samples,
    sample_rng,
    spans_of,
    take_filler,
)
from memviz_probes.haystack import make_haystack
from memviz_probes.registry import Arg, Probe, Widget, keywords, register_probe

INSTRUCTION = (
    "There is important info hidden inside a lot of irrelevant text. Find it and memorize it. "
    "I will quiz you about the important information there."
)
QUESTION = "What is the pass key? The pass key is"
FIRST_INTEGER = re.compile(r"\d+")


def needle(key: int) -> str:
    return f"The pass key is {key}. Remember it. {key} is the pass key."


def make_sample(
    tokenizer, length: int, depth: float, key: int, haystack=None, seed: int = 0, instruction: str = INSTRUCTION
) -> Sample:
    """A prompt of about `length` tokens with the needle at `depth` (0 = first, 1 = last).
    Training may pass `instruction=""` for prompts shorter than the instruction allows."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth must lie in [0, 1], got {depth!r}")
    fixed = len(tokenizer.encode(instruction + " " + needle(key) + "\n" + QUESTION))
    check_length(length, fixed, "instruction, needle and question")
    filler = take_filler(tokenizer, make_haystack(haystack, seed).sentences(), length - fixed)
    costs = [len(tokenizer.encode(" " + s)) for s in filler]
    target, cut, used = depth * sum(costs), 0, 0
    while cut < len(filler) and used + costs[cut] / 2 < target:
        used += costs[cut]
        cut += 1
    pieces = [
        instruction,
        *(" " + s for s in filler[:cut]),
        " " + needle(key),
        *(" " + s for s in filler[cut:]),
        "\n" + QUESTION,
    ]
    prompt = "".join(pieces)
    spans = spans_of(tokenizer, pieces, [cut + 1])
    return Sample(
        prompt=prompt,
        answer=str(key),
        length=length,
        n_tokens=len(tokenizer.encode(prompt)),
        evidence=spans,
        meta={"depth": depth, "needle_depth": used / max(1, sum(costs))},
    )


def seeded_sample(tokenizer, length: int, depth: float, seed: int, index: int, haystack=None) -> Sample:
    """Sample `index` of the (length, depth) cell: the same arguments always give the same sample."""
    rng = sample_rng("passkey", seed, length, depth, index)
    key = rng.randrange(10000, 100000)
    return make_sample(tokenizer, length, depth, key, haystack, seed=rng.randrange(2**31))


def leading_digits(prediction: str, answer: str) -> int:
    """How many leading digits of the first integer in `prediction` match the key: partial
    credit that shows a model starting to retrieve before it gets whole keys right."""
    match = FIRST_INTEGER.search(prediction)
    digits = match.group(0) if match else ""
    n = 0
    while n < min(len(digits), len(answer)) and digits[n] == answer[n]:
        n += 1
    return n


def score(prediction: str, sample: Sample | str) -> bool:
    answer = sample.answer if isinstance(sample, Sample) else sample
    match = FIRST_INTEGER.search(prediction)
    return match is not None and match.group(0) == answer


def run(
    model: MemoryModel,
    lengths: Sequence[int],
    depths: Sequence[float],
    n: int = 10,
    seed: int = 0,
    haystack=None,
    progress: bool | SampleProgress = True,
    workers: int = 1,
    shard: tuple[int, int] = (0, 1),
) -> pd.DataFrame:
    """One row per sample: length, depth, answer, prediction, correct, leading_digits (and
    n_tokens, evidence). `workers` > 1 splits the grid over that many processes."""
    check_n(n)
    check_workers(workers)
    lengths, depths = as_list(lengths, "lengths"), as_list(depths, "depths")
    if not lengths or not depths:
        raise ValueError(f"lengths and depths need at least one value each, got lengths={lengths} and depths={depths}")
    lengths, depths = check_lengths(lengths), check_depths(depths)
    check_grid_size(len(lengths) * len(depths) * n)
    fixed = len(model.tokenizer.encode(INSTRUCTION + " " + needle(12345) + "\n" + QUESTION))
    for length in lengths:
        check_length(length, fixed, "instruction, needle and question")
    if haystack not in (None, "procedural"):
        make_haystack(haystack, seed)  # fail early on an unreadable file
    jobs = [
        (
            {"length": length, "depth": depth, "sample": i},
            lambda length=length, depth=depth, i=i: seeded_sample(model.tokenizer, length, depth, seed, i, haystack),
        )
        for length in lengths
        for depth in depths
        for i in range(n)
    ]
    if workers > 1:
        return run_in_workers(run, model, workers, lengths=lengths, depths=depths, n=n, seed=seed, haystack=haystack)
    df = run_samples(model, jobs, score, max_new_tokens=8, progress=progress, desc="passkey", shard=shard)
    df["leading_digits"] = [leading_digits(p, a) for p, a in zip(df["prediction"], df["answer"])]
    return df


def heatmap(df: pd.DataFrame, title: str = "Pass-key retrieval"):
    """Rows depth, columns length, colour accuracy (red to green)."""
    return accuracy_heatmap(
        df, rows="depth", cols="length", title=title, row_label="needle depth", col_label="length (tokens)"
    )


def run_probe(model: MemoryModel, args: Namespace) -> pd.DataFrame:
    """`run` on the registered arguments (the command line's and the Probes page's run)."""
    return run(model, **keywords(args, "lengths", "depths", "n", "seed", "haystack", "progress", "workers", "shard"))


register_probe(
    Probe(
        name="passkey",
        summary="pass-key retrieval over lengths x depths",
        run=run_probe,
        figure=heatmap,
        summary_table=lambda df: df.pivot_table(index="depth", columns="length", values="correct"),
        args=(
            LENGTHS,
            Arg(
                "depths",
                float,
                nargs="+",
                default=(0.0, 0.25, 0.5, 0.75, 1.0),
                widget=Widget(
                    "multiselect",
                    "depths",
                    "Needle depths",
                    options=(0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0),
                    default=(0.1, 0.5, 0.9),
                    noun="depth",
                ),
            ),
            Arg(
                "haystack",
                help="the filler: procedural (the default), grass (the papers' repeated sentences), shakespeare, or a "
                "plain-text file",
                widget=Widget(
                    "selectbox",
                    "pk_haystack",
                    "Filler",
                    options=("procedural", "grass", "shakespeare"),
                    help="the generated sentences, the papers' repeated 'The grass is green. ...', or the plays",
                ),
            ),
        ),
        workers=True,
        order=10,
    )
)
