"""The linear-memory op: the token-by-token reference against the transition written out as a matrix and
against fla's naive recurrences (a peer); the chunked form against the reference in float64; the read split
over its writers against the recurrence fed one writer; a stream cut anywhere against one call."""

import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from memviz_kernels import dispatch
from memviz_kernels.linear_memory.reference import recurrent

pytestmark = pytest.mark.usefixtures("poisoned_buffers")  # memviz_kernels.testing

KINDS = [("scalar", True), ("scalar", False), ("channel", True), ("channel", False)]


def inputs(kind, delta, B=2, H=3, T=19, dk=6, dv=5, dtype=torch.float64):
    q = F.normalize(torch.randn(B, H, T, dk, dtype=dtype), dim=-1)
    k = F.normalize(torch.randn(B, H, T, dk, dtype=dtype), dim=-1)
    v = torch.randn(B, H, T, dv, dtype=dtype)
    shape = (B, H, T) if kind == "scalar" else (B, H, T, dk)
    g = torch.log(torch.rand(shape, dtype=dtype) * 0.6 + 0.4)
    beta = torch.rand(B, H, T, dtype=dtype) if delta else None
    return q, k, v, g, beta, torch.randn(B, H, dk, dv, dtype=dtype)


def transition(k, g, beta, t):
    """A_t written out [B,H,dk,dk]: (I - beta k k^T) Diag(alpha_t), or Diag(alpha_t) without the delta rule."""
    alpha = g[:, :, t].exp()
    D = torch.diag_embed(alpha[..., None].expand(k[:, :, t].shape) if g.dim() == 3 else alpha)
    if beta is None:
        return D
    kt = k[:, :, t, :, None]
    eye = torch.eye(k.shape[-1], dtype=k.dtype)
    return (eye - beta[:, :, t, None, None] * kt @ kt.transpose(-1, -2)) @ D


@pytest.mark.parametrize("kind, delta", KINDS)
def test_the_reference_is_the_transition_matrix_product(seed, kind, delta):
    q, k, v, g, beta, S = inputs(kind, delta)
    (o, norms), S_T = recurrent(q, k, v, g, beta, S)
    for t in range(k.shape[2]):
        write = k[:, :, t, :, None] * v[:, :, t, None, :]
        S = transition(k, g, beta, t) @ S + (write if beta is None else beta[:, :, t, None, None] * write)
        torch.testing.assert_close(o[:, :, t], (S.transpose(-1, -2) @ q[:, :, t, :, None])[..., 0], rtol=0, atol=1e-13)
        torch.testing.assert_close(norms[:, :, t], S.flatten(2).norm(dim=-1), rtol=0, atol=1e-13)
    torch.testing.assert_close(S_T, S, rtol=0, atol=1e-13)


