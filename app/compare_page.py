"""Compare page: two checkpoints on the same input, timelines aligned."""

from __future__ import annotations

import streamlit as st

import memviz
from app.common import checkpoint_picker, control_samples, current_path, greedy_answer, load_model
from app.trace_page import cached_trace, duration, run_seconds
from memviz import viz
from memviz_probes import passkey

#: widget keys whose values outlive a visit to another page (app/streamlit_app.py keeps them)
KEPT_SETTINGS = ("cmp_left", "cmp_left_path", "cmp_right", "cmp_right_path", "cmp_length", "cmp_depth", "cmp_seed")


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
    try:
        models = [load_model(left), load_model(right)]
    except memviz.CheckpointError as exc:
        st.error(f"Cannot load this checkpoint: {exc}")
        return
    c1, c2, c3 = st.columns(3)
    length = c1.number_input("pass-key length (tokens)", 100, 200_000, 1024, step=256, key="cmp_length")
    depth = c2.slider("needle depth", 0.0, 1.0, 0.5, key="cmp_depth")
    seed = c3.number_input("seed", 0, 10_000, 0, key="cmp_seed")
    if length > 20_000:  # say what two long traces cost before they run
        took = duration(sum(run_seconds(path, length) for path in (left, right)))
        st.caption(f"Tracing both models over {length:,} tokens takes about {took} on this machine, once (cached).")
    traces = []
    for path, model in zip((left, right), models):
        try:
            sample = passkey.seeded_sample(model.tokenizer, int(length), float(depth), int(seed), 0)
            evidence = tuple((a, b) for a, b in sample.evidence)
            traces.append((sample, cached_trace(path, sample.prompt, evidence, sample.reply)))
        except ValueError as exc:
            st.error(f"{path}: {exc}")
            return
    n = min(len(tr) for _, tr in traces)  # tokenizers may differ: align on the shorter
    start, stop = st.slider("Positions", 0, n, (0, n), key="cmp_zoom")
    if stop <= start:
        st.warning("Choose a non-empty range of positions.")
        return
    for column, path, model, (sample, _) in zip(st.columns(2), (left, right), models, traces):
        with column:
            st.markdown(
                f"**{path}** ({model.family}): answer **{sample.answer}** · model says "
                f"**{greedy_answer(path, sample.prompt)!r}**"
            )
    same_text = traces[0][1].tokens[:n].tolist() == traces[1][1].tokens[:n].tolist()
    if same_text:
        labels = {f"left: {left}": traces[0][1], f"right: {right}": traces[1][1]}
        st.plotly_chart(viz.loss_comparison(labels, start=start, stop=stop), width="stretch", key="cmp-loss")
    else:
        st.caption(
            "The two tokenizers split the text differently, so positions do not line up token for token: "
            "no overlay or difference; each model's loss is beside its figures."
        )
    figures = [viz.family_figures(tr, start=start, stop=stop) for _, tr in traces]
    if same_text:
        for figs in figures:
            figs.pop("loss")
    shared = [t for t in figures[0] if t in figures[1]]
    rows = (
        [(t, t) for t in shared]
        + [(t, None) for t in figures[0] if t not in shared]
        + [(None, t) for t in figures[1] if t not in shared]
    )
    for pair in rows:  # one row per figure: the same view of both models side by side
        for column, figs, title, side in zip(st.columns(2), figures, pair, ("left", "right")):
            with column:
                if title is None:
                    st.caption("(no such view for this model)")
                    continue
                fig = figs[title]
                fig.update_layout(title_font_size=13)
                st.plotly_chart(fig, width="stretch", key=f"cmp-{side}-{title}")  # both sides may show one model
