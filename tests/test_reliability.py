"""Issue 48's reliability cases: two threads on one model, one run per output folder, non-finite values named
in traces, limits checked before the work, and values validated where they enter. Each refusal is one error
whose message names the field or the file."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
import torch

import memviz
from memviz.model import ModelBusyError
from tests.conftest import HIGH_WATER_KB, small_model
from tests.test_bad_input import train_config

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
        repeatedly(lambda: model(tokens), 60),
    )
    refusals = [o for o in hooked + plain if isinstance(o, ModelBusyError)]
    assert all(torch.equal(o, hooked_alone) for o in hooked if not isinstance(o, ModelBusyError))
    assert all(torch.equal(o, plain_alone) for o in plain if not isinstance(o, ModelBusyError))
    assert refusals, "the two threads' runs never met; the test proves nothing"
    assert any("a hooked run" in str(r) for r in refusals)
    assert all(str(r).startswith("this sliding_window model is already running") and "copy" in str(r) for r in refusals)


def test_two_threads_tracing_one_model_each_get_their_own_trace_or_a_refusal():
    """The first thread's trace is held inside its forward until the second has tried: the second is
    refused, and the first's trace is the one it gets alone."""
    model = small_model("infini", segment_len=8)
    text = "the quick brown fox jumps over the lazy dog " * 4
    alone = memviz.trace(model, text)
    inside, tried = threading.Event(), threading.Event()
    first = []

    def hold(value, hook):
        if threading.current_thread() is first[0]:
            inside.set()
            tried.wait(30)

    def second():
        assert inside.wait(30), "the first trace never started"
        try:
            return memviz.trace(model, text)
        finally:
            tried.set()

    model.add_hook("blocks.0.hook_resid_post", hold)
    try:
        first_result, second_result = run_in_threads(
            lambda: (first.append(threading.current_thread()), memviz.trace(model, text))[1], second
        )
    finally:
        model.reset_hooks(including_permanent=True)
    assert isinstance(second_result, ModelBusyError), second_result
    assert isinstance(first_result, memviz.Trace), first_result
    for name in alone.names:
        np.testing.assert_array_equal(first_result[name], alone[name])


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
    """tests.test_train's tiny config, with whole sections (eval too) merged in."""
    from tests.test_train import tiny_config
    from training.config import TrainConfig

    config = tiny_config(out, steps=steps).to_dict()
    for key, value in overrides.items():
        config[key] = {**config[key], **value} if isinstance(value, dict) else value
    return TrainConfig.from_dict(config)


def test_a_vocab_size_the_tokenizer_does_not_have_is_refused_before_training(tmp_path):
    from training import Trainer

    cfg = tiny_run(tmp_path / "run")
    cfg.model = {**cfg.model, "vocab_size": 100}
    with pytest.raises(ValueError, match=r"model.vocab_size is 100 but the run's tokenizer has \d+ ids"):
        Trainer(cfg, progress=False).run()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_a_tokenizer_file_that_is_no_tokenizer_is_named_before_training(tmp_path):
    from training.data import build_tokenizer

    (tmp_path / "bin.json").write_bytes(b"\xff\xfe binary")
    with pytest.raises(ValueError, match=f"tokenizer {tmp_path / 'bin.json'}: not UTF-8 text"):
        build_tokenizer(str(tmp_path / "bin.json"))


def test_a_second_run_on_one_folder_is_refused_naming_the_first_and_a_dead_owner_is_taken_over(tmp_path):
    import subprocess
    import sys

    from training import Trainer

    first = Trainer(tiny_run(tmp_path / "run"), progress=False)
    with pytest.raises(
        ValueError, match=rf"out: the run folder .*run is in use by another run \(run 'tiny', pid {os.getpid()}"
    ):
        Trainer(tiny_run(tmp_path / "run"), progress=False)
    first.run()
    assert Trainer(tiny_run(tmp_path / "run", steps=3), resume=True, progress=False).run().step == 3

    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            "import sys, time; from pathlib import Path; "
            "from training.runlock import RunLock; held = RunLock(Path(sys.argv[1]), 'other'); "
            "print('held', flush=True); time.sleep(60)",
            str(tmp_path / "run"),
        ],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
    )
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
    assert "precious" in (
        target.read_text()
        if target.is_file()
        else (target / "notes.txt").read_text()
        if target.is_dir()
        else (tmp_path / "afile").read_text()
    )


