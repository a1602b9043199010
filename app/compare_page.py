"""Compare page: two checkpoints on the same input (a pass-key sample, text or a file), timelines aligned."""

from __future__ import annotations

import streamlit as st

import memviz
from app.common import (
    bounded_number,
    checkpoint_picker,
    control_samples,
    current_path,
    greedy_answer,
    load_model,
    weights_stamp,
)
from app.trace_page import (
    InputError,
    cached_trace,
    choose_layer,
    duration,
    in_layer,
    run_seconds,
    token_count,
    uploaded_text,
)
from memviz import viz
from memviz.protocol import MemoryModel
from memviz_probes import passkey

#: widget keys whose values outlive a visit to another page (app/streamlit_app.py keeps them)
KEPT_SETTINGS = (
    "cmp_left",
    "cmp_left_path",
    "cmp_right",
    "cmp_right_path",
    "cmp_source",
    "cmp_length",
    "cmp_depth",
    "cmp_seed",
    "cmp_text",
)

#: an input both models read: per model (path, model) -> (text, evidence spans, answer or None, a caption)
Inputs = list[tuple[str, tuple[tuple[int, int], ...], str | None, str]]


def choose_inputs(paths: list[str], models: list[MemoryModel]) -> Inputs | None:
    """What each model reads: the same pass-key sample (made with each one's tokenizer), text or file; None while
    there is none. InputError or FieldError for one that cannot be read."""
    source = st.radio("Input", ["pass-key sample", "text", "file"], horizontal=True, key="cmp_source")
    if source in ("text", "file"):
        text = (
            st.text_area("Text", key="cmp_text", height=150)
            if source == "text"
            else uploaded_text(paths[0], "cmp_upload")
        )
        if not text or not text.strip():
            return None
        counts = [token_count(path, weights_stamp(path), text) for path in paths]
        say_cost(paths, counts)  # over the trace limit: refused here
        return [(text, (), None, "")] * 2
    c1, c2, c3 = st.columns(3)
    length = bounded_number("pass-key length (tokens)", 100, 200_000, 1024, "cmp_length", c1, step=256)
    depth = c2.slider("needle depth", 0.0, 1.0, 0.5, key="cmp_depth")
    seed = bounded_number("seed", 0, 10_000, 0, "cmp_seed", c3)
    say_cost(paths, [length, length])
    inputs: Inputs = []
    for path, model in zip(paths, models):
        try:
            sample = passkey.seeded_sample(model.tokenizer, length, float(depth), seed, 0)
        except ValueError as exc:
            raise InputError(f"{path}: {exc}") from exc
        said = f"answer **{sample.answer}** · model says **{greedy_answer(path, sample.prompt)!r}**"
        inputs.append((sample.prompt, tuple((a, b) for a, b in sample.evidence), sample.reply, said))
    return inputs


def say_cost(paths: list[str], n_tokens: list[int]) -> None:
    """Before two long traces run: about how long they take on this machine, at each model's measured speed."""
    if max(n_tokens) > 20_000:
        took = duration(sum(run_seconds(path, n) for path, n in zip(paths, n_tokens)))
        st.caption(
            f"Tracing both models over {max(n_tokens):,} tokens takes about {took} on this machine, once (cached)."
        )


def render() -> None:
    st.title("Compare")
    left_col, right_col = st.columns(2)
    with left_col:
        left = checkpoint_picker("Left checkpoint", "cmp_left", "cmp_left_path", current_path())
    with right_col:
        right = checkpoint_picker(
            "Right checkpoint", "cmp_right", "cmp_right_path", next(iter(control_samples()), None)
        )
    if not left or not right:
        st.info("Choose two checkpoints.")
        return
    paths = [left, right]
    try:
        models = [load_model(left), load_model(right)]
    except memviz.CheckpointError as exc:
        st.error(f"Cannot load this checkpoint: {exc}")
        return
    try:
        inputs = choose_inputs(paths, models)
    except (InputError, ValueError) as exc:  # FieldError, or a text over the trace limit
        st.error(str(exc))
        return
    if inputs is None:
        st.info("Give an input to compare the two models on.")
        return
    traces = []
    for path, (text, evidence, answer, _) in zip(paths, inputs):
        try:
            traces.append(cached_trace(path, weights_stamp(path), text, evidence, answer))
        except ValueError as exc:
            st.error(f"{path}: {exc}")
            return
    n = min(len(tr) for tr in traces)  # tokenizers may differ: align on the shorter
    start, stop = st.slider("Positions", 0, n, (0, n), key="cmp_zoom") if n > 1 else (0, n)
    if stop <= start:
        st.warning("Choose a non-empty range of positions.")
        return
    for column, path, model, tr, (_, _, _, said) in zip(st.columns(2), paths, models, traces, inputs):
        with column:
            st.markdown(f"**{path}** ({model.family}): {len(tr):,} tokens" + (f" · {said}" if said else ""))
            st.caption(f"Next-token loss, {viz.loss_note(tr)}.")
    same_text = traces[0].tokens[:n].tolist() == traces[1].tokens[:n].tolist()
    if same_text:
        labels = {f"left: {left}": traces[0], f"right: {right}": traces[1]}
        st.plotly_chart(viz.loss_comparison(labels, start=start, stop=stop), width="stretch", key="cmp-loss")
    else:
        st.caption(
            "The two tokenizers split the text differently, so positions do not line up token for token: "
            "no overlay or difference; each model's loss is beside its figures."
        )
    figures = [viz.family_figures(tr, start=start, stop=stop) for tr in traces]
    if same_text:
        for figs in figures:
            figs.pop("loss")
    layer = choose_layer([*figures[0], *figures[1]], "cmp")
    figures = [in_layer(figs, layer) for figs in figures]
    shared = [t for t in figures[0] if t in figures[1]]
    for title in shared:  # one row per view both models have: side by side
        for column, figs, side in zip(st.columns(2), figures, ("left", "right")):
            with column:
                show(figs[title], f"cmp-{side}-{title}")
    for index, (figs, other, path) in enumerate(zip(figures, reversed(figures), paths)):
        own = [t for t in figs if t not in other]
        if own:  # the views only one model has, under one line saying so
            st.markdown(f"**Only {path} ({models[index].family}) has these views**")
            for title in own:
                show(figs[title], f"cmp-{'left' if index == 0 else 'right'}-{title}")


def show(fig, key: str) -> None:
    fig.update_layout(title_font_size=13)
    st.plotly_chart(fig, width="stretch", key=key)  # both sides may show one model
