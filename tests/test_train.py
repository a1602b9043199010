"""Training: resume continues the run exactly, divergence stops cleanly, signals save, DDP agrees."""

import json
import math
import os
import random
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

import memviz
from memviz.checkpoint import read_weights
from memviz.layers import scaled_dot_product_attention
from tests.conftest import exits_2_with_one_line, tiny_run, train_config
from training import TrainConfig, Trainer, TrainingDiverged, quick_config, quick_families
from training import __main__ as training_cli
from training import loop as train_module
from training.loss import unembedded_loss, weighted_loss

ROOT = Path(__file__).resolve().parent.parent


def tiny_config(out, steps=6, **overrides):
    data = {
        "name": "tiny",
        "model": {"family": "sliding_window", "d_model": 32, "n_layers": 2, "n_heads": 2, "d_mlp": 64, "window": 16},
        "tokenizer": "byte",
        "data": {"mix": {"facts": 1.0}, "curriculum": [[0, 48]], "n_entities": 20},
        "optim": {"steps": steps, "batch_size": 2, "lr": 0.01, "warmup": 2},
        "out": str(out),
        "save_every": 1,
        "log_every": 1,
        "threads": 1,
    }
    for key, value in overrides.items():
        data[key] = {**data[key], **value} if isinstance(value, dict) and key in data else value
    return TrainConfig.from_dict(data)


def losses(out):
    rows = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in rows if "loss" in r}


def test_resume_continues_as_if_never_stopped(tmp_path):
    straight = Trainer(tiny_config(tmp_path / "a"), progress=False).run()

    def stop_at_three(record):
        if record.get("step") == 3:
            interrupted.stop.set()

    interrupted = Trainer(tiny_config(tmp_path / "b"), progress=False, on_log=stop_at_three)
    interrupted.run()
    assert interrupted.step == 3 and (tmp_path / "b/checkpoints/latest").read_text() == "step-0000003"
    resumed = Trainer(tiny_config(tmp_path / "b"), resume=True, progress=False).run()
    assert resumed.step == 6
    assert losses(tmp_path / "b") == pytest.approx(losses(tmp_path / "a"), abs=1e-6)
    for name, p in straight.model.state_dict().items():
        torch.testing.assert_close(resumed.model.state_dict()[name], p, atol=1e-6, rtol=1e-5)


def test_a_second_stage_starts_from_the_first_stages_weights(tmp_path):
    first = Trainer(tiny_config(tmp_path / "one", steps=3), progress=False).run()
    exported = memviz.save(first.model, tmp_path / "stage1")
    second = Trainer(tiny_config(tmp_path / "two", steps=2, init_from=str(exported)), progress=False)
    for name, p in first.model.state_dict().items():
        assert torch.equal(second.model.state_dict()[name], p), name
    fresh = Trainer(tiny_config(tmp_path / "three", steps=2), progress=False)
    assert not torch.equal(fresh.model.embed.weight, first.model.embed.weight), "without init_from it starts fresh"
    wider = {"model": {"d_mlp": 96}, "init_from": str(exported)}
    with pytest.raises(
        memviz.CheckpointError, match=r"same shapes; it is a sliding_window model differing in \['d_mlp'\]"
    ):
        Trainer(tiny_config(tmp_path / "four", **wider), progress=False)
    narrower_window = Trainer(
        tiny_config(tmp_path / "five", steps=2, model={"window": 4}, init_from=str(exported)), progress=False
    )  # an option that holds no weights may change between stages
    assert narrower_window.model.cfg.attention == {"kind": "window", "span": 4} != first.model.cfg.attention
    assert torch.equal(narrower_window.model.embed.weight, first.model.embed.weight)


def test_resume_refuses_another_data_mix_or_model_and_takes_more_steps(tmp_path):
    Trainer(tiny_config(tmp_path / "run", steps=2), progress=False).run()
    for changes, named in [
        ({"data": {"mix": {"passkey": 1.0}}}, "changes data.mix from the run"),
        ({"model": {"window": 8}, "seed": 3}, "changes model.window, seed from the run"),
    ]:
        with pytest.raises(ValueError, match=named):
            Trainer(tiny_config(tmp_path / "run", steps=3, **changes), resume=True, progress=False)
    longer = Trainer(tiny_config(tmp_path / "run", steps=3, optim={"lr": 0.005}), resume=True, progress=False).run()
    assert longer.step == 3


