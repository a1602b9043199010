"""Titans' memory ops: the Triton kernel against the reference, and the chunk update's state
convention against the token-by-token recurrence it closes."""

import pytest
import torch
import torch.nn.functional as F

from memviz_kernels import dispatch
from memviz_kernels.testing import close
from memviz_kernels.titans.reference import titans_linear_reference

pytestmark = pytest.mark.usefixtures("poisoned_buffers")  # memviz_kernels.testing


@pytest.mark.parametrize("T,chunk", [(19, 5), (10, 5), (3, 4)])
def test_titans_linear_kernel_matches_the_reference(seed, T, chunk):
    B, D = 2, 6
    q, k = F.normalize(torch.randn(B, T, D), dim=-1), F.normalize(torch.randn(B, T, D), dim=-1)
    inputs, state = (
        [q, k, torch.randn(B, T, D), torch.rand(B, T, 3)],
        (torch.randn(B, D, D) * 0.3, torch.randn(B, D, D) * 0.1),
    )
    with torch.no_grad():
        outputs, (W, S) = dispatch.titans_linear_memory(*inputs, state, chunk, impl="triton")
    ref = titans_linear_reference(*(x.double() for x in (*inputs, *state)), chunk)
    for name, a, b in zip(("read", "surprise", "loss", "loss_after", "W", "S"), (*outputs, W, S), ref):
        close(a, b, seed, f"titans {name}")


def test_the_chunk_update_is_the_token_recurrence(seed):
    """Eqs. 10 and 13 token by token, every gradient at the chunk-start weights:
    S_t = eta_t S_t-1 - theta_t g_t, M_t = (1 - alpha_t) M_t-1 + S_t."""
    B, b, m, n = 2, 5, 3, 4
    params, momentum = (
        {"W": torch.randn(B, m, n, dtype=torch.float64)},
        {"W": torch.randn(B, m, n, dtype=torch.float64)},
    )
    a, g, rates = (
        torch.randn(B, b, m, dtype=torch.float64),
        torch.randn(B, b, n, dtype=torch.float64),
        torch.rand(B, b, 3, dtype=torch.float64),
    )
    outputs, (new_params, new_momentum) = dispatch.titans_chunk_update(
        {"W": (a, g)}, dispatch.titans_chunk_coefficients(rates), (params, momentum)
    )
    M, S = params["W"], momentum["W"]
    for t in range(b):
        grad = a[:, t, :, None] * g[:, t, None, :]
        S = rates[:, t, 0, None, None] * S - rates[:, t, 1, None, None] * grad
        M = (1 - rates[:, t, 2, None, None]) * M + S
    assert outputs == ()
    close(new_params["W"], M, seed, "M after the chunk")
    close(new_momentum["W"], S, seed, "S after the chunk")


def test_chunk_coefficients_of_many_chunks_are_each_chunks(seed):
    """Formed for a stack of chunks in one call, the coefficients are those of each chunk alone."""
    rates = torch.rand(3, 4, 7, 3, dtype=torch.float64)  # [batch, chunk, token, (eta, theta, alpha)]
    together = dispatch.titans_chunk_coefficients(rates)
    for j in range(rates.shape[1]):
        alone = dispatch.titans_chunk_coefficients(rates[:, j])
        for name, a, b in zip(("write M", "write S", "keep", "carry", "decay"), together, alone):
            close(a[:, j], b, seed, f"chunk {j}: {name}")
