"""`python -m training.evaluate` re-scores a checkpoint on the grid its card records."""

import json

import pytest

import memviz
from tests.conftest import small_model
from training import evaluate
from training.evaluate import main, probe_scores


def test_evaluate_writes_the_scores_into_the_card(tmp_path, capsys):
    path = memviz.save(
        small_model("sliding_window", window=16),
        tmp_path / "ckpt",
        card={
            "train_config": {
                "eval": {"passkey_lengths": [300], "passkey_depths": [0.5], "facts": 3, "final_n": 2, "seed": 0}
            },
            "facts": {"kb_seed": 0, "n_entities": 10},
        },
    )
    assert main([str(path), "--write-card"]) == 0
    printed = json.loads(capsys.readouterr().out)
    card = json.loads((path / "card.json").read_text())
    assert card["probe_scores"] == printed and printed["n_per_cell"] == 2
    assert set(printed) == {"passkey", "facts", "n_per_cell"} and 0 <= printed["passkey"]["300"] <= 1


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