def test_resume_without_a_checkpoint_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no checkpoint under"):
        Trainer(tiny_config(tmp_path / "none"), resume=True, progress=False)


@pytest.mark.parametrize("rows", [5, 1024])
def test_the_loss_that_unembeds_block_by_block_is_the_plain_loss_with_its_gradients(rows):
    """unembedded_loss against the NLL of the logits h W^T (float64, fresh random inputs): the loss,
    the answers' loss and the gradients of h and W, with padding, answer weights and blocks that do not
    divide the tokens."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    B, T, d, V = 3, 17, 8, 29
    h = torch.randn(B, T, d, generator=g, dtype=torch.float64, requires_grad=True)
    W = torch.randn(V, d, generator=g, dtype=torch.float64, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    weights = torch.ones(B, T, dtype=torch.float64)
    weights[0, -4:] = 0  # padding
    weights[1, 5:8] = 5.0  # an answer
    z = (h @ W.T)[:, :-1]  # in float64 throughout (weighted_loss takes float32 logits)
    nll = z.logsumexp(-1) - z.gather(-1, tokens[:, 1:, None])[..., 0]
    w = weights[:, 1:]
    plain = ((nll * w).sum() / w.sum(), nll[w > 1].mean())
    plain_grads = torch.autograd.grad(3.0 * plain[0], (h, W))
    fused = unembedded_loss(h, W, tokens, weights, rows=rows)
    fused_grads = torch.autograd.grad(3.0 * fused[0], (h, W))
    for a, b in zip((*plain, *plain_grads), (*fused, *fused_grads)):
        torch.testing.assert_close(b, a, rtol=1e-12, atol=1e-12, msg=lambda m: f"seed {seed}: {m}")
    frozen = unembedded_loss(h, W.detach(), tokens, weights, rows=rows)[0]  # a frozen unembedding: h's gradient alone
    torch.testing.assert_close(torch.autograd.grad(3.0 * frozen, h)[0], plain_grads[0], rtol=1e-12, atol=1e-12)


def test_a_training_step_is_the_plain_losss_step(tmp_path):
    """One step of a Trainer (the loss applying the unembedding) against the same step through the
    logits, on tied and untied embeddings: the same loss and the same gradients."""
    for tied in (False, True):
        config = tiny_config(tmp_path / str(tied), model={"tie_embeddings": tied}, optim={"clip": 1e9})  # no clipping
        trainer = Trainer(config, progress=False)
        tokens, weights = trainer.sampler.batch(0, 2, 0)
        plain = weighted_loss(trainer.model(tokens), tokens, weights)[0]
        plain_grads = torch.autograd.grad(plain, list(trainer.model.parameters()))
        trainer.optimizer.step = lambda: None  # keep the weights to compare the gradients
        logged = trainer.train_step()
        assert logged["loss"] == pytest.approx(plain.item(), rel=1e-5)
        for (name, p), expected in zip(trainer.model.named_parameters(), plain_grads):
            torch.testing.assert_close(p.grad, expected, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


def test_under_autocast_the_loss_takes_its_products_in_bfloat16():
    """unembedded_loss under a bfloat16 autocast against the float64 loss of the same products with
    operands rounded to bfloat16 (fresh random inputs): bfloat16's precision, a float32 result, and not
    the float32 path's numbers."""
    seed = random.SystemRandom().randrange(2**31)
    g = torch.Generator().manual_seed(seed)
    B, T, d, V = 2, 40, 16, 50
    h = torch.randn(B, T, d, generator=g, requires_grad=True)
    W = torch.randn(V, d, generator=g, requires_grad=True)
    tokens = torch.randint(0, V, (B, T), generator=g)
    weights = torch.ones(B, T)
    weights[1, 10:14] = 5.0
    rounded = [t.detach().bfloat16().double().requires_grad_() for t in (h, W)]
    z = (rounded[0] @ rounded[1].T)[:, :-1]
    nll = z.logsumexp(-1) - z.gather(-1, tokens[:, 1:, None])[..., 0]
    reference = (nll * weights[:, 1:]).sum() / weights[:, 1:].sum()
    reference_grads = torch.autograd.grad(reference, rounded)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        loss = unembedded_loss(h, W, tokens, weights, rows=16)[0]
    grads = torch.autograd.grad(loss, (h, W))
    assert loss.dtype == torch.float32
    assert loss.item() == pytest.approx(reference.item(), rel=1e-2), f"seed {seed}"
    for got, expected in zip(grads, reference_grads):
        torch.testing.assert_close(got.double(), expected, rtol=5e-2, atol=5e-3, msg=lambda m: f"seed {seed}: {m}")
    assert loss.item() != unembedded_loss(h, W, tokens, weights, rows=16)[0].item(), "the products stayed float32"


