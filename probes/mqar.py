"""Multi-query associative recall (MQAR; Arora et al., "Zoology", arXiv 2312.04927): how many
key-value pairs a memory holds, against the pairs asked and the length read.

A sample of `length` tokens with N = `pairs` is laid out as Zoology lays its sequences out:

    k_1 v_1 k_2 v_2 ... k_N v_N | filler, with each key k_i once more at offset 2 g_i

The pairs fill the first 2N tokens. In the remaining R = length - 2N tokens each key appears once more as a query,
at an even offset 2 g_i. The gaps g_i are drawn without replacement from 0..R/2 - 1 with p(g) proportional to
(g + 1)^(a - 1), Zoology's power law: `power_a` a = 0.01 (Zoology's) puts most queries near the pairs, and a = 1
spreads them evenly. Every other position holds filler, so the length is filled as Zoology fills it. Zoology's
filler is a pad token or random tokens; here it is the tokens of English filler text (the pass-key probe's haystack),
so that the English samples read text between the queries. Each key is queried once, in the random order of its gap.

Keys and values are single tokens of the model's tokenizer that decode to a space and two or more lowercase letters
(" dog"). Keys come from the lower half of these ids and values from the upper half, as Zoology draws keys and values
from the two halves of its vocabulary. A sample's keys are distinct, so are its values, and none of them occurs in its
filler.

Scoring is teacher-forced: one streamed forward per sample (`model.stream`). A query is right iff the argmax of the
logits at the query's position (the prediction of the next token) is its pair's value (`correct`). Beside it,
`correct_among_values` takes the argmax over the sample's N stored values only, the nearest-value decoding of
`capacity_curve`: a model that knows the stored values but not which key holds which scores 1/N on it, so it shows
an association that the vocabulary-wide argmax (English continuations, for a model never trained on MQAR) hides.

The capacity bound: a linear memory S [d_k, d_v] read as o = S^T q (S_t = S_{t-1} + k_t v_t^T, or the delta rule
S_t = S_{t-1} + beta_t k_t (v_t - S_{t-1}^T k_t)^T) returns N generic values exactly only if K S = V is solvable for
the stacked keys K [N, d_k], which needs N <= d_k: d_k pairs a head (orthonormal keys for the additive rule). Zoology
shows that gated convolutions need a dimension growing with the sequence to solve MQAR, and Based (Arora et al. 2024,
arXiv 2402.18668) proves the general form: a recurrent model's state must grow with the number of pairs it recalls.
`capacity_curve` measures where interference starts with the linear-memory operator itself
(`memviz_kernels.dispatch.linear_memory`).
"""

from __future__ import annotations

import math
import numbers
import re
from argparse import Namespace
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np
import pandas as pd
import torch

from memviz.protocol import MemoryModel, ModelState
from memviz.registry import get_family
from memviz.state_rank import matrix_memories
from memviz_kernels.dispatch import linear_memory
from memviz_probes.common import (
    SampleProgress,
    as_list,
    check_grid_size,
    check_lengths,
    check_n,
    check_no_repeats,
    sample_rng,
)
from memviz_probes.haystack import make_haystack
from memviz_probes.registry import Arg, PageParts, Probe, Widget, keywords, register_probe

#: Zoology's power-law exponent for the query gaps
POWER_A = 0.01
#: a pool word: a space and two or more lowercase letters
WORD = re.compile(r" [a-z]{2,}")
#: characters a CSV line cannot hold as they are
CONTROL = re.compile(r"[\x00-\x1f\x7f]")
#: the one-head key dimension of the English samples' matrix memories (Gated DeltaNet's and Infini-attention's S)
KEY_DIMS = 32
RULES = ("additive", "delta")


@dataclass
class MQARSample:
    """One MQAR sequence: `tokens` (exactly `length` ids), the pairs' `keys` and `values` in the order written, and
    `queries`, (position, pair index) in the order read."""

    tokens: list[int]
    keys: list[int]
    values: list[int]
    queries: list[tuple[int, int]] = field(default_factory=list)

    @property
    def length(self) -> int:
        return len(self.tokens)

    @property
    def pairs(self) -> int:
        return len(self.keys)


