"""The Streamlit app driven headlessly with AppTest."""

import base64
import json
import math
import os
import re
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch
from streamlit.testing.v1 import AppTest

import memviz
from app import trace_page
from app.common import STALE
from memviz_probes import lm, passkey
from tests.conftest import small_model

ROOT = Path(__file__).resolve().parent.parent
APP = str(ROOT / "app" / "streamlit_app.py")


def page(module: str, model_path: str | None = None) -> AppTest:
    """One page of the app (app/<module>.py), run headlessly, with a checkpoint chosen."""
    at = AppTest.from_string(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom app import {module}\n{module}.render()\n",
        default_timeout=120,
    )
    if model_path is not None:
        at.session_state["model_path"] = model_path
    return at


def open_app() -> AppTest:
    at = AppTest.from_file(APP, default_timeout=60)
    at.run()
    assert not at.exception, at.exception
    return at


def choose_path(at: AppTest, path: str) -> AppTest:
    at.selectbox(key="checkpoint_choice").select("a local path…").run()
    at.text_input(key="checkpoint_path").input(path).run()
    assert not at.exception, at.exception
    return at


def test_model_page_shows_a_checkpoint(tmp_path):
    model = small_model("sliding_window", window=8)
    path = memviz.save(model, tmp_path / "ckpt", card={"name": "tiny-test"})
    at = choose_path(open_app(), str(path))
    metrics = {m.label: m.value for m in at.metric}
    assert metrics["family"] == "sliding_window"
    assert metrics["parameters"] == f"{model.num_parameters():,}"
    assert "tiny-test" in str([j.value for j in at.json])
    hooks = at.dataframe[0].value
    assert "blocks.{l}.attn.hook_z" in set(hooks["hook"])


def test_model_page_shows_how_a_sample_was_trained_and_what_it_scores():
    at = choose_path(open_app(), "infini_long")
    assert not at.exception, at.exception
    card = memviz.load("infini_long").card
    assert card["train_command"] in [c.value for c in at.code]
    scores = at.dataframe[0].value
    assert dict(zip(scores["probe"], scores["score"]))["passkey 4096"] == "100%"


@pytest.mark.parametrize("corrupt", ["missing", "garbage", "name too long", "no such user", "scores a string"])
def test_model_page_reports_bad_checkpoints(tmp_path, corrupt):
    path = tmp_path / "ckpt"
    if corrupt == "garbage":
        memviz.save(small_model(), path)
        (path / "model.safetensors").write_bytes(b"\x00" * 10)
    elif corrupt == "name too long":
        path = tmp_path / ("x" * 300)
    elif corrupt == "no such user":
        path = "~nosuchuser_memviz/ckpt"
    elif corrupt == "scores a string":  # a hand-edited card: the page shows the rest
        memviz.save(small_model(), path, card={"probe_scores": "x"})
        at = choose_path(open_app(), str(path))
        assert not at.exception and not at.error and at.metric
        return
    at = choose_path(open_app(), str(path))
    assert not at.exception, at.exception
    assert len(at.error) == 1 and "Cannot load this checkpoint" in at.error[0].value
    assert corrupt not in ("name too long", "no such user") or "not a usable path" in at.error[0].value
    assert not at.metric


@pytest.mark.parametrize("page_name", ["trace_page", "intervene_page"])
def test_a_facts_card_that_names_no_usable_knowledge_base_is_refused_at_load_on_the_page(tmp_path, page_name):
    import shutil

    path = tmp_path / "mp"
    shutil.copytree(ROOT / "sample_checkpoints" / "memory_plus_english", path)
    card = json.loads((path / "card.json").read_text())
    (path / "card.json").write_text(json.dumps({**card, "facts": {"n_entities": 0}}))
    at = page(page_name, str(path))
    at.run()
    assert not at.exception, at.exception
    assert any(f"{path}/card.json: facts.n_entities must be" in e.value for e in at.error), at.error


def test_train_page_refuses_a_name_too_long_for_its_folders_before_training(tmp_path, monkeypatch):
    monkeypatch.setenv("MEMVIZ_HOME", str(tmp_path))
    at = page("train_page")
    at.run()
    at.text_input(key="tr_name").input("b" * 240).run()
    at.button(key="tr_start").click().run()
    assert not at.exception and "The name has 240 characters; at most 200" in at.error[0].value
    assert at.session_state["_train_jobs"] == {}


@pytest.fixture(scope="module")
def infini_checkpoint(tmp_path_factory):
    model = small_model("infini", segment_len=16)
    return str(memviz.save(model, tmp_path_factory.mktemp("ckpt") / "infini"))