def test_local_attention_under_the_cpus_autocast_is_float32_attention():
    """Under a CPU bfloat16 autocast the attention of bfloat16 q, k, v is float32 attention of them."""
    q, k, v = (torch.randn(2, 3, 8, 4).bfloat16() for _ in range(3))
    mask = torch.ones(8, 8, dtype=torch.bool).tril()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        z = scaled_dot_product_attention(q, k, v, mask)
    assert z.dtype == torch.float32
    expected = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask)
    assert torch.equal(z, expected)


@pytest.mark.parametrize("family", sorted(quick_families()))
def test_a_bfloat16_step_is_the_float32_step_to_bfloat16s_precision(family, tmp_path):
    """optim.precision "bfloat16": one step's loss and gradients against the float32 step's on the same
    batch and weights, for every family; the weights and their gradients stay float32."""
    steps = {}
    for precision in ("float32", "bfloat16"):
        cfg = quick_config(family, "passkey", 1, family, tmp_path / precision, length=128)
        cfg.optim.precision, cfg.optim.clip = precision, 1e9  # no clipping
        trainer = Trainer(cfg, progress=False)
        trainer.optimizer.step = lambda: None  # keep the weights to compare the gradients
        loss = trainer.train_step()["loss"]
        grads = torch.cat([p.grad.flatten() for p in trainer.model.parameters() if p.grad is not None])
        assert all(p.dtype == torch.float32 for p in trainer.model.parameters()) and grads.dtype == torch.float32
        steps[precision] = loss, grads
    (loss32, grads32), (loss16, grads16) = steps["float32"], steps["bfloat16"]
    assert loss16 == pytest.approx(loss32, rel=2e-2)
    assert loss16 != loss32, "autocast changed nothing"
    cosine = torch.nn.functional.cosine_similarity(grads16, grads32, dim=0).item()
    assert cosine > 0.99 and (grads16.norm() / grads32.norm()).item() == pytest.approx(1, abs=0.05)


