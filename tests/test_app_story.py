"""The app's views of free text, driven headlessly (AppTest): the loss said in nats and bits a byte, the peaks table
that zooms every view, the read at any token and its logit lens, a layer chooser, Compare on text, and fields out of
range."""

import json
import re
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import memviz
from app import trace_page
from app.common import weights_stamp
from tests.conftest import small_model
from tests.test_app import page

ROOT = Path(__file__).resolve().parent.parent
TEXT = "To be, or not to be, that is the question: whether 'tis nobler in the mind to suffer. " * 6


def titles(at: AppTest) -> list[str]:
    return [json.loads(c.proto.spec)["layout"].get("title", {}).get("text", "") for c in at.get("plotly_chart")]


def traced_text(path: str, text: str = TEXT) -> AppTest:
    at = page("trace_page", path)
    at.run()
    at.radio(key="source").set_value("text").run()
    at.text_area(key="text_input").input(text).run()
    assert not at.exception and not at.error, (at.exception, [e.value for e in at.error])
    return at


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    folder = tmp_path_factory.mktemp("story")
    configs = {
        "longmem": {"window": 8, "segment_len": 16},
        "memory_layer": {},
        "lm2": {"segment_len": 16},
        "sliding_window": {"window": 16},
    }
    return {family: str(memviz.save(small_model(family, **cfg), folder / family)) for family, cfg in configs.items()}


@pytest.mark.parametrize("family, read", [("longmem", "chunks token"), ("memory_layer", "the values token")])
def test_the_read_at_any_token_of_free_text(checkpoints, family, read):
    at = traced_text(checkpoints[family])
    tr = trace_page.cached_trace(checkpoints[family], weights_stamp(checkpoints[family]), TEXT, (), None)
    field = at.number_input(key="ro_position")
    assert field.label == "read at token (default: the last token)" and field.value == len(tr) - 1
    field.set_value(40).run()
    assert not at.exception, at.exception
    shown = [t for t in titles(at) if read in t]
    assert shown and all("token 40 " in t for t in shown), shown
    tables = ("the text of the chunks token 40 ", "who else reads the values token 40 ")
    assert any(table in t for t in titles(at) for table in tables)  # the table beside it
    at.number_input(key="ro_position").set_value(len(tr) + 5).run()  # out of range: said, nothing stale shown
    assert any("read at token" in e.value and "is outside 0 to" in e.value for e in at.error)
    assert not [t for t in titles(at) if read in t]


