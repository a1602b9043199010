"""memviz's state-space memories against TransformerLens 4.3's bridge of the same layers, on small random checkpoints
(`tiny.tiny_checkpoint`): wherever the bridge has the same quantity for the same model, its values are memviz's.

TransformerLens wraps transformers' Mamba-2 mixer in `SSM2MixerBridge` (mamba2, bamba, nemotron_h and Zamba2's
Mamba layers here: it leaves a Zamba2 hybrid layer whole, its mixer unbridged; granitemoehybrid's adapter fails on a
RoPE-less Granite) and its Mamba-1 mixer in `SSMMixerBridge` (mamba and jamba here; falcon_mamba disagrees
slightly, its own test). It hooks the mixer's projections (`in_proj`, `conv1d`,
`x_proj`, `dt_proj`, Jamba's `b_layernorm`/`c_layernorm`, the gated norm, `out_proj`) in the model's dtype, and, on
its opt-in `eager_scan`, a Python scan of its own in float32 (it casts with `.float()`) with `hook_ssm_write`
(dt x B^T) and `hook_ssm_state` (h_t at every token); `compute_ssm_effective_attention` and `compute_ssm_state`
rebuild M and h_t from its cache, also in float32. So what the projections give (dt, the decay, x, B, C) is compared
in float64 to 1e-10, and what its scan gives to float32 rounding of the largest value (FLOAT32, REBUILT). Each
memory layer of the bridge is fed memviz's residual stream at that layer, so every layer compares the same layer on
the same input.

How far the bridge reaches (docs/released.md, TransformerLens): its state hooks fire only on the eager scan, a patch of
`hook_ssm_state` changes that token's read and not the recurrence after it, and the eager scan ignores the cache
transformers 5.25 hands the mixer (`cache=`; the bridge looks for `cache_params`), so in generation it hooks a
state started from zero at every step rather than the model's."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, cast

import pytest
import torch
import torch.nn.functional as F

import memviz
from memviz.models.released import ReleasedLM
from memviz.models.released.tiny import TEXT, tiny_checkpoint

#: transformers' Mamba-2 mixer: TransformerLens' SSM2MixerBridge
SSD = ["mamba2", "bamba", "nemotron_h", "zamba2"]
#: transformers' Mamba-1 mixer: TransformerLens' SSMMixerBridge (falcon_mamba: its own test below)
SCAN = ["mamba", "jamba"]
EXACT = 1e-10  # float64 against float64, a share of the largest value
#: the bridge's eager scan computes in float32 (unit rounding 6e-8): its values agree to this share of the largest
#: (seen: at most 5e-7 over 32 tokens)
FLOAT32 = 2e-6
#: its effective attention and `compute_ssm_state` take exp(A (c_t - c_j)) of float32 running sums c of dt A over
#: the sequence, whose rounding grows with the sum (seen: at most 2e-6 of the largest value)
REBUILT = 2e-5
T = 32
PASSAGE = TEXT + " The pass key is 71432. " * 3


@dataclass
class Pair:
    """memviz's float64 model and TransformerLens' bridge of transformers' own float64 model of one checkpoint,
    both run on `ids` (the bridge's memory layers on their eager scan)."""

    model_type: str
    model: Any
    ids: torch.Tensor
    ours: dict[str, torch.Tensor]  # memviz's hooks
    state: Any  # memviz's state after ids
    hf: Any  # transformers' model the bridge wraps
    bridge: Any
    theirs: Any  # the bridge's ActivationCache
    feed: list  # the bridge's hooks that give each memory layer memviz's residual stream

    @property
    def layers(self) -> list[int]:
        return bridged(self.model, self.bridge)

    def mixer(self, l: int):
        return self.bridge.blocks[l].mixer

    def hf_mixer(self, l: int):
        """transformers' mixer module the bridge wraps (its A_log, D, dt_bias, sizes)."""
        return self.mixer(l).original_component


def bridged(model: ReleasedLM, bridge) -> list[int]:
    """The memory layers whose mixer the bridge wraps (Zamba2's hybrid layers it leaves whole, mixer unbridged)."""
    return [l for l in model.cfg.linear_layers if "mixer" in dict(bridge.blocks[l].named_children())]


def build(model_type: str, folder) -> Pair:
    """A tiny `model_type` checkpoint in `folder`, memviz's float64 model of it and TransformerLens' bridge of
    transformers' float64 model, both run on the same tokens."""
    from transformer_lens.model_bridge import TransformerBridge
    from transformers import PreTrainedTokenizerFast

    tiny_checkpoint(folder, model_type)
    model = cast(ReleasedLM, memviz.load(folder, dtype="float64"))
    ids = torch.tensor([model.tokenizer.encode(PASSAGE * 4)[:T]])
    with torch.no_grad():
        compared = lambda n: ".attn." in n or n.endswith(("resid_pre", "attn_out"))  # noqa: E731
        _, cache = model.run_with_cache(ids, names_filter=compared)
        _, state = model(ids, return_state=True)
    ours = {name: cache[name] for name in cache.keys()}
    arch = model.arch
    experts = {"experts_implementation": "eager"} if arch.experts else {}  # its grouped kernel takes no float64
    hf = arch.causal_lm().from_pretrained(folder, dtype=torch.float64, use_kernels=False, **experts).eval()
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=str(folder / "tokenizer.json"))
    bridge = TransformerBridge.boot_transformers(str(folder), hf_model=hf, tokenizer=tokenizer, dtype=torch.float64)
    feed = [
        (f"blocks.{l}.hook_in", lambda value, hook, l=l: ours[f"blocks.{l}.hook_resid_pre"])
        for l in bridged(model, bridge)
    ]
    for l in bridged(model, bridge):
        bridge.blocks[l].mixer.eager_scan = True
    with torch.no_grad(), bridge.hooks(fwd_hooks=feed):
        _, theirs = bridge.run_with_cache(ids)
    return Pair(model_type, model, ids, ours, state, hf, bridge, theirs, feed)


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """The models are tiny: one thread for this module (on a busy machine an OpenMP team made each float64 depthwise
    conv1d take about a second, most of this file's time), restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module", params=SSD + SCAN)
def pair(request, tmp_path_factory) -> Pair:
    """Each architecture's pair, built once for the module."""
    return build(request.param, tmp_path_factory.mktemp(request.param))