def test_nan_loss_stops_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    real = train_module.unembedded_loss
    calls = {"n": 0}

    def poisoned(*args):
        calls["n"] += 1
        loss, answer = real(*args)
        return (loss * float("nan") if calls["n"] == 4 else loss), answer

    monkeypatch.setattr(train_module, "unembedded_loss", poisoned)
    trainer = Trainer(tiny_config(tmp_path / "nan"), progress=False)
    with pytest.raises(TrainingDiverged, match="loss became nan at step 3"):
        trainer.run()
    latest = tmp_path / "nan/checkpoints" / (tmp_path / "nan/checkpoints/latest").read_text()
    assert latest.name == "step-0000003"
    weights = read_weights(latest / "model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())
    assert memviz.load(latest).cfg.name == "tiny"  # the last good checkpoint still loads


def test_a_non_finite_gradient_stops_before_it_reaches_the_weights(tmp_path):
    """A finite loss whose gradient overflows (Titans at its init on 512 tokens does this) must
    stop with the parameter named, not clip every weight by a NaN norm and fail a step later."""
    trainer = Trainer(tiny_config(tmp_path / "inf"), progress=False)
    calls = {"n": 0}

    def overflow_at_step_three(grad):
        calls["n"] += 1
        return grad * float("inf") if calls["n"] == 4 else grad

    name, weight = next((n, p) for n, p in trainer.model.named_parameters() if n.startswith("blocks.1."))
    weight.register_hook(overflow_at_step_three)
    with pytest.raises(
        TrainingDiverged,
        match=rf"gradient became non-finite at step 3 \(loss [0-9.]+, 4\d tokens\) in {re.escape(name)};",
    ):
        trainer.run()
    latest = tmp_path / "inf/checkpoints" / (tmp_path / "inf/checkpoints/latest").read_text()
    assert latest.name == "step-0000003"
    saved = read_weights(latest / "model.safetensors")
    for name, p in trainer.model.state_dict().items():  # no step was taken with the poisoned gradient
        if name in saved:
            assert torch.equal(saved[name], p), name


def test_sigterm_saves_and_exits_then_export_writes_a_card(tmp_path):
    config = tiny_config(tmp_path / "run", steps=100_000)
    path = tmp_path / "config.json"
    path.write_text(json.dumps({**config.to_dict(), "save_every": 1000}))
    proc = subprocess.Popen(
        [sys.executable, "-m", "training", "--config", str(path), "--no-progress"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    metrics = tmp_path / "run/metrics.jsonl"
    deadline = time.time() + 120
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):
        assert time.time() < deadline and proc.poll() is None, proc.communicate()
        time.sleep(0.2)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    assert "saving a checkpoint" in err
    step = int((tmp_path / "run/checkpoints/latest").read_text().split("-")[1])
    assert step >= 3
    # a resumed run at its last step exports; its card names the one-shot command (resume is exact)
    # --threads overrides the config's 1, --precision its float32, and the card says so
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "training",
            "--config",
            str(path),
            "--resume",
            "--steps",
            str(step),
            "--threads",
            "2",
            "--precision",
            "bfloat16",
            "--export",
            str(tmp_path / "exported"),
            "--no-progress",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr
    card = json.loads((tmp_path / "exported/card.json").read_text())
    assert card["steps"] == step and card["family"] == "sliding_window" and "CPU" in card["machine"]
    assert "2 torch threads" in card["machine"] and card["train_config"]["threads"] == 2
    assert card["train_config"]["optim"]["precision"] == "bfloat16"
    assert card["train_command"] == (
        f"python -m training --config {path} --steps {step} --threads 2 --precision bfloat16 "
        f"--export {tmp_path / 'exported'} --no-progress"
    )
    assert memviz.load(tmp_path / "exported").cfg.attention == {"kind": "window", "span": 16}


def test_a_missing_config_and_nonsense_command_line_numbers_are_named(capsys):
    """The config's own fields are tested in tests/test_training_config.py's table; here the file and the flags."""
    with pytest.raises(ValueError, match="does not exist"):
        TrainConfig.load("/no/such/config.json")
    with pytest.raises(SystemExit):
        training_cli.main(["--config", "/no/such/config.json", "--threads", "0"])
    assert "--threads: must be a positive integer, got 0" in capsys.readouterr().err
    for steps in ("0", "-5"):
        with pytest.raises(SystemExit):
            training_cli.main(["--config", "/no/such/config.json", "--steps", steps])
        assert f"--steps: must be a positive integer, got {steps}" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        training_cli.main(["--config", "/no/such/config.json", "--resume", "--overwrite"])
    assert "--overwrite: not allowed with argument --resume" in capsys.readouterr().err


def test_memory_values_get_their_own_lr_and_no_decay(tmp_path):
    memory = {
        "family": "memory_layer",
        "d_model": 32,
        "n_layers": 2,
        "n_heads": 2,
        "d_mlp": 64,
        "window": 16,
        "memory": {"n_keys": 8, "topk": 2, "heads": 2, "d_key": 8, "layers": [1]},
    }
    trainer = Trainer(
        tiny_config(tmp_path / "m", steps=3, model=memory, optim={"memory_value_lr": 0.05}), progress=False
    )
    values = trainer.model.values
    before = values.detach().clone()
    trainer.run()
    groups = trainer.optimizer.param_groups
    [own] = [g for g in groups if any(p is values for p in g["params"])]
    assert len(own["params"]) == 1 and own["weight_decay"] == 0.0
    assert all(not any(p is values for p in g["params"]) for g in groups if g is not own)
    last_lr = trainer.cfg.optim.lr_at(2)
    assert own["lr"] == pytest.approx(5 * last_lr) and groups[0]["lr"] == pytest.approx(last_lr)
    assert not torch.equal(values.detach(), before)
    plain = Trainer(tiny_config(tmp_path / "p", steps=1, model=memory), progress=False).optimizer
    assert len(plain.param_groups) == 2, "without memory_value_lr the values decay with the other matrices"


def test_train_only_trains_the_named_parameters_and_freezes_the_rest(tmp_path):
    only = ["blocks.*.ln2.*", "blocks.1.mlp.W_down.weight"]
    trainer = Trainer(tiny_config(tmp_path / "t", steps=2, optim={"train_only": only}), progress=False)
    before = {name: p.detach().clone() for name, p in trainer.model.named_parameters()}
    trainer.run()
    changed = {name for name, p in trainer.model.named_parameters() if not torch.equal(p.detach(), before[name])}
    assert changed == {"blocks.0.ln2.weight", "blocks.1.ln2.weight", "blocks.1.mlp.W_down.weight"}
    with pytest.raises(ValueError, match=r"train_only: no parameter name matches \['blocks.\*.W_gate'\]"):
        Trainer(tiny_config(tmp_path / "u", optim={"train_only": ["blocks.*.W_gate"]}), progress=False)
    with pytest.raises(ValueError, match="optim.train_only must be a list"):
        TrainConfig.from_dict({"name": "x", "model": {}, "optim": {"train_only": "W_in"}})


DDP_SCRIPT = """
import json, sys, torch
from safetensors.torch import save_file
from training import TrainConfig, Trainer
cfg = TrainConfig.from_dict(json.loads(open(sys.argv[1]).read()))
trainer = Trainer(cfg, progress=False).run()
rank = torch.distributed.get_rank()
save_file({k: v.contiguous() for k, v in trainer.model.state_dict().items() if k != "unembed.weight"},
          f"{cfg.out}/rank{rank}.safetensors")
torch.distributed.destroy_process_group()
"""


def test_ddp_two_cpu_processes_end_with_identical_weights(tmp_path):
    config = tiny_config(tmp_path / "ddp", steps=4)
    (tmp_path / "config.json").write_text(json.dumps(config.to_dict()))
    (tmp_path / "ddp_train.py").write_text(DDP_SCRIPT)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc_per_node",
            "2",
            "--master_port",
            "29517",
            str(tmp_path / "ddp_train.py"),
            str(tmp_path / "config.json"),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    a, b = read_weights(tmp_path / "ddp/rank0.safetensors"), read_weights(tmp_path / "ddp/rank1.safetensors")
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name
    start = Trainer(tiny_config(tmp_path / "fresh", steps=4), progress=False).model.state_dict()
    assert any(not torch.equal(a[n], start[n]) for n in a)  # they trained, and agree


@pytest.mark.parametrize(
    "family, options",
    [
        ("infini", {"segment_len": 8}),
        ("lm2", {"window": 8}),
        ("titans", {"segment_len": 8, "memory": {"chunk": 8}}),
        ("memory_layer", {"memory": {"n_keys": 8, "topk": 4, "d_key": 16, "layers": [1]}}),
    ],
)
def test_a_memory_model_starts_from_a_baselines_backbone(tmp_path, family, options):
    baseline = Trainer(tiny_config(tmp_path / "base", steps=2), progress=False).run()
    exported = memviz.save(baseline.model, tmp_path / "baseline")
    config = {"model": {"family": family, "window": None, **options}, "init_from": str(exported)}
    warm = Trainer(tiny_config(tmp_path / "warm", steps=2, **config), progress=False)
    ours, theirs = warm.model.state_dict(), baseline.model.state_dict()
    replaced = [name for name in theirs if warm.model.replaces_baseline_weight(name)]
    assert replaced == (
        ["blocks.1.mlp.W_gate.weight", "blocks.1.mlp.W_up.weight", "blocks.1.mlp.W_down.weight"]
        if family == "memory_layer"
        else []
    ), "a memory layer takes its FFN's place"
    for name, p in theirs.items():
        assert name in replaced or torch.equal(ours[name], p), name
    assert [name for name in ours if name not in theirs], "the memory's own weights start fresh"
    assert math.isfinite(losses(warm.run().out)[2])  # and it trains
    deeper = config | {"model": {**config["model"], "n_layers": 3}}
    with pytest.raises(
        memviz.CheckpointError,
        match=rf"a {family} model can start from a sliding_window baseline only with the same shape; they differ in "
        r"\['n_layers'\]",
    ):
        Trainer(tiny_config(tmp_path / "deeper", **deeper), progress=False)


def test_a_fresh_run_refuses_a_folder_that_holds_an_earlier_run(tmp_path):
    Trainer(tiny_config(tmp_path / "run", steps=2), progress=False).run()
    with pytest.raises(ValueError, match="holds an earlier run .*--resume.*--overwrite"):
        Trainer(tiny_config(tmp_path / "run", steps=2), progress=False)
    assert (tmp_path / "run" / "checkpoints").is_dir(), "the refusal touched nothing"
    refused = tiny_config(tmp_path / "run", steps=2, optim={"train_only": ["no.such.*"]})
    with pytest.raises(ValueError, match="no parameter name matches"):  # refused before anything is cleared
        Trainer(refused, overwrite=True, progress=False)
    assert (tmp_path / "run" / "checkpoints" / "latest").is_file() and len(losses(tmp_path / "run")) == 2
    again = Trainer(tiny_config(tmp_path / "run", steps=2), overwrite=True, progress=False).run()
    assert again.step == 2 and len(losses(tmp_path / "run")) == 2, "--overwrite starts the metrics afresh"


def test_an_export_that_fails_leaves_the_earlier_folder_whole(tmp_path):
    from memviz.files import replace_folder

    trainer = Trainer(tiny_config(tmp_path / "run", steps=1), progress=False).run()
    first = trainer.export(tmp_path / "export", final_eval=False)
    before = {p.name: p.read_bytes() for p in first.iterdir()}

    def broken(staging):
        (staging / "model.safetensors").write_bytes(b"half")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        replace_folder(tmp_path / "export", broken)
    assert {p.name: p.read_bytes() for p in (tmp_path / "export").iterdir()} == before
    assert memviz.load(tmp_path / "export").family == "sliding_window"
    trainer.export(tmp_path / "export", final_eval=False)  # over the old one, and over the failed attempt's leftovers
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".export")] == []