def test_export_onto_a_checkpoint_needs_replace_export(tmp_path, capsys):
    from training.__main__ import main

    target = tmp_path / "target"
    target.mkdir()
    (target / "card.json").write_text('{"name": "precious"}')
    config = tmp_path / "run.train.json"
    config.write_text(json.dumps(tiny_run(tmp_path / "run").to_dict()))
    assert main(["--config", str(config), "--export", str(target), "--no-progress"]) == 2
    assert "already holds a checkpoint (card.json); pass --replace-export" in capsys.readouterr().err
    assert (target / "card.json").read_text() == '{"name": "precious"}' and not (tmp_path / "run").exists()
    assert main(["--config", str(config), "--export", str(target), "--replace-export", "--no-progress"]) == 0
    card = json.loads((target / "card.json").read_text())
    assert card["steps"] == tiny_run(tmp_path / "run").optim.steps and "--replace-export" not in card["train_command"]


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


@pytest.mark.parametrize(
    "damage, named",
    [
        ("step -3", r"train_state.json says step -3, its folder step-0000002"),
        ("a moment dropped", r"optimizer.safetensors does not match .*moment '0.exp_avg' is missing"),
        ("a moment of another shape", r"optimizer.safetensors does not match .*moment '0.exp_avg' has shape \(3,\)"),
        ("fewer steps than done", r"the run in .*run is at step 2 .*past optim.steps 1; resume with at least"),
    ],
)
def test_a_resume_from_a_state_that_does_not_add_up_is_refused_and_loses_no_log(damage, named, tmp_path):
    from safetensors.torch import load_file, save_file

    from training import Trainer

    Trainer(tiny_run(tmp_path / "run"), progress=False).run()
    checkpoint = tmp_path / "run" / "checkpoints" / "step-0000002"
    metrics = (tmp_path / "run" / "metrics.jsonl").read_text()
    if damage == "step -3":
        state = json.loads((checkpoint / "train_state.json").read_text())
        (checkpoint / "train_state.json").write_text(json.dumps({**state, "step": -3}))
    elif damage.startswith("a moment"):
        moments = load_file(checkpoint / "optimizer.safetensors")
        if damage == "a moment dropped":
            del moments["0.exp_avg"]
        else:
            moments["0.exp_avg"] = torch.zeros(3)
        save_file(moments, checkpoint / "optimizer.safetensors")
    with pytest.raises(ValueError, match=named):
        Trainer(
            tiny_run(tmp_path / "run", steps=1 if damage == "fewer steps than done" else 3), resume=True, progress=False
        )
    assert (tmp_path / "run" / "metrics.jsonl").read_text() == metrics


def test_a_resume_after_a_kill_logs_each_step_once_and_clears_leftovers(tmp_path):
    from training import Trainer

    Trainer(tiny_run(tmp_path / "run"), progress=False).run()
    metrics = tmp_path / "run" / "metrics.jsonl"
    with open(metrics, "a") as fh:  # a note of the user's, then what a run killed after logging step 3 leaves
        fh.write("# lr halved by hand here\n" + json.dumps({"step": 3, "loss": 1.0}) + "\n" + '{"step": 4, "lo')
    (tmp_path / "run" / "checkpoints" / ".latest.abc123.tmp").write_text("step-00")
    Trainer(tiny_run(tmp_path / "run", steps=4), resume=True, progress=False).run()
    lines = metrics.read_text().splitlines()
    assert lines[2] == "# lr halved by hand here"
    assert [json.loads(line)["step"] for line in lines[:2] + lines[3:]] == [1, 2, 3, 4]
    assert list((tmp_path / "run" / "checkpoints").glob(".*.tmp")) == []