def test_each_session_runs_its_own_copy_of_a_checkpoint(infini_checkpoint):
    """A hook one session leaves on its model (as a page's does while it traces or intervenes)
    changes nothing in another session's run of the same cached checkpoint."""
    script = f"""
import sys
sys.path.insert(0, {str(ROOT)!r})
import streamlit as st
import torch
from app.common import load_model
model = load_model({infini_checkpoint!r})
if st.session_state.get("poison"):
    model.blocks[0].attn.hook_z.add_hook(lambda z, hook: z * 0)
with torch.no_grad():
    st.session_state["logit"] = float(model(torch.arange(40)[None])[0, -1].sum())
st.session_state["model_id"] = id(model)
"""
    poisoned, clean = AppTest.from_string(script, default_timeout=60), AppTest.from_string(script, default_timeout=60)
    poisoned.session_state["poison"] = True
    poisoned.run()
    clean.run()
    assert not poisoned.exception and not clean.exception
    with torch.no_grad():
        alone = float(memviz.load(infini_checkpoint)(torch.arange(40)[None])[0, -1].sum())
    assert poisoned.session_state["model_id"] != clean.session_state["model_id"]
    assert clean.session_state["logit"] == pytest.approx(alone, abs=1e-6)
    assert poisoned.session_state["logit"] != pytest.approx(alone, abs=1e-3)


def open_trace_page(path: str) -> AppTest:
    at = page("trace_page", path)
    at.run()
    assert not at.exception, at.exception
    return at


def plotted(values) -> np.ndarray:
    """A figure's array as the app sent it: a list, or plotly's typed base64 form."""
    if isinstance(values, dict):
        return np.frombuffer(base64.b64decode(values["bdata"]), dtype=values["dtype"]).astype(float)
    return np.array([np.nan if v is None else v for v in values], dtype=float)


def chart_titles(at: AppTest) -> list[str]:
    return [json.loads(c.proto.spec)["layout"]["title"]["text"] for c in at.get("plotly_chart")]


def test_trace_page_traces_the_default_passkey_sample(infini_checkpoint):
    at = open_trace_page(infini_checkpoint)
    titles = chart_titles(at)
    assert any("sigmoid(beta)" in t for t in titles) and any("memory share" in t for t in titles), titles
    assert "How much of the evidence the memory still holds" in titles  # the needle's share of the read
    assert at.caption[0].value == f"Model: **{infini_checkpoint}** (infini); the Model page changes it."
    assert "answer" in at.caption[1].value
    readouts = [t for t in titles if "where the read at token" in t]
    assert len(readouts) == 2 and all("the evidence carries" in t for t in readouts), titles  # one a layer
    at.number_input(key="ro_position").set_value(300).run()  # the read at another token
    assert not at.exception and any("where the read at token 300" in t for t in chart_titles(at))
    at.slider(key="zoom").set_value((100, 300)).run()  # zoom re-pools the same cached trace
    assert not at.exception
    assert len(at.get("plotly_chart")) == len(titles)


def test_trace_page_shows_a_family_from_an_installed_package(tmp_path):
    """Gated DeltaNet (families/gated_deltanet, found by its entry point): its own figures and
    its needle_hold on the Trace page, with no page naming it."""
    model = small_model("gated_deltanet", attention={"kind": "window", "span": 16})
    at = open_trace_page(str(memviz.save(model, tmp_path / "gdn")))
    titles = chart_titles(at)
    assert any("decay alpha" in t for t in titles) and any("write strength beta" in t for t in titles), titles
    assert "How much of the evidence the memory still holds" in titles


@pytest.mark.parametrize(
    "memory, decomposes", [({"variant": "mac", "memory": "linear"}, True), ({"variant": "mac", "memory": "mlp"}, False)]
)
def test_trace_page_reads_out_titans_linear_memory_and_says_why_not_the_mlp(tmp_path, memory, decomposes):
    path = str(memviz.save(small_model("titans", segment_len=16, memory=memory), tmp_path / "titans"))
    at = open_trace_page(path)
    readouts = [t for t in chart_titles(at) if "where the read at token" in t]
    if decomposes:
        assert len(readouts) == 2 and all("initial state gives" in t for t in readouts), readouts
    else:
        assert not readouts and any("not linear in its writes" in i.value for i in at.info)


def test_trace_page_text_and_error_paths(infini_checkpoint):
    at = open_trace_page(infini_checkpoint)
    at.radio(key="source").set_value("text").run()
    assert "Give an input" in at.info[0].value  # empty input
    at.text_area(key="text_input").input("The pass key is 12345. " * 10).run()
    assert not at.exception and at.get("plotly_chart")
    at.radio(key="source").set_value("file").run()
    at.get("file_uploader")[0].set_value(("bad.txt", b"\xff\xfe\xfa not utf-8", "text/plain")).run()
    assert "bad.txt is not UTF-8" in at.error[0].value
    at.get("file_uploader")[0].set_value(("big.txt", b"a" * (21 * 1024 * 1024), "text/plain")).run()
    assert "big.txt is 21.0 MB; the limit is 20 MB" in at.error[0].value
    at.get("file_uploader")[0].set_value(("blank.txt", b" \n\t\n", "text/plain")).run()
    assert "blank.txt holds no text" in at.error[0].value
    at.get("file_uploader")[0].set_value(("ok.txt", "Grüße aus dem Speicher. ".encode() * 20, "text/plain")).run()
    assert not at.error and at.get("plotly_chart")


def test_trace_page_reports_a_bad_checkpoint(tmp_path):
    at = open_trace_page(str(tmp_path / "missing"))
    assert "Cannot load the checkpoint chosen on the Model page" in at.error[0].value


