"""A dictionary of rank-1 writes: the training recovers a planted dictionary, the factorised encoder and error equal
their dense numpy forms, captured writes equal the hooks, a saved dictionary reads back (and a broken one is named),
and each atom's table, figures and logit effect say what fires it."""

import json

import numpy as np
import pytest
import torch

import memviz
from memviz import write_dictionary
from memviz.__main__ import main
from memviz.write_dictionary import (
    WriteDictionary,
    WriteDictionaryError,
    Writes,
    atom_figures,
    atom_table,
    capture_writes,
    encode_writes,
    evaluate,
    layers_with_writes,
    load_dictionary,
    logit_effects,
    save_dictionary,
    train_dictionary,
)
from tests.conftest import FAMILY_CONFIGS, small_model

TEXT = "Sandra journeyed to the kitchen. Mary went back to the garden. " * 4


def fresh_seed() -> int:
    return int(np.random.SeedSequence().entropy % 2**32)  # type: ignore[operator]  # fresh data every run, named when one fails


def planted_writes(rng: np.random.Generator, atoms: int = 32, d: int = 32, n: int = 3000, active: int = 3):
    """Writes that are each `active` of `atoms` planted unit rank-1 atoms with weights in [0.5, 1.5], as rank-1 terms
    (a u, w), each factor blurred by Gaussian noise (std 0.02 a coordinate, about 0.11 of its norm)."""
    u = rng.normal(size=(atoms, d))
    w = rng.normal(size=(atoms, d))
    u /= np.linalg.norm(u, axis=1, keepdims=True)
    w /= np.linalg.norm(w, axis=1, keepdims=True)
    chosen = np.stack([rng.permutation(atoms)[:active] for _ in range(n)])
    weights = rng.uniform(0.5, 1.5, size=(n, active, 1))
    keys = weights * (u[chosen] + 0.02 * rng.normal(size=(n, active, d)))
    values = w[chosen] + 0.02 * rng.normal(size=(n, active, d))
    return u, w, torch.tensor(keys[None], dtype=torch.float32), torch.tensor(values[None], dtype=torch.float32)


@pytest.mark.parametrize("draw", [0, 1])
def test_the_training_recovers_a_planted_dictionary(draw):
    torch.set_num_threads(1)  # small steps: a second thread only waits (the suite's 2 come back after the test)
    seed = fresh_seed()
    u, w, keys, values = planted_writes(np.random.default_rng(seed))
    dictionary, measured = train_dictionary(
        keys, values, n_atoms=64, k=3, steps=300, batch=256, lr=1e-2, resample_every=100, seed=seed
    )
    planted = np.einsum("ak,av->akv", u, w).reshape(len(u), -1)  # each atom a flattened d_k x d_v matrix
    learned = dictionary.atoms()[0].double().numpy().reshape(dictionary.n_atoms, -1)
    cosines = planted @ learned.T / np.linalg.norm(planted, axis=1)[:, None] / np.linalg.norm(learned, axis=1)
    best = np.abs(cosines).max(1)
    assert (best >= 0.95).mean() >= 0.9, f"seed {seed}: {np.sort(best)[:5]}"
    assert measured.explained_variance[0] > 0.9, f"seed {seed}"
    assert measured.dead_atoms[0] >= 64 - 32 - 8  # a dictionary twice the planted size leaves about half unused


def random_dictionary(rng, heads=2, atoms=16, d_k=5, d_v=7, k=3) -> WriteDictionary:
    def t(*shape):
        return torch.tensor(rng.normal(size=shape), dtype=torch.float64)

    u = torch.nn.functional.normalize(t(heads, atoms, d_k), dim=-1)
    w = torch.nn.functional.normalize(t(heads, atoms, d_v), dim=-1)
    scale = torch.tensor(rng.uniform(0.5, 2.0, size=heads))
    return WriteDictionary(
        u, w, t(heads, atoms, d_k), t(heads, atoms, d_v), t(heads, atoms), scale, k, list(range(heads))
    )


