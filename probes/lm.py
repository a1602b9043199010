"""Language modelling on held-out text: bits per byte, and loss against token position.

The figure the Infini-attention, LongMem and Titans papers lead with: a model reads whole held-out
documents (a play is 35-60k tokens of these samples' tokenizer) and its loss on each token is kept; the loss
averaged over documents at each position says whether a memory lowers the loss past the local window, and a
control beside it says by how much.

* Per token t >= 1, nll_t = -ln p(x_t | x_<t), streamed through `model.stream` (bounded memory, any length).
* Bits per byte of a document = sum_t nll_t / ln 2 / (UTF-8 bytes of x_1..x_n-1): the first token has no
  context and is not scored; it is independent of the tokenizer, so models with other vocabularies compare.
* `by_position` averages nll_t over documents in log-spaced position bins (every token in its bin).

The documents are `memviz_probes.texts` corpora (default: the held-out split, which no training run reads) or any
UTF-8 file or folder of `.txt` files.
"""

from __future__ import annotations

import math
import os
import warnings
from argparse import Namespace
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import pandas as pd
import torch

from memviz.protocol import MemoryModel
from memviz.running import NonFiniteError
from memviz_probes import texts
from memviz_probes.registry import Arg, PageParts, Probe, Unsampled, Widget, register_probe

#: a document is cut to this many tokens unless asked otherwise (Hamlet is 60k of the English samples' tokens)
MAX_TOKENS = 1 << 20


def token_losses(model: MemoryModel, tokens: Sequence[int], chunk_len: int | None = None) -> np.ndarray:
    """nll_t in nats for t = 1..n-1 (predicting tokens[t] from tokens[:t]), streamed chunk by chunk."""
    ids = torch.as_tensor(list(tokens))
    if ids.numel() < 2:
        raise ValueError(f"a document needs at least 2 tokens to score, got {ids.numel()}")
    if ids.is_floating_point() or ids.is_complex() or ids.dtype == torch.bool:
        raise ValueError(f"tokens must be whole-number token ids, got {ids.dtype}")
    ids = ids.long()
    out = np.empty(ids.numel() - 1, dtype=np.float64)
    with torch.no_grad(), model.evaluating():
        for start, logits, _ in model.stream(ids[None].to(model.device), chunk_len=chunk_len):
            logp = torch.log_softmax(logits[0].double(), dim=-1)  # [chunk, vocab]; position i predicts start + i + 1
            targets = ids[start + 1 : start + 1 + logp.shape[0]].to(logp.device)
            out[start : start + targets.numel()] = -logp[torch.arange(targets.numel()), targets].cpu().numpy()
    if not np.isfinite(out).all():
        bad = int(np.flatnonzero(~np.isfinite(out))[0]) + 1
        raise NonFiniteError(f"the model's loss is not finite from token {bad} on (its memory diverged there)")
    return out


def select(corpus: str | os.PathLike | None, split: str, documents: Sequence[str] | None) -> list[texts.Document]:
    corpus = os.fspath(corpus) if isinstance(corpus, os.PathLike) else corpus
    if corpus is not None and not (isinstance(corpus, str) and corpus.strip()):
        raise ValueError(f"corpus must name a corpus, a file or a folder (None: every built-in one), got {corpus!r}")
    if documents is not None and (isinstance(documents, str) or not documents):
        raise ValueError(f"documents must be a non-empty list of names (None: every one), got {documents!r}")
    corpora = [corpus] if corpus else list(texts.CORPORA)
    docs = [d for c in corpora for d in texts.documents(c, split)]
    if documents:
        names = {d.name for d in docs}
        missing = sorted(set(documents) - names)
        if missing:
            raise ValueError(
                f"document(s) {missing} are not in the {split} split of {corpora}; there are {sorted(names)[:50]}"
            )
        docs = [d for d in docs if d.name in documents]
    if not docs:
        hint = (
            " (a corpus of your own has no held-out documents: use split 'all')" if corpus not in texts.CORPORA else ""
        )
        raise ValueError(f"no {split} documents in {corpora}{hint}")
    return docs


