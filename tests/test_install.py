"""The installed package: its wheel installs only memviz's own names, and installed in a fresh virtual environment it
works from a folder outside the repository beside Hugging Face's `kernels` (which transformers imports)."""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
import sys
import sysconfig
import zipfile
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name

from memviz.models.released.tiny import tiny_checkpoint
from tests.test_structure import FOLDERS

ROOT = Path(__file__).resolve().parent.parent
#: what the wheel is built from (pyproject.toml and setup.py name nothing else)
SOURCES = ("pyproject.toml", "setup.py", "memviz", "kernels", "probes", "families")
#: names other projects on PyPI install, whether or not they are installed here
TAKEN = {"kernels", "probes"}


def leave_out(folder: str, names: list[str]) -> list[str]:
    """Caches and the families' sample checkpoints (weights that the wheel does not ship)."""
    return [n for n in names if n == "__pycache__" or (n.startswith("sample") and Path(folder, n).is_dir())]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """memviz's wheel, built from a copy of its sources (a build in place would leave build/ in the repository)."""
    source, out = tmp_path_factory.mktemp("source"), tmp_path_factory.mktemp("wheel")
    for name in SOURCES:
        if (ROOT / name).is_dir():
            shutil.copytree(ROOT / name, source / name, ignore=leave_out)
        else:
            shutil.copy2(ROOT / name, source / name)
    pip = [sys.executable, "-m", "pip", "wheel", "-q", "--no-deps", "--no-build-isolation", "-w", str(out), str(source)]
    done = subprocess.run(pip, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    (built,) = out.glob("*.whl")
    return built


def top_level_names(wheel: Path) -> set[str]:
    """The importable names a wheel puts in site-packages (its packages and modules, not its metadata)."""
    with zipfile.ZipFile(wheel) as archive:
        firsts = {name.split("/")[0] for name in archive.namelist()}
    return {name.removesuffix(".py") for name in firsts if not name.endswith((".dist-info", ".data"))}


def test_the_wheel_installs_every_module_under_memviz_s_own_names(wheel):
    """The folders' files under the names .names/ links to them (setup.py's package_dir), the C kernels' sources too."""
    folders = {"memviz": "memviz", **FOLDERS}
    tree = {
        f"{name}/{path.relative_to(ROOT / folder)}"
        for name, folder in folders.items()
        for path in (ROOT / folder).rglob("*")
        if path.suffix in (".py", ".c")
        and "__pycache__" not in path.parts
        and not any(part.startswith("sample") for part in path.relative_to(ROOT / folder).parent.parts)
    }
    with zipfile.ZipFile(wheel) as archive:
        shipped = {name for name in archive.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert shipped == tree
    assert {"memviz_kernels/lm2/cpu.c", "memviz_kernels/product_keys/cpu.c"} <= shipped


def test_the_wheel_installs_no_name_another_distribution_installs(wheel):
    names = top_level_names(wheel)
    assert names == {"memviz", "memviz_kernels", "memviz_probes", "memviz_families"}
    ours = importlib.metadata.distribution("memviz-workbench").metadata["Name"]
    others = {
        name: sorted(set(dists) - {ours})
        for name, dists in importlib.metadata.packages_distributions().items()
        if name in names and set(dists) - {ours}
    }
    assert others == {}, "the wheel installs names another installed distribution installs too"
    assert names.isdisjoint(TAKEN)


def test_the_distribution_is_not_named_like_another_project():
    """The name memviz on PyPI is another project (a C++ memory visualiser); memviz installs as memviz-workbench."""
    assert importlib.metadata.distribution("memviz-workbench").metadata["Name"] == "memviz-workbench"
    with pytest.raises(importlib.metadata.PackageNotFoundError):
        importlib.metadata.distribution("memviz")


def test_no_folder_at_the_root_is_a_package_another_distribution_installs():
    """From the repository's root (its folder on sys.path: pytest, `python -m`, the app) a folder holding an
    `__init__.py` shadows an installed package of the same name, as kernels/ once shadowed Hugging Face's."""
    packages = {path.parent.name for path in ROOT.glob("*/__init__.py")}
    installed = importlib.metadata.packages_distributions()
    ours = {"memviz-workbench"}
    clashes = {name: installed[name] for name in packages if set(installed.get(name, ())) - ours}
    assert clashes == {}
    assert packages.isdisjoint(TAKEN)


def test_from_the_root_kernels_is_hugging_faces_and_transformers_sees_it_as_elsewhere(tmp_path):
    """From the repository's root `import kernels` is Hugging Face's, and transformers' hub-kernel check answers as it
    does in a folder outside the repository (where its version window admits the installed kernels, it imports it)."""
    probe = (
        "import json, kernels, memviz\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "import transformers.integrations.hub_kernels as hub\n"
        "print(json.dumps([kernels.__file__, is_kernels_available(), hasattr(hub, 'LayerRepository')]))"
    )
    seen = []
    for where in (ROOT, tmp_path):
        out = subprocess.run([sys.executable, "-c", probe], cwd=where, capture_output=True, text=True, timeout=300)
        assert out.returncode == 0, out.stderr
        seen.append(json.loads(out.stdout))
    (kernels_file, available, imported), elsewhere = seen
    assert Path(kernels_file).parent == Path(importlib.metadata.distribution("kernels").locate_file("kernels"))
    assert [kernels_file, available, imported] == elsewhere
    from transformers.utils import import_utils

    window = SpecifierSet(f">={import_utils.KERNELS_MIN_VERSION},<{import_utils.KERNELS_MAX_VERSION}")
    assert available == window.contains(importlib.metadata.version("kernels"))  # its version window decides
    assert imported or not available


def test_the_wheel_in_a_fresh_environment_traces_a_sample_and_a_qwen3_5_folder(wheel, tmp_path):
    """The wheel installed alone into a new virtual environment (its dependencies are this environment's, through a
    path file, so nothing is downloaded), run from a folder outside the repository."""
    env = tmp_path / "env"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(env)], check=True, timeout=300)
    python = env / "bin" / "python"
    site = Path(
        subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    (site / "dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(site), str(wheel)]
    done = subprocess.run(install, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    qwen = tmp_path / "qwen3_5"
    tiny_checkpoint(qwen, "qwen3_5_text")
    work = tmp_path / "elsewhere"
    work.mkdir()
    probe = f"""
import json, kernels, memviz, memviz_probes.passkey
sample = memviz.load({str(ROOT / "sample_checkpoints" / "infini_english_16k")!r})
text = memviz_probes.passkey.seeded_sample(sample.tokenizer, length=400, depth=0.5, seed=0, index=0).prompt
ids = sample.tokenizer.encode(text)[:100]
trace = memviz.trace(sample, ids)
qwen = memviz.load({str(qwen)!r})
released = memviz.trace(qwen, "The pass key is 71432. Remember it.")
print(json.dumps([memviz.__file__, kernels.__file__, len(trace.tokens), trace.names[:1], len(released.tokens),
                  sorted(released.names)[:1]]))
"""
    out = subprocess.run([python, "-c", probe], cwd=work, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    memviz_file, kernels_file, n_sample, sample_names, n_released, released_names = json.loads(out.stdout)
    assert Path(memviz_file).is_relative_to(site)  # the wheel's memviz, not the repository's
    assert Path(kernels_file).parent == Path(importlib.metadata.distribution("kernels").locate_file("kernels"))
    assert n_sample == 100 and sample_names and n_released > 0 and released_names


def requirements(path: Path) -> dict[str, Requirement]:
    lines = (line.split("#")[0].strip() for line in path.read_text().splitlines())
    found = [Requirement(line) for line in lines if line and not line.startswith("-")]
    return {canonicalize_name(r.name): r for r in found}


def test_the_lock_pins_every_requirement_within_its_range():
    """requirements.lock is requirements.txt resolved (`python3 tasks.py lock`): one exact version a package, each
    inside the range requirements.txt gives it, and the set-up installs from the lock."""
    ranges, locked = requirements(ROOT / "requirements.txt"), requirements(ROOT / "requirements.lock")
    assert all(str(r.specifier).startswith("==") and len(r.specifier) == 1 for r in locked.values())
    outside = {
        name: (str(r.specifier), str(locked[name].specifier) if name in locked else "missing")
        for name, r in ranges.items()
        if name not in locked or not r.specifier.contains(next(iter(locked[name].specifier)).version, prereleases=True)
    }
    assert outside == {}, "run `python3 tasks.py lock`"


def test_the_package_requires_what_requirements_txt_gives_the_same_range():
    """pyproject.toml's dependencies are requirements.txt's runtime part, with the same ranges; the libraries whose
    internals memviz reads are bounded above."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11 on

    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    ranges = requirements(ROOT / "requirements.txt")
    package = {canonicalize_name(r.name): r for r in map(Requirement, declared)}
    assert {name: str(r.specifier) for name, r in package.items()} == {
        name: str(ranges[name].specifier) for name in package
    }
    for name in ("transformers", "transformer-lens", "streamlit"):
        assert any(spec.operator in ("<", "<=", "==") for spec in package[name].specifier), name
