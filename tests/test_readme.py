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


def families_in_readme_table() -> set[str]:
    """The config names in the README's family table (its second column)."""
    section = README.read_text(encoding="utf-8").split("\n## Families\n", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| family ")]
    return {name for row in rows for name in re.findall(r"`([a-z0-9_]+)`", row.rsplit("|", 2)[-2])}


def test_the_readme_family_table_lists_every_registered_family():
    import memviz

    registered = {family.name for family in memviz.families() if family.from_config}
    assert families_in_readme_table() == registered