def test_probes_page_runs_a_grid_and_offers_the_csv(infini_checkpoint):
    at = page("probes_page", infini_checkpoint)
    at.run()
    at.multiselect(key="lengths").set_value([256]).run()
    at.number_input(key="n").set_value(2).run()
    at.button(key="run_probe").click().run()
    assert not at.exception, at.exception
    table = at.dataframe[0].value
    expected = passkey.run(memviz.load(infini_checkpoint), [256], [0.1, 0.5, 0.9], n=2, seed=0, progress=False)
    pd.testing.assert_frame_equal(table.reset_index(drop=True), expected.drop(columns=["evidence"]), check_dtype=False)
    assert at.metric[0].label == "accuracy" and at.metric[0].value == f"{expected['correct'].mean():.0%}"
    assert [b.proto.label for b in at.get("download_button")] == ["Download CSV"]
    assert STALE not in [c.value for c in at.caption]
    at.number_input(key="probe_seed").set_value(7).run()  # a widget changed: the results stay, marked as the last Run
    assert STALE in [c.value for c in at.caption] and len(at.get("plotly_chart")) == 1
    pd.testing.assert_frame_equal(at.dataframe[0].value, table)
    at.number_input(key="probe_seed").set_value(0).run()  # back to the Run's settings: current again
    assert STALE not in [c.value for c in at.caption] and len(at.get("plotly_chart")) == 1
    at.multiselect(key="depths").set_value([]).run()
    at.button(key="run_probe").click().run()
    assert "at least one length and one depth" in at.error[0].value


def test_probes_page_says_what_a_large_grid_costs_before_it_runs(infini_checkpoint, monkeypatch):
    monkeypatch.setattr(trace_page, "tokens_per_second", lambda path, stamp: 1000.0)  # the cost, not this machine's
    at = page("probes_page", infini_checkpoint)
    at.run()
    assert not [c.value for c in at.caption if "prompts" in c.value]  # the default grid is small: nothing said
    at.multiselect(key="lengths").set_value([4096, 8192]).run()
    at.number_input(key="n").set_value(50).run()
    # 50 samples x 3 depths at each length: 150 x (4,096 + 8,192) tokens at 1,000 tokens a second
    assert "300 prompts, 1,843,200 tokens: about 31 min on this machine at the model's measured speed." in [
        c.value for c in at.caption
    ]
    assert not at.get("plotly_chart")  # said, not run


def test_probes_page_runs_a_ruler_grid_over_depths(infini_checkpoint):
    at = page("probes_page", infini_checkpoint)
    at.run()
    at.radio(key="probe").set_value("ruler").run()
    at.multiselect(key="lengths").set_value([512]).run()
    at.multiselect(key="ruler_depths").set_value([0.0, 1.0]).run()
    at.number_input(key="n").set_value(1).run()
    at.button(key="run_probe").click().run()
    assert not at.exception, at.exception
    assert at.dataframe[0].value.shape[0] == 2 and set(at.dataframe[0].value["task"]) == {"niah_single_1"}
    assert chart_titles(at) == ["RULER: niah_single_1"]  # one task over depths: the depth x length grid
    at.multiselect(key="lengths").set_value([256]).run()
    at.button(key="run_probe").click().run()
    assert "shorter than task niah_single_1's template" in at.error[0].value


def test_probes_page_draws_retention_beside_the_control(infini_checkpoint, monkeypatch):
    monkeypatch.setattr(trace_page, "tokens_per_second", lambda path, stamp: 1000.0)  # the cost, not this machine's
    at = page("probes_page", infini_checkpoint)
    at.run()
    at.radio(key="probe").set_value("retention").run()
    assert at.multiselect(key="rt_models").value == ["sliding_window_english"]  # the control family's sample
    at.multiselect(key="rt_distances").set_value([64, 1024]).run()
    at.number_input(key="rt_n").set_value(2).run()
    at.button(key="run_retention").click().run()
    assert not at.exception, at.exception
    table = at.dataframe[0].value
    assert list(table.columns) == [64, 1024] and len(table) == 2  # this model and the control
    assert len(at.get("plotly_chart")) == 1
    at.multiselect(key="rt_distances").set_value([]).run()
    at.button(key="run_retention").click().run()
    assert "at least one distance" in at.error[0].value
    at.multiselect(key="rt_distances").set_value([64, 2**20]).run()  # not run: the cost is said first
    assert not at.exception, at.exception
    # 2 samples x (64 + 1,048,576) tokens x 2 models at 1,000 tokens/s; one sample alone is 1,049 s
    assert at.caption[-1].value == STALE  # the last Run's curve stays below
    assert at.caption[-2].value.startswith(
        "About 70 min on this machine at the models' measured speeds (one sample at 1,048,576 tokens takes about 17 min"
    )


