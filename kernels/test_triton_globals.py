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
import triton
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
    local = {a.arg for a in fn.args.posonlyargs + fn.args.args + fn.args.kwonlyargs} | {
        n.id for n in names if isinstance(n.ctx, ast.Store)
    }
    return {n.id for n in names if isinstance(n.ctx, ast.Load)} - local


def offending_globals(tree: ast.Module, namespace: dict) -> dict[str, str]:
    """{"kernel.name": repr(value)} for each global a kernel in `tree` reads that CUDA's compiler refuses:
    anything but a tl.constexpr, a module, a builtin or another kernel of the same file."""
    kernels = jit_functions(tree)
    kernel_names = {fn.name for fn in kernels}
    found = {}
    for fn in kernels:
        for name in sorted(globals_read(fn) - kernel_names):
            if name not in namespace and hasattr(builtins, name):
                continue
            value = namespace[name]
            if not isinstance(value, (tl.constexpr, types.ModuleType)):
                found[f"{fn.name}.{name}"] = repr(value)
    return found


@pytest.mark.parametrize("path", KERNEL_MODULES, ids=lambda p: p.parent.name)
def test_kernels_read_only_constexpr_globals(path):
    tree = ast.parse(path.read_text())
    assert jit_functions(tree), f"{path} defines no @triton.jit function"
    module = importlib.import_module(f"memviz_kernels.{path.parent.name}.triton")
    assert offending_globals(tree, vars(module)) == {}, f"{path}: make these tl.constexpr"


SNIPPET = """
import triton
import triton.language as tl

@triton.jit
def helper(x):
    return x

@triton.jit
def kernel(x_ptr, N, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    acc = tl.zeros([BLOCK], tl.float32)
    for i in range(0, N):
        a, b = i, i + 1
        acc += helper(tl.load(x_ptr + offs)) * min(a, b) + float("-inf") + EPS
    return acc
"""


def test_the_check_flags_a_plain_float_and_nothing_else():
    tree = ast.parse(SNIPPET)
    assert offending_globals(tree, {"tl": tl, "triton": triton, "EPS": 1e-6}) == {"kernel.EPS": "1e-06"}
    assert offending_globals(tree, {"tl": tl, "triton": triton, "EPS": tl.constexpr(1e-6)}) == {}
