"""Re-reading: a held-out passage read twice, `distance` tokens apart, and each model's loss on both readings.

Prose rarely repeats what a local window has lost, so a memory barely moves the loss on held-out text (`lm`). Text
that does repeat shows what a memory holds. A sample lays out held-out text as

    <lead: L tokens of document B> <passage: P tokens of document A> <d tokens of B, going on> <the passage again>

A and B are different held-out documents (the held-out split no training run reads, `memviz_probes.texts`). The
lead puts unrelated text before the first reading as the filler does before the second, so a model that holds
nothing past its window reads both alike. Per reading, with nll_t = -ln p(x_t | x_<t) streamed by
`lm.token_losses`, the loss is the mean nll_t over the passage's tokens 2..P (its first token follows unrelated
text at both readings and cannot be copied), in nats; the relative change is second / first - 1: near -1 for a
model that copies the passage from its first reading, about 0 for one whose context no longer reaches it.

With `order="shuffled"` the passage's tokens are put in a seeded random order ("reread-order", seed, i), the same
order at both readings: nothing in the passage then predicts its next token but its first reading, so the second
reading's change is copying alone, apart from what the words of a passage predict of each other.

Passages are drawn by seed ("reread", seed, i): the i-th passage's document (in proportion to its length) and place,
then its filler's document (another held-out one long enough for the lead and the longest distance) and place. Every
distance re-reads the same passage after the start of the same filler, so a curve over distance compares like with
like; token positions are the model's own tokenizer's (models sharing one read the same tokens).
"""

from __future__ import annotations

import dataclasses
import numbers
import os
from argparse import Namespace
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from memviz.options import check_choice
from memviz.protocol import MemoryModel
from memviz.registry import get_family
from memviz_kernels.dispatch import linear_memory
from memviz_probes import lm, mqar, texts
from memviz_probes.common import SampleProgress, as_list, check_grid_size, check_n, check_no_repeats, sample_rng
from memviz_probes.registry import Arg, PageParts, Probe, Widget, keywords, register_probe

#: 64 tokens to 16k, powers of four
DISTANCES = (64, 256, 1024, 4096, 16384)
PASSAGE_TOKENS = 300
LEAD_TOKENS = 256
#: the passage as written, or its tokens in a seeded random order (the same at both readings)
ORDERS = ("text", "shuffled")
#: the longest passage, lead or distance a run takes (the longest held-out document is Hamlet, ~60k tokens)
MAX_TOKENS = 1 << 20


@dataclass(frozen=True)
class Reading:
    """One drawn sample: the passage (`passage_tokens` of `document` from token `start`) and its filler (the lead
    and the longest distance of `filler` from token `filler_start`), in one tokenizer's ids."""

    document: str
    start: int
    passage: list[int]
    filler: str
    filler_start: int
    filler_tokens: list[int]

    def tokens(self, distance: int, lead: int) -> tuple[list[int], int, int]:
        """(the sample's ids, the first reading's start, the second's) at `distance` tokens between the readings."""
        first, second = lead, lead + len(self.passage) + distance
        ids = self.filler_tokens[:lead] + self.passage + self.filler_tokens[lead : lead + distance] + self.passage
        return ids, first, second

    def shuffled(self, rng) -> Reading:
        """This reading with its passage's tokens in `rng`'s random order."""
        passage = list(self.passage)
        rng.shuffle(passage)
        return dataclasses.replace(self, passage=passage)


def check_count(value: Any, name: str, least: int) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or not least <= int(value) <= MAX_TOKENS:
        raise ValueError(f"{name} must be a whole number of tokens in {least}..{MAX_TOKENS:,}, got {value!r}")
    return int(value)


def check_distances(distances: Any) -> list[int]:
    distances = as_list(distances, "distances")
    if not distances:
        raise ValueError("distances must name at least one distance (tokens between the two readings)")
    for d in distances:
        check_count(d, "distances", 1)
    check_no_repeats(distances, "distances")
    return distances


