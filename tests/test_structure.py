"""The layers of the code base: imports point down (kernels -> memviz -> probes -> training -> app,
benchmarks) with no circles, and only a family's own file names a family."""

from __future__ import annotations

import ast
import inspect
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

import memviz
from memviz.registry import FAMILIES

ROOT = Path(__file__).resolve().parent.parent
#: each top-level package and the first-party packages it may import
#: each top-level package, by its import name, and the first-party packages it may import
ALLOWED = {
    "memviz_kernels": {"memviz_kernels"},
    "memviz": {"memviz_kernels", "memviz"},
    "memviz_probes": {"memviz_kernels", "memviz", "memviz_probes"},
    "training": {"memviz_kernels", "memviz", "memviz_probes", "training"},
    "app": {"memviz_kernels", "memviz", "memviz_probes", "training", "app"},
    "benchmarks": {"memviz_kernels", "memviz", "memviz_probes", "training", "app", "benchmarks"},
    # written against the public API, like a user's package
    "memviz_families": {"memviz_kernels", "memviz", "memviz_probes", "memviz_families"},
}
#: the folders that install under another name (setup.py), as the links in .names/ say
FOLDERS = {link.name: link.resolve().name for link in (ROOT / ".names").iterdir()}


def module_files() -> dict[str, Path]:
    found = {}
    for package in ALLOWED:
        folder = ROOT / FOLDERS.get(package, package)
        for path in folder.rglob("*.py"):
            parts = [package, *path.relative_to(folder).with_suffix("").parts]
            if parts[-1] == "__init__":
                parts.pop()
            found[".".join(parts)] = path
    return found


def imports_of(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """First-party modules `name` imports anywhere in its file (function-level imports too);
    `from a import b` counts as importing a.b where that is a module, else a."""
    package = name.split(".") if path.name == "__init__.py" else name.split(".")[:-1]
    targets = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            targets.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            subs = [f"{base}.{alias.name}" for alias in node.names]
            targets.update(sub for sub in subs if sub in modules)
            if any(sub not in modules for sub in subs):
                targets.add(base)
    resolved = set()
    for target in targets:
        while target and target not in modules:
            target = target.rpartition(".")[0]
        if target and target != name:
            resolved.add(target)
    return resolved


def import_graph() -> dict[str, set[str]]:
    modules = module_files()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_the_checker_sees_a_circle_and_an_upward_import():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    modules = {"memviz.x": Path("x.py"), "memviz_probes.passkey": Path("p.py"), "memviz_probes": Path("__init__.py")}
    source = ROOT / "memviz" / "checkpoint.py"
    assert imports_of("memviz.checkpoint", source, {**modules, **module_files()}) >= {"memviz.config", "memviz.models"}


def test_imports_point_down_with_no_circles():
    graph = import_graph()
    assert cycles(graph) == [], "import circles"
    upward = sorted(
        f"{name} imports {target}"
        for name, targets in graph.items()
        for target in targets
        if target.split(".")[0] not in ALLOWED[name.split(".")[0]]
    )
    assert upward == []


def string_constants(path: Path) -> list[tuple[int, str]]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    docstrings = {
        id(node.body[0].value)
        for node in ast.walk(tree)
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.ClassDef, ast.AsyncFunctionDef))
        and node.body
        and isinstance(node.body[0], ast.Expr)
        and isinstance(node.body[0].value, ast.Constant)
    }
    return [
        (node.lineno, node.value)
        for node in ast.walk(tree)
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docstrings
    ]


def test_only_a_familys_own_file_names_a_family():
    names = set(FAMILIES)
    own = {Path(inspect.getsourcefile(family.model)).resolve() for family in FAMILIES.values()}  # where each registers
    outside = [
        path
        for package in ("memviz", "probes", "training", "app")
        for path in (ROOT / package).rglob("*.py")
        if "models" not in path.relative_to(ROOT).parts and path.resolve() not in own
    ]
    named = [
        f"{path.relative_to(ROOT)}:{line} {value!r}"
        for path in outside
        for line, value in string_constants(path)
        if value in names
    ]
    assert named == []


#: memviz's family machinery, where a model's class and attributes may be looked at directly
FAMILY_MACHINERY = ("memviz/model.py", "memviz/registry.py", "memviz/models/", "memviz/layers.py")