# ----- values checked where they enter --------------------------------------------------------------
def test_the_command_line_names_a_wrong_typed_option_in_one_line(tmp_path):
    import subprocess
    import sys

    config = tmp_path / "bad.train.json"
    config.write_text(json.dumps(train_config(**{"optim.lr": "big"})))
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "training", "--config", str(config)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 2 and out.stderr.strip().splitlines() == [
        f"error: training config {config}: optim.lr must be a number, got 'big'"
    ]


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
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-m", "training.evaluate", str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
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
        assert (
            "the model diverged: its logits are not finite from token 40 (41 of 81 tokens)" in fig.layout.title.text
        ), title
    panels = [a.text for a in figs["blocks.0.memory surprise"].layout.annotations]
    assert (
        "surprise ||grad|| (not finite from token 40)" in panels
        and "eta (momentum) (not finite from token 40)" in panels
    )
    assert any(shape.line.color == "crimson" and shape.x0 == 39.5 for shape in figs["loss"].layout.shapes)


def saved_and_loaded(trace, tmp_path):
    return memviz.Trace.load(trace.save(tmp_path / "diverged.npz"))


def test_a_trace_that_stays_finite_records_nothing_and_its_figures_say_nothing_of_it():
    from memviz.viz import family_figures

    trace = memviz.trace(small_model("titans", segment_len=8, memory={"variant": "mac"}), "a" * 40)
    assert trace.meta["non_finite"] == {} and trace.diverged_at is None
    assert not any("finite" in (fig.layout.title.text or "") for fig in family_figures(trace).values())


def test_a_longmem_trace_reads_its_empty_retrievals_as_empty_not_as_a_divergence(tmp_path):
    """LongMem writes NaN as the score of a chunk it did not retrieve (the first segment has no bank to read), which
    its hook docs declare; the trace and its figures stay silent on those, and an infinite score is still named."""
    from memviz.trace import non_finite_summary
    from memviz.viz import family_figures

    model = small_model("longmem", window=8, segment_len=8, memory={"chunk_size": 4, "topk_chunks": 2, "bank_size": 16})
    trace = memviz.trace(model, "a fair text of forty and more characters to trace")
    scores = "side_blocks.1.attn.hook_retrieved_scores"
    assert np.isnan(trace[scores][:8]).all()  # nothing to retrieve before the first segment completes
    assert trace.meta["nan_means_none"] == [scores] and trace.meta["non_finite"] == {}
    assert trace.non_finite_from(scores) is None
    assert saved_and_loaded(trace, tmp_path).non_finite_from(scores) is None
    assert not any("finite" in (fig.layout.title.text or "") for fig in family_figures(trace).values())
    poisoned = {scores: trace[scores].copy()}
    poisoned[scores][20, 0, 0] = np.inf
    assert non_finite_summary(poisoned, np.ones(len(trace), bool), [scores]) == {scores: {"first": 20, "count": 1}}


# ----- limits checked before the work, within 200 MB of peak memory --------------------------------
BPE_TOKENIZER = ROOT / "sample_checkpoints" / "memory_plus_shared" / "tokenizer.json"

PEAK_SCRIPT = (
    HIGH_WATER_KB
    + """
import json, resource, sys
import torch
import memviz
from memviz import ModelConfig
from memviz.tokenizer import load_tokenizer
case = sys.argv[1]
def model(tokenizer=None):
    torch.manual_seed(0)
    vocab = tokenizer.vocab_size if tokenizer is not None else 259
    return memviz.build_model(ModelConfig(family="sliding_window", d_model=32, n_layers=2, n_heads=2, d_mlp=64,
                                          window=16, vocab_size=vocab), tokenizer=tokenizer).eval()
if case == "emoji":
    m, text = model(), "\\N{GRINNING FACE}" * (10 * 2**20 // 4)
    call = lambda: memviz.trace(m, text)
elif case == "long text":
    import random
    m = model(load_tokenizer(sys.argv[2]))
    words = "the quick brown fox jumps over lazy dog memory state token segment".split()
    text = " ".join(random.Random(0).choice(words) for _ in range(3_500_000))
    call = lambda: memviz.trace(m, text)
elif case == "trace file":
    call = lambda: memviz.Trace.load(sys.argv[2])
else:
    from memviz_probes import passkey
    m = model()
    call = lambda: passkey.run(m, [100_000_000], [0.5], n=1, progress=False)
before = high_water_kb()
try:
    call()
    error = None
except ValueError as exc:
    error = str(exc)
after = high_water_kb()
print(json.dumps({"error": error, "growth_mb": (after - before) / 1024}))
"""
)


