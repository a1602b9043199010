"""`python -m training.evaluate` re-scores a checkpoint on the grid its card records."""

import json
import shutil
from pathlib import Path

import pytest

import memviz
from memviz_probes import facts, passkey
from tests.conftest import small_model
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
