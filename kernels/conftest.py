"""The kernels' own tests (kernels/<op>/test_*.py) run the Triton kernels in the interpreter on
the CPU, on small odd shapes, against their references in float64."""
import os

os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported

import torch  # noqa: E402

from kernels.testing import poisoned_buffers, seed  # noqa: E402,F401  (fixtures)

torch.set_num_threads(2)