def refused_within_memory(*args) -> str:
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-c", PEAK_SCRIPT, *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["error"] is not None, "not refused"
    assert result["growth_mb"] < 200, result
    return result["error"]


def test_ten_megabytes_of_one_emoji_are_refused_before_tokenizing():
    assert "input has 10,485,760 tokens (one a UTF-8 byte), over the trace limit of 4,000,000" in refused_within_memory(
        "emoji"
    )


@pytest.mark.skipif(not BPE_TOKENIZER.is_file(), reason="the BPE sample's tokenizer is not here")
def test_a_long_text_over_the_trace_limit_is_refused_while_counting_its_tokens():
    assert "more tokens in its first" in refused_within_memory("long text", BPE_TOKENIZER)


def test_a_trace_file_declaring_a_huge_array_is_refused_from_its_header(tmp_path):
    import io
    import zipfile

    path = tmp_path / "huge.npz"
    header = io.BytesIO()
    np.lib.format.write_array_header_1_0(header, {"descr": "<f4", "fortran_order": False, "shape": (2**20, 1024)})
    tokens, meta = io.BytesIO(), io.BytesIO()
    np.save(tokens, np.zeros(1000, dtype=np.int32))
    np.save(meta, np.frombuffer(json.dumps({"names": ["x"], "vocab": None, "meta": {}}).encode(), dtype=np.uint8))
    with zipfile.ZipFile(path, "w", compression=zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("tokens.npy", tokens.getvalue())
        archive.writestr("meta_json.npy", meta.getvalue())
        archive.writestr("array:x.npy", header.getvalue() + bytes(2**26))  # declares 4 GiB; its first 64 MiB
    message = refused_within_memory("trace file", path)
    assert message.startswith(f"{path}: array 'x' declares shape (1048576, 1024), not one row per token of its 1,000")


def test_a_passkey_length_of_a_hundred_million_is_refused_before_any_prompt():
    assert "lengths are whole numbers of tokens in 1..4,194,304, got 100000000" in refused_within_memory("passkey")


# ----- files read with their size checked first ----------------------------------------------------
def test_a_haystack_or_babilong_data_path_that_is_a_device_is_refused_unread():
    from memviz_probes import babilong
    from memviz_probes.haystack import FileHaystack

    with pytest.raises(ValueError, match="haystack file /dev/zero is not a regular file"):
        FileHaystack("/dev/zero")
    with pytest.raises(ValueError, match="BABILong data file /dev/zero is not a regular file"):
        babilong.load("/dev/zero", "qa1")


def test_a_haystack_file_over_its_cap_is_refused_by_its_size(tmp_path, monkeypatch):
    from memviz_probes import haystack

    monkeypatch.setattr(haystack, "MAX_HAYSTACK_FILE_BYTES", 100)
    book = tmp_path / "book.txt"
    book.write_text("A sentence. " * 20)
    with pytest.raises(ValueError, match=r"haystack file .*book.txt has 240 bytes, over the 100"):
        haystack.FileHaystack(book)


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


@pytest.mark.parametrize("top", ['"a string"', "5", "null"])
def test_babilong_json_whose_top_level_is_not_a_list_names_the_file(top, tmp_path):
    from memviz_probes import babilong

    path = tmp_path / "qa1_1k.json"
    path.write_text(top)
    with pytest.raises(ValueError, match=r"qa1_1k.json: expected a non-empty list of samples"):
        babilong.load(path, "qa1")


def test_a_babilong_row_far_longer_than_its_length_is_refused_naming_the_file_and_row(tmp_path):
    from memviz_probes import babilong

    rows = [
        {"input": "Mary went to the kitchen. ", "question": "Where is Mary?", "target": "kitchen"},
        {"input": "Mary went to the office. " * 80_000, "question": "Where is Mary?", "target": "office"},
    ]
    path = tmp_path / "qa1_1k.json"
    path.write_text(json.dumps(rows))
    with pytest.raises(
        ValueError,
        match=r"qa1_1k.json: sample 1's input has 2,000,000 characters, more than a prompt "
        r"of 1,000 tokens can hold",
    ):
        babilong.load(path, "qa1", 1000)
    assert len(babilong.load(path, "qa1")) == 2


def test_a_card_asking_for_a_billion_people_is_refused_naming_the_field(tmp_path):
    from memviz_probes import facts

    model = small_model("sliding_window", window=8)
    model.card["facts"] = {"kb_seed": 0, "n_entities": 10**9}
    with pytest.raises(
        ValueError, match=r"card.json: facts.n_entities must be a whole number of people in 1..1,000,000"
    ):
        facts.run(model, n=1, progress=False)
    model.card["facts"] = "people"
    with pytest.raises(ValueError, match="^the model's card.json: facts must be an object"):
        facts.run(model, n=1, progress=False)
    model.card["path"] = "/data/ckpt"  # what memviz.load notes: the message names the file to mend
    with pytest.raises(ValueError, match="^/data/ckpt/card.json: facts must be an object"):
        facts.run(model, n=1, progress=False)
    copy = memviz.load(memviz.save(model, tmp_path / "copy"))  # its card.json names /data/ckpt: the copy is named
    with pytest.raises(ValueError, match=f"^{re.escape(str(copy.card['path']))}/card.json: facts must be an object"):
        facts.run(copy, n=1, progress=False)
    assert Path(copy.card["path"]).resolve() == (tmp_path / "copy").resolve()


# ----- probes' own arguments --------------------------------------------------------------------------
@pytest.mark.parametrize(
    "kwargs, named",
    [
        (
            dict(lengths=[300], depths=["0.5"]),
            r"depth must lie in \[0, 1\] \(depths are fractions of the prompt\), got '0.5'",
        ),
        (dict(lengths=128, depths=[0.5]), "lengths must be a list, got 128"),
        (dict(lengths=["300"], depths=[0.5]), "lengths are whole numbers of tokens in 1..4,194,304, got '300'"),
        (dict(lengths=[300], depths=0.5), "depths must be a list, got 0.5"),
        (
            dict(lengths=list(range(300, 1300)), depths=[i / 100 for i in range(100)], n=50),
            "5,000,000 samples, over the 200,000",
        ),
    ],
)
def test_passkey_arguments_of_the_wrong_type_name_the_argument(kwargs, named):
    from memviz_probes import passkey

    with pytest.raises(ValueError, match=named):
        passkey.run(small_model("sliding_window", window=8), progress=False, **kwargs)


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


# ----- text and tokenizers -------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def bpe_model():
    from memviz.tokenizer import load_tokenizer

    if not BPE_TOKENIZER.is_file():
        pytest.skip("the BPE sample's tokenizer is not here")
    tokenizer = load_tokenizer(BPE_TOKENIZER)
    torch.manual_seed(0)
    return memviz.build_model(
        memviz.ModelConfig(
            family="sliding_window",
            d_model=32,
            n_layers=2,
            n_heads=2,
            d_mlp=64,
            window=8,
            vocab_size=tokenizer.vocab_size,
        ),
        tokenizer=tokenizer,
    ).eval()


@pytest.mark.parametrize("which", ["byte", "bpe"])
@pytest.mark.parametrize(
    "prompt, error, named",
    [
        (None, TypeError, "prompt must be a str, got NoneType"),
        (b"hello", TypeError, "prompt must be a str, got bytes: decode it first"),
        ("a\ud800b", ValueError, r"lone surrogate \(U\+D800\) at character 1"),
    ],
)
def test_generate_names_a_prompt_that_is_not_text(which, prompt, error, named, request):
    model = request.getfixturevalue("bpe_model") if which == "bpe" else small_model("sliding_window", window=8)
    with pytest.raises(error, match=named):
        model.generate(prompt, max_new_tokens=2)


def bpe_checkpoint(model, tmp_path, edit):
    folder = memviz.save(model, tmp_path / "bpe")
    data = json.loads((folder / "tokenizer.json").read_text())
    edit(data["model"]["vocab"])
    (folder / "tokenizer.json").write_text(json.dumps(data))
    return folder


def test_a_tokenizer_whose_tokens_share_ids_or_leave_the_vocabulary_is_refused_naming_the_file(bpe_model, tmp_path):
    def share(vocab):
        for token in list(vocab)[100:140]:
            vocab[token] = 5

    def past(vocab):
        vocab[list(vocab)[100]] = len(vocab) + 50

    with pytest.raises(
        memviz.CheckpointError, match=r"bpe/tokenizer.json: 41 tokens share 1 id \(id 5: .*each token needs its own id"
    ):
        memviz.load(bpe_checkpoint(bpe_model, tmp_path / "a", share))
    with pytest.raises(
        memviz.CheckpointError, match=r"bpe/tokenizer.json: .*token ids \[1071\] .* lie outside the vocabulary"
    ):
        memviz.load(bpe_checkpoint(bpe_model, tmp_path / "b", past))


@pytest.mark.parametrize(
    "case, named", [("a folder", "is a folder"), ("a device", "is not a regular file"), ("missing", "does not exist")]
)
def test_a_tokenizer_path_that_is_not_a_file_is_refused_naming_it(case, named, tmp_path):
    from memviz.tokenizer import load_tokenizer

    path = {"a folder": tmp_path, "a device": Path("/dev/zero"), "missing": tmp_path / "none.json"}[case]
    with pytest.raises(ValueError, match=f"tokenizer file {re.escape(str(path))} {named}"):
        load_tokenizer(path)


# ----- trace files and trace arguments ---------------------------------------------------------------
@pytest.fixture(scope="module")
def saved_trace(tmp_path_factory):
    model = small_model("sliding_window", window=8)
    return memviz.trace(model, "hello there, general", evidence=[[2, 5]]).save(tmp_path_factory.mktemp("t") / "t.npz")


def rewritten(saved: Path, out: Path, **changes) -> Path:
    """The trace file `saved` with arrays or meta fields replaced (meta fields by a callable on the meta dict)."""
    with np.load(saved) as data:
        payload = {k: data[k] for k in data.files}
    meta = json.loads(bytes(payload["meta_json"]).decode())
    if "meta" in changes:
        changes.pop("meta")(meta)
    payload["meta_json"] = np.frombuffer(json.dumps(meta).encode(), dtype=np.uint8)
    payload.update(changes)
    np.savez(out, **payload)
    return out


INSIDE = r"is not \[start, stop\) inside its 20 tokens"
TRACE_FILE_CASES = {
    "evidence past the end": (
        dict(meta=lambda m: m["meta"].update(evidence=[[3, 999999999]])),
        rf"evidence span \[3, 999999999\] {INSIDE}",
    ),
    "answer past the end": (
        dict(meta=lambda m: m["meta"].update(answer=[20, 40])),
        rf"answer span \[20, 40\] {INSIDE}",
    ),
    "negative token ids": (dict(tokens=np.array([-1] + [5] * 19, dtype=np.int32)), r"token ids range over \[-1, 5\]"),
    "token ids past the vocabulary": (
        dict(tokens=np.array([2**40] + [5] * 19, dtype=np.int64)),
        "outside the vocabulary's 259",
    ),
    "NaN token ids": (
        dict(tokens=np.array([np.nan] + [5.0] * 19)),
        "tokens must be a 1-D array of integer ids, declared float64",
    ),
    "2-D tokens": (
        dict(tokens=np.zeros((20, 2), dtype=np.int32)),
        r"tokens must be a 1-D array of integer ids, declared int32 \(20, 2\)",
    ),
    "a 0-d array": (dict(**{"array:loss": np.float32(1.0)}), r"array 'loss' declares shape \(\)"),
    "meta a list": (dict(meta_json=np.frombuffer(b"[1, 2]", dtype=np.uint8)), "meta_json is not an object"),
    "a short vocabulary": (
        dict(meta=lambda m: m.update(vocab=dict(list(m["vocab"].items())[:2]))),
        r"token ids \[.*\] have no entry in its vocabulary of 2",
    ),
}


@pytest.mark.parametrize("case", sorted(TRACE_FILE_CASES))
def test_a_trace_file_that_does_not_fit_its_input_is_refused_naming_the_file(case, saved_trace, tmp_path):
    from memviz.trace import TraceFileError

    changes, named = TRACE_FILE_CASES[case]
    path = rewritten(saved_trace, tmp_path / "bad.npz", **changes)
    with pytest.raises(TraceFileError, match=rf"bad.npz: .*{named}"):
        memviz.Trace.load(path)


def test_a_trace_file_with_a_crc_error_names_the_file(saved_trace, tmp_path):
    data = bytearray(saved_trace.read_bytes())
    start = data.index(b"meta_json") + 40  # inside the meta member's compressed bytes
    data[start : start + 8] = bytes(8)
    path = tmp_path / "crc.npz"
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=r"crc.npz: not a memviz trace file"):
        memviz.Trace.load(path)