def run(
    model: MemoryModel,
    corpus: str | None = "shakespeare",
    split: str = "heldout",
    documents: Sequence[str] | None = None,
    max_tokens: int | None = None,
    progress: bool | Callable[[int, int], None] = False,
    keep_losses: bool = True,
) -> pd.DataFrame:
    """One row per document: corpus, document, tokens, bytes, nats (summed), bits_per_byte, nats_per_token and
    (with `keep_losses`) `losses`, the nll_t array. `corpus` None reads every built-in corpus."""
    if max_tokens is not None and (not isinstance(max_tokens, int) or isinstance(max_tokens, bool) or max_tokens < 2):
        raise ValueError(f"max_tokens is a whole number of tokens >= 2, got {max_tokens!r}")
    docs = select(corpus, split, documents)
    rows = []
    for i, doc in enumerate(docs):
        tokens = model.tokenizer.encode(doc.text)
        if max_tokens is None and len(tokens) > MAX_TOKENS:
            warnings.warn(
                f"{doc.corpus} / {doc.name}: {len(tokens):,} tokens, scored on its first {MAX_TOKENS:,} "
                "(pass max_tokens to choose)",
                stacklevel=2,
            )
        tokens = tokens[: max_tokens or MAX_TOKENS]
        losses = token_losses(model, tokens)
        n_bytes = model.tokenizer.byte_length(tokens[1:])  # the first token is not scored
        row = {
            "corpus": doc.corpus,
            "document": doc.name,
            "tokens": len(tokens),
            "bytes": n_bytes,
            "nats": float(losses.sum()),
            "bits_per_byte": float(losses.sum() / math.log(2) / n_bytes),
            "nats_per_token": float(losses.mean()),
        }
        if keep_losses:
            row["losses"] = losses
        rows.append(row)
        if callable(progress):
            progress(i + 1, len(docs))
    return pd.DataFrame(rows)


def summary(df: pd.DataFrame) -> pd.DataFrame:
    """Bits per byte over all documents of each corpus (bytes-weighted), per model where there is a `model` column."""
    if not {"corpus", "nats", "bytes", "tokens"} <= set(df.columns) or df.empty:
        raise ValueError("summary needs the rows of lm.run or lm.compare (corpus, nats, bytes, tokens), got none")
    keys = (["model"] if "model" in df else []) + ["corpus"]
    table = df.groupby(keys, sort=False)[["nats", "bytes", "tokens"]].sum()
    table["bits_per_byte"] = table["nats"] / math.log(2) / table["bytes"]
    table["bytes_per_token"] = table["bytes"] / table["tokens"]
    return table[["bits_per_byte", "tokens", "bytes", "bytes_per_token"]]


def compare(models: Mapping[str, MemoryModel], **kw: Any) -> pd.DataFrame:
    """`run` for each named model on the same documents, with a `model` column."""
    if not models:
        raise ValueError("compare needs at least one model, as {name: model}")
    return pd.concat([run(m, **kw).assign(model=name) for name, m in models.items()], ignore_index=True)


def bin_edges(longest: int, per_octave: int = 4, first: int = 16) -> np.ndarray:
    """Position-bin edges: [1, first) whole, then log-spaced, `per_octave` bins per doubling, up to `longest`."""
    edges = [1, first]
    while edges[-1] < longest:
        edges.append(max(edges[-1] + 1, int(round(edges[-1] * 2 ** (1 / per_octave)))))
    return np.array(edges[:-1] + [longest], dtype=np.int64)


def by_position(df: pd.DataFrame, per_octave: int = 4) -> pd.DataFrame:
    """Mean nll_t over every token of every document in each position bin (positions are t, the number of tokens
    of context), per model: columns model, start, end, position (the bin's geometric centre), nats, tokens,
    documents (how many reach the bin)."""
    if "losses" not in df:
        raise ValueError("by_position needs the per-token losses: run(..., keep_losses=True)")
    if not isinstance(per_octave, int) or isinstance(per_octave, bool) or per_octave < 1:
        raise ValueError(f"per_octave must be a whole number of bins >= 1, got {per_octave!r}")
    if "model" not in df:
        df = df.assign(model="model")
    longest = max(len(x) for x in df["losses"]) + 1
    edges = bin_edges(longest, per_octave)
    rows = []
    for name, group in df.groupby("model", sort=False):
        for lo, hi in zip(edges[:-1], edges[1:]):
            parts = [x[lo - 1 : hi - 1] for x in group["losses"] if len(x) >= lo]
            if not parts:
                continue
            values = np.concatenate(parts)
            rows.append(
                {
                    "model": name,
                    "start": int(lo),
                    "end": int(hi),
                    "position": float(math.sqrt(lo * (hi - 1))),
                    "nats": float(values.mean()),
                    "tokens": int(values.size),
                    "documents": len(parts),
                }
            )
    return pd.DataFrame(rows)


