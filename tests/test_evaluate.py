"""`python -m memviz.evaluate` re-scores a checkpoint on the grid its card records."""
import json

import memviz
from memviz.evaluate import main
from tests.conftest import small_model


def test_evaluate_writes_the_scores_into_the_card(tmp_path, capsys):
    path = memviz.save(small_model("sliding_window", window=16), tmp_path / "ckpt", card={
        "train_config": {"eval": {"passkey_lengths": [300], "passkey_depths": [0.5], "facts": 3, "final_n": 2, "seed": 0}},
        "facts": {"kb_seed": 0, "n_entities": 10},
    })
    assert main([str(path), "--write-card"]) == 0
    printed = json.loads(capsys.readouterr().out)
    card = json.loads((path / "card.json").read_text())
    assert card["probe_scores"] == printed and printed["n_per_cell"] == 2
    assert set(printed) == {"passkey", "facts", "n_per_cell"} and 0 <= printed["passkey"]["300"] <= 1


def test_evaluate_reports_a_bad_checkpoint(tmp_path, capsys):
    assert main([str(tmp_path / "missing")]) == 1
    assert "no such checkpoint folder" in capsys.readouterr().err
