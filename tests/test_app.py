"""The Streamlit app driven headlessly with AppTest."""
from pathlib import Path

import pytest
from streamlit.testing.v1 import AppTest

import memviz
from tests.conftest import small_model

APP = str(Path(__file__).resolve().parent.parent / "app" / "streamlit_app.py")


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


@pytest.mark.parametrize("corrupt", ["missing", "garbage"])
def test_model_page_reports_bad_checkpoints(tmp_path, corrupt):
    path = tmp_path / "ckpt"
    if corrupt == "garbage":
        memviz.save(small_model(), path)
        (path / "model.safetensors").write_bytes(b"\x00" * 10)
    at = choose_path(open_app(), str(path))
    assert len(at.error) == 1 and "Cannot load this checkpoint" in at.error[0].value
    assert not at.metric
