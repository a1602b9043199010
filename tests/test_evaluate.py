"""`python -m training.evaluate` re-scores a checkpoint on the grid its card records."""

import json
import re
import shutil
from pathlib import Path

import pytest

import memviz
from memviz_probes import facts, passkey
from tests.conftest import ROOT, exits_2_with_one_line, small_model, tiny_run
from training import evaluate
from training.evaluate import main, probe_scores

SAMPLES = Path(__file__).resolve().parent.parent / "sample_checkpoints"


@pytest.mark.parametrize(
    "sample, grid",
    [
        ("longmem_english", {"passkey_lengths": [300], "passkey_depths": [0.5], "final_n": 2, "seed": 3, "lm": False}),
        ("memory_plus_english", {"passkey_lengths": [], "facts": 4, "final_n": 2, "seed": 3, "lm": False}),
    ],
)
def test_evaluate_writes_the_scores_into_the_card(sample, grid, tmp_path, capsys):
    """A copy of a sample that scores, on a small grid written into its card: the card gets what the
    probes give run alone on the same grid and seed."""
    path = tmp_path / sample
    shutil.copytree(SAMPLES / sample, path)
    card = json.loads((path / "card.json").read_text())
    card["train_config"]["eval"] = {**card["train_config"]["eval"], "passkey_haystacks": [], **grid}
    (path / "card.json").write_text(json.dumps(card))
    assert main([str(path), "--write-card"]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert json.loads((path / "card.json").read_text())["probe_scores"] == printed and printed["n_per_cell"] == 2
    model = memviz.load(path)
    if grid["passkey_lengths"]:
        alone = passkey.run(model, [300], [0.5], n=2, seed=3)["correct"].mean()
        assert set(printed) == {"passkey", "n_per_cell"} and printed["passkey"]["300"] == alone > 0
    else:
        alone = facts.run(model, n=4, seed=3)["correct"].mean()
        assert set(printed) == {"facts", "n_per_cell"} and printed["facts"] == alone > 0


def test_evaluate_scores_fresh_samples_on_another_seed(tmp_path, capsys, monkeypatch):
    grid = {"passkey_lengths": [300], "passkey_depths": [0.5], "final_n": 20, "seed": 0}
    path = memviz.save(
        small_model("sliding_window", window=16), tmp_path / "ckpt", card={"train_config": {"eval": grid}}
    )
    asked = []

    def recording(model, **kwargs):
        asked.append(kwargs)
        return probe_scores(model, **kwargs)

    monkeypatch.setattr(evaluate, "probe_scores", recording)
    assert main([str(path), "--n", "3", "--seed", "7", "--write-card"]) == 0
    assert main([str(path), "--n", "2"]) == 0
    assert [(a["seed"], a["n"], a["passkey_lengths"]) for a in asked] == [(7, 3, [300]), (0, 2, [300])]
    first = json.loads(capsys.readouterr().out.split("\n}\n")[0] + "}")
    card = json.loads((path / "card.json").read_text())
    assert card["probe_seed"] == 7 and card["probe_scores"] == first and first["n_per_cell"] == 3


def test_evaluate_rejects_a_sample_count_below_one(tmp_path, capsys):
    with pytest.raises(SystemExit):
        main([str(tmp_path), "--n", "0"])
    assert "--n must be at least 1" in capsys.readouterr().err


def test_evaluate_reports_a_bad_checkpoint(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 2
    assert "no such checkpoint folder" in capsys.readouterr().err


def test_evaluate_names_a_card_whose_train_config_is_not_a_mapping(tmp_path):
    import subprocess
    import sys

    folder = memviz.save(small_model("sliding_window", window=8), tmp_path / "ckpt")
    card = json.loads((folder / "card.json").read_text()) if (folder / "card.json").exists() else {}
    (folder / "card.json").write_text(json.dumps({**card, "train_config": "lr=3e-3"}))
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "training.evaluate", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "card.json: train_config must be a mapping" in out.stderr and "ckpt" in out.stderr


@pytest.mark.parametrize(
    "grid, named",
    [
        (
            {"passkey_lengths": [20]},
            "eval.passkey_lengths: length 20 is shorter than the instruction, needle and question",
        ),
        (
            {"babilong_tasks": ["qa1"], "babilong_lengths": [10]},
            "eval.babilong_tasks and babilong_lengths: length 10 is shorter than the qa1 story",
        ),
    ],
)
def test_an_eval_length_too_short_for_its_probe_is_refused_before_training(grid, named, tmp_path):
    from training import Trainer

    with pytest.raises(ValueError, match=re.escape(named)):
        Trainer(tiny_run(tmp_path / "run", eval=grid), progress=False)


COMMAND_CASES = [
    "evaluate",
    "evaluate a huge grid",
]


@pytest.mark.parametrize("case", COMMAND_CASES)
def test_the_command_lines_exit_2_with_one_line(case, tmp_path):
    command, named = {
        "evaluate": (["-m", "training.evaluate", str(tmp_path / "nowhere")], "nowhere"),
        "evaluate a huge grid": (["-m", "training.evaluate", "sliding_window", "--n", "100000000"], "samples, over"),
    }[case]
    exits_2_with_one_line(command, named)