@pytest.mark.parametrize("family", sorted(quick_families()))
def test_every_quick_preset_makes_progress(family, tmp_path):
    """What the Train page offers: each family's quick preset, a short pass-key run at its own
    learning rate, lowers the loss on a held-out batch and never meets a non-finite gradient
    (Trainer raises on one). The logged losses are of other batches each time, and on one CPU
    the titans preset's last logged loss was 0.08 below its first; on the held-out batch it
    drops 0.36 (the others 1.7-2.1), at lr 1e-8 by nothing."""
    cfg = quick_config(family, "passkey", 15, "progress", tmp_path / "run", length=256)
    trainer = Trainer(cfg, progress=False)
    tokens, weights = trainer.sampler.batch(10_000, 8, 0)  # a step the run never reaches

    def held_out_loss():
        with torch.no_grad():
            return weighted_loss(trainer.model(tokens), tokens, weights)[0].item()

    before = held_out_loss()
    trainer.run()
    assert held_out_loss() < before - 0.2


def test_longmem_batches_continue_one_prefix_of_filler_that_the_frozen_backbone_wrote(tmp_path, monkeypatch):
    from memviz.models.longmem.bank import ChunkBank

    baseline = Trainer(tiny_config(tmp_path / "base", steps=2), progress=False).run()
    exported = memviz.save(baseline.model, tmp_path / "baseline")
    longmem = {"family": "longmem", "segment_len": 16, "memory": {"bank_size": 512, "chunk_size": 2, "topk_chunks": 2}}
    cfg = tiny_config(
        tmp_path / "prefixed", steps=3, model=longmem, init_from=str(exported), data={"prefix_tokens": [[0, 200]]}
    )
    trainer = Trainer(cfg, progress=False)
    filler = trainer.sampler.prefix(200, 2)
    assert (
        filler.shape == (2, 200)
        and not torch.equal(filler[0], filler[1])
        and torch.equal(filler, trainer.sampler.prefix(200, 2))
    )
    storages, append = [], ChunkBank.append
    monkeypatch.setattr(
        ChunkBank, "append", lambda bank, *args: storages.append((bank := append(bank, *args))._storage) or bank
    )
    read = []
    hook = ("side_blocks.1.attn.hook_retrieved_pos", lambda positions, hook: read.append(positions))
    with trainer.model.hooks(fwd_hooks=[hook]):
        for _ in range(3):
            trainer.train_step()
    prefix_bank = trainer.prefix_states[200].shared.bank
    assert all(s is prefix_bank._storage for s in storages)  # each batch appends to the prefix's storage, not a copy
    assert len(read) == 3 and all(((p >= 0) & (p < 200)).any() for p in read)  # and every batch reads the filler
    written = trainer.model.backbone_prefill(filler).shared.bank  # the weights the steps changed do not enter it
    assert torch.equal(prefix_bank.keys, written.keys) and torch.equal(prefix_bank.values, written.values)
    with pytest.raises(ValueError, match="do not fit in model.memory.bank_size"):
        Trainer(
            tiny_config(tmp_path / "long", model=longmem, init_from=str(exported), data={"prefix_tokens": [[0, 480]]})
        )
    with pytest.raises(ValueError, match="needs a memory that frozen weights write"):
        Trainer(tiny_config(tmp_path / "window", data={"prefix_tokens": [[0, 64]]}))


