"""A released checkpoint's own tokenizer.json behind memviz's tokenizer interface, and its special ids."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

from memviz.tokenizer import TOKENIZER_FILE, Tokenizer


class HFTokenizer(Tokenizer):
    """A checkpoint's own `tokenizer.json` (the `tokenizers` library) behind memviz's tokenizer
    interface; no special tokens are added when encoding."""

    kind = "hf"

    def __init__(self, backend, vocab_size: int, eos_id: int, pad_id: int, bos_id: int) -> None:
        self.backend = backend
        self.text_vocab_size = backend.get_vocab_size(with_added_tokens=True)
        self._vocab_size, self._eos, self._pad, self._bos = vocab_size, eos_id, pad_id, bos_id

    vocab_size = property(lambda self: self._vocab_size)
    eos_id = property(lambda self: self._eos)
    pad_id = property(lambda self: self._pad)
    bos_id = property(lambda self: self._bos)

    def encode(self, text: str) -> list[int]:
        return self.backend.encode(text, add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode([i for i in self.ids_within(ids) if i < self.text_vocab_size])

    def byte_length(self, ids: Iterable[int]) -> int:
        """UTF-8 bytes of the decoded text (a character cut between the tokens counts as U+FFFD)."""
        return len(self.decode(ids).encode("utf-8"))

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """Each token's text, specials by name; "" for an embedding row past the tokenizer's vocabulary."""
        ids = self.ids_within(ids)
        known = iter(
            self.backend.decode_batch([[i] for i in ids if 0 <= i < self.text_vocab_size], skip_special_tokens=False)
        )
        return [next(known) if 0 <= i < self.text_vocab_size else "" for i in ids]

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        self.backend.save(str(path))
        return path


def special_ids(config, backend) -> tuple[int, int, int]:
    """(eos, pad, bos): the config's ids, else the tokenizer's <|endoftext|>; pad and bos (never
    generated) fall back to the last embedding row, a padding row in the released vocabularies."""

    def first(value):
        return value[0] if isinstance(value, list) else value

    eos = first(config.eos_token_id)
    if eos is None:
        eos = backend.token_to_id("<|endoftext|>")
    last = config.vocab_size - 1
    pad = first(config.pad_token_id)
    pad = last if pad is None or pad == eos else pad
    bos = first(config.bos_token_id)
    bos = pad if bos is None or bos == eos else bos
    return (last if eos is None else eos), pad, bos
