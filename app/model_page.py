"""Model page: pick a sample checkpoint or a local path; show its card, config and hooks."""

from __future__ import annotations

import pandas as pd
import streamlit as st
import torch

import memviz
from app.common import checkpoint_picker, current_path, load_model
from memviz.protocol import MemoryModel
from memviz.running import generic_hook_name

#: widget keys whose values outlive a visit to another page (app/streamlit_app.py keeps them)
KEPT_SETTINGS = ("checkpoint_choice", "checkpoint_path")


def hook_table(model: MemoryModel) -> pd.DataFrame:
    generic = sorted({generic_hook_name(n) for n in model.hook_dict})
    traced = {generic_hook_name(n) for n in model.default_trace_reducers()}
    return pd.DataFrame({"hook": generic, "traced by default": [g in traced for g in generic]})


def score_rows(scores: dict, prefix: str = "", n: object = None) -> list[dict]:
    """A card's nested probe scores as rows {probe, score, samples} ("passkey 512": 98% of 5 samples a cell, the
    card's `n_per_cell`; "lm shakespeare": 2.089 bits a byte, the language-modelling probe's held-out score)."""
    rows: list[dict] = []
    if not isinstance(scores, dict):  # a hand-edited card: nothing to show, as stage_rows does
        return rows
    n = scores.get("n_per_cell", n)
    for key, value in scores.items():
        if isinstance(value, dict):
            rows.extend(score_rows(value, f"{prefix}{key} ", n))
        elif isinstance(value, float) and key != "n_per_cell":
            lm = prefix == "lm "
            score = f"{value:.3f} bits a byte" if lm else f"{value:.0%}"
            samples = "the held-out documents" if lm else f"{n} a cell" if isinstance(n, int) else "not recorded"
            rows.append({"probe": f"{prefix}{key}", "score": score, "samples": samples})
    return rows


def stage_rows(stages) -> list[dict]:
    """A card's `stages` as table rows: a list of {name, steps, wall_time_s, threads} or, in older
    cards, {name: what it did}."""
    if isinstance(stages, dict):
        return [{"stage": name, "what": str(what)} for name, what in stages.items()]
    if not isinstance(stages, list):
        return []
    columns = {"steps": "steps", "wall_time_s": "train time (s)", "threads": "threads"}
    return [
        {"stage": str(stage.get("name", "")), **{label: stage[key] for key, label in columns.items() if key in stage}}
        for stage in stages
        if isinstance(stage, dict)
    ]


def render_card(card: dict) -> None:
    """How the checkpoint was trained and what it scores, readably; the whole card below."""
    if not isinstance(card, dict) or not card:
        st.caption("This checkpoint has no card.")
        return
    stages = stage_rows(card.get("stages"))
    staged = len(stages) > 1
    last = " (its last stage)" if staged else ""
    facts = [
        (label, card[key])
        for key, label in (
            ("steps", f"steps{last}"),
            ("wall_time_s", f"train time (s){last}"),
            ("machine", "machine"),
            ("parameters", "parameters"),
        )
        if key in card
    ]
    if facts:
        st.table({"": [label for label, _ in facts], "value": [str(value) for _, value in facts]})
    if card.get("train_command"):
        st.code(card["train_command"], language="bash")
    rows = score_rows(card.get("probe_scores") or {})
    if rows:
        st.dataframe(rows, hide_index=True, width="stretch")
    if staged:
        steps = sum(v for row in stages if isinstance(v := row.get("steps"), (int, float)))
        seconds = sum(v for row in stages if isinstance(v := row.get("train time (s)"), (int, float)))
        whole = f": {steps:,} steps, {seconds / 60:.0f} min of training in all" if seconds else ""
        st.caption(f"Trained in {len(stages)} stages, each continuing the one before (the command above){whole}.")
        st.dataframe(stages, hide_index=True, width="stretch")
    if card.get("note"):
        st.caption(str(card["note"]))
    with st.expander("the whole card (JSON)"):
        st.json(card, expanded=1)


def render() -> None:
    st.title("memviz")
    path = checkpoint_picker("Checkpoint", "checkpoint_choice", "checkpoint_path", current_path())
    st.session_state["model_path"] = path  # the other pages run this one, or say why they cannot
    if not path:
        st.info("Give the path of a checkpoint folder (config.json, model.safetensors, tokenizer.json).")
        return
    try:
        model = load_model(path)
    except memviz.CheckpointError as exc:
        st.error(f"Cannot load this checkpoint: {exc}")
        return
    cfg = model.cfg
    st.metric("family", model.family)  # a row of its own: in a quarter of the page a long name was cut
    cols = st.columns(3)
    cols[0].metric("parameters", f"{model.num_parameters():,}")
    cols[1].metric("layers x d_model", f"{cfg.n_layers} x {cfg.d_model}")
    cols[2].metric("tokenizer", f"{model.tokenizer.kind} ({cfg.vocab_size})")
    st.caption(
        f"The app runs models on {torch.get_num_threads()} torch thread(s) (MEMVIZ_THREADS sets it; half the "
        "cores by default, since sessions and other jobs share the machine)."
    )
    left, right = st.columns(2)
    with left:
        st.subheader("Card")
        render_card(model.card)
        st.subheader("Config")
        st.json(cfg.to_dict(), expanded=1)
    with right:
        st.subheader("Hooks")
        st.dataframe(hook_table(model), hide_index=True, width="stretch")
