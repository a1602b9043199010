"""memviz workbench: `streamlit run app`.

The app is thin: it loads checkpoints through `memviz.load` and shows what the library
computes. The Model page is the first of the workbench's pages; the trace, intervene,
compare, probe and train views build on it.
"""
from __future__ import annotations

import sys
from pathlib import Path

import streamlit as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from app import model_page  # noqa: E402

st.set_page_config(page_title="memviz", layout="wide")
page = st.navigation([st.Page(model_page.render, title="Model", url_path="model", default=True)])
page.run()
