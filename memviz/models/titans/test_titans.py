"""Titans (arXiv 2501.00663): the chunked memory update against torch.autograd, variants, streaming."""

import pytest
import torch

from memviz.models.titans import memory_forward
from memviz.running import flushing_subnormals
from tests.conftest import random_ids, scrambled, small_model

VARIANTS = [
    ("lmm", {}),
    ("mal", {"window": 8}),
    ("mag", {"window": 8}),
    ("mac", {"segment_len": 8}),
    ("mac-window", {"segment_len": 8}),
]


def titans_options(variant, memory="linear", chunk=4):
    """`variant` "mac-window" is MAC with a window for attention (MAC's chunk is its segment)."""
    variant = variant.partition("-")[0]
    return {"variant": variant, "memory": memory, **({} if variant == "mac" else {"chunk": chunk})}


def titans_config(variant, extra):
    """MAC-window attends over the last segment_len tokens; the others as `extra` says."""
    if variant == "mac-window":
        return {**extra, "attention": {"kind": "window", "span": extra["segment_len"]}}
    return extra


def titans(variant="lmm", memory="linear", chunk=4, std=0.1, **extra):
    model = small_model("titans", memory=titans_options(variant, memory, chunk), **titans_config(variant, extra))
    return scrambled(model, std=std).double()


def autograd_reference(mem, x, chunk):
    """Token-by-token eqs. 10 and 13, every gradient by torch.autograd against the weights at
    the start of the token's chunk; tokens read with those weights too."""
    k, v, rates = mem.keys_values(x)
    q = torch.nn.functional.normalize(torch.nn.functional.silu(mem.W_Q(x)), dim=-1)
    params = {n: p.detach().clone() for n, p in mem.init_params().items()}
    momentum = {n: torch.zeros_like(p) for n, p in params.items()}
    reads, surprise = [], []
    for start in range(0, x.shape[1], chunk):
        frozen = {n: p.clone().requires_grad_(True) for n, p in params.items()}
        grads = []
        for t in range(start, min(start + chunk, x.shape[1])):
            loss = (memory_forward(frozen, k[0, t])[0] - v[0, t]).pow(2).sum()
            grads.append(torch.autograd.grad(loss, list(frozen.values())))
            surprise.append(torch.sqrt(sum(g.pow(2).sum() for g in grads[-1])))
            reads.append(memory_forward({n: p.detach() for n, p in frozen.items()}, q[0, t])[0])
        for i, t in enumerate(range(start, min(start + chunk, x.shape[1]))):
            eta, theta, alpha = rates[0, t]
            for (name, p), g in zip(params.items(), grads[i]):
                momentum[name] = eta * momentum[name] - theta * g
                params[name] = (1 - alpha) * p + momentum[name]
    return torch.stack(reads), params, momentum, torch.stack(surprise)


