"""`python -m memviz_probes` writes CSV and an HTML figure, and reports bad input in one line."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest

import memviz
from tests.conftest import exits_2_with_one_line, small_model

ROOT = Path(__file__).resolve().parent.parent


def probes_cli(*args):
    return subprocess.run(
        [sys.executable, "-m", "memviz_probes", *map(str, args), "--no-progress"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return memviz.save(small_model("sliding_window", window=16), tmp_path_factory.mktemp("ckpt") / "tiny")


def test_passkey_cli_writes_csv_and_html(checkpoint, tmp_path):
    out = probes_cli("passkey", checkpoint, "--lengths", 300, 400, "--depths", 0, 1, "--n", 2, "--out", tmp_path)
    assert out.returncode == 0, out.stderr
    df = pd.read_csv(tmp_path / "passkey.csv")
    assert len(df) == 8 and {"length", "depth", "answer", "prediction", "correct"} <= set(df.columns)
    html = (tmp_path / "passkey.html").read_text()
    assert "plotly" in html and "Pass-key retrieval" in html
    assert "accuracy" in out.stdout


def test_babilong_and_facts_cli(checkpoint, tmp_path):
    out = probes_cli("babilong", checkpoint, "--tasks", "qa1", "qa4", "--lengths", 400, "--n", 1, "--out", tmp_path)
    assert out.returncode == 0, out.stderr
    assert pd.read_csv(tmp_path / "babilong.csv")["task"].tolist() == ["qa1", "qa4"]
    out = probes_cli("facts", checkpoint, "--n", 3, "--out", tmp_path)
    assert out.returncode == 0, out.stderr
    assert len(pd.read_csv(tmp_path / "facts.csv")) == 3


def test_ruler_cli_over_two_workers_writes_the_single_process_table(checkpoint, tmp_path):
    args = [
        "ruler",
        checkpoint,
        "--tasks",
        "niah_single_1",
        "--lengths",
        512,
        640,
        "--depths",
        0,
        1,
        "--n",
        2,
        "--threads",
        1,
    ]
    alone = probes_cli(*args, "--out", tmp_path / "one")
    spread = probes_cli(*args, "--workers", 2, "--out", tmp_path / "two")
    assert alone.returncode == 0 and spread.returncode == 0, alone.stderr + spread.stderr
    one, two = pd.read_csv(tmp_path / "one" / "ruler.csv"), pd.read_csv(tmp_path / "two" / "ruler.csv")
    assert len(one) == 8 and {"task", "length", "depth", "answer", "prediction", "correct"} <= set(one.columns)
    pd.testing.assert_frame_equal(one, two)
    assert "niah_single_1" in (tmp_path / "two" / "ruler.html").read_text()


def test_ruler_under_torchrun_writes_the_single_process_table_from_rank_0(checkpoint, tmp_path):
    args = [
        "ruler",
        checkpoint,
        "--tasks",
        "niah_single_1",
        "--lengths",
        512,
        640,
        "--depths",
        0.5,
        "--samples",
        3,
        "--threads",
        1,
        "--no-progress",
    ]
    alone = probes_cli(*args[:-1], "--out", tmp_path / "one")
    ranks = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc_per_node",
            "2",
            "-m",
            "probes",
            *map(str, args),
            "--out",
            str(tmp_path / "two"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert alone.returncode == 0 and ranks.returncode == 0, alone.stderr + ranks.stderr[-3000:]
    one, two = pd.read_csv(tmp_path / "one" / "ruler.csv"), pd.read_csv(tmp_path / "two" / "ruler.csv")
    assert len(one) == 6
    pd.testing.assert_frame_equal(one, two)
    refused = subprocess.run(
        [sys.executable, "-m", "memviz_probes", "facts", str(checkpoint), "--out", str(tmp_path)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "WORLD_SIZE": "2", "RANK": "0"},
    )
    assert refused.returncode == 2 and "torchrun splits the passkey and ruler grids" in refused.stderr


@pytest.mark.parametrize(
    "args, message",
    [
        (["passkey", "/no/such/checkpoint", "--lengths", 500], "no such checkpoint folder"),
        (["passkey", None, "--lengths", 500, "--depths", 2], r"depth must lie in \[0, 1\]"),
        (["babilong", None, "--tasks", "qa7", "--lengths", 500], "unknown task 'qa7'"),
        (["babilong", None, "--lengths", 500, "--data-path", "/no/such/data"], "does not exist"),
        (["ruler", None, "--tasks", "niah_single_9", "--lengths", 2048], "unknown RULER task 'niah_single_9'"),
        (["ruler", None, "--lengths", 2048, "--workers", 0], "workers must be a positive number"),
        (["passkey", None, "--lengths", 500, "--workers", 0], "workers must be a positive number"),
    ],
)
def test_cli_errors_are_one_clear_line(checkpoint, tmp_path, args, message):
    out = probes_cli(*[checkpoint if a is None else a for a in args], "--out", tmp_path)
    assert out.returncode == 2
    assert out.stderr.startswith("error: ") and len(out.stderr.strip().splitlines()) == 1
    assert re.search(message, out.stderr), out.stderr


def test_lm_cli_writes_bits_per_byte_and_the_position_curve_for_each_checkpoint(checkpoint, tmp_path):
    other = memviz.save(small_model("sliding_window", seed=3, window=16), tmp_path / "other")
    out = probes_cli("lm", checkpoint, other, "--corpus", "all", "--max-tokens", 200, "--out", tmp_path / "res")
    assert out.returncode == 0, out.stderr
    df = pd.read_csv(tmp_path / "res" / "lm.csv")
    assert sorted(df["document"]) == sorted(["hamlet", "tempest", "chapter_11"] * 2) and (df["tokens"] == 200).all()
    assert df.groupby("model")["bits_per_byte"].mean().between(7, 10).all()  # a fresh byte model: about log2(259) bits
    positions = pd.read_csv(tmp_path / "res" / "lm_positions.csv")
    assert positions.groupby("model")["tokens"].sum().tolist() == [3 * 199] * 2
    assert "local window (16)" in (tmp_path / "res" / "lm.html").read_text() and "shakespeare" in out.stdout
    bad = probes_cli("lm", checkpoint, "--documents", "macbeth", "--out", tmp_path / "bad")
    assert bad.returncode == 2 and "not in the heldout split" in bad.stderr and not (tmp_path / "bad").exists()
    for flag in ("--n", "--samples", "--seed"):  # lm reads whole documents: what it would ignore is refused
        ignored = probes_cli("lm", checkpoint, flag, 5, "--out", tmp_path / "ignored")
        assert ignored.returncode == 2 and not (tmp_path / "ignored").exists()
        assert ignored.stderr == (
            f"error: lm reads every token of whole documents and draws nothing: {flag} does not apply (choose what "
            "it reads with --documents and --max-tokens)\n"
        )


@pytest.mark.parametrize("what", ["a link", "a folder"])
def test_results_are_never_written_through_a_link_nor_lost_to_a_folder(checkpoint, tmp_path, what):
    precious = tmp_path / "precious.txt"
    precious.write_text("keep me")
    out = tmp_path / "out"
    out.mkdir()
    if what == "a link":
        (out / "passkey.csv").symlink_to(precious)
    else:
        (out / "passkey.csv").mkdir()
    done = probes_cli("passkey", checkpoint, "--lengths", 300, "--depths", 0, "--n", 1, "--out", out)
    assert done.returncode == 2 and "passkey.csv is there and is not a plain file" in done.stderr
    assert precious.read_text() == "keep me" and sorted(p.name for p in out.iterdir()) == ["passkey.csv"]


def test_an_empty_out_is_refused_not_the_working_folder(checkpoint, tmp_path):
    done = subprocess.run(
        [sys.executable, "-m", "memviz_probes", "facts", str(checkpoint), "--n", "1", "--out", "", "--no-progress"],
        cwd=tmp_path,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 2 and "--out: an empty path" in done.stderr and list(tmp_path.iterdir()) == []


def test_a_second_run_into_the_same_out_keeps_the_first_unless_replace(checkpoint, tmp_path):
    args = ("facts", checkpoint, "--n", 1, "--out", tmp_path)
    assert probes_cli(*args).returncode == 0
    first = (tmp_path / "facts.csv").read_bytes()
    again = probes_cli(*args, "--seed", 5)
    assert again.returncode == 2 and "facts.csv holds an earlier run's results; pass --replace" in again.stderr
    assert (tmp_path / "facts.csv").read_bytes() == first
    replaced = probes_cli(*args, "--seed", 5, "--replace")
    assert replaced.returncode == 0, replaced.stderr
    assert (tmp_path / "facts.csv").read_bytes() != first


@pytest.mark.parametrize("probe, extra", [("retention", ["--distances", 64]), ("lm", ["--max-tokens", 50])])
def test_a_checkpoint_named_twice_is_refused_not_merged_into_one_line(checkpoint, tmp_path, probe, extra):
    done = probes_cli(probe, checkpoint, checkpoint, *extra, "--out", tmp_path / "res")
    assert done.returncode == 2 and f"checkpoint '{checkpoint}' is given more than once" in done.stderr
    assert not (tmp_path / "res").exists()


@pytest.mark.parametrize("rank, world", [("0", "0"), ("abc", "2"), ("5", "1")])
def test_torchrun_variables_that_make_no_shard_are_named(monkeypatch, capsys, checkpoint, rank, world):
    from memviz_probes.__main__ import main

    monkeypatch.setenv("RANK", rank)
    monkeypatch.setenv("WORLD_SIZE", world)
    assert main(["passkey", str(checkpoint), "--lengths", "512"]) == 2
    assert f"got RANK={rank!r} and WORLD_SIZE={world!r}" in capsys.readouterr().err


def test_ctrl_c_during_a_grid_writes_nothing_and_leaves_no_new_folder(checkpoint, tmp_path, monkeypatch, capsys):
    from memviz_probes import passkey
    from memviz_probes.__main__ import main

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(passkey, "run", interrupted)
    out = tmp_path / "results"
    assert main(["passkey", str(checkpoint), "--lengths", "512", "--out", str(out), "--no-progress"]) == 130
    assert "interrupted: no results written" in capsys.readouterr().err and not out.exists()
    out.mkdir()
    (out / "passkey.csv").write_text("earlier")
    assert main(["passkey", str(checkpoint), "--lengths", "512", "--out", str(out), "--replace"]) == 130
    assert (out / "passkey.csv").read_text() == "earlier"


def test_the_probes_command_refuses_dev_zero_in_one_line(tmp_path):
    import subprocess
    import sys

    folder = memviz.save(small_model("sliding_window", window=8), tmp_path / "ckpt")
    for args, named in [
        (["passkey", folder, "--lengths", 300, "--haystack", "/dev/zero"], "haystack file /dev/zero"),
        (["babilong", folder, "--lengths", 300, "--data-path", "/dev/zero"], "BABILong data file /dev/zero"),
        (["passkey", folder, "--lengths", 100_000_000], "lengths are whole numbers of tokens"),
    ]:
        out = subprocess.run(
            [sys.executable, "-W", "ignore", "-m", "memviz_probes", *map(str, args), "--out", str(tmp_path / "o")],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1 and named in out.stderr, out.stderr


@pytest.mark.parametrize("case", ["a file", "under a file"])
def test_probes_out_that_cannot_be_written_is_refused_before_the_run(case, tmp_path):
    import subprocess
    import sys

    (tmp_path / "file").write_text("x")
    out_path = tmp_path / "file" if case == "a file" else tmp_path / "file" / "results"
    out = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "probes",
            "passkey",
            "/no/such/checkpoint",
            "--lengths",
            "300",
            "--out",
            str(out_path),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.startswith("error: --out ") and str(out_path) in out.stderr, out.stderr


def test_probes_facts_on_a_model_never_trained_on_facts_says_so(tmp_path):
    import subprocess
    import sys

    folder = memviz.save(small_model("sliding_window", window=8), tmp_path / "ckpt")
    out = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-m",
            "probes",
            "facts",
            str(folder),
            "--n",
            "1",
            "--no-progress",
            "--out",
            str(tmp_path / "o"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0 and "its card names no facts knowledge base" in out.stderr, out.stderr


COMMAND_CASES = [
    "probes",
    "probes threads",
    "probes threads 100000",
]


@pytest.mark.parametrize("case", COMMAND_CASES)
def test_the_command_lines_exit_2_with_one_line(case, tmp_path):
    command, named = {
        "probes": (["-m", "memviz_probes", "passkey", str(tmp_path / "nowhere"), "--lengths", "512"], "nowhere"),
        "probes threads": (
            ["-m", "memviz_probes", "passkey", "infini_english_16k", "--lengths", "512", "--threads", "0"],
            "--threads",
        ),
        "probes threads 100000": (
            ["-m", "memviz_probes", "passkey", "infini_english_16k", "--lengths", "512", "--threads", "100000"],
            "--threads",
        ),
    }[case]
    exits_2_with_one_line(command, named)
