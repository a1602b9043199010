"""Trace page: stream an input through the model and show its memory at work."""

from __future__ import annotations

import time

import numpy as np
import streamlit as st

import memviz
from app.common import (
    FieldError,
    bounded_number,
    current_model,
    current_path,
    greedy_answer,
    last_run,
    load_model,
    weights_stamp,
)
from memviz import speed, viz
from memviz.protocol import MemoryModel, Readout
from memviz.read_lens import ReadLens, read_lens, read_lens_figures
from memviz.registry import get_family, holds_needle, reads_out, reads_through
from memviz.state_rank import state_ranks
from memviz_probes import babilong, facts, passkey
from memviz_probes.haystack import BACKGROUNDS

#: widget keys whose values outlive a visit to another page (app/streamlit_app.py keeps them)
KEPT_SETTINGS = (
    "source",
    "pk_length",
    "pk_depth",
    "pk_seed",
    "bl_task",
    "bl_length",
    "bl_seed",
    "bl_haystack",
    "text_input",
    "fq_person",
    "fq_attribute",
    "ro_position",
    "peak_quantity",
    "peak_lowest",
)

MAX_UPLOAD_BYTES = 20 * 1024 * 1024
MAX_TOKENS = 1_000_000


class InputError(ValueError):
    """An input the user gave that cannot be traced: said once, in place of the figures."""


@st.cache_data(show_spinner=False, max_entries=8)
def cached_trace(
    model_path: str, stamp: int, text: str, evidence: tuple[tuple[int, int], ...], answer: str | None = None
) -> memviz.Trace:
    """The trace of `text` with its `answer` (if any) appended, teacher-forced (`stamp`: the weights' mtime, so a
    checkpoint saved anew at the same path is traced anew)."""
    model = load_model(model_path)
    bar = st.progress(0.0, text="Streaming through the model…")

    def show(done: int, total: int) -> None:
        bar.progress(done / total, text=f"Streaming: {done:,} / {total:,} tokens")

    try:
        return memviz.trace(model, text, evidence=evidence, answer=answer, max_tokens=MAX_TOKENS, progress=show)
    finally:
        bar.empty()  # on an error too: no stale bar beside the message


@st.cache_data(show_spinner="Timing the model…", max_entries=16)
def tokens_per_second(model_path: str, stamp: int) -> float:
    """The model's trace speed on this machine (`memviz.speed`; `stamp`: the weights' mtime)."""
    return speed.trace_tokens_per_second(load_model(model_path))


#: how long a trace waits for the stopped run that still holds the session's model
BUSY_WAIT_S = 60.0


def trace_when_free(
    path: str, text: str, evidence: tuple[tuple[int, int], ...], answer: str | None, wait: float | None = None
) -> memviz.Trace:
    """`cached_trace`, once this session's previous run of the model has let go of it: an input changed mid-trace
    starts a new script run before the stopped one reaches its next progress update and ends."""
    deadline = time.monotonic() + (BUSY_WAIT_S if wait is None else wait)
    while True:
        try:
            return cached_trace(path, weights_stamp(path), text, evidence, answer)
        except memviz.ModelBusyError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


@st.cache_data(show_spinner="Timing the model's views…", max_entries=16)
def view_seconds(model_path: str, stamp: int) -> dict[str, float]:
    """Seconds a token that the views drawn after a trace take on this machine (`memviz.speed`)."""
    return speed.view_seconds_per_token(load_model(model_path))


@st.cache_data(show_spinner="Counting the input's tokens…", max_entries=8)
def token_count(model_path: str, stamp: int, text: str) -> int:
    """The input's tokens, exactly; ValueError (as the trace's) for one over the trace limit, counted only so far."""
    return len(load_model(model_path).tokenizer.encode_within(text, MAX_TOKENS, limit="trace limit"))


def run_seconds(model_path: str, n_tokens: float) -> float:
    """About how long a run over `n_tokens` takes this checkpoint on this machine (`tokens_per_second`)."""
    return n_tokens / tokens_per_second(model_path, weights_stamp(model_path))


def duration(seconds: float) -> str:
    return f"{seconds / 60:,.0f} min" if seconds >= 90 else f"{seconds:.0f} s"


