"""The kernels' own tests (kernels/<op>/test_*.py) run the Triton kernels in the interpreter on
the CPU, on small odd shapes, against their references in float64. With MEMVIZ_TEST_DEVICE=cuda
(`benchmarks/gpu.py` sets it) every tensor they make is a CUDA tensor and the kernels compile for
the GPU; the compiled CPU kernel's tests are skipped there."""

import os

from kernels.testing import DEVICE  # noqa: E402

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from kernels.testing import poisoned_buffers, seed  # noqa: E402,F401  (fixtures)

torch.set_num_threads(2)
if DEVICE != "cpu":
    torch.set_default_device(DEVICE)
