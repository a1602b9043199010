"""pytest imports the tests inside kernels/, probes/ and families/ under the names those folders install as
(`memviz_kernels`, `memviz_probes`, `memviz_families`; setup.py), never under the folder's own name: `kernels` and
`probes` are other distributions' packages (Hugging Face's `kernels`, which transformers imports), and a module
executed under two names would register its family twice.

The kernels' tests run the Triton kernels in the interpreter on the CPU; with MEMVIZ_TEST_DEVICE=cuda
(`benchmarks/gpu.py` sets it) every tensor they make is a CUDA tensor and the kernels compile for the GPU."""

from __future__ import annotations

import importlib
import os
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent
#: each folder whose package installs under another name, and that name: the links in .names/ (setup.py's FOLDERS,
#: which tests/test_install.py checks against them)
INSTALLED = {link.resolve().name: link.name for link in (ROOT / ".names").iterdir()}
DEVICE = os.environ.get("MEMVIZ_TEST_DEVICE", "cpu")  # memviz_kernels.testing reads the same variable

if DEVICE == "cpu":
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
else:
    import torch

    torch.set_default_device(DEVICE)


pytest_plugins = ("memviz_kernels.testing",)  # the kernel tests' fixtures: seed, poisoned_buffers


def installed_name(path: Path) -> str | None:
    """`kernels/lm2/test_lm2_scan.py` -> `memviz_kernels.lm2.test_lm2_scan`; None outside those folders."""
    try:
        parts = list(path.resolve().relative_to(ROOT).with_suffix("").parts)
    except ValueError:
        return None
    if not parts or parts[0] not in INSTALLED:
        return None
    return ".".join([INSTALLED[parts[0]], *parts[1:]])


class InstalledModule(pytest.Module):
    """A test file imported by its installed module name (the editable install maps it to this very file)."""

    def _getobj(self):
        name = installed_name(self.path)
        try:
            module = importlib.import_module(name)
        except ImportError as error:
            raise self.CollectError(f"{self.path}: importing it as {name} failed: {error!r}") from error
        if Path(module.__file__).resolve() != self.path.resolve():
            raise self.CollectError(f"{name} is {module.__file__}, not {self.path}: is memviz installed from here?")
        self.config.pluginmanager.consider_module(module)  # its pytest_plugins, as pytest's own import does
        return module


def pytest_collect_directory(path: Path, parent: pytest.Collector) -> pytest.Collector | None:
    """A plain directory, not a `Package`: a Package imports its `__init__.py` by the folder's own name."""
    if installed_name(path) is not None:
        return pytest.Dir.from_parent(parent, path=path)
    return None


def pytest_pycollect_makemodule(module_path: Path, parent: pytest.Collector) -> pytest.Module | None:
    if installed_name(module_path) is not None:
        return InstalledModule.from_parent(parent, path=module_path)
    return None
