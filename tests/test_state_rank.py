"""State rank: the effective and stable rank of each head's matrix memory, against numpy's SVD of the states the
model itself carries."""

import numpy as np
import pytest
import torch

import memviz
from memviz import viz
from memviz.__main__ import main
from memviz.registry import get_family
from memviz.state_rank import effective_rank, matrix_memories, stable_rank, state_ranks
from tests.conftest import FAMILY_CONFIGS, small_model

TEXT = "Sandra journeyed to the kitchen. Mary went back to the garden. " * 4


def numpy_ranks(matrix: np.ndarray) -> tuple[float, float]:
    """Both ranks of one matrix from numpy's SVD: exp of the entropy of sigma / sum(sigma), and |S|_F^2 / sigma_1^2."""
    sigma = np.linalg.svd(matrix.astype(np.float64), compute_uv=False)
    if sigma.sum() == 0:
        return 0.0, 0.0
    p = sigma / sigma.sum()
    p = p[p > 0]
    return float(np.exp(-(p * np.log(p)).sum())), float((sigma**2).sum() / sigma[0] ** 2)


def test_both_ranks_match_numpys_svd_and_known_matrices():
    seed = int(np.random.SeedSequence().entropy % 2**32)  # fresh matrices every run, named when one fails
    rng = np.random.default_rng(seed)
    states = rng.normal(size=(3, 2, 7, 5)) * rng.uniform(0.1, 10, size=(3, 2, 1, 1))
    er, sr = effective_rank(torch.from_numpy(states)), stable_rank(torch.from_numpy(states))
    for index in np.ndindex(3, 2):
        got = (er[index].item(), sr[index].item())
        assert got == pytest.approx(numpy_ranks(states[index]), rel=1e-10), f"seed {seed}"
    u, _ = np.linalg.qr(rng.normal(size=(8, 8)))
    planted = u[:, :3] @ u[:, 3:6].T * 4.0  # three equal singular values
    assert effective_rank(torch.from_numpy(planted)).item() == pytest.approx(3.0, rel=1e-9)
    assert stable_rank(torch.from_numpy(planted)).item() == pytest.approx(3.0, rel=1e-9)
    spiked = np.diag([10.0, 0.1, 0.1, 0.1])  # one strong direction: the stable rank barely counts the rest
    assert stable_rank(torch.from_numpy(spiked)).item() == pytest.approx(1.0003, rel=1e-9)
    assert 1.0 < effective_rank(torch.from_numpy(spiked)).item() < 1.2
    zero = torch.zeros(2, 4, 4)
    assert effective_rank(zero).tolist() == [0.0, 0.0] and stable_rank(zero).tolist() == [0.0, 0.0]


MATRIX_FAMILIES = sorted(f for f in FAMILY_CONFIGS if get_family(f).matrix_state)


def test_the_families_with_a_matrix_memory_declare_it():
    assert {"infini", "lm2", "titans", "gated_deltanet"} <= set(MATRIX_FAMILIES)


