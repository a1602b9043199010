"""Tokenizers: a byte-level one for any UTF-8 text, and a per-checkpoint byte-level BPE.

Both reserve three special ids after the text vocabulary (pad, bos, eos). `encode` never
produces them, whatever the text says, so a literal "<eos>" in user text stays text.
The BPE splits digits one per token (so a 5-digit pass key is 5 tokens in every context)
and works on bytes, so every string round-trips. Each is saved as `tokenizer.json`.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Iterable, Iterator

from memviz.files import atomic_write_text

TOKENIZER_FILE = "tokenizer.json"
SPECIALS = ("<pad>", "<bos>", "<eos>")


class Tokenizer:
    """Shared interface: `encode`, `decode`, `token_strings`, special ids, `save`."""

    kind: str
    text_vocab_size: int

    @property
    def vocab_size(self) -> int:
        return self.text_vocab_size + len(SPECIALS)

    @property
    def pad_id(self) -> int:
        return self.text_vocab_size

    @property
    def bos_id(self) -> int:
        return self.text_vocab_size + 1

    @property
    def eos_id(self) -> int:
        return self.text_vocab_size + 2

    def encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def decode(self, ids: Iterable[int]) -> str:
        raise NotImplementedError

    def byte_length(self, ids: Iterable[int]) -> int:
        """UTF-8 bytes the text tokens `ids` stand for (specials count none), a multi-byte character cut
        between tokens counted by its own bytes: what bits per byte divide by."""
        raise NotImplementedError

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """A printable string per token (for hover text), specials shown by name."""
        out = []
        for i in ids:
            i = int(i)
            out.append(SPECIALS[i - self.text_vocab_size] if i >= self.text_vocab_size else self.decode([i]))
        return out

    def save(self, directory: str | Path) -> Path:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte (ids 0-255)."""

    kind = "byte"
    text_vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8", errors="replace"))

    def encode_bytes(self, data: bytes) -> list[int]:
        return list(data)

    def byte_length(self, ids: Iterable[int]) -> int:
        return sum(1 for i in map(int, ids) if 0 <= i < 256)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return bytes(i for i in map(int, ids) if 0 <= i < 256)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        atomic_write_text(path, json.dumps({"kind": self.kind}))
        return path


class BPETokenizer(Tokenizer):
    """Byte-level BPE from the `tokenizers` library, digits split one per token."""

    kind = "bpe"

    def __init__(self, backend) -> None:
        self.backend = backend
        self.text_vocab_size = backend.get_vocab_size(with_added_tokens=False)

    @classmethod
    def train(cls, texts: Iterable[str] | Iterator[str], vocab_size: int = 2048) -> "BPETokenizer":
        from tokenizers import Tokenizer as HFTokenizer
        from tokenizers import decoders, models, pre_tokenizers, trainers

        backend = HFTokenizer(models.BPE())
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        backend.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size - len(SPECIALS),
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            show_progress=False,
        )
        backend.train_from_iterator(texts, trainer=trainer)
        return cls(backend)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode([i for i in map(int, ids) if 0 <= i < self.text_vocab_size])

    def byte_length(self, ids: Iterable[int]) -> int:
        if not hasattr(self, "_token_bytes"):  # a byte-level token's string has one character per byte
            self._token_bytes = [len(self.backend.id_to_token(i) or "") for i in range(self.text_vocab_size)]
        return sum(self._token_bytes[i] for i in map(int, ids) if 0 <= i < self.text_vocab_size)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        atomic_write_text(path, self.backend.to_str())
        return path


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a `tokenizer.json` written by either tokenizer; raise ValueError if it is not one."""
    text = Path(path).read_text(encoding="utf-8")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc
    if isinstance(data, dict) and data.get("kind") == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer as HFTokenizer

    try:
        return BPETokenizer(HFTokenizer.from_str(text))
    except Exception as exc:  # the tokenizers library raises its own Exception type
        raise ValueError(f"not a byte or BPE tokenizer file: {exc}") from exc
