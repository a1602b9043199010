"""LM2 bank scan as a compiled CPU loop (kernels/lm2/cpu.c), forward only.

The scan is sequential over tokens, and in eager PyTorch each token costs about eleven small
op dispatches; the C loop does the same O(N d + d^2) arithmetic a token with no dispatch. The
library is compiled on first use with the system C compiler (`$CC`, else `cc`) into a cache
folder (`$MEMVIZ_CACHE`, else ~/.cache/memviz) keyed by the source's hash, and loaded with
ctypes; `available()` says whether that worked, so callers can fall back to the reference.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch
from torch import Tensor

from kernels.lm2.reference import ScanResult, finish_scan, read_weights

SOURCE = Path(__file__).with_suffix(".c")
FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c99"]
FUNCTIONS = {torch.float32: "lm2_scan_f32", torch.float64: "lm2_scan_f64"}


class NativeKernelError(RuntimeError):
    """The C kernel could not be built or loaded."""


def cache_dir() -> Path:
    return Path(os.environ.get("MEMVIZ_CACHE") or Path.home() / ".cache" / "memviz")


def cpu_name() -> str:
    """The processor model: -march=native builds differ between CPUs sharing one cache folder."""
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.is_file():
        for line in cpuinfo.read_text(errors="replace").splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    return platform.machine() + platform.processor()


@functools.cache
def library() -> ctypes.CDLL:
    """Compile (once per source version and machine) and load the shared library."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise NativeKernelError("the LM2 CPU kernel needs a C compiler (set $CC or install cc); "
                                "use MEMVIZ_KERNELS=reference to run the PyTorch reference instead")
    digest = hashlib.sha256(SOURCE.read_bytes() + " ".join(FLAGS + [cpu_name()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"lm2_scan_cpu-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            result = subprocess.run([compiler, *FLAGS, str(SOURCE), "-o", str(built), "-lm"], capture_output=True, text=True)
            if result.returncode != 0:
                raise NativeKernelError(f"compiling {SOURCE.name} failed:\n{result.stderr.strip()}")
            os.replace(built, target)  # atomic: a concurrent build never leaves half a library
    lib = ctypes.CDLL(str(target))
    for name in FUNCTIONS.values():
        getattr(lib, name).restype = ctypes.c_int
    return lib


@functools.cache
def available() -> bool:
    try:
        library()
    except (NativeKernelError, OSError):
        return False
    return True


def supports(q_slot: Tensor) -> bool:
    return q_slot.device.type == "cpu" and q_slot.dtype in FUNCTIONS


def lm2_scan(q_slot: Tensor, g_in: Tensor, M0: Tensor, W_V: Tensor, W_f: Tensor, b_f: Tensor) -> ScanResult:
    """The same contract as kernels.lm2.reference.lm2_scan_reference, with no autograd."""
    if not supports(q_slot):
        raise ValueError(f"the LM2 CPU kernel takes float32 or float64 CPU tensors, got {q_slot.dtype} on {q_slot.device}")
    B, T, d = q_slot.shape
    N = M0.shape[1]
    dtype = q_slot.dtype
    inputs = [x.detach().to(dtype).contiguous() for x in (q_slot, g_in, M0, read_weights(W_V, W_f), b_f)]
    attn = torch.empty(B, T, N, dtype=dtype)
    reads, forgets, decays, commons = (torch.empty(B, T, d, dtype=dtype) for _ in range(4))
    D_last, c_last = torch.empty(B, d, dtype=dtype), torch.empty(B, d, dtype=dtype)
    outputs = [attn, reads, forgets, decays, commons, D_last, c_last]
    status = getattr(library(), FUNCTIONS[dtype])(
        ctypes.c_long(B), ctypes.c_long(T), ctypes.c_long(N), ctypes.c_long(d),
        *(ctypes.c_void_p(t.data_ptr()) for t in inputs + outputs),
    )
    if status != 0:
        raise MemoryError("the LM2 CPU kernel could not allocate its work buffer")
    return finish_scan(inputs[2], *outputs)
