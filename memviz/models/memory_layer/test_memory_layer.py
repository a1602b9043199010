"""Memory layers (arXiv 2412.09764): exact product-key top-k, the value bag, Memory+, usage."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import memviz
from memviz.models.memory_layer import spread_layers, usage_report
from memviz_kernels.product_keys.reference import product_key_topk, weighted_bag
from tests.conftest import random_ids, scrambled, small_model

OPTIONS = {"n_keys": 8, "topk": 4, "heads": 2, "d_key": 8, "layers": [0, 1]}


@pytest.mark.parametrize("shape, H, n, dk, k", [((1,), 1, 4, 2, 1), ((3, 5), 2, 8, 6, 4), ((7,), 3, 16, 10, 16)])
def test_product_key_topk_equals_exhaustive_topk(shape, H, n, dk, k):
    g = torch.Generator().manual_seed(n)
    q = torch.randn(*shape, H, dk, dtype=torch.float64, generator=g)
    keys = torch.randn(H, 2, n, dk // 2, dtype=torch.float64, generator=g)
    full = torch.cat(
        [keys[:, 0, :, None, :].expand(H, n, n, dk // 2), keys[:, 1, None, :, :].expand(H, n, n, dk // 2)], -1
    )
    full = full.reshape(H, n * n, dk)  # full key (i, j) at index i * n + j
    exhaustive_scores, exhaustive_idx = torch.einsum("...hd,hmd->...hm", q, full).topk(k, dim=-1)
    scores, idx = product_key_topk(q, keys, k)
    torch.testing.assert_close(scores, exhaustive_scores)
    assert torch.equal(idx, exhaustive_idx)


def test_weighted_bag_equals_a_dense_gather_with_gradients():
    g = torch.Generator().manual_seed(0)
    values = torch.randn(50, 6, dtype=torch.float64, generator=g, requires_grad=True)
    idx = torch.randint(0, 50, (3, 4, 5), generator=g)
    idx[0, 0] = 7  # repeated rows in one bag
    w = torch.softmax(torch.randn(3, 4, 5, dtype=torch.float64, generator=g), -1).requires_grad_(True)
    out = weighted_bag(idx, w, values)
    dense = (values[idx] * w[..., None]).sum(-2)
    torch.testing.assert_close(out, dense)
    grad_out = torch.randn_like(out)
    gv, gw = torch.autograd.grad(out, (values, w), grad_out)
    dv, dw = torch.autograd.grad(dense, (values, w), grad_out)
    torch.testing.assert_close(gv, dv)
    torch.testing.assert_close(gw, dw)


def test_memory_plus_shares_one_value_pool_and_survives_a_checkpoint(tmp_path):
    model = scrambled(small_model("memory_layer", memory=OPTIONS), std=0.2)
    assert model.blocks[0].mlp.values is model.blocks[1].mlp.values is model.values
    own = small_model("memory_layer", memory={**OPTIONS, "shared_values": False})
    assert own.blocks[0].mlp.values is not own.blocks[1].mlp.values
    assert own.num_parameters() - model.num_parameters() == 64 * model.cfg.d_model
    ids = random_ids(15)
    loaded = memviz.load(memviz.save(model, tmp_path / "m"))
    torch.testing.assert_close(loaded(ids), model(ids))
    assert loaded.blocks[0].mlp.values is loaded.blocks[1].mlp.values


def test_swilu_gate_and_qk_norm():
    model = scrambled(small_model("memory_layer", memory=OPTIONS), std=0.2)
    ids = random_ids(10)
    _, cache = model.run_with_cache(ids)
    mem = model.blocks[1].mlp
    x = model.blocks[1].ln2(cache["blocks.1.hook_resid_mid"])
    y = cache["blocks.1.mlp.hook_read"]
    torch.testing.assert_close(cache["blocks.1.hook_mlp_out"], mem.W_2(y * F.silu(mem.W_1(x))))
    q = cache["blocks.1.mlp.hook_query"]
    torch.testing.assert_close(q[..., :4].norm(dim=-1), torch.ones(1, 10, 2))
    w = cache["blocks.1.mlp.hook_topk_weights"]
    torch.testing.assert_close(w.sum(-1), torch.ones(1, 10, 2))
    assert (w[..., :-1] >= w[..., 1:]).all()  # best first
    idx = cache["blocks.1.mlp.hook_topk_indices"]
    manual = (w[..., None] * mem.values[idx]).sum((-2, -3))
    torch.testing.assert_close(y, manual, atol=1e-5, rtol=1e-5)


def test_plain_pkm_returns_the_read():
    model = small_model("memory_layer", memory={**OPTIONS, "swilu": False, "qk_norm": False})
    _, cache = model.run_with_cache(random_ids(6))
    torch.testing.assert_close(cache["blocks.0.hook_mlp_out"], cache["blocks.0.mlp.hook_read"])


def test_layers_are_spread_through_the_depth():
    assert spread_layers(12, 3) == [2, 6, 10]
    assert spread_layers(4) == [1, 3]
    model = small_model("memory_layer", n_layers=4, memory={"n_keys": 8, "topk": 4, "heads": 1, "d_key": 8})
    kinds = [type(b.mlp).__name__ for b in model.blocks]
    assert kinds == ["SwiGLU", "ProductKeyMemory", "SwiGLU", "ProductKeyMemory"]
    with pytest.raises(memviz.ConfigError, match="outside 0..1"):
        small_model("memory_layer", memory={**OPTIONS, "layers": [5]})
    for bad in ("x", 1, [0.5], [True], [1, 1]):
        with pytest.raises(memviz.ConfigError, match=r"layers must be a list of distinct block indices, got"):
            small_model("memory_layer", memory={**OPTIONS, "layers": bad})
    with pytest.raises(memviz.ConfigError, match="topk"):
        small_model("memory_layer", memory={**OPTIONS, "topk": 9})


def test_usage_report_on_hand_cases():
    n_keys = 4  # 16 values
    uniform = np.arange(16).reshape(16, 1, 1)
    report = usage_report(uniform, 16, n_keys)
    assert report["values_used"] == 1.0 and report["dead_values"] == 0 and report["keys_used"] == 1.0
    assert report["usage_entropy"] == pytest.approx(1.0) and report["gini"] == pytest.approx(0.0, abs=1e-12)
    one = np.full((30, 1, 1), 5)  # value 5 = sub-keys (1, 1)
    report = usage_report(one, 16, n_keys)
    assert report["values_used"] == 1 / 16 and report["dead_values"] == 15 and report["keys_used"] == 2 / 8
    assert report["usage_entropy"] == 0.0 and report["gini"] == pytest.approx(15 / 16)
    with pytest.raises(ValueError, match="no selections"):
        usage_report(np.zeros((0, 1, 1), dtype=int), 16, n_keys)


def test_trace_keeps_the_selections_for_a_usage_report():
    model = small_model("memory_layer", memory=OPTIONS)
    tr = memviz.trace(model, "the quick brown fox jumps over the lazy dog " * 5)
    idx = tr["blocks.0.mlp.hook_topk_indices"]
    assert idx.shape == (len(tr), 2, 4) and idx.dtype.kind == "i"
    report = usage_report(idx, 64, 8)
    assert 0 < report["values_used"] <= 1 and report["dead_values"] == round(64 * (1 - report["values_used"]))