def test_the_factorised_encoder_and_error_equal_the_dense_ones():
    seed = fresh_seed()
    rng = np.random.default_rng(seed)
    dictionary = random_dictionary(rng)
    keys = torch.tensor(rng.normal(size=(2, 9, 3, 5)))  # 9 writes a head, each of 3 rank-1 terms
    values = torch.tensor(rng.normal(size=(2, 9, 3, 7)))
    dense = np.einsum("hbrk,hbrv->hbkv", keys.numpy(), values.numpy())  # W [head, write, d_k, d_v]
    encoders = np.einsum("hnk,hnv->hnkv", dictionary.encoder_u.numpy(), dictionary.encoder_w.numpy())
    scale = dictionary.scale.numpy()
    expected = np.einsum("hbkv,hnkv->hbn", dense, encoders) / scale[:, None, None] + dictionary.bias.numpy()[:, None]
    np.testing.assert_allclose(dictionary.pre_activations(keys, values).numpy(), expected, rtol=1e-10, atol=1e-12)
    indices, activations = dictionary.encode(keys, values)
    top = np.sort(expected, -1)[..., ::-1][..., :3]
    np.testing.assert_allclose(activations.numpy(), np.maximum(top, 0), rtol=1e-10, atol=1e-12, err_msg=f"{seed}")
    atoms = np.einsum("hnk,hnv->hnkv", dictionary.u.numpy(), dictionary.w.numpy())
    picked = np.take_along_axis(atoms, indices.numpy()[..., None, None].reshape(2, -1, 1, 1), 1).reshape(2, 9, 3, 5, 7)
    fitted = (activations.numpy()[..., None, None] * picked).sum(2)
    expected_error = ((dense / scale[:, None, None, None] - fitted) ** 2).sum((-1, -2))
    errors = dictionary.squared_errors(keys, values, indices, activations).numpy()
    np.testing.assert_allclose(errors, expected_error, rtol=1e-9, err_msg=f"seed {seed}")
    explained, relative = evaluate(dictionary, keys, values)
    spread = ((dense - dense.mean(1, keepdims=True)) ** 2).sum((1, 2, 3)) / scale**2
    np.testing.assert_allclose(explained, 1 - expected_error.sum(1) / spread, rtol=1e-9)
    np.testing.assert_allclose(relative, expected_error.sum(1) / (dense**2).sum((1, 2, 3)) * scale**2, rtol=1e-9)


def test_a_dictionary_reads_back_and_a_broken_one_is_named(tmp_path):
    dictionary = random_dictionary(np.random.default_rng(0))
    folder = save_dictionary(dictionary, tmp_path / "d", {"layer": 2, "command": "python -m memviz ..."})
    back = load_dictionary(folder)
    for name in ("u", "w", "encoder_u", "encoder_w", "bias", "scale"):
        torch.testing.assert_close(getattr(back, name), getattr(dictionary, name).float())
    assert (back.k, back.heads, back.card["layer"], back.card["atoms"]) == (3, [0, 1], 2, 16)
    from safetensors.torch import load, save

    weights = folder / "dictionary.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(good[:100])
    with pytest.raises(WriteDictionaryError, match=f"{weights}: not a safetensors file"):
        load_dictionary(folder)
    tensors = load(good)
    weights.write_bytes(save({n: t for n, t in tensors.items() if n != "bias"}))
    with pytest.raises(WriteDictionaryError, match="no tensor 'bias'"):
        load_dictionary(folder)
    weights.write_bytes(save({**tensors, "w": tensors["w"][:, :5].contiguous()}))
    with pytest.raises(WriteDictionaryError, match=r"w has shape \(2, 5, 7\), not \(2, 16, 7\)"):
        load_dictionary(folder)
    weights.write_bytes(good)
    card = json.loads((folder / "card.json").read_text())
    (folder / "card.json").write_text(json.dumps({**card, "k": 17}))
    with pytest.raises(WriteDictionaryError, match=r"card.json: k must be a whole number from 1 to 16"):
        load_dictionary(folder)
    with pytest.raises(WriteDictionaryError, match="does not exist"):
        load_dictionary(tmp_path / "nothing")
    (folder / "card.json").write_text(json.dumps(card))
    writes, _, _ = planted_text_writes(np.random.default_rng(0))  # d_k = d_v = 8, one head
    with pytest.raises(ValueError, match=f"the dictionary \\({folder}\\) has atoms of d_k = 5, d_v = 7; layer 3's"):
        encode_writes(load_dictionary(folder), writes)
    for heads in ([], [0, 0], [True, False]):
        (folder / "card.json").write_text(json.dumps({**card, "heads": heads}))
        with pytest.raises(WriteDictionaryError, match="card.json: heads must list 2 distinct head numbers"):
            load_dictionary(folder)
    fitting = save_dictionary(
        random_dictionary(np.random.default_rng(1), heads=1, d_k=8, d_v=8), tmp_path / "e", {"layer": 7}
    )
    with pytest.raises(ValueError, match="was trained on layer 7's writes \\(card.json's layer\\), not 3's"):
        encode_writes(load_dictionary(fitting), writes)