PAGE_FAULTS_SCRIPT = """
import json, resource, sys, torch
from memviz import heap
from training import Trainer
from tests.test_train import tiny_config
if sys.argv[1] == "trainer":
    Trainer(tiny_config(sys.argv[2], steps=1))
def rss_mb():
    return int(open("/proc/self/statm").read().split()[1]) * resource.getpagesize() / 2**20
def faults():
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
torch.empty(16 << 20).fill_(1.0)  # 64 MiB, then freed
before = faults()
torch.empty((16 << 20) - 1024).fill_(2.0)  # a block that fits in the freed one
again = faults() - before
held = rss_mb()
heap.release_free_heap()
print(json.dumps({"faults": again, "released_mb": held - rss_mb()}))
"""


def huge_pages_always() -> bool:
    """With transparent huge pages always on, a fresh 64 MiB block faults in 2 MiB at a time."""
    path = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    return path.is_file() and "[always]" in path.read_text()


@pytest.mark.skipif(not sys.platform.startswith("linux") or huge_pages_always(), reason="glibc's malloc, 4 KiB pages")
def test_a_training_process_reuses_freed_pages_and_a_trim_still_gives_them_back(tmp_path):
    def run(mode):
        out = subprocess.run(
            [sys.executable, "-c", PAGE_FAULTS_SCRIPT, mode, str(tmp_path / mode)],
            cwd=ROOT,
            capture_output=True,
            text=True,
            check=True,
        )
        return json.loads(out.stdout.splitlines()[-1])

    plain, training = run("plain"), run("trainer")
    assert plain["faults"] > 10_000  # 16k pages of 4 KiB: the freed block went back to the system
    assert training["faults"] < 1_000  # after a Trainer: the same pages again
    assert training["released_mb"] > 48  # release_free_heap (streams) still gives the 64 MiB back


