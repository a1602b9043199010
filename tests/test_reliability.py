"""Issue 48's reliability cases: two threads on one model, one run per output folder, non-finite values named
in traces, limits checked before the work, and values validated where they enter. Each refusal is one error
whose message names the field or the file."""
from __future__ import annotations

import json
import os
import re
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import memviz
from memviz.model import ModelBusyError
from tests.conftest import small_model

ROOT = Path(__file__).resolve().parent.parent


# ----- two threads on one model object ------------------------------------------------------------
def run_in_threads(*jobs):
    """Run each job on its own thread, started together; what each returned or raised, in order."""
    results: list = [None] * len(jobs)
    start = threading.Barrier(len(jobs))

    def work(i, job):
        start.wait()
        try:
            results[i] = job()
        except Exception as exc:  # noqa: BLE001 - the test sorts what came back
            results[i] = exc

    threads = [threading.Thread(target=work, args=(i, job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    return results


def slow_zero(value, hook):
    time.sleep(0.01)  # keeps the hooks on long enough for the other thread to run into them
    return torch.zeros_like(value)


def test_a_second_thread_gets_the_same_answer_or_one_refusal_never_another_runs_hooks():
    model = small_model("sliding_window", window=8)
    tokens = torch.arange(1, 40)[None]
    plain_alone = model(tokens)
    hooked_alone = model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", slow_zero)])
    assert not torch.equal(plain_alone, hooked_alone)

    def repeatedly(run, times):
        def runs():
            outcomes = []
            for _ in range(times):
                try:
                    outcomes.append(run())
                except ModelBusyError as exc:
                    outcomes.append(exc)
                time.sleep(0.001)
            return outcomes
        return runs

    hooked, plain = run_in_threads(
        repeatedly(lambda: model.run_with_hooks(tokens, fwd_hooks=[("blocks.0.hook_resid_post", slow_zero)]), 10),
        repeatedly(lambda: model(tokens), 60))
    refusals = [o for o in hooked + plain if isinstance(o, ModelBusyError)]
    assert all(torch.equal(o, hooked_alone) for o in hooked if not isinstance(o, ModelBusyError))
    assert all(torch.equal(o, plain_alone) for o in plain if not isinstance(o, ModelBusyError))
    assert refusals, "the two threads' runs never met; the test proves nothing"
    assert any("a hooked run" in str(r) for r in refusals)
    assert all(str(r).startswith("this sliding_window model is already running") and "copy" in str(r) for r in refusals)


def test_two_threads_tracing_one_model_each_get_their_own_trace_or_a_refusal():
    model = small_model("infini", segment_len=8)
    text = "the quick brown fox jumps over the lazy dog " * 4
    alone = memviz.trace(model, text)
    results = run_in_threads(lambda: memviz.trace(model, text), lambda: memviz.trace(model, text))
    assert any(isinstance(r, memviz.Trace) for r in results)
    for result in results:
        if isinstance(result, Exception):
            assert isinstance(result, ModelBusyError), result
            continue
        for name in alone.names:
            np.testing.assert_array_equal(result[name], alone[name])


def test_the_same_thread_may_nest_runs_and_the_model_is_free_after_an_error():
    model = small_model("sliding_window", window=8)
    with model.evaluating(), model.hooks(fwd_hooks=[("blocks.0.hook_resid_post", lambda v, hook: v)]):
        model(torch.arange(1, 5)[None])
    with pytest.raises(ValueError):
        with model.evaluating():
            model(torch.tensor([[10**6]]))
    assert run_in_threads(lambda: model(torch.arange(1, 5)[None]).shape)[0] == (1, 4, 259)


# ----- one run per output folder; an export moves nothing it did not write ------------------------
def tiny_run(out, steps=2, **overrides):
    from tests.test_train import tiny_config

    return tiny_config(out, steps=steps, **overrides)


def test_a_second_run_on_one_folder_is_refused_naming_the_first_and_a_dead_owner_is_taken_over(tmp_path):
    import subprocess
    import sys

    from training import Trainer

    first = Trainer(tiny_run(tmp_path / "run"), progress=False)
    with pytest.raises(ValueError, match=rf"out: the run folder .*run is in use by another run \(run 'tiny', pid {os.getpid()}"):
        Trainer(tiny_run(tmp_path / "run"), progress=False)
    first.run()
    assert Trainer(tiny_run(tmp_path / "run", steps=3), resume=True, progress=False).run().step == 3

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from pathlib import Path; "
                               "from training.runlock import RunLock; held = RunLock(Path(sys.argv[1]), 'other'); "
                               "print('held', flush=True); time.sleep(60)", str(tmp_path / "run")],
                              cwd=ROOT, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(ValueError, match=rf"in use by another run \(run 'other', pid {holder.pid} on "):
            Trainer(tiny_run(tmp_path / "run", steps=4), resume=True, progress=False)
    finally:
        holder.kill()  # kill -9: its lock file stays, naming it
        holder.wait()
    assert "other" in (tmp_path / "run" / ".run.lock").read_text()
    assert Trainer(tiny_run(tmp_path / "run", steps=4), resume=True, progress=False).run().step == 4


def test_an_unwritable_out_is_refused_naming_it_and_a_refused_config_leaves_no_folder(tmp_path):
    from training import Trainer

    (tmp_path / "file").write_text("x")
    with pytest.raises(ValueError, match=r"out: cannot write the run folder .*file/run"):
        Trainer(tiny_run(tmp_path / "file" / "run"), progress=False)
    with pytest.raises(ValueError, match="--resume: no checkpoint"):
        Trainer(tiny_run(tmp_path / "fresh"), resume=True, progress=False)
    assert not (tmp_path / "fresh").exists()


@pytest.mark.parametrize("case", ["a plain file", "a folder of other files", "under a file"])
def test_export_onto_what_it_did_not_write_is_refused_before_training(case, tmp_path, capsys):
    from training.__main__ import main

    target = tmp_path / "target"
    if case == "a plain file":
        target.write_text("precious")
    elif case == "a folder of other files":
        target.mkdir()
        (target / "notes.txt").write_text("precious")
    else:
        (tmp_path / "afile").write_text("precious")
        target = tmp_path / "afile" / "export"
    config = tmp_path / "run.train.json"
    config.write_text(json.dumps(tiny_run(tmp_path / "run").to_dict()))
    assert main(["--config", str(config), "--export", str(target), "--no-progress"]) == 2
    assert "--export" in capsys.readouterr().err and not (tmp_path / "run").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []
    assert "precious" in (target.read_text() if target.is_file() else (target / "notes.txt").read_text()
                          if target.is_dir() else (tmp_path / "afile").read_text())


# ----- a run folder's pointers and logs after a kill -----------------------------------------------
def test_a_latest_pointer_outside_the_run_folder_is_refused(tmp_path):
    from training import Trainer

    Trainer(tiny_run(tmp_path / "run"), progress=False).run()
    (tmp_path / "run" / "checkpoints" / "latest").write_text("../../../elsewhere")
    with pytest.raises(ValueError, match=r"checkpoints/latest names '\.\./\.\./\.\./elsewhere'"):
        Trainer(tiny_run(tmp_path / "run", steps=3), resume=True, progress=False)


@pytest.mark.parametrize("damage", ["missing", "lacks step", "not JSON"])
def test_a_resume_without_its_training_state_names_the_file(damage, tmp_path):
    from training import Trainer

    Trainer(tiny_run(tmp_path / "run"), progress=False).run()
    state = tmp_path / "run" / "checkpoints" / "step-0000002" / "train_state.json"
    if damage == "missing":
        state.unlink()
    elif damage == "lacks step":
        state.write_text(json.dumps({k: v for k, v in json.loads(state.read_text()).items() if k != "step"}))
    else:
        state.write_text("{oops")
    with pytest.raises(ValueError, match=r"--resume: .*step-0000002/train_state.json (is missing|lacks 'step'|is not)"):
        Trainer(tiny_run(tmp_path / "run", steps=3), resume=True, progress=False)


def test_a_resume_after_a_kill_logs_each_step_once_and_clears_leftovers(tmp_path):
    from training import Trainer

    Trainer(tiny_run(tmp_path / "run"), progress=False).run()
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as fh:  # what a run killed after logging step 3, before saving it, leaves
        fh.write(json.dumps({"step": 3, "loss": 1.0}) + "\n" + '{"step": 4, "lo')
    (tmp_path / "run" / "checkpoints" / ".latest.abc123.tmp").write_text("step-00")
    Trainer(tiny_run(tmp_path / "run", steps=4), resume=True, progress=False).run()
    steps = [json.loads(line)["step"] for line in metrics.read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert list((tmp_path / "run" / "checkpoints").glob(".*.tmp")) == []


# ----- values checked where they enter --------------------------------------------------------------
def train_config(**changes) -> dict:
    from tests.test_bad_input import train_config as base

    return base(**changes)


TRAIN_CASES = {
    "curriculum steps not increasing": ({"data.curriculum": [[5, 160], [0, 1000]]}, "data.curriculum's steps"),
    "curriculum from a negative step": ({"data.curriculum": [[-1, 160]]}, "data.curriculum's steps"),
    "max_facts steps not increasing": ({"data.max_facts": [[10, 2], [10, 3]]}, "data.max_facts's steps"),
    "eval.every -1": ({"eval.every": -1}, "eval.every"),
    "eval.passkey_depths 2": ({"eval.passkey_depths": [2.0]}, "eval.passkey_depths"),
    "eval.passkey_lengths 0": ({"eval.passkey_lengths": [0]}, "eval.passkey_lengths"),
    "threads -1": ({"threads": -1}, "threads"),
    "optim.lr a string": ({"optim.lr": "big"}, "optim.lr must be a number"),
    "optim.warmup a float": ({"optim.warmup": 1.5}, "optim.warmup must be a whole number"),
    "optim.betas one number": ({"optim.betas": 0.9}, "optim.betas must be a list of 2 numbers"),
    "data.min_len_frac a string": ({"data.min_len_frac": "0.5"}, "data.min_len_frac must be a number"),
    "data.mix a list": ({"data.mix": ["passkey"]}, "data.mix must be a mapping"),
    "data.curriculum of strings": ({"data.curriculum": [["0", "256"]]}, "data.curriculum must be a list of lists"),
    "data.drill true": ({"data.drill": True}, "data.drill must be a whole number"),
    "eval.lm 'yes'": ({"eval.lm": "yes"}, "eval.lm must be true or false"),
    "eval.n 1.5": ({"eval.n": 1.5}, "eval.n must be a whole number"),
    "tokenizer a number": ({"tokenizer": 5}, "tokenizer must be a string"),
    "name a number": ({"name": 5}, "name must be a string"),
    "optim a number": ({"optim": 5}, "optim must be a mapping"),
    "eval grid 1000 x 1000 x 50": ({"eval.passkey_lengths": list(range(1, 1001)), "eval.passkey_depths": [i / 1000 for i in range(1000)],
                                    "eval.n": 50}, "the eval grid asks for 50,000,000 samples"),
}


@pytest.mark.parametrize("case", sorted(TRAIN_CASES))
def test_a_training_config_of_the_wrong_type_or_order_names_the_field(case):
    from training.config import TrainConfig

    changes, named = TRAIN_CASES[case]
    with pytest.raises(ValueError, match=re.escape(named)):
        TrainConfig.from_dict(train_config(**changes))


def test_the_command_line_names_a_wrong_typed_option_in_one_line(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "bad.train.json"
    config.write_text(json.dumps(train_config(**{"optim.lr": "big"})))
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "training", "--config", str(config)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: training config {config}: optim.lr must be a number, got 'big'"]


@pytest.mark.parametrize("field, value", [("tie_embeddings", "no"), ("tie_embeddings", 1), ("name", 5)])
def test_a_model_config_boolean_or_name_of_the_wrong_type_names_the_field(field, value):
    with pytest.raises(memviz.ConfigError, match=f"'{field}' must be"):
        memviz.ModelConfig(family="transformer", **{field: value})


@pytest.mark.parametrize("chunk_len", [0, -4, 2.5, True])
def test_chunk_len_zero_or_nonsense_is_refused_not_taken_for_the_default(chunk_len):
    model = small_model("infini", segment_len=8)
    with pytest.raises(ValueError, match="chunk_len must be a positive number of tokens"):
        memviz.trace(model, "some text to trace", chunk_len=chunk_len)


def test_evaluate_names_a_card_whose_train_config_is_not_a_mapping(tmp_path):
    import subprocess
    import sys

    folder = memviz.save(small_model("sliding_window", window=8), tmp_path / "ckpt")
    card = json.loads((folder / "card.json").read_text()) if (folder / "card.json").exists() else {}
    (folder / "card.json").write_text(json.dumps({**card, "train_config": "lr=3e-3"}))
    out = subprocess.run([sys.executable, "-W", "ignore", "-m", "training.evaluate", str(folder)], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and len(out.stderr.strip().splitlines()) == 1
    assert "card.json: train_config must be a mapping" in out.stderr and "ckpt" in out.stderr


# ----- numbers that stop being numbers, named in the trace and on its figures ---------------------
def test_a_trace_whose_memory_diverges_names_where_each_quantity_and_the_logits_stop_being_finite(tmp_path):
    from memviz.viz import family_figures

    model = small_model("titans", segment_len=8, memory={"variant": "mac"}, tie_embeddings=False)
    poison = model.tokenizer.encode("Z")[0]
    with torch.no_grad():
        model.embed.weight[poison] = float("nan")  # the memory's update at that token makes it NaN from there on
    trace = memviz.trace(model, "a" * 40 + "Z" + "b" * 40)
    found = trace.meta["non_finite"]
    assert found["logits"] == {"first": 40, "count": 41} and trace.diverged_at == 40
    for name in ("blocks.0.memory.hook_surprise", "blocks.1.memory.hook_eta", "loss"):
        assert found[name]["first"] == 40 and trace.non_finite_from(name) == 40
        assert np.isfinite(trace[name][:40]).all()
    assert saved_and_loaded(trace, tmp_path).meta["non_finite"] == found

    figs = family_figures(trace)
    for title, fig in figs.items():
        assert "the model diverged: its logits are not finite from token 40 (41 of 81 tokens)" in fig.layout.title.text, title
    panels = [a.text for a in figs["blocks.0.memory surprise"].layout.annotations]
    assert "surprise ||grad|| (not finite from token 40)" in panels and "eta (momentum) (not finite from token 40)" in panels
    assert any(shape.line.color == "crimson" and shape.x0 == 39.5 for shape in figs["loss"].layout.shapes)


def saved_and_loaded(trace, tmp_path):
    return memviz.Trace.load(trace.save(tmp_path / "diverged.npz"))


def test_a_trace_that_stays_finite_records_nothing_and_its_figures_say_nothing_of_it():
    from memviz.viz import family_figures

    trace = memviz.trace(small_model("titans", segment_len=8, memory={"variant": "mac"}), "a" * 40)
    assert trace.meta["non_finite"] == {} and trace.diverged_at is None
    assert not any("finite" in (fig.layout.title.text or "") for fig in family_figures(trace).values())
