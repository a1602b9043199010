"""The Dictionary page driven headlessly with AppTest: it trains a dictionary on a layer's writes, shows its atoms,
figures and an atom's logit effect, opens a saved one, and refuses what it cannot do with one clear line."""

import pytest

import memviz
from memviz.write_dictionary import load_dictionary, save_dictionary, train_on_text
from tests.conftest import FAMILY_CONFIGS, small_model
from tests.test_app import chart_titles, page

TEXT = "Sandra journeyed to the kitchen. Mary went back to the garden. " * 4


@pytest.fixture(scope="module")
def gdn_checkpoint(tmp_path_factory):
    model = small_model("gated_deltanet", **FAMILY_CONFIGS["gated_deltanet"])
    return str(memviz.save(model, tmp_path_factory.mktemp("ckpt") / "gdn"))


def open_page(path: str):
    at = page("dictionary_page", path)
    at.session_state["wd_choice"] = "a local path…"
    at.session_state["wd_path"] = path
    at.run()
    assert not at.exception, at.exception
    return at


def test_the_page_trains_a_dictionary_and_shows_its_atoms(gdn_checkpoint):
    at = open_page(gdn_checkpoint)
    assert at.selectbox(key="wd_layer").options == ["0", "1"]
    at.text_area(key="wd_text").input(TEXT).run()
    at.number_input(key="wd_atoms").set_value(8).run()
    at.number_input(key="wd_k").set_value(2).run()
    at.number_input(key="wd_steps").set_value(20).run()
    at.button(key="wd_train").click().run()
    assert not at.exception and not at.error, (at.exception, at.error)
    table = at.dataframe[0].value
    assert len(table) == 2 * 8 and list(table.columns) == ["head", "atom", "frequency", "mean_activation", "fires_on"]
    titles = chart_titles(at)
    assert any("how often each atom fires" in t for t in titles) and any(
        "its activation at each write" in t for t in titles
    )
    assert "its card says the explained variance by head: head 0:" in at.caption[1].value
    at.button(key="wd_effect").click().run()
    assert not at.exception and any("promotes" in m.value for m in at.markdown), at.markdown


def test_the_page_opens_a_saved_dictionary_and_names_a_bad_one(gdn_checkpoint, tmp_path):
    model = memviz.load(gdn_checkpoint)
    dictionary, _ = train_on_text(model, TEXT, 1, n_atoms=4, k=1, steps=5, batch=16)
    folder = save_dictionary(dictionary, tmp_path / "d")
    at = open_page(gdn_checkpoint)
    at.selectbox(key="wd_layer").select(1).run()
    at.radio(key="wd_source").set_value("open a saved one").run()
    at.text_area(key="wd_text").input(TEXT).run()
    at.text_input(key="wd_folder").input(str(folder)).run()
    at.button(key="wd_open").click().run()
    assert not at.exception and not at.error, at.error
    assert len(at.dataframe[0].value) == 2 * load_dictionary(folder).n_atoms
    (folder / "dictionary.safetensors").write_bytes(b"junk")
    at.button(key="wd_open").click().run()
    assert len(at.error) == 1 and "dictionary.safetensors: not a safetensors file" in at.error[0].value


def test_the_page_refuses_a_text_over_its_max_tokens_and_a_model_without_writes(gdn_checkpoint, tmp_path):
    at = open_page(gdn_checkpoint)
    at.text_area(key="wd_text").input(TEXT).run()
    at.number_input(key="wd_max_tokens").set_value(10).run()
    at.button(key="wd_train").click().run()
    assert len(at.error) == 1 and "over the trace limit of 10" in at.error[0].value, at.error
    at.number_input(key="wd_max_tokens").set_value(900_000).run()
    assert len(at.error) == 1 and "max tokens: 900,000 is outside 1 to 200,000" in at.error[0].value
    window = str(memviz.save(small_model("sliding_window", window=8), tmp_path / "sw"))
    at = open_page(window)
    assert "has no layer with writes" in at.info[0].value