def draw(
    tokenized: Mapping[str, list[int]], n: int, seed: int, passage_tokens: int, need: int, label: str
) -> list[Reading]:
    """`n` readings: passages from any document of `tokenized` holding `passage_tokens`, filler from another
    holding `need` tokens (ValueError naming what is short, and by how much)."""
    sources = {name: ids for name, ids in tokenized.items() if len(ids) >= passage_tokens}
    if not sources:
        longest = max(len(ids) for ids in tokenized.values())
        raise ValueError(
            f"passage_len ({passage_tokens:,} tokens) is longer than every document of {label} (the longest holds "
            f"{longest:,} tokens)"
        )
    readings = []
    for i in range(n):
        rng = sample_rng("reread", seed, i)
        names = sorted(sources)
        document = rng.choices(names, [len(sources[name]) for name in names])[0]
        fillers = sorted(name for name, ids in tokenized.items() if name != document and len(ids) >= need)
        if not fillers:
            others = [len(ids) for name, ids in tokenized.items() if name != document]
            if not others:
                raise ValueError(
                    f"{label} holds one document ({document}), and a passage is re-read after another document's "
                    "text: choose a corpus of several documents"
                )
            raise ValueError(
                f"lead + the longest of distances need {need:,} tokens of another document of {label} than the "
                f"passage's ({document}); the longest other holds {max(others):,}: ask shorter distances or a corpus "
                "with more held-out text"
            )
        filler = rng.choice(fillers)
        start = rng.randrange(len(sources[document]) - passage_tokens + 1)
        filler_start = rng.randrange(len(tokenized[filler]) - need + 1)
        readings.append(
            Reading(
                document,
                start,
                sources[document][start : start + passage_tokens],
                filler,
                filler_start,
                tokenized[filler][filler_start : filler_start + need],
            )
        )
    return readings


def reading_loss(losses, start: int, passage_tokens: int) -> float:
    """Mean nll over the passage's tokens 2..P when it begins at token `start` (`losses[t - 1]` is token t's)."""
    return float(losses[start : start + passage_tokens - 1].mean())


def is_control(model: MemoryModel) -> bool:
    """Whether the model's family is a control (the contrast a memory is measured against)."""
    try:
        return get_family(model.family).role == "control"
    except ValueError:  # a stand-in model of no registered family
        return False


def draw_readings(
    tokenizer,
    distances: Sequence[int],
    n: int,
    seed: int,
    passage_len: int,
    lead: int,
    corpus: str | os.PathLike | None,
    split: str,
    order: str,
) -> list[Reading]:
    """The `n` readings a run lays out (arguments checked and named as `run` takes them), in `tokenizer`'s ids."""
    check_n(n)
    check_choice("order", order, ORDERS)
    distances = check_distances(distances)
    check_count(passage_len, "passage_len", 2)
    check_count(lead, "lead", 0)
    check_grid_size(len(distances) * n)
    docs = lm.select(corpus, split, None)
    label = f"the {split} split of {corpus or 'every corpus'}"
    tokenized = {f"{d.corpus}/{d.name}" if corpus is None else d.name: tokenizer.encode(d.text) for d in docs}
    readings = draw(tokenized, n, seed, passage_len, lead + max(distances), label)
    if order == "shuffled":
        readings = [reading.shuffled(sample_rng("reread-order", seed, i)) for i, reading in enumerate(readings)]
    return readings


def run(
    model: MemoryModel,
    distances: Sequence[int] = DISTANCES,
    n: int = 10,
    seed: int = 0,
    passage_len: int = PASSAGE_TOKENS,
    lead: int = LEAD_TOKENS,
    corpus: str | os.PathLike | None = "shakespeare",
    split: str = "heldout",
    order: str = "text",
    progress: bool | SampleProgress = False,
) -> pd.DataFrame:
    """One row per (distance, passage): distance, passage (its index), document, start, filler, filler_start,
    tokens (the sample's length), order, first and second (mean nats a token at each reading), change (second /
    first - 1) and control (whether the model's family is a control). `corpus` None reads every built-in corpus;
    `order` "shuffled" reads each passage's tokens in a seeded random order (module docstring)."""
    readings = draw_readings(model.tokenizer, distances, n, seed, passage_len, lead, corpus, split, order)
    distances = check_distances(distances)
    control = is_control(model)
    rows = []
    for j, distance in enumerate(distances):
        for i, reading in enumerate(readings):
            ids, first_start, second_start = reading.tokens(distance, lead)
            losses = lm.token_losses(model, ids)
            first, second = (
                reading_loss(losses, first_start, passage_len),
                reading_loss(losses, second_start, passage_len),
            )
            rows.append(
                {
                    "distance": distance,
                    "passage": i,
                    "document": reading.document,
                    "start": reading.start,
                    "filler": reading.filler,
                    "filler_start": reading.filler_start,
                    "tokens": len(ids),
                    "order": order,
                    "first": first,
                    "second": second,
                    "change": second / first - 1,
                    "control": control,
                }
            )
            if callable(progress):
                progress(j * n + i + 1, len(distances) * n)
    return pd.DataFrame(rows)