def test_probes_page_draws_language_modelling_beside_the_control(infini_checkpoint):
    at = page("probes_page", infini_checkpoint)
    at.run()
    at.radio(key="probe").set_value("language modelling").run()
    assert at.multiselect(key="lm_models").value == ["sliding_window_english"]
    at.selectbox(key="lm_corpus").set_value("botchan").run()
    at.number_input(key="lm_max").set_value(300).run()
    at.button(key="run_lm").click().run()
    assert not at.exception, at.exception
    assert len(at.get("plotly_chart")) == 1
    table = at.dataframe[0].value
    assert len(table) == 2 and (table["tokens"] == 299 + 1).all()
    alone = lm.summary(lm.run(memviz.load(infini_checkpoint), "botchan", max_tokens=300))
    assert table["bits_per_byte"].iloc[0] == pytest.approx(float(alone["bits_per_byte"].iloc[0]), abs=1e-4)
    assert [c.value for c in at.caption].count(
        f"Model: **{infini_checkpoint}** (infini); the Model page changes it."
    ) == 1
    at.number_input(key="lm_max").set_value(1).run()
    at.button(key="run_lm").click().run()
    assert at.error[0].value.startswith("Tokens a document at most: 0 (whole documents) or 2 or more")


def test_intervene_page_runs_the_clean_prompt_and_each_edit_once(infini_checkpoint, monkeypatch):
    from memviz import interventions

    runs = []
    real = interventions.answer_logprob
    monkeypatch.setattr(interventions, "answer_logprob", lambda *a, **k: runs.append(1) or real(*a, **k))
    at = page("intervene_page", infini_checkpoint)
    at.run()
    at.number_input(key="iv_seed").set_value(4321).run()  # a prompt no other test has cached
    assert not at.exception, at.exception
    first = len(runs)  # the clean run and the ablation
    at.radio(key="iv_mode").set_value("replace with another sample's memory").run()
    at.radio(key="iv_mode").set_value("ablate").run()
    assert not at.exception and len(runs) == first + 1  # only the replacement ran anew


def test_intervene_page_ablates_replaces_and_sweeps(infini_checkpoint):
    at = page("intervene_page", infini_checkpoint)
    at.run()
    assert not at.exception, at.exception
    assert "after the edit" in at.metric[0].label
    assert re.search(r"The needle is at tokens \d+-\d+ \(segment \d+", at.caption[1].value)  # 16-token segments
    at.radio(key="iv_mode").set_value("replace with another sample's memory").run()
    assert not at.exception and "donor sample's key" in at.caption[2].value
    at.button(key="iv_sweep").click().run()
    assert not at.exception and len(at.get("plotly_chart")) == 1
    at.radio(key="iv_mode").set_value("ablate").run()  # another edit: the sweep of the same prompt stays
    assert not at.exception and len(at.get("plotly_chart")) == 1
    at.number_input(key="iv_seed").set_value(1).run()  # another prompt: its sweep is not this one's
    assert not at.exception and not at.get("plotly_chart")
    at.number_input(key="iv_length").set_value(100).run()
    assert "shorter than the instruction" in at.error[0].value


def test_intervene_page_silences_memory_plus_on_a_fact_it_learnt():
    """The shipped Memory+ sample on a question from its knowledge base: it answers, and with
    its memory layer's top-k zeroed it does not."""
    at = page("intervene_page", str(ROOT / "sample_checkpoints" / "memory_plus_english"))
    at.run()
    assert not at.exception, at.exception
    assert "Question: Where does" in at.code[0].value
    answer = at.markdown[0].value.split("**")[1]
    assert f"greedy **{answer!r}**" in at.markdown[0].value
    # the answer at least ten times less likely, and no longer the greedy one
    assert float(at.metric[0].delta) < -math.log(10) and answer not in at.markdown[1].value
    at.selectbox(key="iv_attribute").set_value("job").run()
    assert "What does" in at.code[0].value


def test_compare_page_shows_two_models_side_by_side(infini_checkpoint, tmp_path):
    other = str(memviz.save(small_model("sliding_window", window=16), tmp_path / "base"))
    at = page("compare_page")
    at.run()
    at.selectbox(key="cmp_left").select("a local path…").run()
    at.text_input(key="cmp_left_path").input(infini_checkpoint).run()
    at.selectbox(key="cmp_right").select("a local path…").run()
    at.text_input(key="cmp_right_path").input(other).run()
    assert not at.exception, at.exception
    headers = [m.value for m in at.markdown]
    assert any("(infini)" in h for h in headers) and any("(sliding_window)" in h for h in headers)
    titles = chart_titles(at)
    assert (
        titles[0].startswith("Next-token loss, overlaid") and sum("loss" in t.lower() for t in titles) == 1
    )  # one overlay, no pair
    assert titles[0].count("the answer's 6 token(s)") == 2  # " 12345" after the prompt: each model's loss on it
    assert any("sigmoid(beta)" in t for t in titles)
    # the control has none of infini's views: they follow one line that says so, not a note beside each
    only = [m.value for m in at.markdown if m.value.startswith("**Only ")]
    assert only == [f"**Only {infini_checkpoint} (infini) has these views**"] and len(titles) > 2
    at.text_input(key="cmp_right_path").input(str(tmp_path / "nothing")).run()
    assert "Cannot load this checkpoint" in at.error[0].value


