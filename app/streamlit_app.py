"""memviz workbench: `streamlit run app`.

The app is thin: it loads checkpoints through `memviz.load`, traces through `memviz.trace`
and draws with `memviz.viz`. Pages: Model (pick a checkpoint, see its card and hooks) and
Trace (stream an input through the model and see its memory at work), Intervene (ablate or
replace the memory at a segment), Compare (two checkpoints on one input), Probes (pass-key
and BABILong grids with their heatmaps), Train (a small run, live and stoppable), Dictionary (the rank-1 atoms a
memory layer's writes are made of).
"""

from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from app import (  # noqa: E402
    compare_page,
    dictionary_page,
    intervene_page,
    model_page,
    probes_page,
    trace_page,
    train_page,
)
from app.common import app_threads  # noqa: E402


def model_page_by_url() -> None:
    """The Model page at /model too: Streamlit serves the default page at / only."""
    model_page.render()


st.set_page_config(page_title="memviz", layout="wide")
torch.set_num_threads(app_threads())
# Streamlit forgets a widget's value when its page is left; held as session state (re-assigned on
# every run, whichever page runs), each page's settings are still there when the user comes back.
# Each page declares its kept keys (KEPT_SETTINGS) beside its widgets.
# Not kept: ranges and choices that depend on the model or the input (zoom, segment, layer, person).

KEPT_SETTINGS = (
    *model_page.KEPT_SETTINGS,
    *trace_page.KEPT_SETTINGS,
    *intervene_page.KEPT_SETTINGS,
    *compare_page.KEPT_SETTINGS,
    *probes_page.kept_settings(),
    *train_page.KEPT_SETTINGS,
    *dictionary_page.KEPT_SETTINGS,
)
for key in list(st.session_state):
    if key in KEPT_SETTINGS or str(key).startswith(train_page.KEPT_PREFIXES):
        st.session_state[key] = st.session_state[key]
page = st.navigation(
    [
        st.Page(model_page.render, title="Model", default=True),
        st.Page(model_page_by_url, title="Model", url_path="model", visibility="hidden"),
        st.Page(trace_page.render, title="Trace", url_path="trace"),
        st.Page(intervene_page.render, title="Intervene", url_path="intervene"),
        st.Page(compare_page.render, title="Compare", url_path="compare"),
        st.Page(probes_page.render, title="Probes", url_path="probes"),
        st.Page(train_page.render, title="Train", url_path="train"),
        st.Page(dictionary_page.render, title="Dictionary", url_path="dictionary"),
    ]
)
page.run()