def test_a_saved_trace_still_loads_whole(saved_trace):
    loaded = memviz.Trace.load(saved_trace)
    assert loaded.meta["evidence"] == [[2, 5]] and len(loaded) == 20 and loaded.token_text(0, 2) == ["h", "e"]


@pytest.mark.parametrize("evidence", [[["a", "b"]], [[3, 2]], [[0, 10**9]], [5], [[1.5, 3]]])
def test_trace_evidence_that_is_not_a_span_of_the_input_names_it(evidence):
    with pytest.raises(
        ValueError, match="evidence span .* is not \\[start, stop\\) of token positions inside the input's 20 tokens"
    ):
        memviz.trace(small_model("sliding_window", window=8), "hello there, general", evidence=evidence)


# ----- training limits from the model's own cost, and an eval grid checked before training ----------
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
    assert windowed.step_bytes(1, 200_000) <= 20.5 * windowed.step_bytes(1, 10_000)


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


def test_generate_refuses_a_prompt_over_its_limit_before_tokenizing_it(monkeypatch):
    import memviz.model as model_module

    monkeypatch.setattr(model_module, "MAX_PROMPT_TOKENS", 100)
    with pytest.raises(ValueError, match="prompt has 400 tokens \\(one a UTF-8 byte\\), over the prompt limit of 100"):
        small_model("sliding_window", window=8).generate("\N{GRINNING FACE}" * 100)