def position_curve(
    df: pd.DataFrame, title: str = "Loss against token position (held-out text)", window: int | None = None
):
    """Mean loss per log-spaced position bin, one line per model; `window` marks the local attention's span."""
    import plotly.graph_objects as go

    table = df if "position" in df else by_position(df)
    if table.empty:
        raise ValueError("no language-modelling results to plot")
    fig = go.Figure()
    for name, group in table.groupby("model", sort=False):
        fig.add_trace(
            go.Scatter(
                x=group["position"],
                y=group["nats"],
                mode="lines+markers",
                name=str(name),
                customdata=np.stack([group["start"], group["end"] - 1, group["tokens"], group["documents"]], axis=1),
                hovertemplate=(
                    "tokens %{customdata[0]:,}-%{customdata[1]:,}<br>%{y:.3f} nats a token over "
                    "%{customdata[2]:,} tokens of %{customdata[3]} documents<extra>%{fullData.name}</extra>"
                ),
            )
        )
    if window:
        fig.add_vline(x=window, line_dash="dot")
        fig.add_annotation(
            x=math.log10(window), y=1, yref="paper", text=f" local window ({window})", showarrow=False, xanchor="left"
        )  # an annotation on a log axis takes log10 units, a shape data units
    fig.update_layout(
        title=title,
        xaxis_title="token position in the document (log scale)",
        yaxis_title="loss (nats a token)",
        legend_title="model",
    )
    fig.update_xaxes(type="log")
    return fig


def run_probe(model: MemoryModel, args: Namespace) -> pd.DataFrame:
    """`compare` over every checkpoint given, on the registered arguments (the command line's and the Probes
    page's run); the first model's local span kept in the table's `attrs["window"]` for its figure."""
    df = compare(
        args.models,
        corpus=None if args.corpus == "all" else args.corpus,
        split=args.split,
        documents=args.documents,
        max_tokens=args.max_tokens,
        progress=args.progress,
    )
    df.attrs["window"] = model.attention_span  # marked on the loss curve
    return df


def figure(df: pd.DataFrame):
    """The loss against position of `run_probe`'s table, its first model's local span marked."""
    return position_curve(by_position(df), window=df.attrs.get("window"))


def page_values(values: dict[str, Any]) -> dict[str, Any]:
    """The page's 0 tokens a document: whole documents."""
    return {**values, "max_tokens": values["max_tokens"] or None}


def page_check(values: Mapping[str, Any]) -> str | None:
    return "Tokens a document at most: 0 (whole documents) or 2 or more." if values["max_tokens"] == 1 else None


register_probe(
    Probe(
        name="lm",
        summary="bits per byte and loss against position on held-out text",
        run=run_probe,
        figure=figure,
        summary_table=summary,
        args=(
            Arg(
                "corpus",
                default="shakespeare",
                help=f"{', '.join(texts.CORPORA)}, 'all', or a UTF-8 file or folder of .txt files",
                widget=Widget("selectbox", "lm_corpus", "Corpus", options=(*texts.CORPORA, "all")),
            ),
            Arg("split", default="heldout", choices=texts.SPLITS),
            Arg("documents", nargs="+", help="only these documents of the split"),
            Arg(
                "max_tokens",
                int,
                help="cut each document to this many tokens",
                widget=Widget(
                    "number",
                    "lm_max",
                    "Tokens a document at most (0: whole)",
                    default=8192,
                    bounds=(0, MAX_TOKENS),
                    step=1024,
                ),
            ),
        ),
        unsampled=Unsampled(
            "reads every token of whole documents and draws nothing",
            "choose what it reads with --documents and --max-tokens",
        ),
        several=True,
        csv=lambda df: df.drop(columns="losses"),
        outputs={"lm_positions.csv": by_position},
        page=PageParts(
            label="language modelling",
            caption="Every token's loss over whole held-out documents (Hamlet and The Tempest, Botchan's last "
            "chapter), which no sample was trained on: bits per byte, and the loss against the token's position. "
            "Where a memory helps, its line falls below the control's past the local window.",
            run_key="run_lm",
            beside_key="lm_models",
            counts="documents",
            check=page_check,
            prepare=page_values,
            summary=True,
            download="lm_positions.csv",
        ),
        order=50,
    )
)