def test_train_page_trains_exports_and_lists_the_checkpoint(tmp_path, monkeypatch):
    import time

    monkeypatch.setenv("MEMVIZ_HOME", str(tmp_path))
    import memviz.checkpoint

    monkeypatch.setattr(memviz.checkpoint, "USER_DIR", tmp_path / "checkpoints")
    import app.train_page

    monkeypatch.setattr(app.train_page, "USER_DIR", tmp_path / "checkpoints")
    at = page("train_page")
    at.run()
    at.selectbox(key="tr_task").select("facts").run()
    at.number_input(key="tr_steps").set_value(4).run()
    for bad in ("bad name!", "..", ".hidden"):
        at.text_input(key="tr_name").input(bad).run()
        at.button(key="tr_start").click().run()
        assert "letters, digits" in at.error[0].value, bad
    at.selectbox(key="tr_family").select("sliding_window").run()
    assert at.text_input(key="tr_name").value == "sliding_window-facts-1"  # a fresh name by default
    at.text_input(key="tr_name").input("tiny-facts").run()
    for bad, said in (
        ("0:64, 0:128", "steps must increase"),
        ("5:64", "start at step 0"),
        ("0:64, 2:9000", "lie in [64, 4096]"),
        ("0-64", "is not step:length"),
    ):
        at.text_input(key="tr_curriculum").input(bad).run()
        at.button(key="tr_start").click().run()
        assert said in at.error[0].value and "tiny-facts" not in at.session_state["_train_jobs"], bad
    at.text_input(key="tr_curriculum").input("0:64, 2:96").run()
    at.button(key="tr_start").click().run()
    at.run()
    assert at.text_input(key="tr_name").value == "sliding_window-facts-1"  # the next run gets a new name
    at.text_input(key="tr_name").input("my-next-run").run()
    assert at.text_input(key="tr_name").value == "my-next-run"  # and a name typed after a start is kept
    deadline = time.time() + 180
    while not (tmp_path / "checkpoints" / "tiny-facts" / "card.json").exists():
        assert time.time() < deadline
        time.sleep(0.5)
    job = at.session_state["_train_jobs"]["tiny-facts"]
    job["thread"].join(60)
    config = json.loads((tmp_path / "checkpoints" / "tiny-facts" / "card.json").read_text())["train_config"]
    assert config["data"]["curriculum"] == [[0, 64], [2, 96]]  # the stages the page was given
    at.run()
    assert at.text_input(key="tr_name").value == "my-next-run"
    for blank, said in (("", "Give the run a name."), ("my-run ", "begins or ends with a space")):
        at.text_input(key="tr_name").input(blank).run()
        at.button(key="tr_start").click().run()
        assert said in at.error[0].value and at.text_input(key="tr_name").value == blank
    at.text_input(key="tr_name").input("tiny-facts").run()
    at.button(key="tr_start").click().run()
    assert "an earlier run's folder" in at.error[0].value  # never into an existing folder
    other = page("train_page")  # another session does not see (or stop) this one's run
    other.run()
    assert not other.exception, other.exception
    assert other.session_state["_train_jobs"] == {} and not any("tiny-facts" in m.value for m in other.markdown)
    other.selectbox(key="tr_task").select("facts").run()
    other.text_input(key="tr_name").input("tiny-facts").run()
    other.button(key="tr_start").click().run()  # its folder holds the finished run: refused, nothing lost
    assert not other.exception and "an earlier run's folder" in other.error[0].value
    assert not at.exception, at.exception
    assert job["status"] == "finished", job.get("error")
    assert str(tmp_path / "checkpoints" / "tiny-facts") in memviz.list_user_checkpoints()
    assert memviz.load(tmp_path / "checkpoints" / "tiny-facts").card["steps"] == 4


def test_a_run_whose_page_was_reloaded_is_offered_to_the_next_train_page(tmp_path, monkeypatch):
    import memviz.checkpoint
    from app import train_page

    monkeypatch.setenv("MEMVIZ_HOME", str(tmp_path))
    monkeypatch.setattr(memviz.checkpoint, "USER_DIR", tmp_path / "checkpoints")
    monkeypatch.setattr(train_page, "USER_DIR", tmp_path / "checkpoints")
    me = {"id": "first page"}  # AppTest gives every session one id: each page here says which it is
    monkeypatch.setattr(train_page, "session_id", lambda: me["id"])
    open_pages = {"first page", "reloaded page"}
    monkeypatch.setattr(train_page, "session_open", lambda sid: sid in open_pages)
    first = page("train_page")
    first.run()
    first.selectbox(key="tr_family").select("sliding_window").run()
    first.selectbox(key="tr_task").select("facts").run()
    first.number_input(key="tr_steps").set_value(100_000).run()  # goes on until stopped
    first.text_input(key="tr_name").input("left-run").run()
    first.button(key="tr_start").click().run()
    job = first.session_state["_train_jobs"]["left-run"]
    try:
        assert job["owner"] == "first page"
        me["id"] = "reloaded page"
        reloaded = page("train_page")
        reloaded.run()
        assert not reloaded.info and not [b for b in reloaded.button if b.key == "adopt-left-run"]  # still open
        open_pages.discard("first page")  # the first page is reloaded away
        reloaded.run()
        assert any(m.value.startswith("Run **left-run** (running, step") for m in reloaded.info)
        reloaded.button(key="adopt-left-run").click().run()
        assert not reloaded.exception, reloaded.exception
        assert job["owner"] == "reloaded page" and reloaded.session_state["_train_jobs"]["left-run"] is job
        assert not reloaded.info  # its own now: drawn live, no longer offered
        me["id"] = "first page"
        open_pages.add("first page")  # the first page comes back (a reconnect): the run is no longer its own
        first.run()
        assert "left-run" not in first.session_state["_train_jobs"] and not first.info
        me["id"] = "reloaded page"
        reloaded.button(key="stop-left-run").click().run()  # its Stop button is on the page that took it
        job["thread"].join(120)
        assert job["status"] == "stopped", job.get("error")
        assert (tmp_path / "checkpoints" / "left-run" / "card.json").exists()
    finally:
        job["trainer"].stop.set()
        job["thread"].join(120)


