"""What the pages share: the loaded model (cached per path) and the default checkpoint."""
from __future__ import annotations

import os

import streamlit as st

import memviz


def preferred_samples() -> list[str]:
    """The samples that show each family, memory families first (in registration order), so a
    new user sees memory at work at once; the control last."""
    ordered = sorted(memviz.families(), key=lambda f: f.role != "memory")
    return [f.sample_name for f in ordered if f.sample]


def control_samples() -> list[str]:
    """The sample checkpoints of the control families (the contrast every memory is measured against)."""
    samples = memviz.list_samples()
    return [f.sample_name for f in memviz.families() if f.role == "control" and f.sample_name in samples]


@st.cache_resource(show_spinner="Loading checkpoint…")
def load_model(path: str):
    return memviz.load(path)


def default_sample() -> str | None:
    """MEMVIZ_CHECKPOINT if set, else the first preferred sample checkpoint present."""
    if os.environ.get("MEMVIZ_CHECKPOINT"):
        return os.environ["MEMVIZ_CHECKPOINT"]
    samples = memviz.list_samples()
    for name in preferred_samples():
        if name in samples:
            return name
    return samples[0] if samples else None


@st.cache_data(show_spinner=False, max_entries=64)
def greedy_answer(model_path: str, prompt: str, max_new_tokens: int = 8) -> str:
    """The model's greedy continuation, computed once per (checkpoint, prompt), not on every rerun."""
    return load_model(model_path).generate(prompt, max_new_tokens).strip()


def current_path() -> str | None:
    """The checkpoint chosen on the Model page, else the default sample."""
    return st.session_state.get("model_path") or default_sample()


def current_model():
    """The model chosen on the Model page (or the default sample); None with an error shown."""
    path = current_path()
    if path is None:
        st.warning("No checkpoint chosen: pick one on the Model page.")
        return None
    try:
        return load_model(path)
    except memviz.CheckpointError as exc:
        st.error(f"Cannot load this checkpoint: {exc}")
        return None


def checkpoint_picker(label: str, choice_key: str, path_key: str, default: str | None) -> str | None:
    """Samples, app-trained checkpoints (and `default` if neither lists it) or a local path."""
    options = [*memviz.list_samples(), *memviz.list_user_checkpoints()]
    if default and default not in options:
        options = [default, *options]
    options.append("a local path…")
    index = options.index(default) if default in options else 0
    choice = st.selectbox(label, options, index=index, key=choice_key)
    return st.text_input(f"{label} folder", key=path_key) if choice == options[-1] else choice
