"""The benchmark command runs (its numbers are recorded in benchmarks/RESULTS.md, never asserted)."""

import json
import math
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent


def test_benchmark_command_prints_a_ratio_table():
    out = subprocess.run(
        [sys.executable, "benchmarks/run.py", "--quick", "--only", "product_keys"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert "### product_keys" in out.stdout and "| speedup |" in out.stdout


def test_a_key_crosses_the_segment_boundary_only_when_its_tokens_reach_the_next_segment():
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from passkey_diagnostics import crosses_segment

    # prompt of 58 tokens, segment 64: the last token sits at 57, answer tokens predicted at 57..62
    assert not crosses_segment(58, 6, 64)
    assert not crosses_segment(59, 6, 64)  # predicted at 58..63: the last position of the segment
    assert crosses_segment(60, 6, 64)  # predicted at 59..64: the last one from the next segment
    assert crosses_segment(64, 6, 64) and not crosses_segment(65, 6, 64)  # the question opens a segment


def test_copy_heads_rebuilds_each_heads_attention_as_the_model_applies_it():
    """The patterns copy_heads reads are the model's: weighting each head's values by them gives its output z,
    with a window shorter than the input (the mask) and scrambled weights (patterns far from uniform)."""
    import torch

    from tests.conftest import scrambled, small_model

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from copy_heads import attention_patterns

    model = scrambled(small_model("sliding_window", window=8))
    ids = torch.randint(0, model.cfg.vocab_size, (30,)).tolist()
    patterns, cache = attention_patterns(model, ids)
    for l in range(model.cfg.n_layers):
        v, z = cache[f"blocks.{l}.attn.hook_v"][0], cache[f"blocks.{l}.attn.hook_z"][0]
        torch.testing.assert_close(torch.einsum("hts,shd->thd", patterns[l], v), z, rtol=1e-4, atol=1e-5)
    assert (patterns[:, :, 20, :12] == 0).all() and patterns.amax() > 0.9


def test_the_english_control_copies_a_key_in_view_with_layer_3s_heads_only():
    """Why longmem_english caches backbone layer 3 (docs/samples.md): two of its heads copy the key, layer 2's none."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from copy_heads import copy_attention

    import memviz

    table = copy_attention(memviz.load("sliding_window_english"), "shakespeare_train", n=4, seed=3)
    assert table[3].sort().values[-2] >= 0.5 and table[2].max() <= 0.05, table


def test_key_share_splits_a_read_into_shares_that_add_up_to_one_with_the_initial_term():
    import torch

    from tests.conftest import scrambled, small_model

    sys.path.insert(0, str(ROOT / "benchmarks"))
    from key_share import read_shares

    model = scrambled(
        small_model(
            "lm2", attention={"kind": "window", "span": 8}, segment_len=8, memory={"slots": 4, "update": "slots"}
        ),
        std=0.2,
    )
    ids = torch.randint(0, model.cfg.vocab_size, (40,), generator=torch.Generator().manual_seed(0)).tolist()
    early, late = read_shares(model, ids, 39, (0, 13)), read_shares(model, ids, 39, (13, 40))
    readout = model.memory_readout(ids, 39)
    for l, layer in enumerate(readout.reads):
        initial = float(readout.initial_share(layer).mean())
        assert early[l] + late[l] + initial == pytest.approx(1, abs=1e-5)
    assert max(abs(s) for s in early) > 0.01  # tokens two segments back still reach the read


def test_key_share_runs_on_a_sample_and_refuses_a_family_without_a_readout(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from key_share import main

    assert main(["lm2_english_16k", "--lengths", "256", "--n", "1", "--depths", "0.5"]) == 0
    out = capsys.readouterr().out
    assert "   256   0.50  0" in out and "means:" in out
    with pytest.raises(SystemExit):
        main(["sliding_window_english", "--lengths", "256"])
    assert "sliding_window_english: its family (sliding_window) gives no memory readout" in capsys.readouterr().err


def test_null_write_shares_are_the_tokens_part_of_each_slots_softmax_beside_its_null_logit():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from null_write import written_shares

    rng = np.random.default_rng(0)
    scores, sink = rng.normal(size=(20, 3)) * 3, rng.normal(size=3)
    shares = written_shares(scores, sink, 8)  # two whole segments; the last 4 positions are no whole segment
    assert shares.shape == (2, 3)
    for seg in range(2):
        block = np.exp(scores[8 * seg : 8 * seg + 8])
        np.testing.assert_allclose(shares[seg], block.sum(0) / (block.sum(0) + np.exp(sink)), rtol=1e-12)
    assert written_shares(scores, np.full(3, 60.0), 8).max() < 1e-15  # a null logit that wins keeps every slot
    np.testing.assert_allclose(written_shares(scores, np.full(3, -60.0), 8), 1)


def test_null_write_runs_on_a_sample_and_refuses_one_without_a_null_write(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from null_write import main

    assert main(["lm2_english_16k", "--lengths", "512", "--depths", "0.2", "0.8"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("   512   0.20  0") and lines[-1].startswith("median over 2 prompts:")
    assert all(0 <= float(v) <= 1 for v in lines[-1].split(":")[1].replace(",", " ").replace("|", " ").split())
    with pytest.raises(SystemExit):
        main(["infini_long", "--lengths", "256"])
    assert "infini_long: not an LM2 sample with a null write (family infini)" in capsys.readouterr().err
    assert main(["lm2_english_16k", "--lengths", "512", "--depths", "0.99"]) == 0  # the needle in the open segment
    assert "   512   0.99  0  skipped: no whole segment holds the needle" in capsys.readouterr().out


def test_train_time_chains_a_samples_stages_and_times_each_on_weights_of_its_shapes():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_time import chain_of, stage_weights

    assert chain_of("longmem_english") == ["english_backbone", "longmem_english_base", "longmem_english"]
    lm2 = chain_of("lm2_english_16k")
    assert lm2 == ["english_backbone", "lm2_english_16k_family", "lm2_english_16k"]
    # a middle stage whose export is gone times on the chain's sample (same family); the backbone has other shapes
    assert (
        stage_weights("lm2_english_16k_family", "lm2_english_16k")
        == ROOT / "sample_checkpoints/lm2_english_16k/model.safetensors"
    )
    assert stage_weights("english_backbone", "lm2_english_16k") is None
    with pytest.raises(SystemExit, match="no sample card sample_checkpoints/nope/card.json"):
        chain_of("nope")


def test_train_time_times_each_curriculum_stage_of_a_recipe():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_time import stages

    from training import TrainConfig

    titans = TrainConfig.load(ROOT / "sample_checkpoints/titans_qa1.train.json")
    assert stages(titans) == [(0, 400), (400, 1000), (1000, 2000)]
    control = TrainConfig.load(ROOT / "sample_checkpoints/sliding_window_qa1.train.json")  # lengths and story sizes
    assert stages(control) == [
        (0, 500),
        (500, 1000),
        (1000, 1500),
        (1500, 2000),
        (2000, 2500),
        (2500, 3000),
        (3000, 3500),
        (3500, 5000),
    ]


def test_train_time_fits_a_stage_over_the_lengths_its_steps_draw():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from train_time import fitted_seconds, spread_picks

    from memviz.tokenizer import load_tokenizer
    from training import TrainConfig
    from training.data import TaskSampler

    lengths = [100, 400, 200, 300, 1000, 500]  # steps 10-15
    assert spread_picks(lengths, 10, 3) == [11, 12, 14]  # lengths 400, 200, 1000: the sixths 1, 3, 5 of them sorted
    linear = [(n, 0.5 + 0.01 * n) for n in (400, 200, 1000)]
    assert fitted_seconds(linear, lengths) == pytest.approx(0.5 * 6 + 0.01 * sum(lengths))
    assert fitted_seconds([(64, 1.0), (64, 2.0)], [64] * 10) == pytest.approx(15.0)
    # the lengths it weights by are those the run's batches have
    cfg = TrainConfig.load(ROOT / "sample_checkpoints/gated_deltanet_english.train.json")
    sampler = TaskSampler(load_tokenizer(ROOT / "training/tokenizers/english-4096.json"), cfg.data)
    for step in (0, 1250, 1750):
        drawn = sampler.step_length(step)
        assert drawn <= sampler.batch(step, 2)[0].shape[1] <= drawn + 8


def test_long_grid_records_a_babilong_grid_equal_to_the_probe_run(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import long_grid

    import memviz
    from memviz_probes import babilong
    from tests.conftest import small_model

    memviz.save(small_model("infini", segment_len=16), tmp_path / "m")
    (tmp_path / "m" / "card.json").write_text("{}")
    assert (
        long_grid.main([str(tmp_path / "m"), "--babilong", "qa1", "--lengths", "400", "500", "--n", "2", "--record"])
        == 0
    )
    entry = json.loads((tmp_path / "m" / "card.json").read_text())["long_grid"]["qa1:400-500"]
    df = babilong.run(
        memviz.load(tmp_path / "m"), ["qa1"], [400, 500], n=2, seed=11, haystack="procedural", progress=False
    )
    assert entry["qa1"] == {str(k): round(float(v), 4) for k, v in df.groupby("length")["correct"].mean().items()}
    assert entry["n_per_cell"] == 2 and "--babilong qa1" in entry["command"]
    assert entry["haystack"] == "procedural", "a card without a training haystack: the procedural default"
    assert (
        long_grid.main(
            [
                str(tmp_path / "m"),
                "--babilong",
                "qa1",
                "--lengths",
                "400",
                "--n",
                "1",
                "--haystack",
                "shakespeare",
                "--record",
            ]
        )
        == 0
    )
    assert (
        json.loads((tmp_path / "m" / "card.json").read_text())["long_grid"]["qa1:400:shakespeare"]["haystack"]
        == "shakespeare"
    )


def test_a_set_option_no_checkpoint_knows_is_refused_before_anything_runs(tmp_path, capsys):
    """`--set segment_len=128` on an LM2 sample once changed nothing, silently: a key that no given
    checkpoint's family has is one error naming it, in each script that takes `--set`."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import long_grid
    import long_retention
    import retention_curve

    import memviz
    from tests.conftest import small_model

    memviz.save(small_model("lm2", segment_len=16), tmp_path / "m")
    (tmp_path / "m" / "card.json").write_text("{}")
    for main, args in [
        (long_grid.main, ["--lengths", "100", "--n", "1", "--record"]),
        (long_retention.main, ["--distance", "100", "--n", "1", "--record"]),
        (retention_curve.main, ["--distances", "64", "--n", "1"]),
    ]:
        with pytest.raises(SystemExit) as exit_:
            main([str(tmp_path / "m"), *args, "--set", "segment_len=128", "--set", "slots=4"])
        assert exit_.value.code == 2
        error = capsys.readouterr().err
        assert "--set segment_len:" in error and "slots=" not in error and "'slots'" in error, error
    assert json.loads((tmp_path / "m" / "card.json").read_text()) == {}, "nothing ran, nothing recorded"


@pytest.mark.parametrize(
    "script, args, named",
    [
        ("long_grid", ["nosuch", "--lengths", "128"], "nosuch: no such checkpoint folder (sample checkpoints: "),
        ("long_grid", ["lm2_english_16k", "--threads", "0"], "argument --threads: must be a whole number from 1"),
        ("english_lm", ["dense", "--threads", "x"], "argument --threads: must be a whole number from 1"),
        ("user_text", ["dense", "--threads", "-2"], "argument --threads: must be a whole number from 1"),
        ("english_lm", ["dense", "--window", "0"], "--window and --max-tokens must be at least 2 tokens, got 0"),
    ],
)
def test_benchmark_scripts_name_a_bad_argument_in_one_line(script, args, named, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    main = __import__(script).main
    with pytest.raises(SystemExit) as exit_:
        main(args)
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and named in error and "Traceback" not in error
    assert [line for line in error.splitlines() if "error:" in line] == [error.splitlines()[-1]]


@pytest.fixture
def no_work(monkeypatch):
    """The probes' runs, the trace and the per-token losses fail the test if called: a bad argument is refused first."""
    import memviz
    import memviz_probes.babilong
    import memviz_probes.lm
    import memviz_probes.passkey

    def ran(*args, **kwargs):
        raise AssertionError("the work started before the arguments were checked")

    for module, name in [
        (memviz_probes.passkey, "run"),
        (memviz_probes.babilong, "run"),
        (memviz_probes.lm, "compare"),
        (memviz_probes.lm, "token_losses"),
        (memviz, "trace"),
    ]:
        monkeypatch.setattr(module, name, ran)


def one_error_line(main, args, capsys) -> str:
    """`main(args)` exits with status 2 and one error line, its last, with no traceback: that line."""
    with pytest.raises(SystemExit) as exit_:
        main(args)
    error = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in error, error
    assert [line for line in error.splitlines() if "error:" in line] == [error.splitlines()[-1]], error
    return error.splitlines()[-1]


@pytest.mark.parametrize(
    "script, args, named",
    [
        ("english_views", ["nope_ckpt"], "error: nope_ckpt: no such checkpoint folder (sample checkpoints: dense, "),
        ("english_lm", ["nope_ckpt"], "error: nope_ckpt: no such checkpoint folder (sample checkpoints: dense, "),
        ("user_text", ["nope_ckpt"], "error: nope_ckpt: no such checkpoint folder (sample checkpoints: dense, "),
        ("long_grid", ["dense", "--babilong", "qa9"], "error: --babilong: unknown task 'qa9'; tasks are ['qa1', "),
        ("long_grid", ["dense", "--n", "0"], "error: --n: n must be a positive integer, got 0"),
        ("long_grid", ["dense", "--lengths", "-5"], "error: --lengths: lengths are whole numbers of tokens in 1.."),
        ("long_grid", ["dense", "--depths", "3"], "error: --depths: depth must lie in [0, 1] (depths are fractions"),
        ("long_grid", ["dense", "--haystack", "/nonexistent"], "error: --haystack: haystack '/nonexistent' does not"),
        ("long_grid", ["dense", "--n", "100000"], "error: --lengths, --depths and --n: this grid asks for 1,200,000"),
        (
            "long_grid",
            ["longmem_long", "--set", "bank_size=-1"],
            "config.json with overrides {'bank_size': -1}: bad longmem memory options: bank_size must be positive",
        ),
        (
            "long_grid",
            ["dense", "--lengths", "10", "--n", "1"],
            "error: --lengths 10 on dense: length 10 is shorter than the instruction, needle and question itself",
        ),
        ("english_lm", ["dense", "--corpus", "bogus"], "error: argument --corpus: invalid choice: 'bogus'"),
        ("english_lm", ["dense", "--corpus", "/tmp"], "error: argument --corpus: invalid choice: '/tmp'"),
        ("english_lm", ["dense", "--png", "/tmp"], "error: --png: /tmp is a folder; give the picture's file name"),
        ("english_views", ["dense", "--tokens", "-3"], "error: --tokens must be at least 2, got -3"),
        ("english_views", ["dense", "--tokens", "0"], "error: --tokens must be at least 2, got 0"),
        ("english_views", ["dense", "--tokens", "1"], "error: --tokens must be at least 2, got 1"),
        ("english_views", ["dense", "--start", "-5"], "error: --start must be 0 or more, got -5"),
        (
            "english_views",
            ["dense", "--start", "99999999"],
            "error: --start must lie inside hamlet, ",  # its length in tokens follows, then the largest start
        ),
    ],
)
def test_a_bad_benchmark_argument_is_one_line_before_any_work(script, args, named, no_work, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    assert named in one_error_line(__import__(script).main, args, capsys)


def test_every_checkpoint_a_benchmark_names_is_checked_before_the_first_runs(tmp_path, no_work, capsys):
    """A corrupt second checkpoint, a --record checkpoint without card.json and a picture whose folder is a file are
    refused before anything runs, not after the first checkpoint's grid or the whole run."""
    import shutil

    from memviz.checkpoint import resolve

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import english_lm
    import english_views
    import long_grid
    import retention_curve

    corrupt, no_card, a_file = tmp_path / "corrupt", tmp_path / "no_card", tmp_path / "a_file"
    for folder in (corrupt, no_card):
        shutil.copytree(resolve("dense"), folder)
    (corrupt / "model.safetensors").write_bytes(b"not weights")
    (no_card / "card.json").unlink()
    a_file.write_text("")
    grid = ["--lengths", "128", "--n", "1"]
    assert f"error: {corrupt}/model.safetensors: not a readable safetensors file" in one_error_line(
        long_grid.main, ["dense", str(corrupt), *grid], capsys
    )
    missing = f"error: --record: {no_card}/card.json is missing (the scores are stored in the checkpoint's card)"
    assert one_error_line(long_grid.main, ["dense", str(no_card), *grid, "--record"], capsys).endswith(missing)
    assert one_error_line(english_lm.main, ["dense", str(no_card), "--record"], capsys).endswith(missing)
    for main, flag, place in [
        (english_lm.main, "--png", a_file / "x.png"),
        (retention_curve.main, "--png", a_file / "deeper" / "x.png"),
        (english_views.main, "--png-dir", a_file / "pictures"),
    ]:
        error = one_error_line(main, ["dense", flag, str(place)], capsys)
        assert error.endswith(f"error: {flag}: {a_file} is a file, not a folder")


def test_english_views_traces_the_passage_it_is_asked_for(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from english_views import main

    assert main(["dense", "--start", "10", "--tokens", "40", "--threads", "1"]) == 0
    assert capsys.readouterr().out.startswith("dense: hamlet tokens 10-50, ")


def test_long_retention_goes_on_where_it_stopped_under_the_same_memory_options_only(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import long_retention

    import memviz
    from memviz_probes import retention
    from tests.conftest import small_model

    memviz.save(
        small_model("longmem", window=8, segment_len=8, memory={"chunk_size": 4, "bank_size": 64}), tmp_path / "m"
    )
    (tmp_path / "m" / "card.json").write_text("{}")
    log = tmp_path / "log.jsonl"
    run = [str(tmp_path / "m"), "--distance", "100", "--seed", "3", "--log", str(log)]
    assert long_retention.main([*run, "--n", "2"]) == 0
    assert long_retention.main([*run, "--n", "3", "--record"]) == 0  # samples 0 and 1 are in the log: only 2 runs
    rows = [json.loads(line) for line in log.read_text().splitlines()]
    assert [r["sample"] for r in rows] == [0, 1, 2] and all(r["memory"]["chunk_size"] == 4 for r in rows)
    model = memviz.load(tmp_path / "m")
    expected = [retention.seeded_sample(model.tokenizer, 100, 3, i).answer for i in range(3)]
    assert [r["answer"] for r in rows] == expected
    entry = json.loads((tmp_path / "m" / "card.json").read_text())["long_grid"]["retention:100"]
    assert entry["n_per_cell"] == 3 and entry["retention"]["100"] == round(sum(r["correct"] for r in rows) / 3, 4)
    assert long_retention.main([*run, "--n", "1", "--set", "chunk_size=2"]) == 0  # other options: answered anew
    assert json.loads(log.read_text().splitlines()[-1])["memory"]["chunk_size"] == 2


def test_the_samples_table_rounds_no_score_to_perfect_or_nil():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from samples_doc import percent

    values = (0.995, 0.8667, 1.0, 0.0, 0.004, 0.006, 0.9996, 0.0004)
    assert [percent(v) for v in values] == ["99.5%", "87%", "100%", "0%", "0.4%", "1%", "99.9%", "0.1%"]


def test_the_samples_table_in_the_docs_is_the_cards():
    """docs/samples.md's table is generated from every sample's card; an edited card or a new
    sample without `python benchmarks/samples_doc.py` fails here."""
    out = subprocess.run(
        [sys.executable, "benchmarks/samples_doc.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert out.returncode == 0, out.stderr
    text = (ROOT / "docs" / "samples.md").read_text()
    for folder in ("sample_checkpoints/infini_long", "families/gated_deltanet/sample_32k"):
        card = json.loads((ROOT / folder / "card.json").read_text())
        name = folder.removeprefix("sample_checkpoints/")
        assert f"| `{name}` | {card['family']} | {card['parameters']:,} | {card['steps']} |" in text


def test_the_gpu_run_goes_end_to_end_in_cpu_mode():
    """benchmarks/gpu.py on the CPU (Triton in the interpreter, small shapes): the kernel tests pass,
    every Triton kernel is timed beside its reference (and torch's op) and agrees with it, the bag's
    bandwidth and a trace's tokens per second are reported; nothing is recorded."""
    import re

    results = (ROOT / "benchmarks" / "RESULTS.md").read_text()
    out = subprocess.run(
        [sys.executable, "benchmarks/gpu.py", "--device", "cpu", "--rounds", "1"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    assert re.search(r"\*\*Kernel tests on cpu:\*\* \d+ passed", out.stdout)
    rows = {
        m.group(1): float(m.group(2)) for m in re.finditer(r"^\| (\w+) \| 64 \|.*\| ([\d.e+-]+) \|$", out.stdout, re.M)
    }
    assert set(rows) == {"product_key_topk", "weighted_bag", "infini_memory", "lm2_scan", "titans_linear_memory"}
    assert max(rows.values()) < 1e-4  # each kernel agrees with its reference on fresh inputs
    assert re.search(
        r"^\| weighted_bag \| 64 \| [\d.]+ \| [\d.]+x .* \| [\d.]+x ", out.stdout, re.M
    )  # vs F.embedding_bag
    assert re.search(r"^\| 64 \| [\d.]+ \| [\d.]+ \| [\d.]+ \| \d+% \|$", out.stdout, re.M)  # bag vs copy bandwidth
    assert re.search(r"^\| infini_long \| \d+ \| [\d,]+ \| [\d,]+ \|", out.stdout, re.M)  # a trace's tokens/s
    assert (ROOT / "benchmarks" / "RESULTS.md").read_text() == results


def test_a_kernel_that_fails_on_the_device_is_a_row_saying_so_and_the_others_are_kept(monkeypatch):
    """gpu.py's kernel table: a kernel that does not compile gets a 'failed:' row naming the error,
    the kernels after it are still timed, and the error is against the float64 reference."""
    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu

    def cases(device, tokens, dtype=None):
        x = torch.arange(1.0, 5.0, dtype=dtype or torch.float32)

        def broken():
            raise RuntimeError("out of resource: shared memory, Required: 263680\nmore")

        # the float32 reference is off by 2x, so only an error taken against the float64 one reads 1e-3
        reference = (lambda: x) if x.dtype == torch.float64 else (lambda: 2 * x)
        return {
            "broken": (broken, reference, None),
            "good": (lambda: x.float() * (1 + 1e-3), reference, None),  # 1e-3 off the float64 reference
        }, 16

    monkeypatch.setattr(gpu, "kernel_cases", cases)
    table, _ = gpu.kernel_rows("cpu", [64], 1)
    assert table[0] == "| broken | 64 | failed: RuntimeError: out of resource: shared memory, Required: 263680 | | | |"
    assert table[1].startswith("| good | 64 | ") and table[1].endswith("| - | 1.0e-03 |")


def test_english_lm_records_the_probes_bits_per_byte_and_the_window_split(tmp_path):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from english_lm import main

    import memviz
    from memviz_probes import lm
    from tests.conftest import small_model

    configs = {"sliding_window": {"attention": {"kind": "window", "span": 8}}, "infini": {"segment_len": 8}}
    folders = [
        memviz.save(small_model(family, seed=i, **extra), tmp_path / family)
        for i, (family, extra) in enumerate(configs.items())
    ]
    assert main([*map(str, folders), "--max-tokens", "90", "--window", "8", "--record", "--threads", "1"]) == 0
    for folder in folders:
        card = json.loads((folder / "card.json").read_text())["lm"]
        expected = lm.summary(lm.run(memviz.load(folder), corpus=None, max_tokens=90))["bits_per_byte"]
        assert card["bits_per_byte"] == {c: round(float(v), 4) for c, v in expected.items()}
        assert card["held_out"]["shakespeare"] == ["hamlet", "tempest"] and card["loss_past_window"] > 0


def test_user_text_prints_each_texts_bits_per_byte_as_a_one_pass_cross_entropy(tmp_path, capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from user_text import MAX_CHARS, licence_text, main, python_docs

    import memviz
    from memviz_probes import passkey
    from tests.conftest import scrambled, small_model

    folder = memviz.save(scrambled(small_model("infini", segment_len=16)), tmp_path / "infini")
    assert main([str(folder), "--threads", "1"]) == 0
    header, _, row = capsys.readouterr().out.strip().splitlines()[-3:]
    assert header.split(" | ")[1:3] == ["Apache licence", "Python docstrings"]
    assert licence_text().startswith("Copyright 2018- The Hugging Face team")  # transformers' own, not another's
    model = memviz.load(folder)
    prompt = passkey.seeded_sample(model.tokenizer, 1024, 0.5, 11, 0).prompt
    cells = row.strip("| ").split(" | ")[1:]
    assert len(cells) == 3
    for text, cell in zip([licence_text()[:MAX_CHARS], python_docs()[:MAX_CHARS], prompt], cells):
        printed_bits, printed_nats = (float(x.strip("()")) for x in cell.split())  # "bits (nats)"
        ids = torch.tensor([model.tokenizer.encode(text)])
        with torch.no_grad():
            nats = torch.nn.functional.cross_entropy(model(ids)[0, :-1].double(), ids[0, 1:], reduction="sum").item()
        bits = nats / math.log(2) / model.tokenizer.byte_length(ids[0, 1:].tolist())
        assert abs(printed_bits - bits) < 6e-4 and abs(printed_nats - nats / (ids.shape[1] - 1)) < 6e-3, cell


class RetrievalStub:
    """A LongMem stand-in whose augmented block's hook sees fixed retrieved chunks: 4-token chunks, 8-token
    segments, a bank of 8 tokens."""

    options = SimpleNamespace(chunk_size=4, bank_size=8)
    cfg = SimpleNamespace(segment_len=8)
    augmented_layer = 1

    def __init__(self, positions: torch.Tensor) -> None:
        self.positions = positions

    @contextmanager
    def evaluating(self):
        yield

    @contextmanager
    def hooks(self, fwd_hooks):
        ((name, self.hook),) = fwd_hooks
        assert name == "side_blocks.1.attn.hook_retrieved_pos"
        yield

    def stream(self, ids):
        self.hook(self.positions[None], None)
        yield


def test_reread_retrieval_counts_by_hand_what_the_second_reading_retrieved():
    """First reading at tokens 5-10 (chunks 4 and 8 overlap it), second at 20-25; tokens 20-24 each predict the next,
    whose place at the first reading is 6, 7, 8, 9, 10 (chunks 4, 4, 8, 8, 8). The bank at tokens 20-23 holds
    tokens 8-15 (chunks 8 and 12: one of two overlaps the first reading), at 24 tokens 16-23 (none)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reread_retrieval import retrieval_shares

    positions = torch.full((30, 1, 2), -1)
    positions[20:25, 0] = torch.tensor([[8, 12], [8, -1], [4, 16], [4, 8], [16, 20]])
    shares = retrieval_shares(RetrievalStub(positions), list(range(30)), first=5, second=20, passage=6)
    assert shares["in_first"] == pytest.approx(5 / 9)  # 8 | 8 | 4 | 4, 8 | - of 9 chunks read
    assert shares["target"] == pytest.approx(1 / 5)  # only token 23 read its next token's chunk (8, holding 9)
    assert shares["chance"] == pytest.approx((4 * 0.5 + 0) / 5)


def test_reread_retrieval_sees_the_re_reading_sample_read_its_copy_and_refuses_another_family(capsys):
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from reread_retrieval import main

    assert main(["longmem_english_reread", "longmem_english", "--distances", "1024", "--n", "2"]) == 0
    rows = [line.split("|") for line in capsys.readouterr().out.splitlines()[2:]]
    target = {row[1].strip(): float(row[5].strip(" %")) for row in rows}
    assert target["longmem_english_reread"] >= 30 and target["longmem_english"] <= 15, target
    with pytest.raises(SystemExit):
        main(["sliding_window_english"])
    assert "sliding_window_english is a sliding_window model: this reads LongMem's retrieval" in capsys.readouterr().err