def test_captured_writes_are_the_hooks_and_only_layers_with_writes_are_offered():
    model = small_model("gated_deltanet", **FAMILY_CONFIGS["gated_deltanet"])
    assert layers_with_writes(model) == [0, 1]
    ids = model.tokenizer.encode(TEXT)
    writes = capture_writes(model, ids, 1)
    _, cache = model.run_with_cache(torch.tensor([ids]))  # one pass, not streamed
    k, v, beta = (cache[f"blocks.1.attn.hook_{p}"][0].numpy() for p in ("write_key", "write_value", "beta"))
    keys, values = writes.factors([0, 1])
    dense = np.einsum("hbrk,hbrv->bhkv", keys.numpy(), values.numpy())
    np.testing.assert_allclose(dense, beta[..., None, None] * np.einsum("bhk,bhv->bhkv", k, v), rtol=1e-5, atol=1e-7)
    assert writes.tokens.tolist() == ids and len(writes.token_text) == len(ids)
    with pytest.raises(ValueError, match=r"layer must be one of the layers with writes \[0, 1\], got 2"):
        capture_writes(model, ids, 2)
    with pytest.raises(ValueError, match="this sliding_window model has no layer with writes"):
        capture_writes(small_model("sliding_window", window=8), ids, 0)


def test_a_released_state_space_models_writes_fold_the_step_into_the_key(tmp_path):
    from memviz.models.released.tiny import tiny_checkpoint

    tiny_checkpoint(tmp_path / "m", "mamba2")
    model = memviz.load(tmp_path / "m")
    layers = layers_with_writes(model)
    assert layers == sorted({int(n.split(".")[1]) for n in model.hook_dict if n.endswith("attn.hook_write_key")})
    ids = model.tokenizer.encode("The pass key is 71432. Remember it.")
    writes = capture_writes(model, ids, layers[0])
    seen = model.capture(ids, [f"blocks.{layers[0]}.attn.hook_{p}" for p in ("write_key", "write_value", "beta")])
    k, v, dt = (t.numpy() for t in seen.values())
    keys, values = writes.factors(range(writes.n_heads))
    np.testing.assert_allclose(keys[:, :, 0].transpose(0, 1).numpy(), dt[..., None] * k, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(values[:, :, 0].transpose(0, 1).numpy(), v, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("model_type, family", [("recurrent_gemma", "hf_rg_lru"), ("mamba", "hf_mamba")])
def test_released_models_without_matrix_writes_offer_no_layer(tmp_path, model_type, family):
    """RG-LRU writes a scalar a channel and Mamba-1 a vector a channel: no rank-1 atoms to learn, refused by name."""
    from memviz.models.released.tiny import tiny_checkpoint

    tiny_checkpoint(tmp_path / "m", model_type)
    model = memviz.load(tmp_path / "m")
    assert layers_with_writes(model) == []
    with pytest.raises(ValueError, match=f"this {family} model has no layer with writes"):
        capture_writes(model, "The pass key is 71432.", 0)


def planted_text_writes(rng, n=400, d=8) -> tuple[Writes, np.ndarray, np.ndarray]:
    """Writes whose even positions write atom 0 (u0 w0^T) and odd ones atom 1, each with its own strength."""
    u = np.linalg.qr(rng.normal(size=(d, d)))[0][:, :2].T  # two orthonormal key directions
    w = np.linalg.qr(rng.normal(size=(d, d)))[0][:, :2].T
    which = np.arange(n) % 2
    strengths = rng.uniform(0.1, 2.0, size=n)
    writes = Writes(
        torch.tensor(u[which][:, None], dtype=torch.float32),
        torch.tensor(w[which][:, None], dtype=torch.float32),
        torch.tensor(strengths[:, None], dtype=torch.float32),
        np.arange(n, dtype=np.int32),
        [f" t{i}" for i in range(n)],
        layer=3,
    )
    return writes, u, w


def test_the_atom_table_and_figures_say_where_each_atom_fires():
    rng = np.random.default_rng(fresh_seed())
    writes, u, w = planted_text_writes(rng)
    # atom 0 is the even writes' atom, atom 2 the odd ones', atom 1 the odd ones' turned away (it never fires)
    u_rows = torch.tensor(np.stack([u[0], -u[1], u[1]]), dtype=torch.float32)[None]
    w_rows = torch.tensor(np.stack([w[0], w[1], w[1]]), dtype=torch.float32)[None]
    dictionary = WriteDictionary(u_rows, w_rows, u_rows, w_rows, torch.zeros(1, 3), torch.ones(1), 1, [0])
    codes = encode_writes(dictionary, writes)
    table = atom_table(dictionary, writes, codes, top=3).set_index("atom")
    strengths = writes.strengths[:, 0].numpy()
    even = np.arange(0, len(writes), 2)
    assert table.loc[0, "frequency"] == pytest.approx(0.5)  # atom 0 fires on every even write, and only there
    assert table.loc[0, "top_positions"] == even[np.argsort(-strengths[even])][:3].tolist()
    assert table.loc[0, "top_activations"] == pytest.approx(np.sort(strengths[even])[::-1][:3], abs=1e-4)
    best = table.loc[0, "top_positions"][0]
    shown = table.loc[0, "fires_on"].split("  |  ")[0]  # the firing token in brackets, 6 before and 2 after it
    assert shown.startswith(
        f"{' '.join(f't{i}' for i in range(max(0, best - 6), best))}[ t{best}] t{best + 1} t{best + 2} "
    )
    assert shown.split()[-1] == f"{strengths[best]:.2f}"
    assert table.loc[2, "frequency"] == pytest.approx(0.5)
    assert table.loc[1, "frequency"] == 0 and table.loc[1, "top_positions"] == []
    figs = atom_figures(dictionary, writes, table.reset_index(), codes, atom=(0, 0), width=50)
    drawn = np.asarray(figs["atom activation"].data[0].y, dtype=float)
    expected = np.where(np.arange(len(writes)) % 2 == 0, strengths, 0)
    np.testing.assert_allclose(drawn, expected.reshape(50, -1).max(1), rtol=1e-5)
    assert list(figs["atom activation"].data[0].x) == list(range(0, len(writes), 8))
    frequencies = np.asarray(figs["atom frequency"].data[0].y, dtype=float)
    assert frequencies[0] == pytest.approx(0.5) and list(frequencies) == sorted(frequencies, reverse=True)


def test_an_atoms_logit_effect_is_its_value_direction_read_through_its_head():
    from memviz.read_lens import read_logits

    model = small_model("gated_deltanet", **FAMILY_CONFIGS["gated_deltanet"])
    ids = model.tokenizer.encode(TEXT)
    writes = capture_writes(model, ids, 1)
    keys, values = writes.factors([0, 1])
    dictionary, _ = train_dictionary(keys, values, n_atoms=8, k=2, steps=20, batch=32)
    table = atom_table(dictionary, writes)
    head, atom = int(table.iloc[0]["head"]), int(table.iloc[0]["atom"])
    effects = logit_effects(model, dictionary, writes, table, [(head, atom)], promoted=4)
    position = table.iloc[0]["top_positions"][0]
    reads = torch.zeros(1, 2, values.shape[-1], dtype=torch.float64)
    reads[0, head] = table.iloc[0]["top_activations"][0] * dictionary.scale[head] * dictionary.w[head, atom]
    logits = read_logits(model, ids, position, 1, reads)[0]
    logits = logits - logits.mean()
    assert effects.iloc[0]["position"] == position
    np.testing.assert_allclose(effects.iloc[0]["logits"], torch.topk(logits, 4).values.numpy(), atol=1e-4)


def test_bad_settings_are_one_clear_error():
    keys, values = torch.randn(1, 100, 1, 4), torch.randn(1, 100, 1, 4)
    for settings, message in [
        ({"n_atoms": 0}, "n_atoms must be a whole number from 1"),
        ({"n_atoms": 8, "k": 9}, "k must be a whole number from 1 to 8"),
        ({"steps": 2.5}, "steps must be a whole number"),
        ({"held_back": 1.0}, "held_back must be a share between 0 and 1"),
        ({"lr": -1}, "lr must be a positive learning rate"),
    ]:
        with pytest.raises(ValueError, match=message):
            train_dictionary(keys, values, **settings)
    with pytest.raises(ValueError, match="same first three sizes"):
        train_dictionary(keys, values[:, :50])
    with pytest.raises(ValueError, match="not all finite"):
        train_dictionary(keys * float("nan"), values)
    with pytest.raises(ValueError, match="the writes are scalars"):
        train_dictionary(keys[..., :1], values[..., :1])
    with pytest.raises(ValueError, match=r"50 writes leave 45 to train on and 5 to measure .* too few"):
        train_dictionary(keys[:, :50], values[:, :50], n_atoms=8, k=2)  # 5 held back: fewer than a spread needs


def test_settings_of_a_dictionary_on_text_are_refused_before_the_writes_are_captured(monkeypatch):
    def capture(*args, **kwargs):
        raise AssertionError("captured the writes before checking the settings")

    monkeypatch.setattr(write_dictionary, "capture_writes", capture)
    for settings, message in [
        ({"k": 0}, "k must be a whole number from 1"),
        ({"n_atoms": 4, "k": 5}, "k must be a whole number from 1 to 4"),
        ({"lr": True}, "lr must be a positive learning rate"),
        ({"atoms": 64}, "train_on_text's settings are train_dictionary's: .*'atoms'"),
    ]:
        with pytest.raises(ValueError, match=message):
            write_dictionary.train_on_text(object(), "some text", 0, **settings)
    with pytest.raises(AssertionError, match="captured"):  # good settings go on to the capture
        write_dictionary.train_on_text(object(), "some text", 0, n_atoms=4, k=2)


def test_every_atom_has_unit_factors_after_training():
    """The decoder's atoms are u w^T with |u| = |w| = 1 after every step (the code's scale is a_j alone)."""
    rng = np.random.default_rng(fresh_seed())
    keys = torch.from_numpy(rng.normal(size=(2, 400, 1, 6))).float()
    values = torch.from_numpy(rng.normal(size=(2, 400, 1, 5))).float()
    dictionary, _ = train_dictionary(keys, values, n_atoms=12, k=2, steps=40, batch=64, lr=5e-2)
    torch.testing.assert_close(dictionary.u.norm(dim=-1), torch.ones(2, 12))
    torch.testing.assert_close(dictionary.w.norm(dim=-1), torch.ones(2, 12))


def test_the_command_saves_a_dictionary_its_atoms_and_figures(tmp_path, capsys):
    checkpoint = memviz.save(small_model("gated_deltanet", **FAMILY_CONFIGS["gated_deltanet"]), tmp_path / "gdn")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    out = tmp_path / "o"
    settings = ["--layer", "1", "--atoms", "16", "--k", "2", "--steps", "30", "--batch", "64", "--out", str(out)]
    assert main(["write-dictionary", str(checkpoint), "--text", str(text), *settings]) == 0
    dictionary = load_dictionary(out)
    card = dictionary.card
    assert (card["layer"], card["atoms"], card["k"], card["heads"]) == (1, 16, 2, [0, 1])
    assert card["command"].startswith(f"python -m memviz write-dictionary {checkpoint} --text {text} --layer 1")
    assert len(card["explained_variance"]) == 2 and card["tokens"] == len(
        memviz.load(checkpoint).tokenizer.encode(TEXT)
    )
    import pandas as pd

    atoms = pd.read_csv(out / "atoms.csv")
    assert len(atoms) == 2 * 16 and atoms.groupby("head")["promoted"].count().tolist() == [2, 2]  # --effects 2
    assert sorted(p.name for p in out.glob("*.html")) == ["atom_activation.html", "atom_frequency.html"]
    printed = capsys.readouterr().out
    assert "explained variance" in printed and "its value direction promotes" in printed
    assert main(["write-dictionary", str(checkpoint), "--text", str(text), "--layer", "5"]) == 2
    assert "layer must be one of the layers with writes [0, 1], got 5" in capsys.readouterr().err
    assert main(["write-dictionary", str(checkpoint), "--text", str(tmp_path / "none.txt"), "--layer", "1"]) == 2
    assert f"--text {tmp_path / 'none.txt'}" in capsys.readouterr().err
    assert main(["write-dictionary", str(checkpoint), "--text", str(text), "--layer", "1", "--heads", "0,x"]) == 2
    assert "--heads must be head numbers" in capsys.readouterr().err
