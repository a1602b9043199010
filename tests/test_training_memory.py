"""A training step's memory (training.memory): the predicted cost covers a step's measured peak, and a step that
would not fit the machine is refused by that cost before the work."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import memviz
from tests.conftest import HIGH_WATER_KB, tiny_run
from training.memory import step_bytes


def test_full_attention_over_200k_tokens_is_refused_by_what_its_scores_cost(tmp_path):
    from training import Trainer

    config = tiny_run(
        tmp_path / "run",
        model={"family": "transformer", "window": None},
        data={"curriculum": [[0, 200_000]]},
        optim={"batch_size": 1},
    )
    with pytest.raises(
        ValueError,
        match=r"data.curriculum's longest length 200,000 x optim.batch_size 1: a step of "
        r"this transformer model takes about [\d,.]+ GiB for its activations, its memory and its causal "
        r"attention among them, over this cpu's",
    ):
        Trainer(config, progress=False)
    assert not (tmp_path / "run").exists()
    window = tiny_run(tmp_path / "window", steps=1, data={"curriculum": [[0, 200_000]]}, optim={"batch_size": 1})
    windowed = Trainer(window, progress=False).model  # not refused: its step is linear in the length
    assert step_bytes(windowed, 1, 200_000) <= 20.5 * step_bytes(windowed, 1, 10_000)


def test_a_step_whose_activations_do_not_fit_is_refused_by_them(tmp_path, monkeypatch):
    import training.memory
    from training import Trainer

    monkeypatch.setattr(training.memory, "saved_bytes", lambda model, length: length * 2**40)
    with pytest.raises(
        ValueError, match=r"a step of this sliding_window model takes about [\d,.]+ GiB for its activations, its memory"
    ):
        Trainer(tiny_run(tmp_path / "run"), progress=False)


STEP_PEAK_SCRIPT = (
    HIGH_WATER_KB
    + """
import json, sys
import torch
import memviz
from training.memory import step_bytes
torch.set_num_threads(1)

model = memviz.build_model(memviz.ModelConfig.from_dict(json.loads(sys.argv[1]))).train()
length = int(sys.argv[2])
predicted = step_bytes(model, 1, length)
tokens = torch.randint(0, model.cfg.vocab_size, (1, length))
before = high_water_kb() * 1024
model(tokens, return_type="loss").backward()
grown = high_water_kb() * 1024 - before
print(json.dumps({"predicted": predicted, "grown": grown}))
"""
)


@pytest.mark.parametrize(
    "model",
    [
        {"family": "titans", "memory": {"variant": "mac"}, "segment_len": 64},
        {"family": "titans", "memory": {"variant": "lmm", "chunk": 16}, "window": None},
        {"family": "gated_deltanet", "attention": {"kind": "window", "span": 64}, "memory": {"chunk": 32}},
        {"family": "sliding_window", "window": 64},
    ],
    ids=["titans-mac", "titans-lmm", "gated_deltanet", "sliding_window"],
)
def test_a_training_steps_predicted_memory_covers_its_measured_peak(model):
    """The step cost read from the model's graph at 256 and 512 tokens, against a real step's peak at 4,096."""
    config = {"d_model": 128, "n_layers": 4, "n_heads": 4, "vocab_size": 4096, **model}
    run = subprocess.run(
        [sys.executable, "-c", STEP_PEAK_SCRIPT, json.dumps(config), "4096"],
        capture_output=True,
        text=True,
        timeout=300,
        check=True,
    )
    result = json.loads(run.stdout.strip().splitlines()[-1])
    assert result["grown"] <= result["predicted"] <= 3 * result["grown"], result


def test_titans_at_the_token_cap_is_refused_for_its_memory_before_the_work(tmp_path, monkeypatch):
    import training.loop
    from training import Trainer

    monkeypatch.setattr(training.loop, "physical_memory_bytes", lambda: 16 * 2**30)
    model = {
        "family": "titans",
        "d_model": 128,
        "n_layers": 4,
        "n_heads": 4,
        "d_mlp": 256,
        "memory": {"variant": "lmm", "chunk": 16},
        "window": None,
    }
    config = tiny_run(tmp_path / "run", model=model, data={"curriculum": [[0, 131072]]})
    titans = memviz.build_model(memviz.ModelConfig.from_dict({**model, "vocab_size": 259}))
    assert step_bytes(titans, 2, 131072) > 16 * 2**30
    with pytest.raises(
        ValueError, match=r"data.curriculum's longest length 131,072 x optim.batch_size 2: a step of this titans"
    ):
        Trainer(config, progress=False)