@pytest.mark.parametrize("family", MATRIX_FAMILIES)
def test_ranks_are_those_of_the_states_the_model_carries(family):
    model = small_model(family, **FAMILY_CONFIGS[family])
    ids = model.tokenizer.encode(TEXT)
    every = 16
    ranks = state_ranks(model, ids, every=every)
    ends = sorted(set(ranks["position"]))
    assert ends == [*range(every, len(ids), every), len(ids)]
    for end in (ends[0], ends[-1]):  # the state a one-pass prefill of that many tokens leaves
        _, state = model.prefill(torch.tensor([ids[:end]]))
        rows = ranks[ranks["position"] == end]
        expected = []
        for layer, layer_state in enumerate(state.layers):
            for name, tensor in matrix_memories(layer_state, get_family(family).matrix_state):
                for head, matrix in enumerate(tensor[0].reshape(-1, *tensor.shape[-2:]).numpy()):
                    expected.append((f"blocks.{layer}", name, head, *numpy_ranks(matrix)))
        assert expected, f"{family}: no declared matrix memory in its state"
        got = list(rows[["layer", "memory", "head", "effective_rank", "stable_rank"]].itertuples(index=False))
        assert [g[:3] for g in got] == [e[:3] for e in expected]
        np.testing.assert_allclose([g[3:] for g in got], [e[3:] for e in expected], rtol=1e-5, atol=1e-6)
    figs = viz.state_rank_figures(ranks, width=3)  # more states than columns: averaged in bins
    first = ranks[(ranks["layer"] == ranks["layer"].iloc[0]) & (ranks["memory"] == ranks["memory"].iloc[0])]
    table = first.pivot(index="head", columns="position", values="effective_rank").to_numpy()
    size = -(-table.shape[1] // 3)
    binned = [table[:, a : a + size].mean(1) for a in range(0, table.shape[1], size)]
    drawn = np.asarray(next(iter(figs.values())).data[0].z, dtype=float)
    np.testing.assert_allclose(drawn, np.stack(binned, 1), rtol=1e-12)


@pytest.mark.parametrize(
    "model_type, field", [("qwen3_5_text", "S"), ("kimi_linear", "S"), ("mamba2", "S"), ("xlstm", "C")]
)
def test_a_released_models_states_have_their_rank(tmp_path, model_type, field):
    from memviz.models.released.tiny import tiny_checkpoint

    tiny_checkpoint(tmp_path / model_type, model_type)
    model = memviz.load(tmp_path / model_type)
    ids = model.tokenizer.encode("The pass key is 71432. Remember it.")
    ranks = state_ranks(model, ids, every=4)
    _, state = model.prefill(torch.tensor([ids]))
    last = ranks[ranks["position"] == len(ids)]
    memories = {i: getattr(s, field) for i, s in enumerate(state.layers) if field in getattr(s, "_fields", ())}
    assert memories and set(last["layer"]) == {f"blocks.{i}" for i in memories} and set(last["memory"]) == {field}
    for row in last.itertuples():  # every head of every memory layer, by its own path (getattr, not the walker)
        tensor = memories[int(row.layer.split(".")[1])]
        expected = numpy_ranks(tensor[0].reshape(-1, *tensor.shape[-2:])[row.head].double().numpy())
        assert (row.effective_rank, row.stable_rank) == pytest.approx(expected, rel=1e-5), row


def test_a_bad_request_is_one_clear_error(tmp_path):
    with pytest.raises(ValueError, match="the sliding_window family declares no matrix memory"):
        state_ranks(small_model("sliding_window", window=8), TEXT)
    model = small_model("gated_deltanet", **FAMILY_CONFIGS["gated_deltanet"])
    for every in (0, -3, 2.5, True):
        with pytest.raises(ValueError, match="every must be a positive whole number"):
            state_ranks(model, TEXT, every=every)
    with pytest.raises(ValueError, match="empty input"):
        state_ranks(model, "")


def test_the_command_writes_the_table_and_a_figure_a_layer(tmp_path, capsys):
    checkpoint = memviz.save(small_model("gated_deltanet", **FAMILY_CONFIGS["gated_deltanet"]), tmp_path / "gdn")
    text = tmp_path / "text.txt"
    text.write_text(TEXT)
    assert main(["state-rank", str(checkpoint), "--text", str(text), "--every", "8", "--out", str(tmp_path / "o")]) == 0
    import pandas as pd

    table = pd.read_csv(tmp_path / "o" / "state_rank.csv")
    assert list(table.columns) == ["position", "layer", "memory", "head", "effective_rank", "stable_rank"]
    assert sorted(p.name for p in (tmp_path / "o").glob("*.html")) == [
        f"blocks_{i}_s_state_rank.html" for i in sorted({int(x.split(".")[1]) for x in table["layer"]})
    ]
    assert "effective_rank" in capsys.readouterr().out
    assert main(["state-rank", str(checkpoint), "--text", str(tmp_path / "missing.txt")]) == 2
    assert "--text " + str(tmp_path / "missing.txt") in capsys.readouterr().err


def test_declared_paths_select_a_field_and_what_lies_below_it_only():
    from typing import NamedTuple

    class Part(NamedTuple):
        params: dict
        paramsX: torch.Tensor
        bank: list

    part = Part({"W1": torch.ones(1, 2, 2), "W2": torch.ones(1, 2, 2)}, torch.ones(1, 2, 2), [torch.ones(1, 3, 3)])
    assert [n for n, _ in matrix_memories(part, ["params"])] == ["params.W1", "params.W2"]
    assert [n for n, _ in matrix_memories(part, ["bank.0", "paramsX"])] == ["paramsX", "bank.0"]


def test_a_state_that_is_not_finite_has_no_rank_and_one_that_matches_nothing_is_named(monkeypatch):
    from memviz.state_rank import ranks_of

    model = small_model("gated_deltanet", **FAMILY_CONFIGS["gated_deltanet"])
    _, state = model.prefill(torch.tensor([model.tokenizer.encode(TEXT)]))
    broken = state.layers[0]._replace(S=state.layers[0].S.clone())
    broken.S[0, 1, 0, 0] = float("nan")  # head 1 of layer 0 diverged
    state.layers[0] = broken
    rows = ranks_of(state, ["S"])
    nan_heads = [(r["layer"], r["head"]) for r in rows if np.isnan(r["effective_rank"])]
    assert nan_heads == [("blocks.0", 1)] and all(
        bool(np.isnan(r["stable_rank"])) == ((r["layer"], r["head"]) in nan_heads) for r in rows
    )
    import dataclasses

    from memviz import registry

    family = get_family("gated_deltanet")
    monkeypatch.setitem(registry.FAMILIES, "gated_deltanet", dataclasses.replace(family, matrix_state=("Sx",)))
    with pytest.raises(ValueError, match=r"matrix memories \['Sx'\] match nothing in its state after 16 tokens"):
        state_ranks(model, TEXT, every=16)
