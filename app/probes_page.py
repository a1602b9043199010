"""Probes page: every registered probe (`memviz_probes.registry`, the table the command line reads too), with
widgets made from the arguments it declares and laid out by its page parts: the grids for the loaded model,
retention over distance and language modelling beside other checkpoints (the control among them); its figure and
the CSV to download."""

from __future__ import annotations

import math
from typing import Any

import pandas as pd
import streamlit as st
from streamlit.delta_generator import DeltaGenerator

import memviz
from app.common import (
    FieldError,
    bounded_number,
    control_samples,
    current_model,
    current_path,
    last_run,
    load_model,
    weights_stamp,
)
from app.trace_page import duration, run_seconds
from memviz.protocol import MemoryModel
from memviz_probes.registry import Arg, Probe, Widget, get_probe, registered_probes

#: a run's cost is said before it runs past this many tokens for one model, or prompts of this many tokens
SAY_COST_TOKENS, SAY_COST_LENGTH = 100_000, 10_000

#: the page's values of a probe's arguments, by name, as the runner takes them (hashable: a cache key)
Values = tuple[tuple[str, Any], ...]


def kept_settings() -> tuple[str, ...]:
    """The keys of the page's widgets kept across pages (app/streamlit_app.py): the picker, and each probe's
    declared widgets (its arguments', its `n` and seed, the checkpoints beside it)."""
    keys = ["probe"]
    for probe in registered_probes():
        widgets = [arg.widget for arg in probe.args if arg.widget is not None]
        if probe.sampled:
            widgets += [probe.page.n, probe.page.seed]
        keys += [widget.key for widget in widgets] + ([probe.page.beside_key] if probe.page.beside_key else [])
    return tuple(dict.fromkeys(keys))


def page_probes() -> dict[str, Probe]:
    """The probes the page offers, by their label in its picker: every registered one, in the registry's order."""
    return {probe.page.label or probe.name: probe for probe in registered_probes()}


@st.cache_data(show_spinner=False, max_entries=16)
def run_probe(name: str, path: str, stamp: int, values: Values) -> pd.DataFrame:
    """Probe `name`'s table for the checkpoint at `path` (`stamp`: the weights' mtime, so a checkpoint saved anew
    is run anew)."""
    probe = get_probe(name)
    model = load_model(path)
    bar = st.progress(0.0, text="Running the probe…")

    def progress(done: float, total: int) -> None:
        bar.progress(done / total, text=f"{path}: {int(done)} / {total} {probe.page.counts}")

    df = probe.run(model, probe.arguments(model, models={path: model}, progress=progress, **dict(values)))
    bar.empty()
    return df


def run_all(name: str, paths: tuple[str, ...], stamps: tuple[int, ...], values: Values) -> pd.DataFrame:
    """The probe's table for each checkpoint (each run cached on its own), one after the other."""
    frames = [run_probe(name, path, stamp, values) for path, stamp in zip(paths, stamps)]
    if len(frames) == 1:
        return frames[0]
    df = pd.concat(frames, ignore_index=True)
    df.attrs = dict(frames[0].attrs)  # what the figure reads of the first model (lm: its local window)
    return df


def ask(widget: Widget, place: DeltaGenerator | None = None) -> Any:
    """The widget's value: a multiselect's choices sorted, as a tuple; a number as an int."""
    where: Any = st if place is None else place
    if widget.kind == "multiselect":
        chosen = where.multiselect(
            widget.label, list(widget.options), default=list(widget.default or ()), key=widget.key, help=widget.help
        )
        return tuple(sorted(chosen))
    if widget.kind == "selectbox":
        options = list(widget.options)
        index = options.index(widget.default) if widget.default in options else 0
        return where.selectbox(widget.label, options, index=index, key=widget.key, help=widget.help)
    low, high = widget.bounds
    return bounded_number(
        widget.label, low, high, widget.default, widget.key, where, step=widget.step, help=widget.help
    )


def value_of(arg: Arg) -> Any:
    """The page's value of an argument: its widget's (an empty multiselect is None where the argument's default
    is), or its default where it has no widget."""
    if arg.widget is None:
        return arg.default
    value = ask(arg.widget)
    return None if value == () and arg.default is None and not arg.widget.noun else value


