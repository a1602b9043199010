"""Intervene page: ablate or replace the memory at a segment and watch the answer change."""

from __future__ import annotations

import time

import streamlit as st

from app.common import FieldError, bounded_number, current_model, current_path, last_run, load_model, weights_stamp
from app.trace_page import duration, run_seconds
from memviz import interventions, viz
from memviz.protocol import MemoryModel
from memviz.registry import Intervention, get_family
from memviz_probes import facts, passkey

#: widget keys whose values outlive a visit to another page (app/streamlit_app.py keeps them)
KEPT_SETTINGS = ("iv_length", "iv_depth", "iv_seed", "iv_mode", "iv_attribute")

SWEEP_POINTS = 32  # boundaries a sweep ablates at most: its time stays linear in the prompt's length


def hook_point(model: MemoryModel) -> Intervention | None:
    """The family's first intervention made through hooks (Memory+'s silenced read), if it has one."""
    return next((p for p in get_family(model.family).interventions.values() if p.through_hooks), None)


def answer_run(path: str, prompt: str, answer: str, edit: tuple = (), layer: int | None = None) -> dict:
    """`cached_answer` for the checkpoint at `path` (the one chosen on the Model page)."""
    return cached_answer(path, weights_stamp(path), prompt, answer, edit, layer)


@st.cache_data(show_spinner="Running the prompt…", max_entries=64)
def cached_answer(
    model_path: str, stamp: int, prompt: str, answer: str, edit: tuple = (), layer: int | None = None
) -> dict:
    """`interventions.answer_logprob` once per (checkpoint, prompt, edit), not on every rerun: over a long prompt a
    run takes minutes. `edit` is () for the clean run, ("ablate", segment) or ("replace", segment, donor prompt);
    `layer` turns the family's hook intervention on there."""
    model = load_model(model_path)
    edits = []
    if edit:
        kind, segment, *donor = edit
        at = (
            interventions.ablate_at(model, segment)
            if kind == "ablate"
            else interventions.replace_at(model, segment, *donor)
        )
        edits.append(at)
    point = hook_point(model)
    hooks = point.hooks(model, layer) if layer is not None and point is not None and point.hooks else []
    return interventions.answer_logprob(model, prompt, answer, edits, fwd_hooks=hooks)


