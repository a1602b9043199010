"""The adapters against the real peer packages: tiny models built with titans-pytorch and
product-key-memory, traced by memviz, and every captured quantity recomputed from the peer's
weights (in float64); the errors for a missing or unsupported peer and a module or state dict
that does not fit."""

from __future__ import annotations

import importlib.metadata

import pytest
import torch
import torch.nn.functional as F
from torch.func import functional_call

import memviz
from memviz import viz
from memviz.checkpoint import CheckpointError
from memviz.registry import get_family
from memviz_families import peers
from memviz_families.peers.pkm import adapt_pkm
from memviz_families.peers.titans import adapt_mac
from memviz_probes import passkey
from tests.conftest import random_ids, small_model

titans_pytorch = pytest.importorskip("titans_pytorch")
product_key_memory = pytest.importorskip("product_key_memory")

MAC = dict(
    num_tokens=259,
    dim=32,
    depth=2,
    segment_len=8,
    heads=2,
    dim_head=16,
    num_longterm_mem_tokens=2,
    num_persist_mem_tokens=2,
    num_residual_streams=1,
    neural_memory_layers=(2,),
    neural_memory_segment_len=4,
    neural_memory_kwargs=dict(heads=2, dim_head=16),
)


def peer_mac(seed: int = 0):
    torch.manual_seed(seed)
    return titans_pytorch.MemoryAsContextTransformer(**MAC).eval()


def test_a_mac_model_runs_as_the_peer_runs_it_from_the_module_or_its_state_dict():
    peer = peer_mac()
    ids = random_ids(45)
    with torch.no_grad():
        expected = peer(ids)
        for source in (peer, peer.state_dict()):
            model = adapt_mac(source, **MAC)
            torch.testing.assert_close(model(ids), expected, atol=0, rtol=0)
            streamed = torch.cat([logits for _, logits, _ in model.stream(ids, 10)], 1)
            torch.testing.assert_close(streamed, expected, atol=1e-5, rtol=1e-4)
    assert model.memory_layers == [1] and model.tokenizer.decode(model.tokenizer.encode("ok")) == "ok"


def test_the_mac_memory_quantities_equal_a_recomputation_from_the_peer_weights():
    """Loss ||M_0(k_t) - v_t||^2 / d, theta_t, eta and alpha per chunk, and the chunk's surprise
    ||grad sum_t theta_t l_t||, recomputed from the normalised store input the peer's memory saw,
    then read at the tokens' positions (the long-term memory tokens left out)."""
    model = adapt_mac(peer_mac(1), **MAC).to(torch.float64)
    mem = model.memories[1]
    seen = {}
    mem.store_norm.register_forward_hook(lambda module, inputs, output: seen.setdefault("store", output.detach()))
    ids = random_ids(37, seed=3)
    _, cache = model.run_with_cache(ids)
    store = seen["store"]  # [2 views (keys, values), batch, stored positions, d]
    keys_in, values_in = store[0], store[1]
    n_stored, heads, chunk = keys_in.shape[1], mem.heads, mem.store_chunk_size
    theta = torch.sigmoid(mem.to_adaptive_step[0](keys_in))  # default max_lr 1
    k = mem.to_keys(keys_in).unflatten(-1, (heads, -1))  # a bare linear map (no activation set)
    v = mem.to_values(values_in).unflatten(-1, (heads, -1))
    chunk_means = keys_in.unflatten(1, (-1, chunk)).mean(2)
    alpha = torch.sigmoid(mem.to_decay_factor[0](chunk_means)).repeat_interleave(chunk, 1)
    eta = torch.sigmoid(mem.to_momentum[0](chunk_means)).repeat_interleave(chunk, 1)
    names = mem.memory_model_parameter_names
    loss = torch.empty(1, n_stored, heads, dtype=torch.float64)
    surprise = torch.empty_like(loss)
    for h in range(heads):
        weights = {name: p[h].detach().clone().requires_grad_() for name, p in zip(names, mem.memory_model_parameters)}
        per_token = (functional_call(mem.memory_model, weights, k[0, :, h]) - v[0, :, h]).pow(2).mean(-1)
        loss[0, :, h] = per_token.detach()
        for c in range(0, n_stored, chunk):
            grads = torch.autograd.grad(
                (theta[0, c : c + chunk, h] * per_token[c : c + chunk]).sum(), list(weights.values()), retain_graph=True
            )
            surprise[0, c : c + chunk, h] = torch.sqrt(sum(g.pow(2).sum() for g in grads))
    window = model.cfg.segment_len + MAC["num_longterm_mem_tokens"]
    at_tokens = [p for p in range(10 * len(ids[0])) if p % window < model.cfg.segment_len][: ids.shape[1]]
    stored = [i for i, p in enumerate(at_tokens) if p < n_stored]
    assert len(stored) > 20 and len(stored) < ids.shape[1]  # the unfinished last chunk is NaN
    for name, expected in {"loss": loss, "theta": theta, "eta": eta, "alpha": alpha, "surprise": surprise}.items():
        hooked = cache[f"blocks.1.memory.hook_{name}"]
        assert hooked.shape == (1, ids.shape[1], heads)
        torch.testing.assert_close(
            hooked[:, stored], expected[:, [at_tokens[i] for i in stored]], atol=1e-10, rtol=1e-9
        )
        assert hooked[:, len(stored) :].isnan().all(), name
    assert cache["blocks.1.memory.hook_retrieved"].shape == (1, ids.shape[1], model.cfg.d_model)