def capability_guesses(source: str) -> list[str]:
    """Where code asks a model what it can do instead of asking the registry: `hasattr(model…, …)`,
    `getattr(model…, name, default)`, and a comparison of a class's attribute (`type(model).f is …`)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            subject = ast.unparse(node.args[0])
            guessing = node.func.id == "hasattr" or (node.func.id == "getattr" and len(node.args) == 3)
            if guessing and "model" in subject:
                found.append(f"{node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Compare) and any(
            isinstance(side, ast.Attribute)
            and isinstance(side.value, ast.Call)
            and isinstance(side.value.func, ast.Name)
            and side.value.func.id == "type"
            for side in (node.left, *node.comparators)
        ):
            found.append(f"{node.lineno}: {ast.unparse(node)}")
    return found


def test_the_capability_checker_sees_each_kind_of_guess():
    planted = (
        "if hasattr(self.model, 'backbone_prefill'): pass\n"
        "span = getattr(model.options, 'bank_size', None)\n"
        "if type(model).memory_readout is MemoryLM.memory_readout: pass\n"
        "ok = getattr(model.options, declared) and hasattr(values, '__iter__')\n"
    )
    assert [line.split(":")[0] for line in capability_guesses(planted)] == ["1", "2", "3"]


def test_the_app_training_and_probes_ask_the_registry_what_a_model_can_do():
    outside = [
        path
        for package in ("memviz", "probes", "training", "app", "benchmarks")
        for path in sorted((ROOT / package).rglob("*.py"))
        if not str(path.relative_to(ROOT)).startswith(FAMILY_MACHINERY)
    ]
    guesses = [
        f"{path.relative_to(ROOT)}:{guess}" for path in outside for guess in capability_guesses(path.read_text())
    ]
    assert guesses == [], "declare the capability on the family's registration (memviz.registry.Family) instead"


def test_python_m_memviz_families_lists_each_familys_unit():
    out = subprocess.run(
        [sys.executable, "-m", "memviz", "families"], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    # a family not built from a config (a released model's) registers when its first checkpoint loads, so a fresh
    # process need not list it; every family it lists is listed whole
    for family in memviz.families():
        if not family.from_config and f"\n{family.name} (" not in "\n" + out.stdout:
            continue
        assert f"\n{family.name} ({family.role}): " in "\n" + out.stdout
        for hook in family.hooks:
            assert f"hook       {hook}" in out.stdout
        for point in family.interventions:
            assert f"intervene  {point}:" in out.stdout
    assert "figures    memviz.models.lm2.lm2_figures" in out.stdout
    assert "read at    memviz.models.longmem.longmem_read_at" in out.stdout


@pytest.mark.parametrize("bad", [[], ["nonsense"]])
def test_python_m_memviz_needs_a_known_command(bad):
    out = subprocess.run([sys.executable, "-m", "memviz", *bad], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "families" in out.stderr


def test_the_install_adds_no_generic_top_level_name(tmp_path):
    """Outside the repository the folders' own names (`kernels`, `probes`, `families`, `training`) are not memviz's:
    kernels/, probes/ and families/ are the installed `memviz_kernels`, `memviz_probes`, `memviz_families`, and the
    families come in through the entry point."""
    probe = (
        "import importlib.util, json, memviz\n"
        "names = ('kernels', 'probes', 'families', 'training')\n"
        "specs = [importlib.util.find_spec(n) for n in names]\n"
        "print(json.dumps([None if s is None else [s.origin, *(s.submodule_search_locations or [])] for s in specs]"
        " + [importlib.util.find_spec(n).submodule_search_locations[0]"
        " for n in ('memviz_kernels', 'memviz_probes', 'memviz_families')]"
        " + ['gated_deltanet' in [f.name for f in memviz.families()]]))"
    )
    out = subprocess.run([sys.executable, "-c", probe], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    *elsewhere, kernels, probes, families, registered = json.loads(out.stdout)
    names = ("kernels", "probes", "families", "training")
    assert not any(
        place and Path(place).is_relative_to(ROOT / name)
        for name, places in zip(names, elsewhere)
        for place in places or ()
    )
    assert [kernels, probes, families] == [str(ROOT / "kernels"), str(ROOT / "probes"), str(ROOT / "families")]
    assert registered


def test_pytest_imports_the_folders_tests_by_their_installed_names(pytestconfig):
    """pytest collects kernels/ and families/ (the root conftest.py) under the names they install as, so each module
    is executed once, a family registers once, and no module takes the name `kernels` from Hugging Face's."""
    import memviz_families.gated_deltanet

    assert FAMILIES["gated_deltanet"].model is memviz_families.gated_deltanet.GatedDeltaNetLM
    misnamed = []
    for name, module in list(sys.modules.items()):
        try:
            places = [getattr(module, "__file__", None), *getattr(module, "__path__", ())]
        except TypeError:  # a lazy module's __path__ that is no list of folders
            places = [getattr(module, "__file__", None)]
        for installed, folder in FOLDERS.items():
            inside = any(isinstance(p, str) and Path(p).resolve().is_relative_to(ROOT / folder) for p in places)
            if inside and name.split(".")[0] != installed:
                misnamed.append(name)
    assert misnamed == []
    named = pytestconfig.pluginmanager.get_plugin(str(ROOT / "conftest.py")).installed_name
    assert named(ROOT / "kernels" / "lm2" / "test_lm2_scan.py") == "memviz_kernels.lm2.test_lm2_scan"
    assert named(ROOT / "tests" / "test_structure.py") is None