@st.cache_data(show_spinner="Decomposing the memory's read…", max_entries=8)
def cached_readout(model_path: str, stamp: int, text: str, answer: str | None, position: int) -> Readout | None:
    model = load_model(model_path)
    reader = reads_out(model)
    return None if reader is None else reader.memory_readout(traced_ids(model, text, answer), position)


@st.cache_data(show_spinner="Pushing the read through the rest of the model…", max_entries=8)
def cached_read_lens(model_path: str, stamp: int, text: str, answer: str | None, position: int) -> ReadLens:
    model = load_model(model_path)
    return read_lens(model, traced_ids(model, text, answer), position)


@st.cache_data(show_spinner="Measuring how much of the evidence the memory holds…", max_entries=8)
def cached_needle_hold(
    model_path: str, stamp: int, text: str, answer: str | None, span: tuple[int, int]
) -> dict[str, np.ndarray] | None:
    model = load_model(model_path)
    holder = holds_needle(model)
    return None if holder is None else holder.needle_hold(traced_ids(model, text, answer), span)


def traced_ids(model: MemoryModel, text: str, answer: str | None) -> list[int]:
    """The token ids `cached_trace` traced: the text's, then the answer's."""
    return model.tokenizer.encode(text) + (model.tokenizer.encode(answer) if answer else [])


@st.cache_data(show_spinner=False, max_entries=16)
def bytes_per_token(model_path: str) -> float:
    """How many bytes of English text a token of the model's tokenizer holds (on the probes' filler)."""
    tokenizer = load_model(model_path).tokenizer
    text = " ".join(passkey.seeded_sample(tokenizer, 2048, 0.5, 0, 0).prompt.split())
    return len(text.encode()) / max(1, len(tokenizer.encode(text)))


def uploaded_text(model_path: str, key: str) -> str | None:
    """The text of a file the user uploads (None before one is), InputError naming it where it is too large, not
    UTF-8 or empty."""
    upload = st.file_uploader(
        f"A UTF-8 text file of at most {MAX_UPLOAD_BYTES // 2**20} MB and {MAX_TOKENS:,} tokens of this model's "
        f"tokenizer (about {MAX_TOKENS * bytes_per_token(model_path) / 2**20:.1f} MB of English text)",
        type=["txt", "md"],
        key=key,
    )
    if upload is None:
        return None
    data = upload.getvalue()
    if len(data) > MAX_UPLOAD_BYTES:
        raise InputError(f"{upload.name} is {len(data) / 2**20:.1f} MB; the limit is {MAX_UPLOAD_BYTES // 2**20} MB.")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise InputError(f"{upload.name} is not UTF-8 text ({exc.reason} at byte {exc.start}).") from exc
    if not text.strip():
        raise InputError(f"{upload.name} holds no text ({len(data):,} bytes of white space or none).")
    return text