@lru_cache(maxsize=8)
def word_pools(tokenizer) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """The key and value pools of `tokenizer`: the ids whose token decodes to a space and 2+ lowercase letters and
    encodes back to that one id, split at the middle (keys the lower ids, values the upper)."""
    words = [
        i
        for i in range(tokenizer.vocab_size)
        if WORD.fullmatch(piece := tokenizer.decode([i])) and tokenizer.encode(piece) == [i]
    ]
    half = len(words) // 2
    return tuple(words[:half]), tuple(words[half : 2 * half])


def check_pairs(pairs: Any, pool: int | None = None) -> list[int]:
    """A non-empty list of pair counts, each a whole number >= 1 (and at most `pool`, the words a pool holds)."""
    pairs = as_list(pairs, "pairs")
    if not pairs:
        raise ValueError("pairs needs at least one value")
    for count in pairs:
        if not isinstance(count, numbers.Integral) or isinstance(count, bool) or int(count) < 1:
            raise ValueError(f"pairs are whole numbers of key-value pairs >= 1, got {count!r}")
        if pool is not None and int(count) > pool:
            raise ValueError(
                f"pairs {count} is more than the tokenizer's {pool} single-token key words "
                f"(and {pool} value words) hold"
            )
    values = [int(count) for count in pairs]
    check_no_repeats(values, "pairs")
    return values


def check_room(length: int, pairs: int) -> None:
    """Zoology's room: 2N tokens of pairs and N query slots of two tokens each, so length >= 4N."""
    if length < 4 * pairs:
        raise ValueError(
            f"length {length} is too short for {pairs} pairs: MQAR needs 4 x pairs = {4 * pairs} tokens "
            "(the pairs, then a two-token slot for each query)"
        )


def check_power_a(power_a: Any) -> float:
    if not isinstance(power_a, numbers.Real) or isinstance(power_a, bool) or not 0 < float(power_a) <= 1:
        raise ValueError(f"power_a is the gaps' power-law exponent in (0, 1], got {power_a!r}")
    return float(power_a)


def filler_tokens(tokenizer, count: int, haystack=None, seed: int = 0) -> list[int]:
    """Exactly `count` tokens of the haystack's sentences, each sentence with its leading space."""
    tokens: list[int] = []
    sentences = make_haystack(haystack, seed).sentences()
    while len(tokens) < count:
        tokens += tokenizer.encode(" " + next(sentences))
    return tokens[:count]


def gap_weights(slots: int, power_a: float) -> np.ndarray:
    """Zoology's p(g) proportional to (g + 1)^(a - 1) over the query slots g = 0..slots - 1."""
    p = np.arange(1, slots + 1, dtype=np.float64) ** (power_a - 1)
    return p / p.sum()


def make_sample(
    tokenizer, length: int, pairs: int, seed: int = 0, haystack=None, power_a: float = POWER_A
) -> MQARSample:
    """An MQAR sequence of exactly `length` tokens with `pairs` pairs (module docstring), drawn by `seed`."""
    check_room(length, pairs)
    rng = sample_rng("mqar-sample", seed)
    region = length - 2 * pairs
    filler = filler_tokens(tokenizer, region - pairs, haystack, rng.randrange(2**31))
    used = set(filler)
    key_pool, value_pool = ([t for t in pool if t not in used] for pool in word_pools(tokenizer))
    if pairs > min(len(key_pool), len(value_pool)):
        raise ValueError(
            f"pairs {pairs} is more than the {min(len(key_pool), len(value_pool))} key or value words left "
            "once the filler's own words are set aside"
        )
    keys, values = rng.sample(key_pool, pairs), rng.sample(value_pool, pairs)
    gaps = np.random.default_rng(rng.randrange(2**63)).choice(
        region // 2, size=pairs, replace=False, p=gap_weights(region // 2, power_a)
    )
    slots = dict(zip((2 * int(g) for g in gaps), range(pairs)))
    rest = iter(filler)
    body = [keys[slots[offset]] if offset in slots else next(rest) for offset in range(region)]
    queries = sorted((2 * pairs + offset, pair) for offset, pair in slots.items())
    head = [token for pair in zip(keys, values) for token in pair]
    return MQARSample(head + body, keys, values, queries)


