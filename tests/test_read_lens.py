"""The logit lens on memory reads (memviz.read_lens): the frozen path of each family that declares one, checked against
what the model itself adds to its residual stream (from its hooks, where the path is built from its weights) and the
logits it gives, each writer's part against the path applied to it alone, and the writers' shifts adding up to the
read's."""

import numpy as np
import pytest
import torch

import memviz
from memviz.read_lens import read_lens, read_lens_figures, read_logits, read_path_of
from memviz.registry import get_family
from tests.conftest import FAMILY_CONFIGS, random_ids, scrambled, small_model

#: the hook holding what each family's memory adds to the residual stream, and how it gets there
OWN_FAMILIES = ["gated_deltanet", "infini", "lm2"]
RELEASED = ["qwen3_5_text", "qwen3_next", "olmo_hybrid", "kimi_linear", "bailing_hybrid"]


def fresh_seed() -> int:
    return int(np.random.SeedSequence().generate_state(1)[0])


#: what each family's exact split of a read needs beyond its tiny config (LM2 records its bank per segment)
SPLIT_READ = {"lm2": {"segment_len": 8, "memory": {"slots": 4, "update": "segment"}}}


def own_model(family: str, seed: int, **overrides) -> memviz.MemoryLM:
    model = small_model(family, seed=seed, **{**FAMILY_CONFIGS[family], **SPLIT_READ.get(family, {}), **overrides})
    return scrambled(model, std=0.2, seed=seed).double()


def memory_contribution(model, family: str, ids, position: int) -> dict[str, torch.Tensor]:
    """What each memory layer adds to the residual stream at `position`, from the model's own hooks and weights
    (the memory's output after its norm and gates, its mix and the output projection), not the read path."""
    L, H = model.cfg.n_layers, model.cfg.n_heads
    if family == "lm2":
        seen = model.capture(ids, [f"blocks.{l}.hook_mem_out" for l in range(L)])
        return {f"blocks.{l}": seen[f"blocks.{l}.hook_mem_out"][position] for l in range(L)}
    names = [f"blocks.{l}.attn.hook_{h}" for l in range(L) for h in ("mem_out", "gate")]
    seen = model.capture(ids, names)
    out = {}
    for l, block in enumerate(model.blocks):
        mem = seen[f"blocks.{l}.attn.hook_mem_out"][position]  # [head, d]
        gate = seen[f"blocks.{l}.attn.hook_gate"][position]  # [head]
        out[f"blocks.{l}"] = block.attn.W_O.weight.double() @ (gate[:, None] * mem).reshape(H * mem.shape[-1])
    return out