def choose_input(model: MemoryModel, model_path: str) -> tuple[str, tuple[tuple[int, int], ...], str | None] | None:
    """The text to trace, its evidence spans and its answer (None for free text), from the
    source the user picks; None while there is none, InputError for one that cannot be traced."""
    sources = ["pass-key sample", "BABILong sample", "text", "file"]
    if model.facts is not None:  # a model trained on a knowledge base (Memory+): its own questions first
        sources.insert(0, "fact question")
    source = st.radio("Input", sources, horizontal=True, key="source")
    if source == "fact question":
        try:
            kb = facts.knowledge_base_of(model)
        except ValueError as exc:
            raise InputError(f"No fact questions: {exc}") from exc
        c1, c2 = st.columns(2)
        person = bounded_number(f"person (0-{kb.n_entities - 1})", 0, kb.n_entities - 1, 0, "fq_person", c1)
        attribute: str = c2.selectbox("attribute", facts.ATTRIBUTES, index=1, key="fq_attribute")  # type: ignore[assignment]  # streamlit's stub: typing.Never is missing at 3.10, so its no-options overload (-> None) matches
        sample = facts.make_sample(model.tokenizer, kb.entities[person], attribute)
        st.caption(
            f"answer **{sample.answer}** · model says **{greedy_answer(model_path, sample.prompt)!r}** "
            "(from the knowledge base the model was trained on; its memory layers hold the facts)"
        )
        return sample.prompt, (), sample.reply
    if source == "pass-key sample":
        c1, c2, c3 = st.columns(3)
        # the default is an example the default sample (infini_english_16k) answers right; Probes gives the rates
        length = bounded_number("length (tokens)", 100, 200_000, 2048, "pk_length", c1, step=256)
        depth = c2.slider("needle depth", 0.0, 1.0, 0.5, key="pk_depth")
        seed = bounded_number("seed", 0, 10_000, 1, "pk_seed", c3)
        try:
            sample = passkey.seeded_sample(model.tokenizer, length, float(depth), seed, 0)
        except ValueError as exc:  # a length shorter than the prompt itself: said, not a traceback
            raise InputError(str(exc)) from exc
    elif source == "BABILong sample":
        c1, c2, c3, c4 = st.columns(4)
        task: str = c1.selectbox("task", babilong.TASKS, key="bl_task")  # type: ignore[assignment]  # streamlit's stub: typing.Never is missing at 3.10, so its no-options overload (-> None) matches
        length = bounded_number("length (tokens)", 200, 200_000, 1000, "bl_length", c2, step=250)
        seed = bounded_number("seed", 0, 10_000, 0, "bl_seed", c3)
        background = c4.selectbox(
            "background",
            BACKGROUNDS,
            key="bl_haystack",
            help="the shipped qa1 samples were trained on the procedural one",
        )
        try:
            sample = babilong.seeded_sample(model.tokenizer, task, length, seed, 0, haystack=background)
        except ValueError as exc:
            raise InputError(str(exc)) from exc
    elif source == "text":
        text = st.text_area("Text", key="text_input", height=150)
        return (text, (), None) if text.strip() else None
    else:
        uploaded = uploaded_text(model_path, "upload")
        return None if uploaded is None else (uploaded, (), None)
    st.caption(
        f"{sample.n_tokens:,} tokens · answer **{sample.answer}** · model says "
        f"**{greedy_answer(model_path, sample.prompt)!r}**"
        if sample.n_tokens <= 20_000
        else f"{sample.n_tokens:,} tokens · answer **{sample.answer}**"
    )
    return sample.prompt, tuple((a, b) for a, b in sample.evidence), sample.reply


def render() -> None:
    st.title("Trace")
    model, path = current_model(), current_path()
    if model is None or path is None:  # current_model said why
        return
    try:
        chosen = choose_input(model, path)
    except (InputError, FieldError) as exc:
        st.error(str(exc))
        return
    if chosen is None:
        st.info("Give an input to trace.")
        return
    text, evidence, answer = chosen
    try:  # counted exactly, and refused here when over the trace limit, before any run
        n_tokens = token_count(path, weights_stamp(path), text) + (len(model.tokenizer.encode(answer)) if answer else 0)
    except ValueError as exc:
        st.error(str(exc))
        return
    try:
        if n_tokens > 20_000:  # say what a long input costs before it runs
            st.caption(time_line(path, n_tokens, bool(evidence)))
        st.caption(cost_line(model.cost(n_tokens), n_tokens))
    except memviz.ModelBusyError:  # its first call measures the model, which a stopped run may still hold
        pass
    try:
        tr = trace_when_free(path, text, evidence, answer)
    except memviz.ModelBusyError:
        st.error(f"The previous run on this model has not stopped within {BUSY_WAIT_S:.0f} s; try again when it has.")
        return
    except ValueError as exc:
        st.error(str(exc))
        return
    note = viz.non_finite_note(tr)
    if note:  # the figures' lines stop where the numbers do: say why
        st.warning(f"This trace stops being finite: {note}.")
    start, stop = st.slider("Positions", 0, len(tr), (0, len(tr)), key="zoom") if len(tr) > 1 else (0, len(tr))
    if stop - start < 1:
        st.warning("Choose a non-empty range of positions.")
        return
    said = viz.loss_note(tr)
    if (start, stop) != (0, len(tr)):
        said += f"; {viz.loss_note(tr, start, stop)}"
    st.markdown(f"**Next-token loss**, {said}.")
    with st.expander("Input text (evidence highlighted; hover a token for its position)", expanded=False):
        st.html(
            f'<div style="max-height:300px;overflow:auto;font-family:monospace;white-space:pre-wrap">'
            f"{viz.text_with_evidence(tr, start, stop)}</div>"
        )
    show_figures(viz.family_figures(tr, start=start, stop=stop), "fig")
    if evidence:
        hold = cached_needle_hold(path, weights_stamp(path), text, answer, evidence[0])
        if hold is not None:
            fig = viz.needle_hold_figure(tr, hold, start=start, stop=stop)
            st.plotly_chart(fig, width="stretch", key="fig-needle-hold")
            st.caption(
                "Where the evidence was written (outlined) and, at every later token, how much of it the "
                "memory's read still carries: where this falls to zero, the model can no longer answer from memory."
            )
    show_peaks(tr)
    show_read(model, path, text, answer, evidence, tr)
    show_state_rank(model, path, text, answer, len(tr))
    st.download_button(
        "Download trace (.npz, memviz.Trace.load)",
        tr.to_bytes(),
        file_name="trace.npz",
        key="dl-trace",
        on_click="ignore",
    )