def seeded_sample(
    tokenizer, length: int, pairs: int, seed: int, index: int, haystack=None, power_a: float = POWER_A
) -> MQARSample:
    """Sample `index` of the (length, pairs) cell: the same arguments always give the same sample."""
    rng = sample_rng("mqar", seed, length, pairs, index)
    return make_sample(tokenizer, length, pairs, rng.randrange(2**31), haystack, power_a)


def predictions_at(
    model: MemoryModel, tokens: Sequence[int], positions: Sequence[int], candidates: Sequence[int]
) -> tuple[dict[int, tuple[int, int] | None], ModelState]:
    """At each of `positions`, from one streamed forward over `tokens`: the argmax of the logits over the vocabulary
    and over `candidates` only (None where the logits are not finite); and the state the forward leaves."""
    wanted = sorted(positions)
    among = torch.tensor(list(candidates), dtype=torch.long)
    found: dict[int, tuple[int, int] | None] = {}
    state = None
    with torch.no_grad(), model.evaluating():
        for start, logits, reached in model.stream(torch.tensor([list(tokens)], device=model.device)):
            state = reached
            here = [p for p in wanted if start <= p < start + logits.shape[1]]
            if here:
                rows = logits[0, torch.tensor(here) - start].float().cpu()
                best, best_among = rows.argmax(-1).tolist(), among[rows[:, among].argmax(-1)].tolist()
                finite = torch.isfinite(rows).all(-1).tolist()
                found.update({p: (b, c) if ok else None for p, b, c, ok in zip(here, best, best_among, finite)})
    if state is None:
        raise ValueError("an MQAR sample has no tokens to read")
    return found, state


def capacity_bound(shape: Sequence[int]) -> int:
    """The most pairs a linear memory of shape [(heads,) d_k, d_v] returns exactly by linear reads: d_k a head,
    summed over its heads (module docstring)."""
    if len(shape) < 2:
        raise ValueError(f"a matrix memory has at least 2 dimensions [d_k, d_v], got shape {tuple(shape)}")
    return math.prod(shape[:-2]) * int(shape[-2])


def memory_size(model: MemoryModel, state: ModelState) -> tuple[int, int]:
    """The numbers the model's matrix memories hold in `state` (one batch row, every layer; `Family.matrix_state`)
    and the largest layer's `capacity_bound`; (0, 0) for a family that declares no matrix memory."""
    paths = get_family(model.family).matrix_state
    numbers_held, bound = 0, 0
    for layer_state in state.layers if paths else ():
        memories = [tensor[0] for _, tensor in matrix_memories(layer_state, paths)]
        numbers_held += sum(memory.numel() for memory in memories)
        bound = max(bound, sum(capacity_bound(memory.shape) for memory in memories))
    return numbers_held, bound