def test_a_vocab_size_the_tokenizer_does_not_have_is_refused_before_training(tmp_path):
    from training import Trainer

    cfg = tiny_run(tmp_path / "run")
    cfg.model = {**cfg.model, "vocab_size": 100}
    with pytest.raises(ValueError, match=r"model.vocab_size is 100 but the run's tokenizer has \d+ ids"):
        Trainer(cfg, progress=False).run()
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.parametrize(
    "changes, named",
    [
        ({"model": {"family": "sliding_window", "d_model": -3}}, "model: config field 'd_model' must be"),
        ({"model": {"family": "sliding_window", "bogus": 1}}, r"model: unknown config fields \['bogus'\]"),
        ({"init_from": "/nonexistent"}, "init_from: /nonexistent"),
    ],
)
def test_a_model_section_or_start_the_trainer_refuses_names_its_field(changes, named, tmp_path):
    from training import Trainer

    cfg = TrainConfig.from_dict({**train_config(out=str(tmp_path / "run")), **changes})
    with pytest.raises(ValueError, match=named):
        Trainer(cfg, progress=False)
    assert not (tmp_path / "run").exists()


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
    checkpoints = tmp_path / "run" / "checkpoints"
    (checkpoints / ".latest.abc123.tmp").write_text("step-00")
    # a save killed part-way: memviz.save's staging folder, whose process is gone; one of a live process stays
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    staging = checkpoints / f".step-0000003.writing-{gone.stdout.strip()}-x1"
    staging.mkdir()
    (staging / "model.safetensors").write_bytes(b"half")
    writing = checkpoints / f".step-0000009.writing-{os.getpid()}-x2"
    writing.mkdir()
    Trainer(tiny_run(tmp_path / "run", steps=4), resume=True, progress=False).run()
    lines = metrics.read_text().splitlines()
    assert lines[2] == "# lr halved by hand here"
    assert [json.loads(line)["step"] for line in lines[:2] + lines[3:]] == [1, 2, 3, 4]
    assert list(checkpoints.glob(".*.tmp")) == [] and not staging.exists() and writing.is_dir()


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