@pytest.mark.parametrize("family", OWN_FAMILIES)
def test_the_path_of_a_read_gives_what_the_memory_adds_and_the_final_steps_give_the_logits(family):
    seed = fresh_seed()
    model = own_model(family, seed)
    ids = random_ids(40, seed=seed)
    position = 37
    path = read_path_of(model, ids, position)
    readout = model.memory_readout(ids, position)
    expected = memory_contribution(model, family, ids, position)
    assert set(path.layers) == set(expected), f"seed {seed}"
    for layer, parts in readout.parts.items():
        read = parts.sum(0) + readout.initial.get(layer, 0)
        got = path.residual(layer, read[None])[0]
        torch.testing.assert_close(got, expected[layer], rtol=1e-9, atol=1e-10, msg=f"{layer}, seed {seed}")
        if len(parts):  # a writer's part alone goes the same frozen way: its residual is the path applied to it
            one = parts[len(parts) // 2]
            alone = torch.einsum("hd,hdm->m", one, path.layers[layer])
            torch.testing.assert_close(path.residual(layer, one[None])[0], alone, rtol=1e-12, atol=1e-14)
    last = model.capture(ids, [f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"])
    x = next(iter(last.values()))[position]
    with torch.no_grad():
        logits = model(ids)[0, position].double()
    torch.testing.assert_close((x * path.final_scale) @ path.unembed.T, logits, rtol=1e-9, atol=1e-9)


@pytest.fixture(scope="module", params=RELEASED)
def released(request, tmp_path_factory):
    from memviz.models.released.tiny import tiny_checkpoint

    folder = tmp_path_factory.mktemp(request.param)
    tiny_checkpoint(folder, request.param, seed=3)
    return memviz.load(str(folder), dtype="float64")


def test_a_released_models_path_gives_its_memory_layers_output_and_its_logits(released):
    ids = released.as_tokens("The pass key is 40721. Remember it. The grass is green and the sky is blue.")
    position = ids.shape[1] - 2
    path = read_path_of(released, ids, position)
    readout = released.memory_readout(ids, position)
    memory_layers = sorted(int(name.split(".")[1]) for name in path.layers)
    assert memory_layers == sorted(released.linear) and memory_layers
    outputs = released.capture(ids, [f"blocks.{l}.hook_attn_out" for l in memory_layers])
    for l in memory_layers:
        read = readout.parts[f"blocks.{l}"].sum(0)
        got = path.residual(f"blocks.{l}", read[None])[0]
        torch.testing.assert_close(got, outputs[f"blocks.{l}.hook_attn_out"][position], rtol=1e-7, atol=1e-9)
    x = released.capture(ids, [f"blocks.{released.cfg.n_layers - 1}.hook_resid_post"])
    with torch.no_grad():
        logits = released(ids)[0, position].double()
    final = (next(iter(x.values()))[position] * path.final_scale) @ path.unembed.T
    torch.testing.assert_close(final, logits, rtol=1e-7, atol=1e-8)


def outputs_at(model, ids, position: int, modules: dict) -> tuple[torch.Tensor, dict]:
    """The model's logits at `position` and each of `modules`' output there ({key: module}; a module returning a
    tuple gives its first part), from torch hooks on transformers' own modules, not memviz's hook points."""
    seen = {}

    def keep(key):
        return lambda _, args, out: seen.__setitem__(key, (out[0] if isinstance(out, tuple) else out)[0, position])

    hooks = [module.register_forward_hook(keep(key)) for key, module in modules.items()]
    try:
        with torch.no_grad():
            logits = model(ids)[0, position].double()
    finally:
        for hook in hooks:
            hook.remove()
    return logits, seen


#: Mamba-2 architectures, each with the config fields that put transformers' multipliers on the path (Granite 4.0-H
#: adds residual_multiplier x a mixer's output to the residual stream and divides its logits by logits_scaling)
SSD = {
    "mamba2": {},
    "bamba": {},
    "nemotron_h": {},
    "zamba2": {},
    "granitemoehybrid": {"residual_multiplier": 0.5, "logits_scaling": 4.0, "embedding_multiplier": 3.0},
}


@pytest.mark.parametrize("model_type", SSD)
def test_a_mamba2_read_with_its_skip_goes_through_the_gated_norm_to_what_the_mixer_adds(tmp_path, model_type):
    """The frozen diagonal is the gated norm's output over its input y_t + D x_t: transformers' own norm applied to
    that input and the gate its mixer projected gives hook_mem_out, and the path applied to it gives the mixer's
    output (a torch hook on transformers' module) times the multiplier the decoder layer applies."""
    from memviz.models.released.tiny import tiny_checkpoint

    seed = fresh_seed() % 2**31
    tiny_checkpoint(tmp_path, model_type, seed=seed, **SSD[model_type])
    model = memviz.load(str(tmp_path), dtype="float64")
    ids = model.as_tokens("The pass key is 40721. Remember it. The grass is green and the sky is blue.")
    position = ids.shape[1] - 2
    path = read_path_of(model, ids, position)
    layers = sorted(model.linear)
    assert sorted(int(name.split(".")[1]) for name in path.layers) == layers and layers
    mixers = {l: model.memory_layer(l) for l in layers}
    modules = {(l, part): getattr(mixer, part, mixer) for l, mixer in mixers.items() for part in ("in_proj", "mixer")}
    logits, seen = outputs_at(model, ids, position, modules)
    captured = model.capture(ids, [f"blocks.{l}.attn.hook_{h}" for l in layers for h in ("write_value", "mem_out")])
    readout = model.memory_readout(ids, position)
    multiplier = SSD[model_type].get("residual_multiplier", 1.0)
    for l, mixer in mixers.items():
        read = readout.parts[f"blocks.{l}"].sum(0)
        y = read + mixer.D.double()[:, None] * captured[f"blocks.{l}.attn.hook_write_value"][position]
        gate = seen[(l, "in_proj")][: mixer.intermediate_size]
        with torch.no_grad():
            normed = mixer.norm(y.flatten()[None, None], gate[None, None])[0, 0]
        mem_out = captured[f"blocks.{l}.attn.hook_mem_out"][position].flatten()
        torch.testing.assert_close(normed.double(), mem_out, rtol=1e-9, atol=1e-12, msg=f"layer {l}, seed {seed}")
        got = path.residual(f"blocks.{l}", y[None])[0]
        torch.testing.assert_close(got, seen[(l, "mixer")].double() * multiplier, rtol=1e-9, atol=1e-12)
    x = model.capture(ids, [f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"])
    final = (next(iter(x.values()))[position] * path.final_scale) @ path.unembed.T
    torch.testing.assert_close(final, logits, rtol=1e-6, atol=1e-6)  # Mamba-2 keeps its residual in float32


def test_falcon_h1_is_refused_with_why(tmp_path):
    from memviz.models.released.tiny import tiny_checkpoint

    tiny_checkpoint(tmp_path, "falcon_h1")
    model = memviz.load(str(tmp_path))
    with pytest.raises(ValueError, match="no read lens for .*Falcon-H1 gates its read inline"):
        read_lens(model, model.as_tokens("The pass key is 40721."), 3)


@pytest.mark.parametrize("config", [{}, {"use_bias": True, "output_logit_soft_cap": 2.0}])
def test_an_mlstm_read_goes_through_its_division_layer_norm_and_gate_to_what_the_layer_adds(tmp_path, config):
    """The path of C_t q_t gives the mLSTM layer's output (a torch hook on transformers' module) less what the layer
    norm's bias adds through the output gate (o_t from the layer's own gate projection); the frozen final steps give
    the logits, their soft cap included."""
    from memviz.models.released.tiny import tiny_checkpoint

    seed = fresh_seed() % 2**31
    tiny_checkpoint(tmp_path, "xlstm", seed=seed, **config)
    model = memviz.load(str(tmp_path), dtype="float64")
    ids = model.as_tokens("The pass key is 40721. Remember it. The grass is green and the sky is blue. " * 3)
    position = ids.shape[1] - 2
    path = read_path_of(model, ids, position)
    layers = {l: model.memory_layer(l) for l in sorted(model.linear)}
    modules = {
        (l, part): getattr(layer, part, layer) for l, layer in layers.items() for part in ("layer", "ogate_preact")
    }
    logits, seen = outputs_at(model, ids, position, modules)
    readout = model.memory_readout(ids, position)
    for l, layer in layers.items():
        read = readout.parts[f"blocks.{l}"].sum(0)
        bias = layer.multihead_norm.bias
        with torch.no_grad():
            from_bias = 0 if bias is None else layer.out_proj(torch.sigmoid(seen[(l, "ogate_preact")]) * bias)
        expected = seen[(l, "layer")].double() - from_bias
        got = path.residual(f"blocks.{l}", read[None])[0]
        torch.testing.assert_close(got, expected, rtol=1e-6, atol=1e-6, msg=f"layer {l}, seed {seed}")  # float32 norms
    x = model.capture(ids, [f"blocks.{model.cfg.n_layers - 1}.hook_resid_post"])
    final = (next(iter(x.values()))[position] * path.final_scale) @ path.unembed.double().T
    torch.testing.assert_close(final, logits, rtol=1e-6, atol=1e-6)  # transformers casts xLSTM's logits to float32


def test_the_writers_shifts_add_up_to_the_reads_logits_and_the_figure_draws_them():
    seed = fresh_seed()
    model = own_model("gated_deltanet", seed)
    ids = random_ids(30, seed=seed)
    lens = read_lens(model, ids, 29, promoted=6, writers=4)
    assert set(lens.layers) == {"blocks.0", "blocks.1"}
    for layer in lens.layers.values():
        columns = layer.shifts.to_numpy().sum(0)  # the listed writers, every other one and the initial state
        np.testing.assert_allclose(columns, layer.promoted["logit"].to_numpy(), rtol=1e-9, atol=1e-9)
        assert len(layer.writers) == 4 and len(layer.promoted) == 6
        assert layer.promoted["logit"].is_monotonic_decreasing
        assert abs(layer.logits.mean()) < 1e-9  # centred
        assert layer.writers["shift"].abs().is_monotonic_decreasing  # the largest in size first, either sign
        assert (layer.writers["position"] <= 29).all()
    figures = read_lens_figures(lens)
    heatmap = figures["blocks.1 read lens"].data[0]
    assert heatmap.z.shape == (1 + 4 + 2, 6) and heatmap.y[0].startswith("the read")


def test_read_logits_are_each_reads_own():
    seed = fresh_seed()
    model = own_model("infini", seed)
    ids = random_ids(24, seed=seed)
    reads = torch.randn(3, model.cfg.n_heads, model.cfg.d_head, dtype=torch.float64)
    together = read_logits(model, ids, 20, 1, reads)
    for i in range(3):
        torch.testing.assert_close(read_logits(model, ids, 20, 1, reads[i : i + 1])[0], together[i])
    assert together.shape == (3, model.cfg.vocab_size)


def test_the_lens_refuses_what_it_cannot_read_with_one_error():
    model = own_model("gated_deltanet", 0)
    ids = random_ids(12)
    with pytest.raises(ValueError, match=r"position must be a token index in \[0, 12\), got 12"):
        read_lens(model, ids, 12)
    with pytest.raises(ValueError, match="writers must be a whole number of at least 1, got 0"):
        read_lens(model, ids, 5, writers=0)
    without = [f.name for f in memviz.families() if f.readout and not f.read_lens]
    assert "titans" in without  # MAC's read enters attention as context, not the residual stream
    titans = small_model("titans", **FAMILY_CONFIGS["titans"])
    with pytest.raises(ValueError, match="the titans family gives no path"):
        read_lens(titans, ids, 5)
    bank_gate = own_model("lm2", 0, memory={"slots": 4, "update": "segment", "output_gate": "bank"})
    with pytest.raises(ValueError, match="no linear path from its read"):
        read_lens(bank_gate, ids, 5)
    assert get_family("gated_deltanet").read_lens and get_family("hf_gated_deltanet").read_lens


def test_the_command_writes_the_tables_and_a_figure_a_layer_and_names_a_bad_argument(tmp_path, capsys):
    import pandas as pd

    from memviz.__main__ import main

    model = small_model("gated_deltanet", **FAMILY_CONFIGS["gated_deltanet"])
    checkpoint = memviz.save(model, tmp_path / "gdn")
    text = tmp_path / "text.txt"
    text.write_text("Sandra journeyed to the kitchen. Mary went back to the garden. " * 3)
    out = tmp_path / "o"
    assert main(["read-lens", str(checkpoint), "--text", str(text), "--position", "30", "--out", str(out)]) == 0
    expected = read_lens(memviz.load(str(checkpoint)), model.tokenizer.encode(text.read_text()), 30)
    promoted = pd.read_csv(out / "read_lens_promoted.csv", keep_default_na=False)
    assert (
        promoted[promoted.layer == "blocks.1"]["token_id"].tolist()
        == expected.layers["blocks.1"].promoted["token_id"].tolist()
    )
    writers = pd.read_csv(out / "read_lens_writers.csv", keep_default_na=False)
    assert (
        writers[writers.layer == "blocks.0"]["position"].tolist()
        == expected.layers["blocks.0"].writers["position"].tolist()
    )
    assert sorted(p.name for p in out.glob("*.html")) == ["blocks_0_read_lens.html", "blocks_1_read_lens.html"]
    assert "the reads at token 30" in capsys.readouterr().out
    assert main(["read-lens", str(checkpoint), "--text", str(text), "--position", "9999"]) == 2
    assert "--position must be a token of the text" in capsys.readouterr().err
    assert main(["read-lens", str(checkpoint), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "--text " + str(tmp_path / "missing.txt") in capsys.readouterr().err


def test_a_token_before_any_write_reached_the_memory_is_refused_and_equal_token_texts_stay_apart():
    from memviz.read_lens import distinct_labels

    model = own_model("infini", 0)  # segment_len 8: the first segment reaches the memory when it completes
    ids = random_ids(20)
    with pytest.raises(ValueError, match="at token 5 no write has reached any memory layer"):
        read_lens(model, ids, 5)
    assert set(read_lens(model, ids, 12).layers) == {"blocks.0", "blocks.1"}
    assert distinct_labels(["a", "\ufffd", "\ufffd"], [7, 130, 131]) == ["'a'", "'\ufffd' #130", "'\ufffd' #131"]


def test_the_command_refuses_an_out_that_is_a_file_and_a_count_below_one_before_loading(tmp_path, capsys):
    from memviz.__main__ import main

    text = tmp_path / "text.txt"
    text.write_text("Mary went to the office.")
    (tmp_path / "taken").write_text("")
    assert main(["read-lens", "no-such-checkpoint", "--text", str(text), "--out", str(tmp_path / "taken")]) == 2
    assert "--out " + str(tmp_path / "taken") + " exists and is not a folder" in capsys.readouterr().err
    assert main(["read-lens", "no-such-checkpoint", "--text", str(text), "--writers", "0"]) == 2
    assert "--writers must be at least 1, got 0" in capsys.readouterr().err