def compare(models: Mapping[str, MemoryModel], **kw: Any) -> pd.DataFrame:
    """`run` for each named model on the same passages, with a `model` column first."""
    if not models:
        raise ValueError("compare needs at least one model, as {name: model}")
    frames = [run(model, **kw) for model in models.values()]
    return pd.concat(
        [f.assign(model=name)[["model", *f.columns]] for name, f in zip(models, frames)], ignore_index=True
    )


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Per model and distance: the passages' mean loss at each reading and the relative change of the means
    (second / first - 1, every passage of one length weighing alike), with the passages' count."""
    if df.empty or not {"distance", "first", "second"} <= set(df.columns):
        raise ValueError("summary needs the rows of reread.run or reread.compare (distance, first, second), got none")
    if "model" not in df:
        df = df.assign(model="model")
    table = df.groupby(["model", "distance"], sort=False).agg(
        first=("first", "mean"), second=("second", "mean"), passages=("first", "size")
    )
    table["change"] = table["second"] / table["first"] - 1
    return table[["first", "second", "change", "passages"]]


def curve(
    df: pd.DataFrame,
    title: str = "Re-reading: loss on a passage's second reading against its first",
    controls: Sequence[str] = (),
):
    """The relative change of `summary` against the distance (log scale), one line per model; the controls dashed:
    the models whose family is one (the `control` column) and those named in `controls`."""
    import plotly.graph_objects as go

    table = summary(df).reset_index()
    flagged = set(df.loc[df["control"].astype(bool), "model"]) if {"control", "model"} <= set(df.columns) else set()
    dashed = flagged | set(controls)
    fig = go.Figure()
    for name, group in table.groupby("model", sort=False):
        control = name in dashed
        fig.add_trace(
            go.Scatter(
                x=group["distance"],
                y=group["change"],
                mode="lines+markers",
                name=f"{name} (control)" if control and not str(name).endswith("(control)") else str(name),
                line_dash="dash" if control else "solid",
                customdata=group[["first", "second", "passages"]].to_numpy(),
                hovertemplate=(
                    "distance %{x:,} tokens<br>%{y:+.1%}: %{customdata[0]:.3f} then %{customdata[1]:.3f} nats a "
                    "token, %{customdata[2]} passages<extra>%{fullData.name}</extra>"
                ),
            )
        )
    fig.add_hline(y=0, line_color="grey", line_width=1)
    fig.update_layout(
        title=title,
        xaxis_title="tokens between the two readings (log scale)",
        yaxis_title="second reading's loss against the first",
        yaxis_tickformat="+.0%",
        legend_title="model",
    )
    fig.update_xaxes(type="log")
    return fig


#: key dimensions an oracle memory is measured at: a head of the English samples (32), their 4 heads' (128), and up
MEMORY_KEY_DIMS = (32, 128, 512, 2048, 4096)
#: the oracle reads are decoded among random unit values, one per distinct token, in this many dimensions
ORACLE_VALUE_DIMS = 512
#: tokens a key is made of: the token just read and the one before, what an induction head matches
ORACLE_CONTEXT = 2
#: the largest oracle state measured: d_k x ORACLE_VALUE_DIMS float32 numbers, 128 MiB
MAX_KEY_DIMS = 65_536