COMMAND_CASES = [
    "training config",
    "training config missing",
    "training config a folder",
    "training export into its run",
    "training export empty",
    "training threads 100000",
]


@pytest.mark.parametrize("case", COMMAND_CASES)
def test_the_command_lines_exit_2_with_one_line(case, tmp_path):
    config = tmp_path / "bad.train.json"
    config.write_text(json.dumps(train_config(**{"optim.steps": -5})))
    good = tmp_path / "good.train.json"
    good.write_text(json.dumps(train_config(out=str(tmp_path / "run"))))
    command, named = {
        "training config": (["-m", "training", "--config", str(config)], "optim.steps"),
        "training config missing": (["-m", "training", "--config", str(tmp_path / "none.json")], "none.json"),
        "training config a folder": (["-m", "training", "--config", str(tmp_path)], str(tmp_path)),
        "training export into its run": (
            ["-m", "training", "--config", str(good), "--export", str(tmp_path / "run" / "checkpoints")],
            "is the run folder",
        ),
        "training export empty": (["-m", "training", "--config", str(good), "--export", ""], "--export: an empty"),
        "training threads 100000": (["-m", "training", "--config", str(good), "--threads", "100000"], "--threads"),
    }[case]
    exits_2_with_one_line(command, named)


def test_export_memory_writes_the_trained_weights_read_with_options_that_hold_none(tmp_path):
    """`export_memory` sets what the exported checkpoint reads with (LongMem's chunks here) without touching the
    weights: its logits are the trained model's loaded with the same options; an option that holds weights, or one the
    family does not know, is refused before the first step."""
    baseline = Trainer(tiny_config(tmp_path / "base", steps=2), progress=False).run()
    exported = memviz.save(baseline.model, tmp_path / "baseline")
    longmem = {"family": "longmem", "segment_len": 16, "memory": {"bank_size": 512, "chunk_size": 4, "topk_chunks": 2}}
    plain = Trainer(tiny_config(tmp_path / "plain", steps=2, model=longmem, init_from=str(exported)), progress=False)
    plain.run().export(tmp_path / "chunks_of_4", final_eval=False)
    cfg = tiny_config(
        tmp_path / "tokens", steps=2, model=longmem, init_from=str(exported), export_memory={"chunk_size": 1}
    )
    Trainer(cfg, progress=False).run().export(tmp_path / "tokens_one_by_one", final_eval=False)
    written = json.loads((tmp_path / "tokens_one_by_one/config.json").read_text())["memory"]
    assert (written["chunk_size"], written["topk_chunks"]) == (1, 2)
    tokens = torch.randint(0, 256, (1, 200), generator=torch.Generator().manual_seed(3))
    reads_tokens = memviz.load(tmp_path / "tokens_one_by_one")(tokens)
    assert torch.equal(reads_tokens, memviz.load(tmp_path / "chunks_of_4", chunk_size=1)(tokens))
    assert not torch.allclose(reads_tokens, memviz.load(tmp_path / "chunks_of_4")(tokens))
    for options, why in (({"side_layers": 1}, "changes the weights"), ({"chunks": 1}, "chunks")):
        bad = tiny_config(tmp_path / "bad", model=longmem, init_from=str(exported), export_memory=options)
        with pytest.raises(memviz.ConfigError, match=rf"export_memory .*{why}"):
            Trainer(bad, progress=False)
        assert not (tmp_path / "bad/checkpoints").exists()