def test_trace_page_says_what_a_long_input_costs_and_the_upload_limit_in_tokens(infini_checkpoint, monkeypatch):
    monkeypatch.setattr(trace_page, "tokens_per_second", lambda path, stamp: 100.0)
    views = {"needle hold": 0.01, "read-out": 0.03}  # seconds a token: the views' cost, not this machine's
    monkeypatch.setattr(trace_page, "view_seconds", lambda path, stamp: views)
    at = open_trace_page(infini_checkpoint)
    at.number_input(key="pk_length").set_value(24_000).run()
    assert not at.exception, at.exception
    estimate = [c.value for c in at.caption if "the trace takes about" in c.value]
    assert len(estimate) == 1, estimate
    tokens = int(estimate[0].split(" tokens")[0].replace(",", ""))  # the prompt's, counted
    assert 23_000 < tokens <= 24_000 and estimate[0] == (
        f"{tokens:,} tokens: the trace takes about {tokens / 100 / 60:.0f} min on this machine at the model's "
        f"measured speed, and its needle hold and read-out views about {tokens * 0.04 / 60:.0f} min more; "
        "each is kept afterwards (the read-out for each token it is asked at)."
    )
    assert "and its read-out view about 20 min more" in trace_page.time_line(infini_checkpoint, 40_000, False)
    at.radio(key="source").set_value("text").run()
    at.text_area(key="text_input").set_value("the cat sat. " * 400_000).run()  # over the limit: refused, no estimate
    assert "over the trace limit" in at.error[0].value or "than the trace limit" in at.error[0].value
    assert not [c for c in at.caption if "the trace takes about" in c.value]
    at.radio(key="source").set_value("file").run()
    label = at.get("file_uploader")[0].proto.label
    assert "at most 20 MB and 1,000,000 tokens" in label and "MB of English text" in label


def test_trace_page_says_when_a_sample_length_cannot_hold_its_prompt(infini_checkpoint):
    at = open_trace_page(infini_checkpoint)
    at.number_input(key="pk_length").set_value(100).run()
    assert not at.exception, at.exception
    assert "shorter than" in at.error[0].value, [e.value for e in at.error]


def test_the_app_takes_its_thread_count_from_memviz_threads(monkeypatch):
    import os

    from app.common import app_threads

    monkeypatch.delenv("MEMVIZ_THREADS", raising=False)
    for cores, threads in ((8, 4), (3, 1), (1, 1), (None, 1)):  # half the cores, at least one
        monkeypatch.setattr(os, "cpu_count", lambda c=cores: c)
        assert app_threads() == threads, cores
    monkeypatch.setenv("MEMVIZ_THREADS", "3")
    assert app_threads() == 3
    for bad in ("0", "two", "-1"):
        monkeypatch.setenv("MEMVIZ_THREADS", bad)
        with pytest.raises(ValueError, match="MEMVIZ_THREADS"):
            app_threads()


def test_trace_page_offers_a_facts_model_its_own_questions():
    at = open_trace_page("memory_plus_english")
    assert at.radio(key="source").value == "fact question"
    assert "from the knowledge base" in at.caption[1].value and "model says" in at.caption[1].value
    assert any("the values token" in t for t in chart_titles(at))  # what the question read from the memory layer


def test_trace_page_says_where_a_trace_stops_being_finite_and_when_the_model_is_busy(tmp_path, monkeypatch):
    model = small_model("titans", segment_len=8, memory={"variant": "mac", "theta_max": 1e6})  # its memory overshoots
    at = page("trace_page", str(memviz.save(model, tmp_path / "diverges")))
    at.session_state["pk_length"] = 300  # a short pass-key sample: a diverged memory is slow to decompose
    at.run()
    assert not at.exception, at.exception
    assert any(
        "stops being finite: the model diverged: its logits are not finite from token" in w.value for w in at.warning
    ), at.warning

    def busy(*args, **kwargs):
        raise memviz.ModelBusyError("this model is running another input")

    monkeypatch.setattr(memviz, "trace", busy)
    monkeypatch.setattr(trace_page, "BUSY_WAIT_S", 0.3)
    at.radio(key="source").set_value("text").run()
    at.text_area(key="text_input").input("another text, not cached").run()
    assert not at.exception and "The previous run on this model has not stopped within 0 s" in at.error[0].value


