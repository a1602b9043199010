"""Text a user might paste: `python benchmarks/user_text.py NAME [NAME ...]`.

Bits per byte (and nats a token) of each named checkpoint on two texts no sample trained on, found on any
machine with the requirements installed: the Apache License 2.0 as `transformers` ships it, and the docstrings
of a fixed list of Python's standard modules (technical prose with some code; both change a little between
versions, so the table names them). A third column is the pass-key prompt at 1,024 tokens in the procedural
filler (the long grid's seed 11, depth 0.5): prompts the pass-key samples train on, so a check that a model
reads the prompts the app's probes show, not a held-out text. The held-out plays and Botchan are
`english_lm.py`'s.
"""

from __future__ import annotations

import argparse
import importlib
import importlib.metadata
import inspect
import math
import platform
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from long_grid import load_checkpoints  # noqa: E402

#: standard modules whose docstrings are mostly prose, together past MAX_CHARS
DOC_MODULES = ("socketserver", "shelve", "copy", "site", "configparser")
#: each text is cut to at most this many characters, so every model reads the same bytes
MAX_CHARS = 12_000


def licence_text() -> str:
    """The Apache License 2.0 as the installed `transformers` distribution ships it."""
    dist = importlib.metadata.distribution("transformers")
    path = next((f for f in dist.files or () if f.name == "LICENSE"), None)
    if path is None:
        raise SystemExit(f"transformers {dist.version} lists no LICENSE file: reinstall it (python3 tasks.py setup)")
    return path.read_text()


def python_docs() -> str:
    return "\n\n".join(inspect.getdoc(importlib.import_module(m)) or "" for m in DOC_MODULES)


def main(argv: list[str] | None = None) -> int:
    from memviz.threads import thread_count
    from memviz_probes import passkey
    from memviz_probes.lm import token_losses

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoints", nargs="+")
    parser.add_argument("--threads", type=thread_count, default=2)
    args = parser.parse_args(argv)
    models = load_checkpoints(parser, args.checkpoints)
    torch.set_num_threads(args.threads)
    texts = {"Apache licence": licence_text()[:MAX_CHARS], "Python docstrings": python_docs()[:MAX_CHARS]}
    transformers_version = importlib.metadata.version("transformers")
    print(
        f"bits per byte (nats a token); Python {platform.python_version()}, transformers {transformers_version}, "
        f"at most {MAX_CHARS:,} characters a text"
    )
    print("| model | " + " | ".join(texts) + " | pass-key prompt, 1k, procedural (trained on) |")
    print("|---|" + "---|" * (len(texts) + 1))
    for name, model in models.items():
        prompt = passkey.seeded_sample(model.tokenizer, 1024, 0.5, 11, 0).prompt
        cells = []
        for text in [*texts.values(), prompt]:
            tokens = model.tokenizer.encode(text)
            losses = token_losses(model, tokens)
            bits = losses.sum() / math.log(2) / model.tokenizer.byte_length(tokens[1:])
            cells.append(f"{bits:.3f} ({losses.mean():.2f})")
        print(f"| `{name}` | " + " | ".join(cells) + " |", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