def test_a_step_whose_activations_do_not_fit_is_refused_by_them(tmp_path, monkeypatch):
    from memviz.model import MemoryLM
    from training import Trainer

    monkeypatch.setattr(MemoryLM, "saved_bytes", lambda self, length: length * 2**40)
    with pytest.raises(
        ValueError, match=r"a step of this sliding_window model takes about [\d,.]+ GiB for its activations, its memory"
    ):
        Trainer(tiny_run(tmp_path / "run"), progress=False)


@pytest.mark.parametrize("ids", [[1, 2, float("nan")], [1, 2.5], [1, True]])
def test_trace_token_ids_that_are_not_whole_numbers_are_named(ids):
    with pytest.raises(ValueError, match="token ids must be whole numbers, got .* at position"):
        memviz.trace(small_model("sliding_window", window=8), ids)


ALLOCATION_SCRIPT = (
    HIGH_WATER_KB
    + """
import json, resource, sys
import memviz
with open("/proc/self/statm") as fh:
    used = int(fh.read().split()[0]) * resource.getpagesize()
resource.setrlimit(resource.RLIMIT_AS, (used + 3 * 2**30, resource.RLIM_INFINITY))  # 3 GiB more than it holds now
before = high_water_kb()
try:
    memviz.load(sys.argv[1])
    error = None
except memviz.CheckpointError as exc:
    error = str(exc)
print(json.dumps({"error": error, "growth_mb": (high_water_kb() - before) / 1024}))
"""
)