EVERY_LAYER = "every layer"


def show_figures(figures: dict, key: str) -> None:
    """The views, each with its HTML download; where they show several layers one at a time, a layer chooser."""
    figures = in_layer(figures, choose_layer(figures, key))
    for title, fig in figures.items():
        st.plotly_chart(fig, width="stretch", key=f"{key}-{title}")
        st.download_button(
            f"Download {title} (HTML)",
            fig.to_html(include_plotlyjs=True),
            file_name=f"{title.replace(' ', '_')}.html",
            key=f"dl-{key}-{title}",
            on_click="ignore",  # no rerun: what the page shows stays
        )


def choose_layer(titles, key: str) -> str | None:
    """Where views of several layers are among `titles`, a chooser of one layer or every one: the layer chosen, or
    None for every layer (and where there is nothing to choose)."""
    layers = sorted({layer for t in titles if (layer := viz.figure_layer(t))}, key=lambda n: int(n.split(".")[1]))
    if len(layers) < 2:
        return None
    chosen = st.selectbox("Layer", [EVERY_LAYER, *layers], key=f"{key}-layer", help="the views of one layer")
    return None if chosen == EVERY_LAYER else chosen


def in_layer(figures: dict, layer: str | None) -> dict:
    """The views of `layer` and those of no one layer (all of them for None)."""
    return {t: fig for t, fig in figures.items() if layer is None or viz.figure_layer(t) in (None, layer)}


#: the most states the page measures the rank of over one input
MAX_RANK_STATES = 4096

#: tokens either side of a peak that choosing it zooms every view to
PEAK_ZOOM = 32


def peak_quantities(tr: memviz.Trace) -> list[str]:
    """What the peaks table ranks: the loss first, then every floating-point quantity the trace holds (`show_peaks`
    gives it the memory shares the figures derive too, `viz.with_memory_shares`)."""
    kept = [n for n in tr.names if n != "loss" and np.issubdtype(tr[n].dtype, np.floating)]
    return ["loss", *kept]