@pytest.mark.parametrize("memory", ["linear", "mlp"])
@pytest.mark.parametrize("chunk", [1, 3, 8])
def test_chunked_update_equals_autograd_token_by_token(memory, chunk):
    model = titans(memory=memory, chunk=chunk, std=0.3)
    mem = model.blocks[0].memory
    x = torch.randn(1, 11, model.cfg.d_model, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        state = mem.init_state(1, x.device)
        retrieved, new_state, stats = mem.step(x, state, 0)
    reads, params, momentum, surprise = autograd_reference(mem, x, chunk)
    torch.testing.assert_close(retrieved[0], reads, atol=1e-10, rtol=1e-8)
    torch.testing.assert_close(stats["surprise"][0], surprise, atol=1e-10, rtol=1e-8)
    done = (11 // chunk) * chunk  # the open chunk's tokens wait in the state
    assert new_state.open_chunk.keys.shape[1] == 11 - done
    if done == 11:
        for name in params:
            torch.testing.assert_close(new_state.params[name][0], params[name], atol=1e-10, rtol=1e-8)
            torch.testing.assert_close(new_state.momentum[name][0], momentum[name], atol=1e-10, rtol=1e-8)


def test_a_chunk_is_a_mini_batch_step_and_retrieval_does_not_update():
    model = titans(chunk=11, std=0.3)
    mem = model.blocks[0].memory
    x = torch.randn(1, 11, model.cfg.d_model, dtype=torch.float64)
    state = mem.init_state(1, x.device)
    with torch.no_grad():
        retrieved, new_state, stats = mem.step(x, state, 0)
        # every token of the chunk read the initial weights, untouched by the chunk's own writes
        torch.testing.assert_close(retrieved, mem.read(x, {n: p[None] for n, p in mem.init_params().items()}))
        assert (stats["loss_after"] < stats["loss"]).float().mean() > 0.5  # the step fits the chunk
        assert (mem.read(x, new_state.params) - retrieved).abs().max() > 1e-3  # later tokens read the writes


@pytest.mark.parametrize("variant, extra", VARIANTS)
@pytest.mark.parametrize("memory", ["linear", "mlp"])
@pytest.mark.parametrize("chunk_len", [1, 7])
def test_streamed_run_equals_one_pass(variant, extra, memory, chunk_len):
    model = titans(variant, memory, **extra)
    ids = random_ids(29)
    with torch.no_grad():
        one_pass = model(ids)
        streamed = torch.cat([lg for _, lg, _ in model.stream(ids, chunk_len)], dim=1)
    torch.testing.assert_close(streamed, one_pass, atol=1e-9, rtol=1e-9)


@pytest.mark.parametrize("variant, extra", VARIANTS)
def test_hooks_fire_once_with_per_token_layouts(variant, extra):
    model = titans(variant, **extra)
    ids = random_ids(20)
    calls = []
    model.run_with_hooks(
        ids, fwd_hooks=[(lambda n: n.endswith("hook_surprise"), lambda t, hook: calls.append(t.shape))]
    )
    assert calls == [(1, 20)] * model.cfg.n_layers
    _, cache = model.run_with_cache(ids)
    for name in ("eta", "theta", "alpha"):
        rate = cache[f"blocks.0.memory.hook_{name}"]
        assert rate.shape == (1, 20) and (rate > 0).all() and (rate < 1).all()
    assert cache["blocks.1.memory.hook_retrieved"].shape == (1, 20, model.cfg.d_model)


@pytest.mark.parametrize("variant, extra", VARIANTS)
def test_memory_carries_information_beyond_attention(variant, extra):
    model = titans(variant, chunk=4, std=0.3, **extra)
    ids = random_ids(40)
    changed = ids.clone()
    changed[0, 1] = (changed[0, 1] + 7) % 256
    with torch.no_grad():
        diff = (model(ids) - model(changed)).abs().amax(-1)[0]
    assert diff[32:].min() > 1e-6  # windows of 8 over 2 layers cannot see token 1 from 32 on


@pytest.mark.parametrize("variant, extra", VARIANTS)
def test_every_variant_trains_every_parameter(variant, extra):
    model = small_model("titans", memory=titans_options(variant), **titans_config(variant, extra)).train()
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3, weight_decay=0.0)
    for step in range(20):
        half = torch.randint(0, 16, (2, 12), generator=torch.Generator().manual_seed(step))
        loss = model(torch.cat([half, half], 1), return_type="loss")
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    assert not [n for n, p in model.named_parameters() if torch.equal(p.detach(), before[n])]


def test_mac_window_sees_across_the_segment_boundary_and_agrees_within_the_first_segment():
    segment_local = titans("mac", segment_len=8, std=0.3)
    windowed = titans("mac-window", segment_len=8, std=0.3)
    windowed.load_state_dict(segment_local.state_dict())
    ids = random_ids(24)
    with torch.no_grad():
        diff = (segment_local(ids) - windowed(ids)).abs().amax(-1)[0]
    assert diff[:8].max() < 1e-12  # a window of 8 and the first segment of 8 are the same context
    assert diff[8] > 1e-6  # the first token of segment 2 now also sees segment 1's tokens


def test_config_errors():
    from memviz import ConfigError

    with pytest.raises(ConfigError, match="'mac' needs config.segment_len"):
        small_model("titans", memory={"variant": "mac"})
    with pytest.raises(ConfigError, match="'mag' needs sliding-window attention"):
        small_model("titans", memory={"variant": "mag"})
    with pytest.raises(ConfigError, match="chunk must be segment_len"):  # it was replaced without a word
        small_model("titans", memory={"variant": "mac", "chunk": 4}, segment_len=8)
    with pytest.raises(ConfigError, match="'lmm' has no attention"):
        small_model("titans", memory={"variant": "lmm"}, window=8)
    older = small_model("titans", memory={"variant": "mac", "chunk": 8, "local": "window"}, segment_len=8)
    assert older.cfg.attention == {"kind": "window", "span": 8} and "local" not in older.cfg.memory
    with pytest.raises(ConfigError, match="variant must be one of"):
        small_model("titans", memory={"variant": "mad"}, segment_len=8)


@pytest.mark.parametrize("variant, extra", VARIANTS)
def test_the_read_out_parts_sum_to_the_memory_read(variant, extra):
    """memory_readout decomposes the linear memory's read over the tokens of the complete chunks
    before it plus the initial weights' term; in float64 they sum to the read the model made
    (MAC: the context hook_mem_out; the others: hook_retrieved), and the values' lambdas are not
    trivial (a token's part changes when only its value is counted)."""
    model = titans(variant, chunk=4, std=0.2, **extra)
    ids = random_ids(30, seed=3)
    _, cache = model.run_with_cache(ids)
    hook = "hook_mem_out" if variant.startswith("mac") else "memory.hook_retrieved"
    for position in (2, 13, 29):
        readout = model.memory_readout(ids, position)
        chunk = model.blocks[0].memory.chunk
        for layer in range(2):
            name = f"blocks.{layer}"
            assert readout.parts[name].shape == (position // chunk * chunk, 1, model.cfg.d_model)
            torch.testing.assert_close(
                readout.reads[name][0], cache[f"{name}.{hook}"][0, position], atol=1e-12, rtol=1e-12
            )
            total = readout.shares(name).sum(0) + readout.initial_share(name)
            torch.testing.assert_close(total, torch.ones(1, dtype=torch.float64))
        if position >= chunk:
            assert readout.parts["blocks.1"].abs().max() > 1e-3
    with pytest.raises(ValueError, match="position must lie in"):
        model.memory_readout(ids, 30)
    assert titans(variant, memory="mlp", **extra).memory_readout(ids, 20) is None


def test_a_forward_flushes_subnormals_agrees_with_float64_and_restores_the_callers_mode():
    """With a small eta the momentum products of a 16-token chunk fall below 1.2e-38, where each
    x86 multiply is slow (memviz.running.denormals_flushed): a float32 forward runs with them
    flushed, agrees with the float64 model to float32 rounding and leaves the caller's mode."""
    if not torch.set_flush_denormal(False):
        pytest.skip("this CPU has no flush-to-zero mode torch can set (torch.set_flush_denormal)")
    model = titans("lmm", chunk=16, std=0.3)
    with torch.no_grad():
        for block in model.blocks:
            block.memory.W_rates.bias[0] = -6.0  # eta ~ 0.0025: prod over 16 tokens ~ 1e-42
    tokens = random_ids(40)
    reference = model(tokens)
    fp32 = model.float()
    seen = []
    fp32.blocks[0].memory.hook_eta.add_hook(lambda eta, hook: seen.append(flushing_subnormals()))
    eta = fp32.run_with_cache(tokens, names_filter="blocks.0.memory.hook_eta")[1]["blocks.0.memory.hook_eta"]
    assert eta.double().log().sum(-1).item() / 40 * 16 < -87.3  # a chunk's product is subnormal or below
    try:
        for callers_mode in (False, True):
            torch.set_flush_denormal(callers_mode)
            logits = fp32(tokens)
            assert flushing_subnormals() == callers_mode
            torch.testing.assert_close(logits.double(), reference, atol=2e-4, rtol=2e-4)
    finally:
        torch.set_flush_denormal(False)
    assert seen and all(seen)