@pytest.mark.parametrize("kind, delta", KINDS)
@pytest.mark.parametrize("T, chunk", [(1, 4), (23, 1), (23, 5), (40, 8), (17, 64)])
@pytest.mark.parametrize("dk, dv", [(6, 5), (6, 1), (1, 1)])  # d_v = 1 without the delta rule: a diagonal recurrence
def test_the_chunked_form_is_the_recurrence(seed, kind, delta, T, chunk, dk, dv):
    q, k, v, g, beta, S = inputs(kind, delta, T=T, dk=dk, dv=dv)
    (o, norms), S_T = recurrent(q, k, v, g, beta, S)
    (o_c, norms_c), S_c = dispatch.linear_memory(q, k, v, g, beta, S, chunk)
    for name, a, b in (("o", o_c, o), ("norms", norms_c, norms), ("S", S_c, S_T)):
        torch.testing.assert_close(a, b, atol=1e-10, rtol=1e-10, msg=lambda m: f"{name} (seed {seed}): {m}")
    (none, skipped), S_q = dispatch.linear_memory(None, k, v, g, beta, S, chunk, state_norms=False)
    assert none is None and skipped is None
    torch.testing.assert_close(S_q, S_T, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind, delta", KINDS)
def test_a_stream_cut_anywhere_is_one_call(seed, kind, delta):
    q, k, v, g, beta, S = inputs(kind, delta, T=29)
    (o, norms), S_T = dispatch.linear_memory(q, k, v, g, beta, S, 8)
    cut = int(torch.randint(1, 28, ()))
    parts = []
    state = S
    for piece in (slice(0, cut), slice(cut, 29)):
        b = None if beta is None else beta[:, :, piece]
        (o_p, n_p), state = dispatch.linear_memory(
            q[:, :, piece], k[:, :, piece], v[:, :, piece], g[:, :, piece], b, state, 8
        )
        parts.append((o_p, n_p))
    torch.testing.assert_close(torch.cat([p[0] for p in parts], 2), o, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(torch.cat([p[1] for p in parts], 2), norms, atol=1e-10, rtol=1e-10)
    torch.testing.assert_close(state, S_T, atol=1e-10, rtol=1e-10)


@pytest.mark.parametrize("kind, delta", KINDS)
def test_each_writers_part_is_the_read_with_that_writer_alone(seed, kind, delta):
    q, k, v, g, beta, S = inputs(kind, delta, T=13)
    zero = torch.zeros_like(S)
    weights = dispatch.linear_memory_read_parts(q[:, :, -1], k, g, beta)
    (o, _), _ = recurrent(q, k, v, g, beta, zero)
    torch.testing.assert_close((weights[..., None] * v).sum(2), o[:, :, -1], atol=1e-12, rtol=0)
    for j in range(13):
        alone = torch.zeros_like(v)
        alone[:, :, j] = v[:, :, j]
        (o_j, _), _ = recurrent(q, k, alone, g, beta, zero)  # the others' keys still remove and decay
        torch.testing.assert_close(weights[:, :, j, None] * v[:, :, j], o_j[:, :, -1], atol=1e-12, rtol=0)


def test_half_precision_is_computed_in_float32(seed):
    q, k, v, g, beta, S = inputs("channel", True, dtype=torch.float32)
    (o, norms), S_T = dispatch.linear_memory(*(t.bfloat16() for t in (q, k, v, g, beta)), S, 8)
    (o32, norms32), S32 = dispatch.linear_memory(*(t.bfloat16().float() for t in (q, k, v, g, beta)), S, 8)
    assert o.dtype == torch.bfloat16 and norms.dtype == S_T.dtype == torch.float32
    assert torch.equal(o, o32.bfloat16()) and torch.equal(norms, norms32) and torch.equal(S_T, S32)


def fla_naive(op):
    spec = importlib.util.find_spec("fla")
    path = Path(spec.submodule_search_locations[0]) / "ops" / op / "naive.py" if spec else None
    if path is None or not path.is_file():
        pytest.skip("fla-core (a test-only peer reference, requirements.txt) is not installed")
    module_spec = importlib.util.spec_from_file_location(f"fla_{op}_naive", path)
    module = importlib.util.module_from_spec(module_spec)
    module_spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("kind", ["scalar", "channel"])
def test_the_reference_matches_flas_naive_recurrence(seed, kind):
    """fla's gated delta rule (g per head) and Kimi Delta Attention (g per key channel): [B,T,H,d], float32
    inside, q scaled by `scale`."""
    q, k, v, g, beta, S = inputs(kind, True, dtype=torch.float32)
    (o, _), S_T = recurrent(q, k, v, g, beta, S)
    first = lambda t: t.transpose(1, 2)  # noqa: E731  [B,H,T,...] -> [B,T,H,...]
    if kind == "scalar":
        run = fla_naive("gated_delta_rule").naive_recurrent_gated_delta_rule
    else:
        run = fla_naive("kda").naive_recurrent_kda
    ref_o, ref_S = run(
        first(q),
        first(k),
        first(v),
        **{"beta": first(beta), "g": first(g)},
        scale=1.0,
        initial_state=S,
        output_final_state=True,
    )
    torch.testing.assert_close(o, first(ref_o), atol=2e-5, rtol=1e-4, msg=lambda m: f"o (seed {seed}): {m}")
    torch.testing.assert_close(S_T, ref_S, atol=2e-5, rtol=1e-4, msg=lambda m: f"S (seed {seed}): {m}")


@pytest.mark.parametrize("kind", ["scalar", "channel"])
def test_the_norm_holds_where_the_delta_rule_erases(kind):
    """One key written again and again with beta = 1, a large value and then small ones: each write replaces the
    last, so the state's norm falls by six orders of magnitude; float32's norms stay within float32 rounding of
    the largest state (a closed form summed in float32 was off by 300 times the true norm)."""
    T, dk = 12, 4
    k = F.normalize(torch.ones(1, 1, T, dk, dtype=torch.float64), dim=-1)
    v = torch.full((1, 1, T, 3), 1e-3, dtype=torch.float64)
    v[:, :, 0] = 1e3
    g = torch.zeros((1, 1, T) if kind == "scalar" else (1, 1, T, dk), dtype=torch.float64)
    beta, S = torch.ones(1, 1, T, dtype=torch.float64), torch.zeros(1, 1, dk, 3, dtype=torch.float64)
    (_, truth), _ = recurrent(k, k, v, g, beta, S)
    (_, norms), _ = dispatch.linear_memory(*(t.float() for t in (k, k, v, g, beta, S)), chunk=8)
    assert truth[0, 0, -1] < 1e-2 < truth[0, 0, 0]
    torch.testing.assert_close(norms.double(), truth, rtol=0, atol=1e-6 * truth.max().item())


def test_no_token_reads_nothing_and_keeps_the_state(seed):
    q, k, v, g, beta, S = inputs("scalar", True, T=0)
    (o, norms), final = dispatch.linear_memory(q, k, v, g, beta, S)
    assert o.shape == (2, 3, 0, 5) and norms.shape == (2, 3, 0) and torch.equal(final, S)
