"""The README's Python blocks run as written (in a scratch folder, so their files land there)."""

import os
import re
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def test_the_readme_python_blocks_run(tmp_path):
    blocks = re.findall(r"```python\n(.*?)```", README.read_text(encoding="utf-8"), flags=re.S)
    assert blocks, "the README has no Python block"
    here = os.getcwd()
    os.chdir(tmp_path)
    try:
        for block in blocks:
            exec(compile(block, str(README), "exec"), {"__name__": "readme"})
    finally:
        os.chdir(here)
    assert (tmp_path / "trace.npz").is_file()