def test_a_peak_chosen_in_the_table_zooms_every_view_and_the_read_there(checkpoints):
    at = traced_text(checkpoints["longmem"])
    tr = trace_page.cached_trace(checkpoints["longmem"], weights_stamp(checkpoints["longmem"]), TEXT, (), None)
    summary = tr.loss_summary()
    said = [m.value for m in at.markdown if m.value.startswith("**Next-token loss**")]
    assert said and f"mean {summary['mean_nats']:.3f} nats" in said[0] and "bits a byte" in said[0]
    table = at.dataframe[0].value
    assert table["position"].tolist() == tr.peaks("loss", 10, apart=trace_page.PEAK_ZOOM // 2)["position"].tolist()
    top = int(table["position"].iloc[0])
    chooser = at.selectbox(key="peak_zoom")
    chooser.select(chooser.options[0]).run()
    assert not at.exception, at.exception
    low, high = at.slider(key="zoom").value
    assert low == max(0, top - trace_page.PEAK_ZOOM) and high == min(len(tr), top + trace_page.PEAK_ZOOM + 1)
    assert at.number_input(key="ro_position").value == top
    assert any(f"chunks token {top} " in t for t in titles(at))
    at.selectbox(key="peak_quantity").select("side_blocks.1.attn.hook_gate").run()  # another quantity, its rows
    assert not at.exception and at.dataframe[0].value["position"].tolist() == (
        tr.peaks("side_blocks.1.attn.hook_gate", 10, apart=trace_page.PEAK_ZOOM // 2)["position"].tolist()
    )


def test_a_layer_chooser_shows_one_layer_of_lm2(checkpoints):
    at = traced_text(checkpoints["lm2"])
    every = titles(at)
    assert any(t.startswith("blocks.0: LM2 gates") for t in every) and any(t.startswith("blocks.1: LM2") for t in every)
    at.selectbox(key="fig-layer").select("blocks.1").run()
    one = titles(at)
    assert not any(t.startswith("blocks.0") for t in one) and any(t.startswith("blocks.1: slot norms") for t in one)
    assert any(t.startswith("Next-token loss") for t in one)  # a view of the whole model stays


def test_a_one_token_text_says_why_its_loss_chart_is_empty(checkpoints):
    at = traced_text(checkpoints["sliding_window"], "A")
    assert any("a one-token input has no next token to predict" in m.value for m in at.markdown)


def test_the_cost_line_counts_the_input_exactly(checkpoints):
    at = traced_text(checkpoints["sliding_window"])
    path = checkpoints["sliding_window"]
    n = len(trace_page.cached_trace(path, weights_stamp(path), TEXT, (), None))
    assert any(c.value.startswith(f"{n:,} tokens hold ") for c in at.caption), [c.value for c in at.caption]


def test_compare_reads_one_text_through_two_models(checkpoints):
    at = page("compare_page")
    at.run()
    for side, family in (("cmp_left", "longmem"), ("cmp_right", "sliding_window")):
        at.selectbox(key=side).select("a local path…").run()
        at.text_input(key=f"{side}_path").input(checkpoints[family]).run()
    at.radio(key="cmp_source").set_value("text").run()
    at.text_area(key="cmp_text").input(TEXT).run()
    assert not at.exception and not at.error, at.exception
    shown = titles(at)
    assert shown[0].startswith("Next-token loss, overlaid") and any("retrieval" in t.lower() for t in shown)
    assert sum(c.value.startswith("Next-token loss, the text: mean") for c in at.caption) == 2
    only = [m.value for m in at.markdown if m.value.startswith("**Only ")]
    assert len(only) == 1 and "(longmem)" in only[0]


def test_an_out_of_range_number_is_said_and_the_old_results_go(checkpoints):
    at = page("intervene_page", checkpoints["sliding_window"])
    at.run()
    assert not at.exception and not at.error
    at.number_input(key="iv_length").set_value(99_999_999).run()
    assert [e.value for e in at.error] == [
        "pass-key length (tokens): 99,999,999 is outside 100 to 20,000; nothing is shown for it."
    ]
    assert not at.metric and not at.markdown


def test_the_upload_limit_said_on_the_widget_is_the_apps():
    config = (ROOT / ".streamlit" / "config.toml").read_text()  # tomllib is not in Python 3.10
    server = config.split("[server]", 1)[1]
    assert int(re.search(r"^maxUploadSize = (\d+)$", server, re.M).group(1)) * 2**20 == trace_page.MAX_UPLOAD_BYTES


def test_probes_reach_the_samples_tested_lengths_and_say_their_cost_first(checkpoints, monkeypatch):
    monkeypatch.setattr(trace_page, "tokens_per_second", lambda path, stamp: 1000.0)  # the cost, not this machine's
    at = page("probes_page", checkpoints["sliding_window"])
    at.run()
    assert {"16384", "32768", "65536"} <= set(at.multiselect(key="lengths").options)
    at.multiselect(key="lengths").set_value([16384]).run()
    # 5 samples x 3 depths at 16,384 tokens, at 1,000 tokens a second: said before any Run
    assert "15 prompts, 245,760 tokens: about 4 min on this machine at the model's measured speed." in [
        c.value for c in at.caption
    ]
    assert not at.exception and not at.get("plotly_chart")


def test_the_state_rank_of_a_matrix_memory_on_request(tmp_path):
    from tests.conftest import FAMILY_CONFIGS

    path = str(memviz.save(small_model("gated_deltanet", **FAMILY_CONFIGS["gated_deltanet"]), tmp_path / "gdn"))
    at = traced_text(path)
    assert not [t for t in titles(at) if "state rank" in t.lower() or "directions" in t]  # not before it is asked
    at.number_input(key="rank_every").set_value(16).run()
    at.button(key="rank_run").click().run()
    assert not at.exception, at.exception
    shown = [t for t in titles(at) if "how many directions each head's state uses" in t]
    assert shown and shown[0].startswith("blocks.0 S")
    at.number_input(key="rank_every").set_value(0).run()  # out of range: said, the old figures gone
    assert any("a state every (tokens): 0 is outside" in e.value for e in at.error)
    assert not [t for t in titles(at) if "directions" in t]


def test_the_read_lens_at_a_chosen_token_lists_what_the_library_computes(tmp_path):
    from memviz.read_lens import read_lens
    from tests.conftest import FAMILY_CONFIGS

    path = str(memviz.save(small_model("gated_deltanet", **FAMILY_CONFIGS["gated_deltanet"]), tmp_path / "gdn"))
    at = traced_text(path)
    at.number_input(key="ro_position").set_value(40).run()
    assert not at.exception, at.exception
    shown = [t for t in titles(at) if "what the memory's read at token 40 promotes" in t]
    assert shown == [
        "blocks.0: what the memory's read at token 40 promotes, and who wrote it",
        "blocks.1: what the memory's read at token 40 promotes, and who wrote it",
    ]
    at.selectbox(key="lens-layer").select("blocks.1").run()
    assert [t for t in titles(at) if "promotes" in t] == [shown[1]]
    model = memviz.load(path)
    expected = read_lens(model, model.tokenizer.encode(TEXT), 40).layers["blocks.1"]
    promoted = next(d.value for d in at.dataframe if "logit" in d.value.columns and "rank" in d.value.columns)
    assert promoted["token"].tolist() == expected.promoted["token"].tolist()
    writers = next(d.value for d in at.dataframe if "promotes" in d.value.columns)
    assert writers["position"].tolist() == expected.writers["position"].tolist()