def close(theirs: torch.Tensor, ours: torch.Tensor, share: float) -> None:
    """TransformerLens' value equals memviz's to `share` of memviz's largest magnitude, which is not zero."""
    scale = ours.abs().max().item()
    assert scale > 1e-3, "nothing to compare"
    torch.testing.assert_close(theirs.double(), ours.double(), atol=share * max(scale, 1.0), rtol=0)


def projections(pair: Pair, l: int) -> dict[str, torch.Tensor]:
    """dt, exp(dt A), x, B and C of memory layer l from the bridge's float64 hooks, through the layer's own maps
    (transformers' Mamba2Mixer / MambaMixer), in memviz's layout: Mamba-2 [b, T, head(, d)], Mamba-1
    [b, T, channel(, d_state)] with x [b, T, channel, 1]."""
    theirs, mixer, pre = pair.theirs, pair.hf_mixer(l), f"blocks.{l}.mixer"
    conv = theirs[f"{pre}.conv1d.hook_out"][..., :T]  # [b, channels, T + K - 1], causal: the first T
    A = -mixer.A_log.exp()
    if pair.model_type in SSD:
        H, P, G, N = mixer.num_heads, mixer.head_dim, mixer.n_groups, mixer.ssm_state_size
        dt = F.softplus(theirs[f"{pre}.in_proj.hook_out"][..., -H:] + mixer.dt_bias).clamp(*mixer.time_step_limit)
        x, B, C = F.silu(conv).transpose(1, 2).split([H * P, G * N, G * N], dim=-1)
        B, C = (m.unflatten(-1, (G, N)).repeat_interleave(H // G, dim=2) for m in (B, C))
        return dict(beta=dt, alpha=(dt * A).exp(), write_value=x.unflatten(-1, (H, P)), write_key=B, read_query=C)
    N, channels = mixer.ssm_state_size, mixer.intermediate_size
    dt = F.softplus(theirs[f"{pre}.dt_proj.hook_out"])  # [b, T, channel]
    _, B, C = theirs[f"{pre}.x_proj.hook_out"].split([mixer.time_step_rank, N, N], dim=-1)
    if f"{pre}.b_layernorm.hook_out" in theirs:  # Jamba: the bridge hooks B and C after their norms
        B, C = theirs[f"{pre}.b_layernorm.hook_out"], theirs[f"{pre}.c_layernorm.hook_out"]
    elif hasattr(mixer, "b_layernorm"):  # Falcon Mamba: its weightless norms, unhooked
        B, C = mixer.b_layernorm(B), mixer.c_layernorm(C)
    B, C = (m[:, :, None].expand(-1, -1, channels, -1) for m in (B, C))
    x = mixer.act(conv).transpose(1, 2)[..., None]
    return dict(beta=dt, alpha=(dt[..., None] * A).exp(), write_value=x, write_key=B, read_query=C)


def test_step_decay_and_projections_equal_the_bridge_s(pair):
    """The step dt_t (memviz's hook_beta), the decay exp(dt_t A) (hook_alpha), x_t (hook_write_value), B_t
    (hook_write_key) and C_t (hook_read_query) of every memory layer against the bridge's in_proj / conv1d /
    x_proj / dt_proj (and Jamba's b/c_layernorm) hooks: the same float64 numbers through the same maps, to 1e-10."""
    for l in pair.layers:
        for name, value in projections(pair, l).items():
            ours = pair.ours[f"blocks.{l}.attn.hook_{name}"]
            assert value.shape == ours.shape, (l, name)
            close(value, ours, EXACT)
        assert pair.ours[f"blocks.{l}.attn.hook_alpha"].min() < 0.5  # some heads forget within a few tokens


def test_writes_and_state_trajectory_equal_the_bridge_s(pair):
    """The bridge's eager float32 scan: its write dt_t x_t B_t^T (hook_ssm_write) is memviz's beta x k^T, the norm of
    its state at every token (hook_ssm_state) memviz's hook_state_norm, its last state the state memviz carries
    (h = S^T), and `compute_ssm_state`, its rebuild of h_t from its cache, that state too."""
    for l in pair.layers:
        pre, at = f"blocks.{l}.mixer", f"blocks.{l}.attn.hook_"
        beta, x, k = (pair.ours[at + n] for n in ("beta", "write_value", "write_key"))
        S = pair.state.layers[l].S  # [b, head, d_state, d_v]
        write, states = pair.theirs[f"{pre}.hook_ssm_write"], pair.theirs[f"{pre}.hook_ssm_state"]
        if pair.model_type in SSD:  # theirs [b, T, head, head_dim, d_state]
            close(write, beta[..., None, None] * x[..., :, None] * k[..., None, :], FLOAT32)
            close(states.flatten(3).norm(dim=-1), pair.ours[at + "state_norm"], FLOAT32)
            close(states[:, -1], S.transpose(-1, -2), FLOAT32)
            rebuilt = pair.theirs.compute_ssm_state(layer=l, time_step=T - 1)  # [b, head, head_dim, d_state]
            close(rebuilt, S.transpose(-1, -2), REBUILT)
        else:  # theirs [b, channel, T, d_state]
            close(write.transpose(1, 2), beta[..., None] * x * k, FLOAT32)
            close(states.norm(dim=-1).transpose(1, 2), pair.ours[at + "state_norm"], FLOAT32)
            close(states[:, :, -1], S[..., 0], FLOAT32)
            close(pair.theirs.compute_ssm_state(layer=l, time_step=T - 1), S[..., 0], REBUILT)


def test_read_and_layer_output_equal_the_bridge_s(pair):
    """The read h_t C_t (memviz's hook_read, without the skip D x_t): Mamba-2's is the bridge's gated norm input
    less D x_t; the value before out_proj (memviz's hook_mem_out: Mamba-2's gated norm output, Mamba-1's
    (y_t + D x_t) silu(z_t)) and the mixer's output (hook_attn_out) are the bridge's, all to float32 rounding."""
    for l in pair.layers:
        pre, at = f"blocks.{l}.mixer", f"blocks.{l}.attn.hook_"
        mem_out = pair.ours[at + "mem_out"]
        if pair.model_type in SSD:
            x, D = pair.ours[at + "write_value"], pair.hf_mixer(l).D
            y = pair.theirs[f"{pre}.inner_norm.hook_in"].unflatten(-1, x.shape[-2:])
            close(y - D[:, None] * x, pair.ours[at + "read"], FLOAT32)
            close(pair.theirs[f"{pre}.inner_norm.hook_out"].unflatten(-1, x.shape[-2:]), mem_out, FLOAT32)
        else:
            close(pair.theirs[f"{pre}.out_proj.hook_in"], mem_out, FLOAT32)
        close(pair.theirs[f"{pre}.hook_out"], pair.ours[f"blocks.{l}.hook_attn_out"], FLOAT32)


def test_effective_attention_is_memviz_s_read_out(pair):
    """TransformerLens' effective attention M (`compute_ssm_effective_attention`; with include_dt_scaling column j
    carries dt_j, so y_t = sum_j M[t, j] x_j + D x_t): for a diagonal recurrence M[t, j] x_j is exactly writer j's
    part of the read h_t C_t, memviz's `memory_readout` part j. Per head (Mamba-2) or channel (Mamba-1); M's rows
    over x give hook_read at every token, and M without dt scaling is M with dt_j divided out."""
    position = T - 5
    readout = pair.model.memory_readout(pair.ids, position)
    for l in pair.layers:
        at = f"blocks.{l}.attn.hook_"
        x = pair.ours[at + "write_value"][0]  # [T, head, d_v]
        M = pair.theirs.compute_ssm_effective_attention(layer=l, include_dt_scaling=True)[0]  # [head, T, T]
        assert M.shape == (x.shape[1], T, T)
        assert not M.triu(1).any()
        close(torch.einsum("htj,jhd->thd", M.double(), x), pair.ours[at + "read"][0], REBUILT)
        parts = readout.parts[f"blocks.{l}"]  # [position + 1, head, d_v]
        close(M[:, position, : position + 1].T[..., None] * x[: position + 1], parts, REBUILT)
        assert (parts.abs().amax((1, 2)) > 1e-3 * parts.abs().max()).sum() > 4  # many writers take part
        plain = pair.theirs.compute_ssm_effective_attention(layer=l, include_dt_scaling=False)[0]
        close(plain * pair.ours[at + "beta"][0].T[:, None, :], M, REBUILT)


def test_state_hooks_fire_only_on_the_eager_scan(pair):
    """On its default path (transformers' own mixer forward) the bridge hooks no state or write, and its effective
    attention has nothing to rebuild from: transformers 5.25 runs the convolution (and Mamba-1's dt_proj) as
    functions of the modules' weights, so their hooks never fire."""
    mixers = [pair.mixer(l) for l in pair.layers]
    try:
        for mixer in mixers:
            mixer.eager_scan = False
        with torch.no_grad():
            _, plain = pair.bridge.run_with_cache(pair.ids)
    finally:
        for mixer in mixers:
            mixer.eager_scan = True
    assert not [name for name in plain.keys() if "ssm_state" in name or "ssm_write" in name or "conv1d" in name]
    with pytest.raises(RuntimeError, match="reconstruction needs"):
        plain.compute_ssm_effective_attention(layer=pair.layers[0])


def test_a_patch_of_hook_ssm_state_changes_only_that_token_s_read(pair):
    """The bridge's hook_ssm_state is the trajectory after the scan: zeroing h_t at one token changes the mixer's
    output at that token alone, the recurrence after it runs on (a patch of hook_ssm_write, before the scan,
    changes every later token)."""
    l, p = pair.layers[0], 12
    pre = f"blocks.{l}.mixer"
    axis = 1 if pair.model_type in SSD else 2  # the token axis of the bridge's state and write

    def zero_at_p(value, hook):
        value = value.clone()
        value.select(axis, p).zero_()
        return value

    base = pair.theirs[f"{pre}.hook_out"][0]
    changed = {}
    for name in ("hook_ssm_state", "hook_ssm_write"):
        with torch.no_grad(), pair.bridge.hooks(fwd_hooks=[*pair.feed, (f"{pre}.{name}", zero_at_p)]):
            _, patched = pair.bridge.run_with_cache(pair.ids, names_filter=f"{pre}.hook_out")
        changed[name] = (patched[f"{pre}.hook_out"][0] - base).abs().amax(-1)  # [T]
    state, write = changed["hook_ssm_state"], changed["hook_ssm_write"]
    assert state[p] > 1e-2 and state[:p].max() == 0 and state[p + 1 :].max() == 0
    assert write[:p].max() == 0 and write[p] > 1e-2 and write[p + 1 :].min() > 1e-6


def test_the_eager_scan_ignores_transformers_cache(pair):
    """Given the cache of the first 16 tokens, handed over as transformers 5.25 hands it to a mixer (`cache=`; the
    bridge looks for `cache_params`), the bridge's eager scan of the next token gives what it gives without it, a
    scan from zero, far from the one pass; transformers' own mixer continues the cache to the one pass. In the
    bridge's generation every decode step's hook_ssm_state is therefore the step's own write alone, not the model's
    state (memviz's state norm there is 6 to 35 times larger in the median head)."""
    l, k = pair.layers[0], 16
    pre, mixer = f"blocks.{l}.mixer", pair.mixer(l)
    x, one_pass = pair.theirs[f"{pre}.hook_in"][:, k : k + 1], pair.theirs[f"{pre}.hook_out"][:, k : k + 1]
    with torch.no_grad():
        mixer.eager_scan = False
        try:
            out = pair.hf(pair.ids[:, :k], use_cache=True)
            cache = out.get("cache") if out.get("cache") is not None else out.get("past_key_values")
            mixer.eager_scan = True
            with_cache = mixer(hidden_states=x, cache=cache)
            without = mixer(hidden_states=x)
            mixer.eager_scan = False
            own = mixer(hidden_states=x, cache=cache)  # transformers' mixer (it updates the cache, so last)
        finally:
            mixer.eager_scan = True
    close(own, one_pass, FLOAT32)
    torch.testing.assert_close(with_cache, without, atol=0, rtol=0)
    assert (with_cache - one_pass).abs().max() > 0.1 * one_pass.abs().max()

    states, writes = [], []
    mixer.hook_ssm_state.add_hook(lambda value, hook: states.append(value))
    mixer.hook_ssm_write.add_hook(lambda value, hook: writes.append(value))
    try:
        with torch.no_grad():
            tokens = pair.bridge.generate(pair.ids[:, :k], max_new_tokens=3, do_sample=False, verbose=False)
    finally:
        mixer.hook_ssm_state.remove_hooks()
        mixer.hook_ssm_write.remove_hooks()
    axis = 1 if pair.model_type in SSD else 2  # the token axis of the bridge's state
    assert [s.shape[axis] for s in states] == [k, 1, 1]  # it fires on every decode step...
    for state, write in zip(states[1:], writes[1:]):  # ...with the step's write alone
        torch.testing.assert_close(state, write, atol=0, rtol=0)
    with torch.no_grad():
        _, cache = pair.model.run_with_cache(tokens[:, : k + 2], names_filter=f"blocks.{l}.attn.hook_state_norm")
    last = states[-1].flatten(3)[:, 0] if axis == 1 else states[-1][:, :, 0]  # [b, head or channel, ...]
    assert (cache[f"blocks.{l}.attn.hook_state_norm"][:, -1] > 3 * last.norm(dim=-1).double()).any()


def test_falcon_mamba_bridge_normalises_dt_twice(tmp_path):
    """A disagreement, and why: on Falcon Mamba TransformerLens' eager scan RMS-normalises the low-rank step (and B,
    C) twice, once for the mixer's `rms_eps` and once through its `dt_layernorm` (which transformers 5.25's
    FalconMambaMixer has as well), so its dt_proj hook is dt_proj(rms(rms(.))) where transformers' and memviz's
    dt is softplus(dt_proj(rms(.))): apart by 5e-7 to 7e-6 of dt, far above float64 rounding, near float32's."""
    pair = build("falcon_mamba", tmp_path)
    mixer, theirs = pair.hf_mixer(0), pair.theirs
    step = theirs["blocks.0.mixer.x_proj.hook_out"][..., : mixer.time_step_rank]
    once = mixer.dt_layernorm(step)
    twice = mixer.dt_layernorm(once)
    close(F.softplus(mixer.dt_proj(once)), pair.ours["blocks.0.attn.hook_beta"], EXACT)
    close(theirs["blocks.0.mixer.dt_proj.hook_out"], mixer.dt_proj(twice), EXACT)
    off = (F.softplus(theirs["blocks.0.mixer.dt_proj.hook_out"]) - pair.ours["blocks.0.attn.hook_beta"]).abs().max()
    assert 1e-8 < off < 1e-4