def render() -> None:
    st.title("Intervene")
    model, path = current_model(), current_path()
    if model is None or path is None:  # current_model said why
        return
    point = hook_point(model)
    if point is not None and model.facts is not None:
        render_fact_question(model, path, point)
        return
    c1, c2, c3 = st.columns(3)
    try:
        length = bounded_number("pass-key length (tokens)", 100, 20_000, 512, "iv_length", c1, step=128)
        depth = c2.slider("needle depth", 0.0, 1.0, 0.2, key="iv_depth")
        seed = bounded_number("seed", 0, 10_000, 0, "iv_seed", c3)
        sample = passkey.seeded_sample(model.tokenizer, length, float(depth), seed, 0)
    except ValueError as exc:  # FieldError too: the field named
        st.error(str(exc))
        return
    answer = sample.reply
    if sample.n_tokens > 4096:  # say what a long prompt costs before it runs
        st.caption(
            f"Each run over the {sample.n_tokens:,} tokens takes about "
            f"{duration(run_seconds(path, sample.n_tokens))} on this machine at the model's measured speed "
            "(the clean one and each edit, each once: they are cached)."
        )
    clean = answer_run(path, sample.prompt, answer)
    st.write(
        f"Answer **{sample.answer}** · clean run: greedy **{clean['greedy'].strip()!r}**, "
        f"log p(answer) = **{clean['logprob']:.2f}**"
    )
    if point is not None:
        intervene_through_hooks(model, path, point, sample.prompt, answer, clean)
        return
    try:
        seg = interventions.segment_length(model)
    except ValueError as exc:
        st.info(str(exc))
        return
    n_segments = max(1, -(-sample.n_tokens // seg))
    if n_segments < 2:
        st.info(f"The prompt fits in one segment of {seg} tokens: no segment boundary lies inside it to edit at.")
        return
    needle = ", ".join(
        f"tokens {a}-{b - 1} (segment {a // seg}{'' if (b - 1) // seg == a // seg else f'-{(b - 1) // seg}'})"
        for a, b in sample.evidence
    )
    st.caption(
        f"The needle is at {needle}, segments of {seg} tokens counted from 0: a reset at the start of a segment "
        "after it should cost the answer, one before it nothing."
    )
    mode = st.radio("Edit", ["ablate", "replace with another sample's memory"], horizontal=True, key="iv_mode")
    segment = (  # segments 1 .. n-1 start inside the prompt; with two, only segment 1 does
        st.slider("at the start of segment", 1, n_segments - 1, n_segments // 2, key="iv_segment")
        if n_segments > 2
        else 1
    )
    if mode == "ablate":
        edit: tuple = ("ablate", segment)
    else:
        donor = passkey.seeded_sample(model.tokenizer, int(length), float(depth), int(seed) + 1, 0)
        edit = ("replace", segment, donor.prompt)
        st.caption(f"donor sample's key: {donor.answer}")
    try:
        result = answer_run(path, sample.prompt, answer, edit)
    except ValueError as exc:  # a donor too short for the segment
        st.error(str(exc))
        return
    st.metric(
        f"log p(answer) after the edit at token {segment * seg}",
        f"{result['logprob']:.2f}",
        delta=f"{result['logprob'] - clean['logprob']:.2f}",
    )
    st.write(f"greedy answer after the edit: **{result['greedy'].strip()!r}**")
    points = min(SWEEP_POINTS, n_segments - 1)
    if points == 1:
        where = "the one segment boundary"
    elif points == n_segments - 1:
        where = f"each of the {points} segment boundaries"
    else:
        where = f"{points} evenly spaced of the {n_segments - 1} segment boundaries"
    clicked = st.button(f"Sweep: ablate at {where}", key="iv_sweep")

    def sweep() -> list:
        bar, began = st.progress(0.0, text="Sweeping…"), time.perf_counter()

        def show(done: int, total: int) -> None:
            left = (time.perf_counter() - began) / done * (total - done)
            bar.progress(done / total, text=f"Sweeping: {done:,} / {total:,} tokens run · about {left:.0f} s left")

        try:
            return interventions.ablation_sweep(model, sample.prompt, answer, points=SWEEP_POINTS, progress=show)
        finally:
            bar.empty()

    # a sweep of another prompt says nothing about this one: not shown
    rows = last_run("iv_sweep", (path, weights_stamp(path), sample.prompt, answer), sweep, clicked, show_stale=False)
    if rows is not None:
        st.plotly_chart(viz.ablation_sweep_figure(rows, sample.evidence), width="stretch", key="iv_sweep_fig")


def render_fact_question(model: MemoryModel, path: str, point: Intervention) -> None:
    """A memory layer is parametric: ask a fact of the knowledge base the model was trained on
    (its card's `facts`) and apply the family's hook intervention (silence a layer's top-k read)."""
    try:
        kb = facts.knowledge_base_of(model)
    except ValueError as exc:
        st.error(f"No fact questions: {exc}")
        return
    c1, c2 = st.columns(2)
    try:
        person = bounded_number(f"person (0-{kb.n_entities - 1})", 0, kb.n_entities - 1, 0, "iv_person", c1)
    except FieldError as exc:
        st.error(str(exc))
        return
    attribute: str = c2.selectbox("attribute", facts.ATTRIBUTES, index=1, key="iv_attribute")  # type: ignore[assignment]  # streamlit's stub: typing.Never is missing at 3.10, so its no-options overload (-> None) matches
    sample = facts.make_sample(model.tokenizer, kb.entities[person], attribute)
    st.code(sample.prompt, language=None)
    answer = sample.reply
    clean = answer_run(path, sample.prompt, answer)
    st.write(
        f"Answer **{sample.answer}** · clean run: greedy **{clean['greedy'].strip()!r}**, "
        f"log p(answer) = **{clean['logprob']:.2f}**"
    )
    intervene_through_hooks(model, path, point, sample.prompt, answer, clean)


def intervene_through_hooks(
    model: MemoryModel, path: str, point: Intervention, prompt: str, answer: str, clean: dict
) -> None:
    """The answer with a hook intervention (the registry's `point`) on at a chosen memory layer."""
    st.caption(point.summary)
    assert point.sites is not None  # a point acting through hooks says where (Intervention.__post_init__)
    layer = st.selectbox("memory layer to act on", point.sites(model), key="iv_layer")
    result = answer_run(path, prompt, answer, layer=layer)
    st.metric(
        f"log p(answer) with layer {layer}'s intervention on",
        f"{result['logprob']:.2f}",
        delta=f"{result['logprob'] - clean['logprob']:.2f}",
    )
    st.write(f"greedy answer with the intervention: **{result['greedy'].strip()!r}**")