def show_peaks(tr: memviz.Trace) -> None:
    """The tokens where a chosen quantity peaks (`Trace.peaks`), with their words; choosing one zooms every view and
    the read below to it."""
    st.subheader("Where a quantity peaks, and the words there")
    tr = viz.with_memory_shares(tr)
    c1, c2, c3 = st.columns([3, 1, 1])
    quantities = peak_quantities(tr)
    if st.session_state.get("peak_quantity") not in quantities:
        st.session_state["peak_quantity"] = quantities[0]
    name: str = c1.selectbox("quantity (heads, slots and channels averaged)", quantities, key="peak_quantity")  # type: ignore[assignment]  # streamlit's stub: typing.Never is missing at 3.10, so its no-options overload (-> None) matches
    lowest = c2.toggle("lowest", key="peak_lowest", help="the dips: for a decay or gate whose events are lows")
    k = c3.slider("rows", 1, 50, 10, key="peak_k")
    table = tr.peaks(name, int(k), lowest=lowest, apart=PEAK_ZOOM // 2, context=8)
    if table.empty:
        st.info(f"{name} has no finite value in this trace.")
        return
    shown = table.assign(token=table["token"].map(repr))  # a newline or a space, visible
    st.dataframe(
        shown, hide_index=True, width="stretch", column_config={"value": st.column_config.NumberColumn(format="%.4g")}
    )
    labels = [f"#{r.rank}: token {r.position} {r.token!r}" for r in table.itertuples()]
    positions = dict(zip(labels, table["position"]))

    def zoom_to_peak() -> None:
        chosen = st.session_state.get("peak_zoom")
        if chosen in positions:
            at = int(positions[chosen])
            st.session_state["zoom"] = (max(0, at - PEAK_ZOOM), min(len(tr), at + PEAK_ZOOM + 1))
            st.session_state["ro_position"] = at
        st.session_state["peak_zoom"] = None  # chosen again after another zoom, a row zooms again

    st.selectbox(
        "zoom every view, and the read below, to a peak",
        labels,
        index=None,
        placeholder="choose a row",
        key="peak_zoom",
        on_change=zoom_to_peak,
    )


def time_line(path: str, n_tokens: int, evidence: bool) -> str:
    """What tracing `n_tokens` and drawing the views after it take on this machine at the model's measured speeds."""
    views = view_seconds(path, weights_stamp(path))
    drawn = [name for name in ("needle hold", "read-out") if name in views and (evidence or name != "needle hold")]
    after = (
        f", and its {' and '.join(drawn)} view{'s' if len(drawn) > 1 else ''} about "
        f"{duration(n_tokens * sum(views[name] for name in drawn))} more"
        if drawn
        else ""
    )
    return (
        f"{n_tokens:,} tokens: the trace takes about {duration(run_seconds(path, n_tokens))} on this machine at the "
        f"model's measured speed{after}; each is kept afterwards (the read-out for each token it is asked at)."
    )


def cost_line(cost: dict[str, int], n_tokens: int) -> str:
    """What a run over `n_tokens` holds beyond the weights, part by part (`model.cost`)."""
    parts = " · ".join(f"{name.replace('_', ' ')} {size / 2**20:,.1f} MiB" for name, size in cost.items())
    return f"{n_tokens:,} tokens hold about {sum(cost.values()) / 2**20:,.1f} MiB beyond the weights: {parts}."


def show_read(
    model: MemoryModel,
    path: str,
    text: str,
    answer: str | None,
    evidence: tuple[tuple[int, int], ...],
    tr: memviz.Trace,
) -> None:
    """The read at a chosen token: what the family's trace says the memory read there (`viz.read_figures`: LongMem's
    chunks, a memory layer's values) and, where the read decomposes exactly, each written token's part of it."""
    if reads_out(model) is None and get_family(model.family).read_at is None:
        return
    st.subheader("The read at one token: what the memory returned, and from where")
    traced = (path, hash(text), answer, len(tr))
    if st.session_state.get("ro_traced") != traced:  # a new input: back to its answer's position
        st.session_state["ro_traced"] = traced
        st.session_state["ro_position"] = tr.read_position
    default = "where the answer's first non-blank token is predicted" if answer else "the last token"
    try:
        position = bounded_number(
            f"read at token (default: {default})", 0, len(tr) - 1, tr.read_position, "ro_position"
        )
    except FieldError as exc:
        st.error(str(exc))
        return
    st.caption(f"Token {position}: {' '.join(repr(t) for t in tr.token_text(max(0, position - 6), position + 1))}")
    for title, fig in viz.read_figures(tr, position).items():
        st.plotly_chart(fig, width="stretch", key=f"read-{title}")
    if reads_out(model) is None:
        return
    readout = cached_readout(path, weights_stamp(path), text, answer, position)
    if readout is None:
        st.info(
            "This model's memory is not linear in its writes (Titans' MLP memory, LM2's per-token update), "
            "so its read has no exact decomposition over the tokens that wrote it."
        )
        return
    figures = viz.readout_figures(readout, evidence)
    if not figures:
        st.info(
            f"At token {position} no earlier token has reached the memory yet (a segment's writes arrive when "
            "it completes), so there is nothing to decompose: pick a later token."
        )
        return
    st.caption(
        f"The read is {readout.what}. Each written token's part of it, projected on the read: a head's row sums "
        "to 1 (less the share of the memory's initial state, named in the title where it has one); red carries "
        "the read, blue pushes against it. It spans every token written before the read, whatever the Positions "
        "range above."
    )
    for title, fig in figures.items():
        st.plotly_chart(fig, width="stretch", key=f"fig-{title}")
    if reads_through(model) is not None:
        show_read_lens(path, text, answer, position)


def show_read_lens(path: str, text: str, answer: str | None, position: int) -> None:
    """The logit lens on the read at `position`: the tokens it promotes through the rest of the model, and the
    writers that push them (`memviz.read_lens`)."""
    st.markdown(f"**What the read at token {position} says**: its logits through the rest of the model")
    try:
        lens = cached_read_lens(path, weights_stamp(path), text, answer, position)
    except ValueError as exc:
        st.error(str(exc))
        return
    st.caption(
        "Each layer's read alone, through the layer's own norm and gates, its output projection, the final norm "
        "(each scale frozen at this token) and the unembedding: the direct path, before the later layers act on it. "
        "Logits are centred over the vocabulary. The rows split the read's logit over the tokens that wrote it: "
        "they sum to the top row."
    )
    figures = read_lens_figures(lens)
    layer = choose_layer(figures, "lens")
    for title, fig in in_layer(figures, layer).items():
        st.plotly_chart(fig, width="stretch", key=f"lens-{title}")
        layer_lens = lens.layers[title.removesuffix(" read lens")]
        left, right = st.columns(2)
        left.dataframe(layer_lens.promoted, hide_index=True, key=f"lens-promoted-{title}")
        right.dataframe(layer_lens.writers, hide_index=True, key=f"lens-writers-{title}")


@st.cache_data(show_spinner=False, max_entries=8)
def cached_state_ranks(model_path: str, stamp: int, text: str, answer: str | None, every: int):
    """`memviz.state_rank.state_ranks` over the traced tokens, once per (checkpoint and its weights' `stamp`, input,
    spacing)."""
    model = load_model(model_path)
    bar = st.progress(0.0, text="Measuring the state's rank…")

    def show(done: int, total: int) -> None:
        bar.progress(done / total, text=f"State rank: {done:,} / {total:,} tokens")

    try:
        return state_ranks(model, traced_ids(model, text, answer), every=every, progress=show)
    finally:
        bar.empty()


def show_state_rank(model: MemoryModel, path: str, text: str, answer: str | None, n_tokens: int) -> None:
    """For a family with a matrix memory: each head's effective and stable rank over the text, on request (a second
    pass over the input)."""
    if not get_family(model.family).matrix_state:
        return
    st.subheader("State rank: how many directions each head's memory uses")
    fewest = -(-n_tokens // MAX_RANK_STATES)  # at most MAX_RANK_STATES states
    default = max(fewest, min(64, n_tokens))
    traced = (path, hash(text), answer, n_tokens)
    if st.session_state.get("rank_traced") != traced:  # a new input: its own default spacing
        st.session_state["rank_traced"] = traced
        st.session_state["rank_every"] = default
    try:
        every = bounded_number("a state every (tokens)", fewest, max(1, n_tokens), default, "rank_every")
    except FieldError as exc:
        st.error(str(exc))
        return
    took = f", about {duration(run_seconds(path, n_tokens))} on this machine" if n_tokens > 20_000 else ""
    st.caption(
        f"{-(-n_tokens // every):,} states: the effective rank exp(H(sigma / sum sigma)) and the stable rank "
        "||S||_F^2 / ||S||_2^2 of each head's state, after every chosen number of tokens (memviz.state_rank); "
        f"a second pass over the input{took}."
    )
    clicked = st.button("Measure the state's rank", key="rank_run")
    ranks = last_run(
        "state_rank",
        (path, weights_stamp(path), hash(text), answer, every),
        lambda: cached_state_ranks(path, weights_stamp(path), text, answer, every),
        clicked,
        show_stale=False,
    )
    if ranks is None:
        return
    figures = viz.state_rank_figures(ranks)
    for title, fig in in_layer(figures, choose_layer(figures, "rank")).items():
        st.plotly_chart(fig, width="stretch", key=f"rank-{title}")
