"""Compiled CPU kernels: one C file per op, built on first use and loaded with ctypes.

The library is compiled with the system C compiler (`$CC`, else `cc`) into a cache folder
(`$MEMVIZ_CACHE`, else ~/.cache/memviz) keyed by the source's hash, the flags and the processor.
Plain C through ctypes rather than `torch.utils.cpp_extension`: these loops touch no torch API,
and a C file compiles in about a second where an extension that includes torch's headers takes
about a minute (on every fresh clone, the test suite's included); a kernel's module says
`available()` so that callers fall back to the PyTorch reference where no compiler exists.
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
from collections.abc import Callable, Iterable
from pathlib import Path

import torch
from torch import Tensor

FLAGS = ["-O3", "-march=native", "-shared", "-fPIC", "-std=c99"]
#: with OpenMP where the compiler has it: the kernels' parallel regions then run on the OpenMP
#: runtime torch has already loaded (the same libgomp.so.1), not on a second pool of threads that
#: would spin against torch's between ops
OPENMP = ["-fopenmp"]


class NativeKernelError(RuntimeError):
    """A C kernel could not be built or loaded."""


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


def build(source: Path, what: str) -> ctypes.CDLL:
    """Compile `source` (once per source version and machine) and load it; `what` names the
    kernel in errors. Every exported function returns int (0 on success)."""
    compiler = shutil.which(os.environ.get("CC", "cc"))
    if compiler is None:
        raise NativeKernelError(
            f"the {what} CPU kernel needs a C compiler (set $CC or install cc); "
            "use MEMVIZ_KERNELS=reference to run the PyTorch reference instead"
        )
    digest = hashlib.sha256(source.read_bytes() + " ".join(FLAGS + OPENMP + [cpu_name()]).encode()).hexdigest()[:16]
    target = cache_dir() / f"{source.parent.name}_{source.stem}-{digest}.so"
    if not target.exists():
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=target.parent) as tmp:
            built = Path(tmp) / target.name
            for flags in (FLAGS + OPENMP, FLAGS):  # without OpenMP the kernels run on one thread
                result = subprocess.run(
                    [compiler, *flags, str(source), "-o", str(built), "-lm"], capture_output=True, text=True
                )
                if result.returncode == 0:
                    break
            else:
                raise NativeKernelError(f"compiling {source.name} failed:\n{result.stderr.strip()}")
            os.replace(built, target)  # atomic: a concurrent build never leaves half a library
    return ctypes.CDLL(str(target))


def loader(source: Path, what: str, functions: Iterable[str]) -> tuple[Callable[[], ctypes.CDLL], Callable[[], bool]]:
    """(library, available) for one C file: `library()` builds and loads it once (its `functions`
    return int), `available()` says whether that works on this machine."""
    functions = tuple(functions)

    @functools.cache
    def library() -> ctypes.CDLL:
        lib = build(source, what)
        for name in functions:
            getattr(lib, name).restype = ctypes.c_int
        return lib

    @functools.cache
    def available() -> bool:
        try:
            library()
        except (NativeKernelError, OSError):
            return False
        return True

    return library, available


def supports(tensor: Tensor) -> bool:
    """The C kernels take float32 and float64 CPU tensors."""
    return tensor.device.type == "cpu" and tensor.dtype in (torch.float32, torch.float64)


def pointers(tensors: Iterable[Tensor]) -> list[ctypes.c_void_p]:
    return [ctypes.c_void_p(t.data_ptr()) for t in tensors]
