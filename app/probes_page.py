"""Probes page: the pass-key and BABILong grids for the loaded model, with CSV download."""
from __future__ import annotations

import streamlit as st

from app.common import current_model, current_path, load_model
from probes import babilong, passkey


@st.cache_data(show_spinner=False, max_entries=16)
def run_grid(model_path: str, probe: str, lengths: tuple[int, ...], depths_or_tasks: tuple, n: int, seed: int):
    model = load_model(model_path)
    bar = st.progress(0.0, text="Running the probe…")
    progress = lambda done, total: bar.progress(done / total, text=f"{done} / {total} samples")  # noqa: E731
    if probe == "passkey":
        df = passkey.run(model, lengths, depths_or_tasks, n=n, seed=seed, progress=progress)
    else:
        df = babilong.run(model, depths_or_tasks, lengths, n=n, seed=seed, progress=progress)
    bar.empty()
    return df


def render() -> None:
    st.title("Probes")
    model = current_model()
    if model is None:
        return
    probe = st.radio("Probe", ["passkey", "babilong"], horizontal=True, key="probe")
    lengths = st.multiselect("Lengths (tokens)", [256, 512, 1024, 2048, 4096, 8192], default=[256, 512], key="lengths")
    if probe == "passkey":
        axis = st.multiselect("Needle depths", [0.0, 0.1, 0.25, 0.5, 0.75, 0.9, 1.0], default=[0.1, 0.5, 0.9], key="depths")
    else:
        axis = st.multiselect("Tasks", list(babilong.TASKS), default=["qa1"], key="tasks")
    c1, c2 = st.columns(2)
    n = c1.number_input("Samples per cell", 1, 200, 5, key="n")
    seed = c2.number_input("Seed", 0, 10_000, 0, key="probe_seed")
    if not st.button("Run", key="run_probe"):
        return
    if not lengths or not axis:
        st.error("Choose at least one length and one " + ("depth." if probe == "passkey" else "task."))
        return
    try:
        df = run_grid(current_path(), probe, tuple(sorted(lengths)),
                      tuple(sorted(axis)), int(n), int(seed))
    except ValueError as exc:
        st.error(str(exc))
        return
    fig = passkey.heatmap(df) if probe == "passkey" else babilong.heatmap(df)
    st.plotly_chart(fig, use_container_width=True, key="probe_heatmap")
    st.metric("accuracy", f"{df['correct'].mean():.0%}", help=f"{len(df)} samples")
    st.download_button("Download CSV", df.drop(columns=["evidence"]).to_csv(index=False), file_name=f"{probe}.csv", key="dl_csv")
    st.dataframe(df.drop(columns=["evidence"]), hide_index=True, use_container_width=True)