def run(
    model: MemoryModel,
    lengths: Sequence[int] = (512, 2048),
    pairs: Sequence[int] = (4, 8, 16, 32),
    n: int = 10,
    seed: int = 0,
    haystack=None,
    power_a: float = POWER_A,
    progress: bool | SampleProgress = True,
) -> pd.DataFrame:
    """One row per query: length, pairs, sample, query (its rank in reading order), position, distance (tokens from
    its pair's value), key, answer, prediction, correct (the argmax over the vocabulary is the value),
    correct_among_values (the argmax over the sample's stored values is: chance 1 / pairs), diverged (its logits were
    not finite; scored wrong), and the model's state_size and pair_bound (`memory_size`)."""
    from tqdm.auto import tqdm

    check_n(n)
    lengths, pairs = check_lengths(lengths), check_pairs(pairs, len(word_pools(model.tokenizer)[0]))
    power_a = check_power_a(power_a)
    check_grid_size(len(lengths) * len(pairs) * n)
    for length in lengths:
        for count in pairs:
            check_room(length, count)
    if haystack not in (None, "procedural"):
        make_haystack(haystack, seed)  # fail early on an unreadable file
    cells = [(length, count, i) for length in lengths for count in pairs for i in range(n)]
    tok, rows = model.tokenizer, []
    size: tuple[int, int] | None = None
    for done, (length, count, i) in enumerate(tqdm(cells, desc="mqar", disable=progress is not True, leave=False)):
        sample = seeded_sample(tok, length, count, seed, i, haystack, power_a)
        found, state = predictions_at(model, sample.tokens, [p for p, _ in sample.queries], sample.values)
        if size is None:
            size = memory_size(model, state)
        for rank, (position, pair) in enumerate(sample.queries):
            predicted, among = found[position] or (None, None)
            rows.append(
                {
                    "length": length,
                    "pairs": count,
                    "sample": i,
                    "query": rank,
                    "position": position,
                    "distance": position - (2 * pair + 1),
                    "key": tok.decode([sample.keys[pair]]),
                    "answer": tok.decode([sample.values[pair]]),
                    "prediction": "" if predicted is None else tok.decode([predicted]),
                    "correct": predicted == sample.values[pair],
                    "correct_among_values": among == sample.values[pair],
                    "diverged": predicted is None,
                }
            )
        if callable(progress):
            progress(done + 1, len(cells))
    state_size, pair_bound = size or (0, 0)
    return pd.DataFrame(rows).assign(state_size=state_size, pair_bound=pair_bound)


def compare(
    models: Mapping[str, MemoryModel],
    lengths: Sequence[int] = (512, 2048),
    pairs: Sequence[int] = (4, 8, 16, 32),
    n: int = 10,
    seed: int = 0,
    progress: bool | SampleProgress = True,
    **kw: Any,
) -> pd.DataFrame:
    """`run` for each named model on the same samples (where they share a tokenizer), with a `model` column."""
    if not models:
        raise ValueError("models must name at least one model")
    frames = [
        run(model, lengths, pairs, n, seed, progress=progress, **kw).assign(model=name)
        for name, model in models.items()
    ]
    return pd.concat(frames, ignore_index=True)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Both accuracies per model (rows, with its state size and pair bound) and (score, length, pairs) (columns)."""
    if df.empty or not {"length", "pairs", "correct", "correct_among_values", "state_size", "pair_bound"} <= set(df):
        raise ValueError("summary needs the rows of mqar.run or mqar.compare, got none")
    if "model" not in df:
        df = df.assign(model="model")
    keys = ["model", "state_size", "pair_bound"]
    scores = ["correct", "correct_among_values"]
    return df.pivot_table(index=keys, columns=["length", "pairs"], values=scores, sort=False)


def csv_rows(df: pd.DataFrame) -> pd.DataFrame:
    """The rows as `mqar.csv` holds them: the tokens' text (key, answer, prediction) with control characters written
    as escapes ("\\x0d"), so that a token such as a lone carriage return does not break the file's lines."""
    text = [column for column in ("key", "answer", "prediction") if column in df]
    return df.assign(**{column: df[column].map(escape_controls) for column in text})


def escape_controls(text: str) -> str:
    return CONTROL.sub(lambda found: f"\\x{ord(found.group()):02x}", text)


def recall_accuracy(keys: torch.Tensor, values: torch.Tensor, rule: str) -> torch.Tensor:
    """Write the pairs (keys [B, N, d_k], values [B, N, d_v]) in order into a zero linear memory with `rule`
    ("additive": S += k v^T; "delta": beta = 1), read each key back (o = S^T k) and decode it as the stored value of
    largest inner product: the share of pairs decoded right, [B]."""
    if rule not in RULES:
        raise ValueError(f"rule must be one of {', '.join(RULES)}, got {rule!r}")
    batch, count, key_dims = keys.shape
    k, v = keys[:, None], values[:, None]
    g = keys.new_zeros(batch, 1, count)
    beta = None if rule == "additive" else keys.new_ones(batch, 1, count)
    start = keys.new_zeros(batch, 1, key_dims, values.shape[-1])
    _, memory = linear_memory(None, k, v, g, beta, start, state_norms=False)
    reads = k @ memory  # [B, 1, N, d_v]: o_i = S^T k_i
    decoded = (reads @ v.transpose(-1, -2)).argmax(-1)[:, 0]
    return (decoded == torch.arange(count)).double().mean(-1)