def test_the_model_page_keeps_the_checkpoint_chosen_before_its_widget_was_forgotten(tmp_path):
    """Streamlit drops a page's widgets when another page runs: coming back, the Model page shows the
    checkpoint the other pages run, not the default sample."""
    path = str(memviz.save(small_model("lm2", segment_len=16), tmp_path / "chosen"))
    at = page("model_page", path)  # model_path set, its picker's state gone
    at.run()
    assert not at.exception, at.exception
    assert at.selectbox(key="checkpoint_choice").value == path
    assert {m.label: m.value for m in at.metric}["family"] == "lm2" and at.session_state["model_path"] == path


def test_a_checkpoint_that_fails_to_load_is_what_the_other_pages_then_say(tmp_path):
    at = choose_path(open_app(), str(tmp_path / "missing"))
    assert "Cannot load this checkpoint" in at.error[0].value
    assert at.session_state["model_path"] == str(tmp_path / "missing")  # not the sample chosen before
    at.text_input(key="checkpoint_path").input("   ").run()
    assert "Give the path of a checkpoint folder" in at.info[0].value and not at.error
    trace = page("trace_page", "")  # what the Trace page runs after an empty path: no model, said
    trace.run()
    assert "No checkpoint chosen" in trace.warning[0].value and not trace.get("plotly_chart")


def test_the_read_out_follows_a_new_input_and_says_when_nothing_was_written_yet(infini_checkpoint):
    at = open_trace_page(infini_checkpoint)
    first = at.number_input(key="ro_position").value
    at.number_input(key="pk_length").set_value(512).run()
    moved = at.number_input(key="ro_position").value
    assert not at.exception and moved < 512 - 3 and sum("the evidence carries" in t for t in chart_titles(at)) == 2
    at.number_input(key="pk_length").set_value(2048).run()  # back: the answer's position again, not 512's
    assert at.number_input(key="ro_position").value == first
    at.number_input(key="ro_position").set_value(3).run()  # inside the first 16-token segment
    assert not at.exception and any("no earlier token has reached the memory" in i.value for i in at.info)


def test_a_one_token_text_traces(infini_checkpoint):
    at = open_trace_page(infini_checkpoint)
    at.radio(key="source").set_value("text").run()
    at.text_area(key="text_input").input("a").run()
    assert not at.exception and not at.error and at.get("plotly_chart")


def test_intervene_page_edits_a_prompt_of_two_segments_at_its_one_boundary(tmp_path):
    path = str(memviz.save(small_model("infini", segment_len=160), tmp_path / "infini160"))
    at = page("intervene_page", path)
    at.session_state["iv_length"] = 300  # two 160-token segments: one boundary to edit at
    at.run()
    assert not at.exception, at.exception
    assert "after the edit at token 160" in at.metric[0].label and not at.get("slider")[1:]


def test_compare_page_shows_one_checkpoint_beside_itself(infini_checkpoint):
    at = page("compare_page")
    at.run()
    for side in ("left", "right"):
        at.selectbox(key=f"cmp_{side}").select("a local path…").run()
        at.text_input(key=f"cmp_{side}_path").input(infini_checkpoint).run()
    assert not at.exception, at.exception
    loss, *views = [json.loads(c.proto.spec) for c in at.get("plotly_chart")]
    left, right, difference = (plotted(trace["y"]) for trace in loss["data"])
    assert len(left) > 10 and np.isfinite(left).sum() > 10 and np.array_equal(left, right, equal_nan=True)
    assert set(difference[np.isfinite(difference)]) == {0}  # the same model: no difference anywhere
    titles = [v["layout"]["title"]["text"] for v in views]
    assert len(titles) > 2 and titles[::2] == titles[1::2]  # each view of the left beside the same of the right
    assert not [c.value for c in at.caption if "no such view" in c.value]


def test_the_model_page_shows_bits_a_byte_as_such_and_every_stage_of_a_chain():
    from app.model_page import score_rows, stage_rows

    rows = score_rows({"lm": {"shakespeare": 2.0892}, "passkey": {"4096": 0.9}, "n_per_cell": 5})
    assert rows == [
        {"probe": "lm shakespeare", "score": "2.089 bits a byte", "samples": "the held-out documents"},
        {"probe": "passkey 4096", "score": "90%", "samples": "5 a cell"},
    ]
    assert score_rows({"passkey": {"4096": 0.9}})[0]["samples"] == "not recorded"
    card = memviz.load("infini_english_16k").card
    stages = stage_rows(card["stages"])
    assert [row["stage"] for row in stages][-1] == "infini_english_16k" and len(stages) == len(card["stages"]) > 1
    assert sum(row["steps"] for row in stages) > card["steps"]
    assert stage_rows({"stage1": "1000 steps"}) == [{"stage": "stage1", "what": "1000 steps"}]
    assert stage_rows("nonsense") == []