def test_no_first_party_code_imports_a_folder_by_its_own_name():
    """`kernels`, `probes` and `families` are the folders; their modules are `memviz_kernels`, `memviz_probes` and
    `memviz_families` (from the root, `import probes.passkey` would still find the folder, a second copy)."""
    folders = set(FOLDERS.values())
    found = []
    for path in [*module_files().values(), *ROOT.glob("tests/*.py"), *ROOT.glob("*.py")]:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and not node.level:
                names = [node.module or ""]
            found += [f"{path.relative_to(ROOT)}:{node.lineno} {n}" for n in names if n.split(".")[0] in folders]
    assert found == []


#: the one home of the delta rule's recurrence, chunked form and read-out (DESIGN.md: the linear-memory operator)
LINEAR_MEMORY = ROOT / "kernels" / "linear_memory"


def is_range(node: ast.expr) -> bool:
    return isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == "range"


def delta_rule_math(source: str) -> list[str]:
    """Functions that compute a delta rule themselves: a linear solve or an inverse (the chunked form), or a loop
    over token positions that indexes a write strength `beta` by its position (the recurrence, or the read-out's
    back-recurrence). A heuristic: what it does not see, review does."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.FunctionDef):
            continue
        solves = any(
            isinstance(n, ast.Attribute) and n.attr in ("solve_triangular", "solve", "inv", "inverse")
            for n in ast.walk(node)
        )
        stepping = any(
            isinstance(sub, ast.Subscript)
            and "beta" in ast.unparse(sub.value)
            and loop.target.id in {n.id for n in ast.walk(sub.slice) if isinstance(n, ast.Name)}
            for loop in ast.walk(node)
            if isinstance(loop, ast.For) and isinstance(loop.target, ast.Name) and is_range(loop.iter)
            for sub in ast.walk(loop)
        )
        if solves or stepping:
            found.append(f"{node.lineno}: {node.name}")
    return found


def test_the_delta_rule_checker_sees_a_copy():
    planted = (
        "def chunk(system, rhs):\n    return torch.linalg.solve_triangular(system, rhs, upper=False)\n"
        "def inverted(system, rhs):\n    return torch.linalg.inv(system) @ rhs\n"
        "def back(r, k, beta):\n    for j in range(9, -1, -1):\n        r = r - beta[j] * (r @ k[j]) * k[j]\n"
        "def fine(beta):\n    return beta.sigmoid()\n"
        "def shown(beta, positions):\n    for t in positions:\n        print(beta[: t + 1])\n"
    )
    assert delta_rule_math(planted) == ["1: chunk", "3: inverted", "5: back"]


def test_the_delta_rule_is_computed_in_one_place():
    """The gated delta rule's recurrence, chunked form and read-out live in kernels/linear_memory; every model
    (memviz's own, the families', the released adapters') calls the operator. Tests may recompute it."""
    copies = [
        f"{path.relative_to(ROOT)}:{where}"
        for path in module_files().values()
        if LINEAR_MEMORY not in path.parents and not path.name.startswith("test_")
        for where in delta_rule_math(path.read_text())
    ]
    assert not copies, f"the delta rule computed outside kernels/linear_memory: {copies}"


def test_memviz_load_asks_the_registry_which_family_opens_a_folder():
    """checkpoint.py opens another library's folder through the family whose loader claims its model_type
    (`memviz.registry.folder_family`): it imports no family's folder."""
    folders = {p.name for p in (ROOT / "memviz" / "models").iterdir() if (p / "__init__.py").is_file()}
    tree = ast.parse((ROOT / "memviz" / "checkpoint.py").read_text())
    imported = [
        f"{node.module}.{alias.name}" if isinstance(node, ast.ImportFrom) else alias.name
        for node in ast.walk(tree)
        if isinstance(node, (ast.Import, ast.ImportFrom))
        for alias in node.names
    ]
    named = [name for name in imported if any(f"memviz.models.{folder}" in name for folder in folders)]
    assert folders and named == [], named
    assert "folder_family" in {n.id for n in ast.walk(tree) if isinstance(n, ast.Name)}


#: words that name a ticket or a kind of case in a test file's name, where the module it tests belongs
TICKET_WORDS = ("reliability", "bad_input", "regression", "issue")


def test_every_test_file_is_named_after_the_code_it_tests():
    """A test lives in the file of the module it tests (tests/test_trace.py, kernels/lm2/test_lm2_scan.py): a file
    named after a ticket ("test_reliability.py", "Issue 48's cases") gathers every module's tests and hides which
    module breaks."""
    files = [*ROOT.glob("tests/*.py"), *(path for path in module_files().values() if path.name.startswith("test_"))]
    named = sorted(
        str(path.relative_to(ROOT))
        for path in files
        if any(word in path.stem.lower() for word in TICKET_WORDS)
        or re.search(r"(?i)\bissue \d+", ast.get_docstring(ast.parse(path.read_text(encoding="utf-8"))) or "")
    )
    assert named == [], "name each test file after the module it tests and say so in its docstring"
