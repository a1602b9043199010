"""The probe registry is the one table of probes: the command line, the Probes page and a probe of a test's own
read it, and `python -m memviz_probes` names no probe itself."""

import ast
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
from streamlit.testing.v1 import AppTest

import memviz
from memviz_probes.__main__ import main
from memviz_probes.registry import Arg, Probe, Widget, get_probe, register_probe, registered_probes, unregister_probe
from tests.conftest import small_model

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return str(memviz.save(small_model("sliding_window", window=8), tmp_path_factory.mktemp("ckpt") / "tiny"))


def toy_figure(df: pd.DataFrame):
    import plotly.graph_objects as go

    return go.Figure(go.Bar(x=df["i"], y=df["correct"]), layout={"title": "Toy probe"})


def toy_run(model, args) -> pd.DataFrame:
    """One row per time asked, each naming the model's family and the seed it was given."""
    return pd.DataFrame(
        {"i": range(args.times), "family": model.family, "seed": args.seed, "correct": [True] * args.times}
    )


@pytest.fixture
def toy():
    probe = register_probe(
        Probe(
            name="toy",
            summary="a test's own probe",
            run=toy_run,
            figure=toy_figure,
            summary_table=lambda df: df.groupby("family")["correct"].mean(),
            args=(
                Arg(
                    "times",
                    int,
                    default=2,
                    help="rows to make",
                    widget=Widget("number", "toy_times", "Times", default=2, bounds=(1, 5)),
                ),
            ),
        )
    )
    yield probe
    unregister_probe("toy")


def test_every_probe_is_in_the_help_with_its_declared_arguments(capsys):
    out = subprocess.run(
        [sys.executable, "-m", "memviz_probes", "--help"], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr
    probes = registered_probes()
    assert {"passkey", "babilong", "facts", "retention", "ruler", "lm"} <= {p.name for p in probes}
    for probe in probes:
        assert f"    {probe.name} " in out.stdout and probe.summary.split()[0] in out.stdout
        with pytest.raises(SystemExit) as done:
            main([probe.name, "--help"])
        assert done.value.code == 0
        usage = capsys.readouterr().out
        flags = [arg.flag for arg in probe.args]
        flags += ["--n", "--seed"] if probe.sampled else []
        flags += ["--workers"] if probe.workers else []
        assert all(f"{flag} " in usage for flag in flags), (probe.name, usage)
        assert ("[CHECKPOINT ...]" in usage) == probe.several
        if not probe.sampled:
            assert "--seed" not in usage


def test_a_probe_registered_by_a_test_runs_from_the_command_line(toy, checkpoint, tmp_path, capsys):
    assert main(["toy", checkpoint, "--times", "3", "--seed", "7", "--out", str(tmp_path), "--no-progress"]) == 0
    df = pd.read_csv(tmp_path / "toy.csv")
    assert len(df) == 3 and set(df["family"]) == {"sliding_window"} and set(df["seed"]) == {7}
    assert "Toy probe" in (tmp_path / "toy.html").read_text()
    assert f"accuracy 100.0% over 3 samples; wrote {tmp_path / 'toy'}.csv and .html" in capsys.readouterr().out
    assert main(["toy", checkpoint, "--out", str(tmp_path)]) == 2  # its files are there: --replace, as for any probe
    assert "toy.csv holds an earlier run's results" in capsys.readouterr().err
    assert get_probe("toy").run_with(memviz.load(checkpoint), times=1).shape[0] == 1
    with pytest.raises(ValueError, match="probe 'toy' takes no depths; it takes times, n, seed"):
        get_probe("toy").arguments(memviz.load(checkpoint), depths=[0.5])
    with pytest.raises(ValueError, match="'toy' registered twice"):
        register_probe(toy)


def test_an_unknown_probe_names_the_known_ones():
    with pytest.raises(ValueError, match="unknown probe 'nonesuch'; known probes are ") as raised:
        get_probe("nonesuch")
    assert all(probe.name in str(raised.value) for probe in registered_probes())


def test_the_command_line_names_no_probe_itself():
    """`main` and `parser` ask the registry: no probe's name is a string in probes/__main__.py."""
    tree = ast.parse((ROOT / "probes" / "__main__.py").read_text())
    strings = {node.value for node in ast.walk(tree) if isinstance(node, ast.Constant) and isinstance(node.value, str)}
    assert not strings & {probe.name for probe in registered_probes()}


def page(checkpoint: str) -> AppTest:
    at = AppTest.from_string(
        f"import sys\nsys.path.insert(0, {str(ROOT)!r})\nfrom app import probes_page\nprobes_page.render()\n",
        default_timeout=120,
    )
    at.session_state["model_path"] = checkpoint
    return at.run()


def test_the_probes_page_lists_the_registry_and_runs_a_probe_of_a_tests_own(toy, checkpoint):
    from app.probes_page import page_probes

    assert [probe.name for probe in page_probes().values()] == [probe.name for probe in registered_probes()]
    at = page(checkpoint)
    assert not at.exception, at.exception
    assert at.radio(key="probe").options == [probe.page.label or probe.name for probe in registered_probes()]
    at.radio(key="probe").set_value("toy").run()
    at.number_input(key="toy_times").set_value(4).run()
    at.button(key="run_probe").click().run()
    assert not at.exception, at.exception
    table = at.dataframe[0].value
    assert len(table) == 4 and set(table["family"]) == {"sliding_window"}
    assert at.metric[0].value == "100%" and len(at.get("plotly_chart")) == 1