def test_a_run_time_is_said_in_seconds_under_90_and_in_minutes_past():
    from app.trace_page import duration

    assert [duration(s) for s in (0.4, 30, 89.4, 90, 5400, 10**6)] == [
        "0 s",
        "30 s",
        "89 s",
        "2 min",
        "90 min",
        "16,667 min",
    ]


def test_a_trace_waits_for_the_stopped_run_that_still_holds_the_model(monkeypatch):
    calls = []

    def busy_twice(*args):
        calls.append(args)
        if len(calls) < 3:
            raise memviz.ModelBusyError("held by the stopped script run")
        return "the trace"

    monkeypatch.setattr(trace_page, "cached_trace", busy_twice)
    assert trace_page.trace_when_free("ckpt", "text", None, None) == "the trace" and len(calls) == 3
    monkeypatch.setattr(trace_page, "cached_trace", lambda *a: (_ for _ in ()).throw(memviz.ModelBusyError("held")))
    with pytest.raises(memviz.ModelBusyError):
        trace_page.trace_when_free("ckpt", "text", None, None, wait=0.2)


def test_a_checkpoint_saved_anew_at_the_same_path_is_traced_anew(tmp_path):
    """The page's cached trace, read-out and needle hold are keyed by the weights' mtime, as its model is."""
    text, path = "Mary went back to the garden. Sandra journeyed to the kitchen. " * 3, tmp_path / "ckpt"
    means = []
    for seed in (1, 2):
        model = small_model("gated_deltanet", attention={"kind": "window", "span": 16}, seed=seed)
        memviz.save(model, path)
        os.utime(path / memviz.checkpoint.WEIGHTS_FILE, ns=(seed * 10**18, seed * 10**18))  # a later save
        shown = trace_page.trace_when_free(str(path), text, (), None).loss_summary()["mean_nats"]
        assert shown == pytest.approx(memviz.trace(model, text).loss_summary()["mean_nats"], rel=1e-9)
        means.append(shown)
    assert means[0] != means[1]


RELEASED_TITLES = {  # a model type of each released family: its decay's and its state norm's chart titles
    "qwen3_5_text": ("blocks.0: decay alpha (1 keeps the state)", "||S_t|| (mean over heads)"),
    "kimi_linear": ("blocks.0: decay alpha (1 keeps the state)", "||S_t|| (mean over heads)"),
    "bamba": ("blocks.0: decay exp(dt_t A) (1 keeps the state)", "||h_t|| (mean over heads)"),
    "mamba": ("blocks.0: decay exp(dt_t A) (1 keeps the state)", "||h_t|| (mean over heads)"),
    "xlstm": ("blocks.0: forget gate f_t (1 keeps the memory)", "||C_t|| (mean over heads)"),
    "recurrent_gemma": ("blocks.0: decay a_t per channel (1 keeps the state)", "||h_t|| (over the layer's channels)"),
}


@pytest.mark.parametrize("model_type", sorted(RELEASED_TITLES))
def test_every_page_opens_a_hugging_face_folder(model_type, tmp_path):
    """A released model's folder (memviz.models.released), one per family: its hooks listed; its Trace page;
    Intervene's ablation, Probes' grid and Compare beside itself run on it."""
    from memviz.models.released.tiny import tiny_checkpoint

    checkpoint = tmp_path / model_type
    tiny_checkpoint(checkpoint, model_type)
    family = memviz.load(checkpoint).family
    at = choose_path(open_app(), str(checkpoint))
    assert {m.label: m.value for m in at.metric}["family"] == family
    assert "blocks.{l}.attn.hook_state_norm" in set(at.dataframe[0].value["hook"])
    trace_page = open_trace_page(str(checkpoint))
    assert any(" tokens hold about " in c.value and "kv cache" in c.value for c in trace_page.caption)  # before it runs
    titles = chart_titles(trace_page)
    assert {*RELEASED_TITLES[model_type], "How much of the evidence the memory still holds"} <= set(titles), titles
    assert any(t.startswith("blocks.3: where the read at token") for t in titles), titles
    intervene = page("intervene_page", str(checkpoint))
    intervene.run()
    intervene.number_input(key="iv_length").set_value(1100).run()  # a released model's segments are 512 tokens
    assert not intervene.exception and "after the edit" in intervene.metric[0].label, intervene.exception
    probes = page("probes_page", str(checkpoint))
    probes.run()
    probes.multiselect(key="lengths").set_value([256]).run()
    probes.number_input(key="n").set_value(1).run()
    probes.button(key="run_probe").click().run()
    assert not probes.exception and len(probes.dataframe[0].value) == 3, probes.exception  # three depths
    compare = page("compare_page")
    compare.run()
    for side in ("cmp_left", "cmp_right"):
        compare.selectbox(key=side).select("a local path…").run()
        compare.text_input(key=f"{side}_path").input(str(checkpoint)).run()
    assert not compare.exception and sum(f"({family})" in m.value for m in compare.markdown) == 2, compare.exception