def test_a_checkpoint_config_too_big_to_allocate_is_refused_before_any_weight(tmp_path):
    import subprocess
    import sys

    folder = memviz.save(small_model("transformer"), tmp_path / "big")
    config = json.loads((folder / "config.json").read_text())
    config.update(d_model=4096, n_layers=8, n_heads=32, d_head=128, d_mlp=11008)  # 1.6e9 parameters, 6 GiB
    (folder / "config.json").write_text(json.dumps(config))
    out = subprocess.run(
        [sys.executable, "-c", ALLOCATION_SCRIPT, str(folder)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert out.returncode == 0, out.stderr[-2000:]
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result["growth_mb"] < 200, result
    assert "config.json" in result["error"] and "about 1.62e+09 parameters" in result["error"], result
    assert "nothing was allocated" in result["error"]


# ----- files read with their size checked first (memviz_probes.texts, a checkpoint's card) ----------------
def test_a_corpus_file_that_is_a_device_or_too_large_is_refused_before_reading(tmp_path, monkeypatch):
    from memviz_probes import texts

    with pytest.raises(ValueError, match="corpus file /dev/zero is not a regular file"):
        texts.read_utf8(Path("/dev/zero"))
    crlf = tmp_path / "crlf.txt"
    crlf.write_bytes(b"CHAPTER I\r\nold Mac\rtext\n")
    assert texts.read_utf8(crlf) == "CHAPTER I\nold Mac\ntext\n"  # universal newlines, as text mode reads them
    monkeypatch.setattr(texts, "MAX_TEXT_FILE_BYTES", 100)
    big = tmp_path / "big.txt"
    big.write_text("a" * 101)
    with pytest.raises(ValueError, match=f"corpus file {re.escape(str(big))} has 101 bytes, over the 100"):
        texts.read_utf8(big)


def test_a_card_over_its_size_cap_or_not_a_file_is_refused_naming_it(tmp_path, monkeypatch):
    import memviz.checkpoint as checkpoint

    folder = memviz.save(small_model("sliding_window", window=8), tmp_path / "ckpt")
    card = folder / "card.json"
    card.unlink()
    os.mkfifo(card)  # a reader of a pipe waits for a writer: it must not be opened
    with pytest.raises(memviz.CheckpointError, match=f"{re.escape(str(card))}: card file .* is not a regular file"):
        memviz.load(folder)
    card.unlink()
    card.write_text(json.dumps({"note": "x" * 200}))
    monkeypatch.setattr(checkpoint, "MAX_CARD_FILE_BYTES", 100)
    with pytest.raises(memviz.CheckpointError, match=f"{re.escape(str(card))}: card file .* over the 100"):
        memviz.load(folder)


STEP_PEAK_SCRIPT = (
    HIGH_WATER_KB
    + """
import json, sys
import torch
import memviz
torch.set_num_threads(1)

model = memviz.build_model(memviz.ModelConfig.from_dict(json.loads(sys.argv[1]))).train()
length = int(sys.argv[2])
predicted = model.step_bytes(1, length)
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


# ----- a family's memory counted in the training step's cost ----------------------------------------
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
    assert titans.step_bytes(2, 131072) > 16 * 2**30
    with pytest.raises(
        ValueError, match=r"data.curriculum's longest length 131,072 x optim.batch_size 2: a step of this titans"
    ):
        Trainer(config, progress=False)


@pytest.mark.parametrize(
    "family, memory",
    [("sliding_window", {}), ("longmem", {"chunk_size": 4, "topk_chunks": 3, "bank_size": 16, "side_layers": 2})],
)
def test_generate_refuses_a_progress_that_cannot_be_called_before_it_reads(family, memory):
    model = small_model(family, window=8, segment_len=8, memory=memory) if memory else small_model(family, window=8)
    with pytest.raises(TypeError, match="progress is called with .* got 5"):
        model.generate("a prompt long enough to pass the longmem side network's reach" * 3, progress=5)
    if memory:  # the backbone's pass alone, as training's bank of distractors runs it
        with pytest.raises(TypeError, match="progress is called with .* got 5"):
            model.backbone_prefill(list(range(40)), progress=5)
