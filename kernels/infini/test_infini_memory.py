"""Infini-attention's memory op: the Triton kernel against the reference with gradients, and the
op's state convention (a stream cut anywhere gives the one-call result)."""

import pytest
import torch
import torch.nn.functional as F

from memviz_kernels import dispatch
from memviz_kernels.infini.reference import infini_memory_reference
from memviz_kernels.testing import close, leaves

pytestmark = pytest.mark.usefixtures("poisoned_buffers")  # memviz_kernels.testing


def empty_open_segment(M):
    return M.new_zeros(*M.shape[:2], 0, M.shape[2]), M.new_zeros(*M.shape[:2], 0, M.shape[3])


@pytest.mark.parametrize("rule", ["linear", "delta"])
@pytest.mark.parametrize("T,segment", [(23, 7), (14, 7), (5, 8)])
def test_infini_segment_memory_matches_the_reference_with_gradients(seed, rule, T, segment):
    B, H, D = 2, 3, 5
    sq, sk = F.elu(torch.randn(B, H, T, D)) + 1, F.elu(torch.randn(B, H, T, D)) + 1
    v, M, z = torch.randn(B, H, T, D), torch.randn(B, H, D, D) * 0.1, torch.rand(B, H, D)
    ins32, ins64 = leaves([sq, sk, v, M, z], torch.float32), leaves([sq, sk, v, M, z], torch.float64)
    out = dispatch.triton_kernel("infini_memory")(*ins32, segment, rule)
    ref = infini_memory_reference(*ins64, segment, rule)
    for name, a, b in zip(("read", "norms", "M", "z"), out, ref):
        close(a, b, seed, f"{rule} {name}")
    grads = [torch.randn_like(out[i]) for i in (0, 2, 3)]
    torch.autograd.backward([out[0], out[2], out[3]], grads)
    torch.autograd.backward([ref[0], ref[2], ref[3]], [g.double() for g in grads])
    for name, a, b in zip(("dsq", "dsk", "dv", "dM", "dz"), ins32, ins64):
        expected = torch.zeros_like(b) if b.grad is None else b.grad  # keys of an unfinished segment
        close(a.grad, expected, seed, f"{rule} {name}")


def test_infini_kernel_starts_from_an_empty_memory(seed):
    sq, sk, v = F.elu(torch.randn(1, 2, 9, 4)) + 1, F.elu(torch.randn(1, 2, 9, 4)) + 1, torch.randn(1, 2, 9, 4)
    M, z = torch.zeros(1, 2, 4, 4), torch.zeros(1, 2, 4)
    (read, norms), state = dispatch.infini_memory(sq, sk, v, (M, z, *empty_open_segment(M)), 4, "delta", impl="triton")
    (ref_read, ref_norms), ref_state = dispatch.infini_memory(
        *(t.double() for t in (sq, sk, v)),
        (M.double(), z.double(), *empty_open_segment(M.double())),
        4,
        "delta",
        impl="reference",
    )
    assert torch.equal(read[:, :, :4], torch.zeros(1, 2, 4, 4)), "the first segment has nothing to read"
    for name, a, b in zip(
        ("read", "norms", "M", "z", "open keys", "open values"),
        (read, norms, *state),
        (ref_read, ref_norms, *ref_state),
    ):
        close(a, b, seed, f"empty start {name}")


@pytest.mark.parametrize("impl", ["reference", "triton"])
@pytest.mark.parametrize("rule", ["linear", "delta"])
def test_a_stream_cut_anywhere_gives_the_one_call_result(seed, impl, rule):
    B, H, T, D, S = 1, 2, 17, 4, 5
    sq, sk, v = F.elu(torch.randn(B, H, T, D)) + 1, F.elu(torch.randn(B, H, T, D)) + 1, torch.randn(B, H, T, D)
    M, z = torch.zeros(B, H, D, D), torch.zeros(B, H, D)
    start = (M, z, *empty_open_segment(M))
    (whole_read, whole_norms), whole_state = dispatch.infini_memory(sq, sk, v, start, S, rule, impl=impl)
    cuts = sorted(torch.randperm(T - 1)[:3].add(1).tolist())
    state, reads, norms = start, [], []
    for a, b in zip([0, *cuts], [*cuts, T]):
        (read, norm), state = dispatch.infini_memory(
            sq[:, :, a:b], sk[:, :, a:b], v[:, :, a:b], state, S, rule, impl=impl
        )
        reads.append(read)
        norms.append(norm)
    close(torch.cat(reads, 2), whole_read, seed, f"read, cut at {cuts}")
    close(torch.cat(norms, 2), whole_norms, seed, f"norms, cut at {cuts}")
    for name, a, b in zip(("M", "z", "open keys", "open values"), state, whole_state):
        close(a, b, seed, f"{name}, cut at {cuts}")
    assert whole_state[2].shape[2] == T % S, "the last partial segment waits in the state"
