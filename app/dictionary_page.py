"""Dictionary page: a dictionary of rank-1 atoms trained on a layer's writes over a text (or a saved one opened on
it), its atoms' table, how often each fires, one atom's activation over the text and its logit effect. Everything
is `memviz.write_dictionary`'s; the page only asks and shows."""

from __future__ import annotations

import pandas as pd
import streamlit as st

import memviz
from app.common import FieldError, bounded_number, checkpoint_picker, current_path, last_run, load_model
from app.trace_page import InputError, uploaded_text
from memviz import write_dictionary as wd

#: widget keys whose values outlive a visit to another page (app/streamlit_app.py keeps them)
KEPT_SETTINGS = (
    "wd_choice",
    "wd_path",
    "wd_source",
    "wd_text",
    "wd_max_tokens",
    "wd_atoms",
    "wd_k",
    "wd_steps",
    "wd_folder",
)
#: the most tokens a dictionary is trained on here (each write is kept in memory: d_k + d_v + 1 floats a head)
MAX_TOKENS = 200_000
SHOWN = ["head", "atom", "frequency", "mean_activation", "fires_on"]


def train(path: str, text: str, layer: int, atoms: int, k: int, steps: int, max_tokens: int):
    """A dictionary trained on `layer`'s writes over `text`, with its writes, codes and atom table."""
    model = load_model(path)
    dictionary, writes = wd.train_on_text(model, text, layer, max_tokens=max_tokens, n_atoms=atoms, k=k, steps=steps)
    codes = wd.encode_writes(dictionary, writes)
    return dictionary, writes, codes, wd.atom_table(dictionary, writes, codes)


def open_saved(path: str, text: str, layer: int, folder: str, max_tokens: int):
    """A saved dictionary, its atoms read on `layer`'s writes over `text`."""
    dictionary = wd.load_dictionary(folder)
    writes = wd.capture_writes(load_model(path), text, layer, max_tokens)
    codes = wd.encode_writes(dictionary, writes)
    return dictionary, writes, codes, wd.atom_table(dictionary, writes, codes)


def chosen(value: int | None, options: list[int]) -> int:
    """A select box's whole-number choice (its first option while it has none)."""
    return int(options[0] if value is None else value)


def render() -> None:
    st.title("Write dictionary")
    st.caption(
        "Sparse rank-1 atoms u w^T that a memory layer's writes beta_t k_t v_t^T are made of (WriteSAE, "
        "arXiv 2605.12770): trained on a text's writes, a dictionary a head, k atoms a write."
    )
    path = checkpoint_picker("Checkpoint", "wd_choice", "wd_path", current_path())
    if not path:
        st.info("Choose a checkpoint.")
        return
    try:
        model = load_model(path)
    except memviz.CheckpointError as exc:
        st.error(f"Cannot load this checkpoint: {exc}")
        return
    layers = wd.layers_with_writes(model)
    if not layers:
        st.info(f"This {model.family} model has no layer with writes (hook_write_key, hook_write_value, hook_beta).")
        return
    layer = chosen(st.selectbox("Layer", layers, key="wd_layer"), layers)
    source = st.radio("Dictionary", ["train one", "open a saved one"], horizontal=True, key="wd_source")
    try:
        text = st.text_area("Text whose writes it reads", key="wd_text", height=120) or uploaded_text(path, "wd_upload")
        max_tokens = bounded_number("max tokens", 1, MAX_TOKENS, 20_000, "wd_max_tokens", step=1000)
        if source == "train one":
            c1, c2, c3 = st.columns(3)
            atoms = bounded_number("atoms a head", 2, 4096, 256, "wd_atoms", c1)
            k = bounded_number("k (atoms a write)", 1, 64, 4, "wd_k", c2)
            steps = bounded_number("steps", 1, 20_000, 1000, "wd_steps", c3)
        else:
            folder = st.text_input("Saved dictionary folder", key="wd_folder").strip()
    except (FieldError, InputError) as exc:
        st.error(str(exc))
        return
    if not text or not text.strip():
        st.info("Give a text: its writes are what the dictionary reads.")
        return
    try:
        if source == "train one":
            settings = (path, text, layer, atoms, k, steps, max_tokens)
            clicked = st.button("Train", key="wd_train")
            result = last_run("wd_train", settings, lambda: train(*settings), clicked, show_stale=False)
        else:
            opened = (path, text, layer, folder, max_tokens)
            clicked = st.button("Open", key="wd_open")
            result = last_run("wd_open", opened, lambda: open_saved(*opened), clicked, show_stale=False)
    except ValueError as exc:  # a text over max tokens, a dictionary file that is not one, one of another shape
        st.error(str(exc))
        return
    if result is None:
        st.info("Press Train (or Open) to see the atoms.")
        return
    show(model, *result)


def show(model, dictionary: wd.WriteDictionary, writes: wd.Writes, codes, table: pd.DataFrame) -> None:
    card = dictionary.card
    explained, dead = card.get("explained_variance"), card.get("dead_atoms")
    if isinstance(explained, list) and isinstance(dead, list) and len(explained) == len(dead) == len(dictionary.heads):
        heads = ", ".join(
            f"head {h}: {'n/a' if ev is None else f'{ev:.2f}'} ({n} dead)"
            for h, ev, n in zip(dictionary.heads, explained, dead)
        )
        st.caption(
            f"{len(writes):,} writes of this text. On the held-back end of the text it was trained on "
            f"({card.get('text') or 'its card names none'}), its card says the explained variance by head: {heads}."
        )
    st.dataframe(table[SHOWN], hide_index=True, key="wd_table")
    c1, c2 = st.columns(2)
    head = chosen(c1.selectbox("Head", dictionary.heads, key="wd_head"), dictionary.heads)
    ranked = table[table["head"] == head]["atom"].tolist()
    atom = chosen(c2.selectbox("Atom (most frequent first)", ranked, key="wd_atom"), ranked)
    figures = wd.atom_figures(dictionary, writes, table, codes, atom=(head, atom))
    for title, fig in figures.items():
        st.plotly_chart(fig, width="stretch", key=f"wd-{title}")
    if st.button("Logit effect of this atom", key="wd_effect"):
        try:
            effect = wd.logit_effects(model, dictionary, writes, table, [(head, atom)])
        except ValueError as exc:  # a family with no read path to the logits
            st.warning(str(exc))
            return
        row = effect.iloc[0]
        st.markdown(
            f"At the token that fires it most (position {row['position']}), a read of its value direction promotes: "
            f"{row['promoted']}"
        )
