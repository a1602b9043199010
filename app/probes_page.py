"""Probes page: the pass-key, BABILong and RULER grids for the loaded model; retention over distance and
language modelling on held-out text beside other checkpoints (the control among them); CSV download."""

from __future__ import annotations

import pandas as pd
import streamlit as st

import memviz
from app.common import control_samples, current_model, current_path, last_run, load_model, weights_stamp
from app.trace_page import duration, run_seconds
from memviz_probes import babilong, lm, passkey, retention, ruler, texts
from memviz_probes.haystack import BACKGROUNDS


@st.cache_data(show_spinner=False, max_entries=16)
def run_grid(
    model_path: str,
    stamp: int,
    probe: str,
    lengths: tuple[int, ...],
    depths_or_tasks: tuple,
    n: int,
    seed: int,
    depths: tuple[float, ...] | None = None,
    haystack: str | None = None,
):
    """The probe's table (`stamp`: the weights' mtime, so a checkpoint saved anew is run anew)."""
    model = load_model(model_path)
    bar = st.progress(0.0, text="Running the probe…")
    progress = lambda done, total: bar.progress(done / total, text=f"{int(done)} / {total} samples")  # noqa: E731
    if probe == "passkey":
        df = passkey.run(model, lengths, depths_or_tasks, n=n, seed=seed, haystack=haystack, progress=progress)
    elif probe == "ruler":
        background = haystack if ruler.reads_essay(depths_or_tasks) else None  # the other tasks bring their own
        df = ruler.run(model, depths_or_tasks, lengths, depths, n=n, seed=seed, haystack=background, progress=progress)
    else:
        df = babilong.run(model, depths_or_tasks, lengths, n=n, seed=seed, haystack=haystack, progress=progress)
    bar.empty()
    return df


@st.cache_data(show_spinner=False, max_entries=16)
def run_retention(model_paths: tuple[str, ...], stamps: tuple[int, ...], distances: tuple[int, ...], n: int, seed: int):
    bar = st.progress(0.0, text="Running the probe…")
    frames = []
    for k, path in enumerate(model_paths):

        def progress(done, total, k=k):
            bar.progress((k + done / total) / len(model_paths), text=f"{path}: {int(done)} / {total} samples")

        frames.append(retention.run(load_model(path), distances, n=n, seed=seed, progress=progress).assign(model=path))
    bar.empty()
    return pd.concat(frames, ignore_index=True)


def render_retention() -> None:
    st.caption(
        "A pass key written once, then `distance` tokens of filler, then the question: how far back "
        "each memory still finds it. A model without memory falls to chance past its attention window."
    )
    others = [s for s in memviz.list_samples() if s != current_path()]
    control = [s for s in control_samples() if s in others]
    compare = st.multiselect("Beside", others, default=control, key="rt_models")
    distances = st.multiselect(
        "Distances (tokens)", list(retention.DISTANCES), default=[64, 256, 1024, 4096], key="rt_distances"
    )
    c1, c2 = st.columns(2)
    n = c1.number_input("Samples per distance", 1, 200, 5, key="rt_n")
    seed = c2.number_input("Seed", 0, 10_000, 0, key="rt_seed")
    paths = (current_path(), *compare)
    if distances and max(distances) > 20_000:  # say what long distances cost before they run
        seconds = sum(run_seconds(p, int(n) * sum(distances)) for p in paths)
        st.caption(
            f"About {duration(seconds)} on this machine at the models' measured speeds (one sample at "
            f"{max(distances):,} tokens takes about {duration(run_seconds(paths[0], max(distances)))} for this model)."
        )
    clicked = st.button("Run", key="run_retention")
    if clicked and not distances:
        st.error("Choose at least one distance.")
        return
    inputs = (paths, tuple(map(weights_stamp, paths)), tuple(sorted(distances)), int(n), int(seed))
    try:
        df = last_run("run_retention", inputs, lambda: run_retention(*inputs), clicked)
    except (ValueError, memviz.CheckpointError) as exc:
        st.error(str(exc))
        return
    if df is None:
        return
    st.plotly_chart(retention.curve(df), width="stretch", key="retention_curve")
    st.download_button(
        "Download CSV",
        df.drop(columns=["evidence"]).to_csv(index=False),
        file_name="retention.csv",
        key="rt_csv",
        on_click="ignore",  # a rerun would lose the results shown under the Run button
    )
    st.dataframe(df.pivot_table(index="model", columns="distance", values="correct", sort=False), width="stretch")


@st.cache_data(show_spinner=False, max_entries=8)
def run_lm(model_paths: tuple[str, ...], stamps: tuple[int, ...], corpus: str | None, max_tokens: int | None):
    bar = st.progress(0.0, text="Reading the held-out documents…")
    frames = []
    for k, path in enumerate(model_paths):

        def progress(done, total, k=k):
            bar.progress((k + done / total) / len(model_paths), text=f"{path}: {done} / {total} documents")

        frames.append(
            lm.run(load_model(path), corpus=corpus, max_tokens=max_tokens, progress=progress).assign(model=path)
        )
    bar.empty()
    return pd.concat(frames, ignore_index=True), lm.local_span(load_model(model_paths[0]))