def test_a_mac_model_saves_loads_traces_and_draws(tmp_path):
    model = adapt_mac(peer_mac(), **MAC)
    folder = memviz.save(model, tmp_path / "mac")
    loaded = memviz.load(folder)
    ids = random_ids(30)
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), model(ids))
    trace = memviz.trace(loaded, "The pass key is 4821. Remember it. " * 4)
    assert {"blocks.1.memory.hook_surprise", "blocks.1.memory.hook_loss"} <= set(trace.names)
    assert set(viz.family_figures(trace, width=100)) == {"blocks.1.memory surprise", "loss"}
    assert get_family("titans_pytorch").interventions == {}
    rows = passkey.run(
        loaded, lengths=[256], depths=[0.5], n=2, seed=0
    )  # the probes run it (untrained: no claim on scores)
    assert list(rows["length"]) == [256, 256] and rows["prediction"].map(type).eq(str).all()


def test_pkm_selections_equal_a_recomputation_from_the_peer_weights():
    torch.manual_seed(0)
    pkm = product_key_memory.PKM(32, heads=2, num_keys=8, topk=3, dim_head=16)
    model = adapt_pkm({1: pkm}, backbone=small_model("sliding_window", window=8)).to(torch.float64)
    pkm = model.blocks[1].mlp.pkm
    ids = random_ids(25, seed=4)
    _, cache = model.run_with_cache(ids)
    x = model.blocks[1].ln2(cache["blocks.1.hook_resid_mid"])  # what the PKM reads
    q = F.layer_norm(
        pkm.to_queries(x).unflatten(-1, (2, 2, 16)), (16,), pkm.norm.weight, pkm.norm.bias
    )  # [b t half h d]
    dots = torch.einsum("btphd,hnpd->bthpn", q, pkm.keys)
    best = dots.topk(3, -1)
    sums = best.values[..., 0, :, None] + best.values[..., 1, None, :]  # [b t h k k]
    index = best.indices[..., 0, :, None] * 8 + best.indices[..., 1, None, :]
    scores, pick = sums.flatten(-2).topk(3, -1)
    indices = index.flatten(-2).gather(-1, pick)
    weights = torch.softmax(scores, -1)
    torch.testing.assert_close(cache["blocks.1.mlp.hook_topk_indices"], indices, atol=0, rtol=0)
    torch.testing.assert_close(cache["blocks.1.mlp.hook_topk_weights"], weights, atol=1e-12, rtol=1e-12)
    read = torch.einsum("bthk,bthkd->btd", weights, pkm.values.weight[indices])
    torch.testing.assert_close(cache["blocks.1.mlp.hook_read"], read, atol=1e-12, rtol=1e-12)