def refusal(probe: Probe, values: dict[str, Any]) -> str | None:
    """Why a Run on these values is refused: a multiselect that must not be empty is, or the probe's own check."""
    needed = [arg for arg in probe.args if arg.widget is not None and arg.widget.noun]
    if any(not values[arg.name] for arg in needed):
        return "Choose at least one " + " and one ".join(arg.widget.noun for arg in needed if arg.widget) + "."
    return probe.page.check(values)


def say_cost(probe: Probe, values: dict[str, Any], paths: tuple[str, ...]) -> None:
    """Before a large run: about how long it takes on this machine, at the models' measured speeds."""
    widgets = [(arg.widget, values[arg.name]) for arg in probe.args if arg.widget is not None]
    lengths = [length for widget, value in widgets if widget.tokens for length in value or ()]
    if not lengths or not probe.sampled:
        return
    cells = math.prod(
        1 if value is None else len(value)
        for widget, value in widgets
        if widget.kind == "multiselect" and not widget.tokens
    )
    prompts, tokens, longest = values["n"] * cells * len(lengths), values["n"] * cells * sum(lengths), max(lengths)
    if tokens <= SAY_COST_TOKENS and longest <= SAY_COST_LENGTH:
        return
    if probe.several:
        st.caption(
            f"About {duration(sum(run_seconds(p, tokens) for p in paths))} on this machine at the models' measured "
            f"speeds (one sample at {longest:,} tokens takes about {duration(run_seconds(paths[0], longest))} for "
            "this model)."
        )
    else:
        st.caption(
            f"{prompts:,} prompts, {tokens:,} tokens: about {duration(run_seconds(paths[0], tokens))} on this machine "
            "at the model's measured speed."
        )


def show(probe: Probe, df: pd.DataFrame) -> None:
    """The probe's figure, its accuracy (one model's), the CSV to download and its table."""
    st.plotly_chart(probe.figure(df), width="stretch", key=f"{probe.name}_figure")
    if "correct" in df and not probe.several:
        st.metric("accuracy", f"{df['correct'].mean():.0%}", help=f"{len(df)} samples")
    rows = df.drop(columns=["evidence"], errors="ignore")
    name = probe.page.download or f"{probe.name}.csv"
    offered = probe.outputs[name](df) if probe.page.download else rows
    st.download_button(
        "Download CSV",
        offered.to_csv(index=False),
        file_name=name,
        key=f"{probe.name}_csv",
        on_click="ignore",  # a rerun would lose the results shown under the Run button
    )
    if probe.page.summary:
        st.dataframe(probe.summary_table(df), width="stretch")
    else:
        st.dataframe(rows, hide_index=True, width="stretch")


def render_probe(probe: Probe, model: MemoryModel, path: str) -> None:
    """One probe's widgets, its Run and the last Run's results."""
    parts = probe.page
    if parts.caption:
        st.caption(parts.caption)
    try:
        warning = probe.requires(model)
    except ValueError as exc:
        st.error(str(exc))
        return
    if warning:
        st.warning(f"{path}: {warning}")
    paths: tuple[str, ...] = (path,)
    if probe.several:
        others = [s for s in memviz.list_samples() if s != path]
        control = [s for s in control_samples() if s in others]
        paths = (path, *st.multiselect("Beside", others, default=control, key=parts.beside_key))
    try:
        values = {arg.name: value_of(arg) for arg in probe.args}
        if probe.sampled:
            c1, c2 = st.columns(2)
            values["n"], values["seed"] = ask(parts.n, c1), ask(parts.seed, c2)
    except FieldError as exc:
        st.error(str(exc))
        return
    say_cost(probe, values, paths)
    clicked = st.button("Run", key=parts.run_key)
    refused = refusal(probe, values) if clicked else None
    if refused:
        st.error(refused)
        return
    inputs = (paths, tuple(map(weights_stamp, paths)), tuple(parts.prepare(values).items()))
    try:
        df = last_run(f"run_{probe.name}", inputs, lambda: run_all(probe.name, *inputs), clicked)
    except (ValueError, memviz.CheckpointError) as exc:
        st.error(str(exc))
        return
    if df is not None:
        show(probe, df)


def render() -> None:
    st.title("Probes")
    model, path = current_model(), current_path()
    if model is None or path is None:
        return
    probes = page_probes()
    label = st.radio("Probe", list(probes), horizontal=True, key="probe")
    if label is not None:  # None only for a radio without a default, which this is not
        render_probe(probes[label], model, path)
