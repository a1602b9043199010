"""What the pages share: the session's models and the default checkpoint.

A loaded checkpoint is cached once for the server (`shared_model`), but no page ever runs it:
each session runs its own copy (`load_model`), so the hooks one session attaches while it traces
or intervenes never reach another session's numbers. The cache is keyed by the weights file's
modification time too, so a checkpoint replaced on disk is loaded again.
"""

from __future__ import annotations

import copy
import os

import streamlit as st

import memviz
from memviz.protocol import MemoryModel
from memviz.threads import check_threads


def app_threads() -> int:
    """Torch threads for the app's runs: MEMVIZ_THREADS, else half the cores (at least one): the
    sessions of a served app and other jobs share the machine, and oversubscribed torch threads
    run many times slower than fewer."""
    value = os.environ.get("MEMVIZ_THREADS", "")
    if value:
        return check_threads(int(value) if value.isdigit() else value, "MEMVIZ_THREADS")
    return max(1, (os.cpu_count() or 2) // 2)


def preferred_samples() -> list[str]:
    """The samples that show each family, memory families first (in registration order), so a
    new user sees memory at work at once; the control last."""
    ordered = sorted(memviz.families(), key=lambda f: f.role != "memory")
    return [name for f in ordered if f.sample and (name := f.sample_name)]


def control_samples() -> list[str]:
    """The sample checkpoints of the control families (the contrast every memory is measured against)."""
    samples = memviz.list_samples()
    return [f.sample_name for f in memviz.families() if f.role == "control" and f.sample_name in samples]


@st.cache_resource(show_spinner="Loading checkpoint…", max_entries=16)
def shared_model(path: str, stamp: int) -> MemoryModel:
    """The checkpoint loaded once for the server (`stamp`: its weights' mtime); never run or hooked."""
    return memviz.load(path)


def weights_stamp(path: str) -> int:
    weights = memviz.checkpoint.resolve(path) / memviz.checkpoint.WEIGHTS_FILE
    return weights.stat().st_mtime_ns if weights.is_file() else 0


def session_copy(path: str, stamp: int) -> MemoryModel:
    """A copy of the cached checkpoint that one session alone runs and hooks."""
    return copy.deepcopy(shared_model(path, stamp))


def load_model(path: str) -> MemoryModel:
    """This session's own copy of the checkpoint's model (module docstring)."""
    stamp = weights_stamp(path)
    models = st.session_state.setdefault("_session_models", {})
    if models.get(path, (None, None))[0] != stamp:
        models[path] = (stamp, session_copy(path, stamp))
    return models[path][1]


def default_sample() -> str | None:
    """MEMVIZ_CHECKPOINT if set, else the first preferred sample checkpoint present."""
    if os.environ.get("MEMVIZ_CHECKPOINT"):
        return os.environ["MEMVIZ_CHECKPOINT"]
    samples = memviz.list_samples()
    for name in preferred_samples():
        if name in samples:
            return name
    return samples[0] if samples else None


def greedy_answer(model_path: str, prompt: str, max_new_tokens: int = 8) -> str:
    """The first line of the model's greedy continuation (the answer; past a line break the model goes on
    to a next question), computed once per (checkpoint, prompt), not on every rerun."""
    return cached_greedy_answer(model_path, weights_stamp(model_path), prompt, max_new_tokens)


@st.cache_data(show_spinner=False, max_entries=64)
def cached_greedy_answer(model_path: str, stamp: int, prompt: str, max_new_tokens: int) -> str:
    try:
        return session_copy(model_path, stamp).generate(prompt, max_new_tokens).strip().split("\n", 1)[0]
    except memviz.NonFiniteError:  # said in place of an answer; the figures show where the state stopped being finite
        return "no answer: its logits are not finite (the memory diverged on this input)"


def current_path() -> str | None:
    """The checkpoint last chosen on the Model page, even one that failed to load or an empty path
    (so no page runs another model in its place), else the default sample."""
    if "model_path" in st.session_state:
        return st.session_state["model_path"] or None
    return default_sample()


def current_model() -> MemoryModel | None:
    """The model chosen on the Model page (or the default sample), named in a caption; None with an
    error shown."""
    path = current_path()
    if path is None:
        st.warning("No checkpoint chosen: pick one on the Model page.")
        return None
    try:
        model = load_model(path)
    except memviz.CheckpointError as exc:
        st.error(f"Cannot load the checkpoint chosen on the Model page: {exc}")
        return None
    st.caption(f"Model: **{path}** ({model.family}); the Model page changes it.")
    return model


LOCAL_PATH = "a local path…"


def checkpoint_picker(label: str, choice_key: str, path_key: str, default: str | None) -> str | None:
    """Samples, app-trained checkpoints (and `default` if neither lists it) or a local path; the
    choice kept in the session while other pages run (app/streamlit_app.py)."""
    options = [*memviz.list_samples(), *memviz.list_user_checkpoints()]
    if default and default not in options:
        options = [default, *options]
    options.append(LOCAL_PATH)
    if st.session_state.get(choice_key) not in options:  # none yet, or a checkpoint since removed
        st.session_state[choice_key] = default if default in options else options[0]
    choice = st.selectbox(label, options, key=choice_key)
    if choice != LOCAL_PATH:
        return choice
    return st.text_input(f"{label} folder", key=path_key).strip()


#: said above results kept from a Run on other inputs
STALE = (
    "These results are from the last Run, with other settings or another model than those above; "
    "press Run for results on these."
)


def last_run(key: str, inputs: tuple, run, clicked: bool, show_stale: bool = True):
    """What this page's Run button `key` last gave, kept in the session: a result drawn only under a clicked
    button vanished at the next widget change. `run()` when `clicked` (its errors propagate, and nothing is
    kept); None before any run. A result run on other `inputs` is returned under the STALE caption, or with
    `show_stale` False not at all."""
    runs = st.session_state.setdefault("_last_runs", {})
    if clicked:
        runs.pop(key, None)
        runs[key] = (inputs, run())
    if key not in runs:
        return None
    ran_on, result = runs[key]
    if ran_on != inputs:
        if not show_stale:
            return None
        st.caption(STALE)
    return result


class FieldError(ValueError):
    """A number field holds a value outside its range: said once, naming the field, in place of what it feeds."""


def bounded_number(label: str, low: int, high: int, default: int, key: str, place=None, **kwargs) -> int:
    """A whole-number field checked here, not by the browser: a browser-bounded field turns red on a value out of
    range and keeps sending the old one, so the results of the old value would stay on the page, unmarked.
    FieldError naming the field and its range for a value outside [low, high]."""
    where = st if place is None else place
    value = where.number_input(label, value=default, key=key, **kwargs)
    if not low <= value <= high:
        raise FieldError(f"{label}: {value:,} is outside {low:,} to {high:,}; nothing is shown for it.")
    return int(value)