def test_pkm_hooks_edit_the_peer_bag_and_silence_reaches_it(tmp_path):
    torch.manual_seed(0)
    pkm = product_key_memory.PKM(32, heads=2, num_keys=8, topk=3, dim_head=16)
    model = adapt_pkm({1: pkm}, backbone=small_model("sliding_window", window=8))
    ids = random_ids(20)
    with torch.no_grad():
        clean = model(ids)
        silenced, cache = model.run_with_cache(ids)
        assert torch.equal(silenced, clean)
        quiet = model.run_with_hooks(ids, fwd_hooks=model.silence_hooks(1))
        with model.hooks(fwd_hooks=model.silence_hooks(1)):
            _, quiet_cache = model.run_with_cache(ids)
    assert quiet_cache["blocks.1.mlp.hook_read"].abs().max() == 0  # every weight zeroed: the bag reads nothing
    assert (quiet - clean).abs().max() > 1e-3
    loaded = memviz.load(memviz.save(model, tmp_path / "pkm"))
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids), clean)
    again = adapt_pkm(
        {1: pkm.state_dict()},
        backbone=small_model("sliding_window", window=8),
        memory=dict(heads=2, num_keys=8, topk=3, dim_head=16),
    )
    with torch.no_grad():
        torch.testing.assert_close(again(ids), clean)


def test_adapters_name_what_they_cannot_take():
    with pytest.raises(peers.PeerError, match="not a torch.nn.modules.linear.Linear"):
        adapt_mac(torch.nn.Linear(2, 2), **MAC)
    with pytest.raises(peers.PeerError, match=r"missing \['depth'"):
        adapt_mac(peer_mac(), **{k: v for k, v in MAC.items() if k != "depth"})
    with pytest.raises(peers.PeerError, match="does not know the arguments \\['neural_memory_model'\\]"):
        adapt_mac(peer_mac(), **MAC, neural_memory_model=torch.nn.Identity())
    with pytest.raises(peers.PeerError, match="other shapes.*token_emb"):
        adapt_mac(peer_mac(), **{**MAC, "num_tokens": 300})
    with pytest.raises(peers.PeerError, match="missing \\['layers.0.4"):
        adapt_mac(peer_mac().state_dict(), **{**MAC, "neural_memory_layers": (1, 2)})
    with pytest.raises(peers.PeerError, match="not torch.nn.modules.linear.Linear \\(layer 1\\)"):
        adapt_pkm({1: torch.nn.Linear(2, 2)}, d_model=32)
    with pytest.raises(peers.PeerError, match="other settings than given: {'topk': \\(4, 3\\)}"):
        adapt_pkm(
            {1: product_key_memory.PKM(32, heads=2, num_keys=8, topk=3, dim_head=16)},
            d_model=32,
            n_layers=2,
            memory={"topk": 4},
        )


def test_an_unsupported_or_missing_peer_says_what_to_install(monkeypatch, tmp_path):
    real = importlib.metadata.version
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.6.0" if name == "titans-pytorch" else real(name))
    with pytest.raises(
        peers.PeerError, match=r"supports versions 0\.5\.x; 0\.6\.0 is installed: pip install titans-pytorch==0\.5\.5 "
    ):
        adapt_mac(peer_mac(), **MAC)

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(
        peers.PeerError,
        match=r"needs product-key-memory, which is not installed: pip install product-key-memory==0\.3\.0 "
        r"\(or memviz's extra: pip install '/path/to/memviz\[peers\]'\)",
    ):
        small_model("product_key_memory", window=8)
    monkeypatch.setattr(importlib.metadata, "version", real)
    folder = memviz.save(
        small_model("product_key_memory", window=8, memory={"heads": 2, "num_keys": 8, "topk": 4, "dim_head": 16}),
        tmp_path / "p",
    )
    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(CheckpointError, match="not installed"):  # loading a checkpoint says it too
        memviz.load(folder)