def unit_vectors(generator: torch.Generator, *shape: int) -> torch.Tensor:
    x = torch.randn(*shape, generator=generator, dtype=torch.float64)
    return x / x.norm(dim=-1, keepdim=True)


def capacity_curve(
    key_dims: int = KEY_DIMS, pairs: Sequence[int] | None = None, trials: int = 32, seed: int = 0
) -> pd.DataFrame:
    """Recall of N pairs with random unit keys and values (d_v = d_k) through the linear-memory operator, additive
    and delta rule: columns rule, key_dims, pairs, load (N / d_k), accuracy (mean over `trials` draws). `pairs`
    defaults to powers of two from 1 to 8 d_k."""
    if not isinstance(key_dims, int) or isinstance(key_dims, bool) or key_dims < 1:
        raise ValueError(f"key_dims must be a positive whole number, got {key_dims!r}")
    check_n(trials)
    counts = check_pairs(pairs if pairs is not None else [2**i for i in range(int(math.log2(8 * key_dims)) + 1)])
    generator = torch.Generator().manual_seed(seed)
    rows = []
    for count in counts:
        keys = unit_vectors(generator, trials, count, key_dims)
        values = unit_vectors(generator, trials, count, key_dims)
        for rule in RULES:
            accuracy = float(recall_accuracy(keys, values, rule).mean())
            rows.append(
                {"rule": rule, "key_dims": key_dims, "pairs": count, "load": count / key_dims, "accuracy": accuracy}
            )
    return pd.DataFrame(rows)


def figure(
    df: pd.DataFrame,
    score: str = "correct_among_values",
    key_dims: int = KEY_DIMS,
    title: str = "MQAR: recall against pairs stored",
):
    """Accuracy (`score`: "correct_among_values", decoded among the stored values as the operator's reads are, or
    "correct", over the vocabulary) against pairs (log scale), one panel per length and one line per model (its state
    size and pair bound in the legend), beside the linear-memory operator's recall at d_k = `key_dims` (additive and
    delta rule), its exact bound N = d_k and chance among the stored values (1 / N)."""
    import plotly.graph_objects as go
    from plotly.subplots import make_subplots

    if df.empty:
        raise ValueError("no MQAR results to plot")
    if score not in ("correct", "correct_among_values"):
        raise ValueError(f"score must be 'correct' or 'correct_among_values', got {score!r}")
    if "model" not in df:
        df = df.assign(model="model")
    lengths = sorted(df["length"].unique())
    shown = sorted(df["pairs"].unique())
    widest = max(2 * max(shown), 4 * key_dims)  # far enough to show where the operator's interference starts
    grid = sorted({2**i for i in range(int(math.log2(widest)) + 1)} | set(shown))
    reference = capacity_curve(key_dims, grid)
    fig = make_subplots(rows=1, cols=len(lengths), subplot_titles=[f"{length:,} tokens" for length in lengths])
    colours = dict(zip(df["model"].unique(), palette()))
    for col, length in enumerate(lengths, start=1):
        first = col == 1
        for rule, dash in zip(RULES, ("dash", "dot")):
            ref = reference[reference["rule"] == rule]
            fig.add_trace(
                go.Scatter(
                    x=ref["pairs"],
                    y=ref["accuracy"],
                    mode="lines",
                    line={"color": "grey", "dash": dash},
                    name=f"linear memory d_k={key_dims}, {rule} rule",
                    legendgroup=rule,
                    showlegend=first,
                    hovertemplate=f"{rule} rule, d_k {key_dims}<br>%{{x}} pairs: %{{y:.0%}}<extra></extra>",
                ),
                row=1,
                col=col,
            )
        fig.add_trace(
            go.Scatter(
                x=grid,
                y=[1 / count for count in grid],
                mode="lines",
                line={"color": "lightgrey", "dash": "dashdot"},
                name="chance (1 / pairs)",
                legendgroup="chance",
                showlegend=first,
                hoverinfo="skip",
            ),
            row=1,
            col=col,
        )
        fig.add_vline(x=key_dims, line={"color": "grey", "width": 1}, row=1, col=col)
        for name, group in df[df["length"] == length].groupby("model", sort=False):
            table = group.groupby("pairs")[score].agg(["mean", "size"]).sort_index()
            size, bound = int(group["state_size"].iloc[0]), int(group["pair_bound"].iloc[0])
            memory = f"{size:,} numbers, bound {bound}" if size else "no matrix memory"
            fig.add_trace(
                go.Scatter(
                    x=table.index,
                    y=table["mean"],
                    mode="lines+markers",
                    line={"color": colours[name]},
                    name=f"{name} ({memory})",
                    legendgroup=str(name),
                    showlegend=first,
                    customdata=table["size"],
                    hovertemplate="%{x} pairs: %{y:.1%} of %{customdata} queries<extra>%{fullData.name}</extra>",
                ),
                row=1,
                col=col,
            )
    fig.update_xaxes(type="log", title_text="key-value pairs (log scale)", dtick=math.log10(2))
    fig.update_yaxes(range=[-0.03, 1.03], tickformat=".0%")
    fig.update_yaxes(
        title_text="answered (among the stored values)" if score == "correct_among_values" else "answered", row=1, col=1
    )
    fig.update_layout(title=title, legend_title=f"model (vertical line: d_k = {key_dims})")
    return fig