def oracle_vectors(
    ids: Sequence[int], key_dims: int, value_dims: int = ORACLE_VALUE_DIMS, context: int = ORACLE_CONTEXT, seed: int = 0
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """An oracle memory's vectors for a sequence: a random unit key per distinct run of `context` tokens (position t's
    is that of ids[t - context + 1 .. t], ids before the start counted as -1) and a random unit value per distinct
    token, float32: (keys [T, key_dims], values [U, value_dims], tokens [U] the distinct ids sorted, token_of [T]
    each position's index into tokens)."""
    sequence = torch.as_tensor(list(ids), dtype=torch.long)
    windows = torch.cat([sequence.new_full((context - 1,), -1), sequence]).unfold(0, context, 1)  # [T, context]
    _, context_of = torch.unique(windows, dim=0, return_inverse=True)
    tokens, token_of = torch.unique(sequence, return_inverse=True)
    generator = torch.Generator().manual_seed(seed)
    keys = mqar.unit_vectors(generator, int(context_of.max()) + 1, key_dims).float()[context_of]
    values = mqar.unit_vectors(generator, len(tokens), value_dims).float()
    return keys, values, tokens, token_of


def oracle_predictions(
    ids: Sequence[int],
    key_dims: int,
    rule: str,
    context: int = ORACLE_CONTEXT,
    value_dims: int = ORACLE_VALUE_DIMS,
    seed: int = 0,
) -> np.ndarray:
    """What an ideal linear memory S [key_dims, value_dims], written at every token and never decayed, predicts: at
    step t it writes the pair (key of the context ending at t - 1, value of ids[t]) by `rule` ("additive" or "delta",
    beta = 1; mqar.recall_accuracy's rules), then reads o_t = S_t^T key_t and names the token of the value of largest
    inner product. Entry t - 1 is the token predicted for position t, as `lm.token_losses` orders its losses; -1
    where nothing is written yet (t = 1)."""
    check_choice("rule", rule, mqar.RULES)
    ids = list(ids)
    predicted = np.full(max(len(ids) - 1, 0), -1, dtype=np.int64)
    if len(ids) < 3:
        return predicted
    keys, values, tokens, token_of = oracle_vectors(ids, key_dims, value_dims, context, seed)
    count = len(token_of)
    k, q, v = keys[: count - 2], keys[1 : count - 1], values[token_of[1 : count - 1]]
    g = k.new_zeros(1, 1, count - 2)  # exp(0) = 1: nothing decays, the most a memory keeps of the first reading
    beta = None if rule == "additive" else k.new_ones(1, 1, count - 2)
    start = k.new_zeros(1, 1, key_dims, value_dims)
    (reads, _), _ = linear_memory(q[None, None], k[None, None], v[None, None], g, beta, start, state_norms=False)
    assert reads is not None  # a query was given
    predicted[1:] = tokens[(reads[0, 0] @ values.T).argmax(-1)].numpy()
    return predicted


def check_whole(value: Any, name: str, least: int = 1) -> int:
    if not isinstance(value, numbers.Integral) or isinstance(value, bool) or int(value) < least:
        raise ValueError(f"{name} must be a whole number of at least {least}, got {value!r}")
    return int(value)


def memory_ceiling(
    control: MemoryModel,
    key_dims: Sequence[int] = MEMORY_KEY_DIMS,
    distances: Sequence[int] = DISTANCES,
    rules: Sequence[str] = mqar.RULES,
    n: int = 8,
    seed: int = 0,
    passage_len: int = PASSAGE_TOKENS,
    lead: int = LEAD_TOKENS,
    corpus: str | os.PathLike | None = "shakespeare",
    split: str = "heldout",
    context: int = ORACLE_CONTEXT,
    value_dims: int = ORACLE_VALUE_DIMS,
) -> pd.DataFrame:
    """The most a linear memory of d_k key dimensions can lower a second reading's loss, on `run`'s passages (the
    same draw, in `control`'s tokenizer). An oracle memory (`oracle_predictions`) reads each sequence; `control`'s
    losses price its tokens. Rows per rule, key_dims, distance and passage: recall_first and recall (the share of
    the passage's tokens 2..P it names right at each reading); first and second, each reading's mean loss if the
    tokens it names cost nothing and the rest what they cost the control; and change (second / first - 1), the
    probe's change for the control given that memory."""
    key_dims = [check_whole(d, "key_dims") for d in as_list(key_dims, "key_dims")]
    for dims in key_dims:
        if dims > MAX_KEY_DIMS:
            raise ValueError(
                f"key_dims must be at most {MAX_KEY_DIMS:,} (a state of d_k x {value_dims} numbers), got {dims:,}"
            )
    rules = as_list(rules, "rules")
    for name, values in (("key_dims", key_dims), ("rules", rules)):
        if not values:
            raise ValueError(f"{name} must name at least one")
        check_no_repeats(values, name)
    for rule in rules:
        check_choice("rules", rule, mqar.RULES)
    check_whole(context, "context")
    check_whole(value_dims, "value_dims")
    distances = check_distances(distances)
    check_grid_size(len(distances) * n * len(rules) * len(key_dims))
    readings = draw_readings(control.tokenizer, distances, n, seed, passage_len, lead, corpus, split, "text")
    rows = []
    for distance in distances:
        for i, reading in enumerate(readings):
            ids, first, second = reading.tokens(distance, lead)
            losses = lm.token_losses(control, ids)
            targets = np.asarray(ids)
            for rule in rules:
                for dims in key_dims:
                    predicted = oracle_predictions(ids, dims, rule, context, value_dims, seed)
                    recall: dict[str, float] = {}
                    loss: dict[str, float] = {}
                    for which, start in (("first", first), ("second", second)):
                        right = predicted[start : start + passage_len - 1] == targets[start + 1 : start + passage_len]
                        recall[which] = float(right.mean())
                        loss[which] = float(np.where(right, 0.0, losses[start : start + passage_len - 1]).mean())
                    rows.append(
                        {
                            "rule": rule,
                            "key_dims": dims,
                            "distance": distance,
                            "passage": i,
                            "recall_first": recall["first"],
                            "recall": recall["second"],
                            "first": loss["first"],
                            "second": loss["second"],
                            "change": loss["second"] / loss["first"] - 1,
                        }
                    )
    return pd.DataFrame(rows)


def run_probe(model: MemoryModel, args: Namespace) -> pd.DataFrame:
    """`compare` over every checkpoint given, on the registered arguments (the command line's and the Probes
    page's run)."""
    kw = keywords(args, "distances", "n", "seed", "passage_len", "lead", "split", "order", "progress")
    return compare(args.models, corpus=None if args.corpus == "all" else args.corpus, **kw)


register_probe(
    Probe(
        name="reread",
        summary="loss on a held-out passage read a second time, d tokens after the first, per checkpoint",
        run=run_probe,
        figure=curve,
        summary_table=summary,
        args=(
            Arg(
                "distances",
                int,
                nargs="+",
                default=DISTANCES,
                help="tokens of other held-out text between the two readings",
                widget=Widget(
                    "multiselect",
                    "rr_distances",
                    "Distances (tokens)",
                    options=DISTANCES,
                    default=(64, 1024, 4096),
                    noun="distance",
                    tokens=True,
                ),
            ),
            Arg(
                "passage_len",
                int,
                default=PASSAGE_TOKENS,
                help="tokens of the passage read twice",
                widget=Widget("number", "rr_passage", "Passage (tokens)", default=PASSAGE_TOKENS, bounds=(2, 4096)),
            ),
            Arg("lead", int, default=LEAD_TOKENS, help="tokens of the filler's text before the first reading"),
            Arg(
                "corpus",
                default="shakespeare",
                help=f"{', '.join(texts.CORPORA)}, 'all', or a UTF-8 file or folder of .txt files",
                widget=Widget(
                    "selectbox", "rr_corpus", "Corpus", options=("shakespeare", "all")
                ),  # botchan: one held out
            ),
            Arg("split", default="heldout", choices=texts.SPLITS),
            Arg(
                "order",
                default="text",
                choices=ORDERS,
                help="the passage as written, or its tokens shuffled (the same at both readings): copying alone",
                widget=Widget("selectbox", "rr_order", "Passage order", options=ORDERS),
            ),
        ),
        several=True,
        page=PageParts(
            label="re-reading",
            caption="A held-out passage read, then `distance` tokens of another held-out document, then the same "
            "passage again: how much lower each model's loss is the second time. A model whose context no longer "
            "reaches the first reading gains nothing; a memory that holds it copies.",
            n=Widget("number", "rr_n", "Passages", default=4, bounds=(1, 200)),
            seed=Widget("number", "rr_seed", "Seed", default=0, bounds=(0, 10_000)),
            run_key="run_reread",
            beside_key="rr_models",
            counts="samples",
            summary=True,
        ),
        order=55,
    )
)
