"""The dispatcher: models call it, it picks a path, and a bad choice is a clear error."""
import pytest
import torch

from kernels import dispatch


def test_reference_is_taken_on_cpu_and_bad_modes_are_rejected(monkeypatch):
    q = torch.randn(1, 3, 4)
    args = (q, torch.rand(1, 3, 4), torch.randn(1, 2, 4), torch.randn(4, 4), torch.randn(4, 4), torch.randn(4))
    for a, b in zip(dispatch.lm2_scan(*args), dispatch.lm2_scan_reference(*args)):
        assert torch.equal(a, b)
    with pytest.raises(ValueError, match="kernel implementation must be one of"):
        dispatch.lm2_scan(*args, impl="cuda")
    monkeypatch.setenv("MEMVIZ_KERNELS", "triton")
    with pytest.raises(NotImplementedError, match="no Triton kernel for lm2_scan"):
        dispatch.lm2_scan(*args)