def palette() -> list[str]:
    import plotly.express as px

    return px.colors.qualitative.Plotly * 4


def run_probe(model: MemoryModel, args: Namespace) -> pd.DataFrame:
    """`compare` over every checkpoint given, on the registered arguments (the command line's and the Probes
    page's run)."""
    return compare(args.models, **keywords(args, "lengths", "pairs", "n", "seed", "haystack", "power_a", "progress"))


register_probe(
    Probe(
        name="mqar",
        summary="multi-query associative recall (Zoology's MQAR): pairs x length, per checkpoint",
        run=run_probe,
        figure=figure,
        summary_table=summary,
        csv=csv_rows,
        args=(
            Arg(
                "lengths",
                int,
                nargs="+",
                default=(512, 2048),
                widget=Widget(
                    "multiselect",
                    "mq_lengths",
                    "Lengths (tokens)",
                    options=(256, 512, 1024, 2048, 4096, 8192),
                    default=(512, 2048),
                    noun="length",
                    tokens=True,
                ),
            ),
            Arg(
                "pairs",
                int,
                nargs="+",
                default=(4, 8, 16, 32),
                help="key-value pairs a sample stores (a length must hold 4 x pairs tokens)",
                widget=Widget(
                    "multiselect",
                    "mq_pairs",
                    "Key-value pairs",
                    options=(1, 2, 4, 8, 16, 32, 64, 128),
                    default=(4, 8, 16, 32),
                    noun="pair count",
                ),
            ),
            Arg("haystack", help="the filler: procedural (the default), grass, shakespeare, or a plain-text file"),
            Arg(
                "power_a",
                float,
                default=POWER_A,
                help="the query gaps' power-law exponent in (0, 1]: 0.01 (Zoology's) puts queries near the pairs, "
                "1 spreads them evenly",
            ),
        ),
        several=True,
        page=PageParts(
            caption="Zoology's MQAR: key-value pairs of single-token words, then each key once more among filler; a "
            "query is right when the model's next token is its value (one forward a sample). Beside it the "
            "linear-memory operator's recall at d_k = 32 and chance (1 / pairs).",
            n=Widget("number", "mq_n", "Samples per cell", default=5, bounds=(1, 200)),
            seed=Widget("number", "mq_seed", "Seed", default=0, bounds=(0, 10_000)),
            run_key="run_mqar",
            beside_key="mq_models",
            counts="samples",
            summary=True,
        ),
        order=45,
    )
)
