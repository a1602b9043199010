"""What the interpreter lets by but CUDA's compiler refuses: a Triton kernel may read a module-level
name only when it is a `tl.constexpr`, another kernel function or a module (the first GPU run found the
Infini kernel reading a plain float, EPS, and failing to compile)."""

from __future__ import annotations

import ast
import builtins
import importlib
import types
from pathlib import Path

import pytest
import triton.language as tl

KERNEL_MODULES = sorted(Path(__file__).parent.glob("*/triton.py"))


def jit_functions(tree: ast.Module) -> list[ast.FunctionDef]:
    def is_jit(decorator: ast.expr) -> bool:
        target = decorator.func if isinstance(decorator, ast.Call) else decorator
        return isinstance(target, ast.Attribute) and target.attr == "jit"

    return [node for node in tree.body if isinstance(node, ast.FunctionDef) and any(map(is_jit, node.decorator_list))]


def globals_read(fn: ast.FunctionDef) -> set[str]:
    """Names a function's body loads that are neither its parameters nor assigned in it."""
    names = [node for statement in fn.body for node in ast.walk(statement) if isinstance(node, ast.Name)]
    local = {a.arg for a in fn.args.args} | {n.id for n in names if isinstance(n.ctx, ast.Store)}
    return {n.id for n in names if isinstance(n.ctx, ast.Load)} - local


@pytest.mark.parametrize("path", KERNEL_MODULES, ids=lambda p: p.parent.name)
def test_kernels_read_only_constexpr_globals(path):
    tree = ast.parse(path.read_text())
    kernels = jit_functions(tree)
    assert kernels, f"{path} defines no @triton.jit function"
    module = importlib.import_module(f"kernels.{path.parent.name}.triton")
    kernel_names = {fn.name for fn in kernels}
    for fn in kernels:
        for name in sorted(globals_read(fn)):
            if name in kernel_names or hasattr(builtins, name):
                continue
            value = getattr(module, name)
            assert isinstance(value, (tl.constexpr, types.ModuleType)), (
                f"{path}: kernel {fn.name} reads the global {name} = {value!r}, which CUDA's compiler refuses; "
                f"make it a tl.constexpr"
            )


def test_the_check_catches_a_plain_float():
    tree = ast.parse("import triton\nEPS = 1e-6\n@triton.jit\ndef k(x):\n    y = x + EPS\n    return y\n")
    (fn,) = jit_functions(tree)
    assert globals_read(fn) == {"EPS"}