def render_lm() -> None:
    st.caption(
        "Every token's loss over whole held-out documents (Hamlet and The Tempest, Botchan's last chapter), "
        "which no sample was trained on: bits per byte, and the loss against the token's position. Where a "
        "memory helps, its line falls below the control's past the local window."
    )
    others = [s for s in memviz.list_samples() if s != current_path()]
    compare = st.multiselect("Beside", others, default=[s for s in control_samples() if s in others], key="lm_models")
    c1, c2 = st.columns(2)
    corpus = c1.selectbox("Corpus", [*texts.CORPORA, "all"], key="lm_corpus")
    max_tokens = c2.number_input(
        "Tokens a document at most (0: whole)", 0, lm.MAX_TOKENS, 8192, step=1024, key="lm_max"
    )
    clicked = st.button("Run", key="run_lm")
    if clicked and max_tokens == 1:  # the loss needs a token to predict from
        st.error("Tokens a document at most: 0 (whole documents) or 2 or more.")
        return
    paths = (current_path(), *compare)
    inputs = (paths, tuple(map(weights_stamp, paths)), None if corpus == "all" else corpus, int(max_tokens) or None)
    try:
        kept = last_run("run_lm", inputs, lambda: run_lm(*inputs), clicked)
    except (ValueError, memviz.CheckpointError) as exc:
        st.error(str(exc))
        return
    if kept is None:
        return
    df, window = kept  # the window of the model the Run read, which another may have replaced
    positions = lm.by_position(df)
    st.plotly_chart(lm.position_curve(positions, window=window), width="stretch", key="lm_curve")
    st.dataframe(lm.summary(df), width="stretch")
    st.download_button(
        "Download CSV", positions.to_csv(index=False), file_name="lm_positions.csv", key="lm_csv", on_click="ignore"
    )


def render() -> None:
    st.title("Probes")
    model = current_model()
    if model is None:
        return
    probe = st.radio(
        "Probe", ["passkey", "babilong", "ruler", "retention", "language modelling"], horizontal=True, key="probe"
    )
    if probe == "retention":
        render_retention()
        return
    if probe == "language modelling":
        render_lm()
        return
    lengths = st.multiselect("Lengths (tokens)", [256, 512, 1024, 2048, 4096, 8192], default=[256, 512], key="lengths")
    if probe == "passkey":
        axis = st.multiselect(
            "Needle depths", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0], default=[0.1, 0.5, 0.9], key="depths"
        )
    elif probe == "ruler":
        axis = st.multiselect(
            "RULER tasks (scored as RULER does: the share of the answers found)",
            list(ruler.TASKS),
            default=["niah_single_1"],
            key="ruler_tasks",
        )
        fixed = st.multiselect(
            "Needle depths (empty: RULER's random depths; with one task, the depth x length grid)",
            [0.0, 0.25, 0.5, 0.75, 1.0],
            default=[],
            key="ruler_depths",
        )
    else:
        axis = st.multiselect("Tasks", list(babilong.TASKS), default=["qa1"], key="tasks")
    if probe == "passkey":
        haystack = st.selectbox(
            "Filler",
            ["procedural", "grass", "shakespeare"],
            key="pk_haystack",
            help="the generated sentences, the papers' repeated 'The grass is green. ...', or the plays",
        )
    else:
        haystack = st.selectbox(
            "Background",
            BACKGROUNDS,
            key="haystack",
            help="Shakespeare's plays (real English, as PG19 and essays are in the papers) or the "
            "procedural sentences the shipped qa1 samples were trained on",
        )
    c1, c2 = st.columns(2)
    n = c1.number_input("Samples per cell", 1, 200, 5, key="n")
    seed = c2.number_input("Seed", 0, 10_000, 0, key="probe_seed")
    path = current_path()
    depths = tuple(sorted(fixed)) or None if probe == "ruler" else None
    prompts = int(n) * len(axis) * len(depths or (None,))  # a grid's prompts at each length
    if prompts * sum(lengths) > 100_000:  # say what a large grid costs before it runs
        took = duration(run_seconds(path, prompts * sum(lengths)))
        st.caption(
            f"{prompts * len(lengths):,} prompts, {prompts * sum(lengths):,} tokens: about {took} on this machine at "
            "the model's measured speed."
        )
    clicked = st.button("Run", key="run_probe")
    if clicked and (not lengths or not axis):
        st.error("Choose at least one length and one " + ("depth." if probe == "passkey" else "task."))
        return
    grid = (tuple(sorted(lengths)), tuple(sorted(axis)), int(n), int(seed), depths, haystack)
    inputs = (path, weights_stamp(path), probe, *grid)
    try:
        df = last_run(f"run_{probe}", inputs, lambda: run_grid(*inputs), clicked)
    except ValueError as exc:
        st.error(str(exc))
        return
    if df is None:
        return
    fig = {"passkey": passkey.heatmap, "ruler": ruler.heatmap}.get(probe, babilong.heatmap)(df)
    st.plotly_chart(fig, width="stretch", key="probe_heatmap")
    st.metric("accuracy", f"{df['correct'].mean():.0%}", help=f"{len(df)} samples")
    st.download_button(
        "Download CSV",
        df.drop(columns=["evidence"]).to_csv(index=False),
        file_name=f"{probe}.csv",
        key="dl_csv",
        on_click="ignore",
    )
    st.dataframe(df.drop(columns=["evidence"]), hide_index=True, width="stretch")
