"""Tokenizers: a byte-level one for any UTF-8 text, and a per-checkpoint byte-level BPE.

Both reserve three special ids after the text vocabulary (pad, bos, eos). `encode` never
produces them, whatever the text says, so a literal "<eos>" in user text stays text.
The BPE splits digits one per token (so a 5-digit pass key is 5 tokens in every context)
and works on bytes, so every string round-trips. Each is saved as `tokenizer.json`.
"""

from __future__ import annotations

import json
import operator
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import numpy as np

from memviz.files import atomic_write_text, read_bytes_within

TOKENIZER_FILE = "tokenizer.json"
SPECIALS = ("<pad>", "<bos>", "<eos>")
#: the largest tokenizer.json read (a 1M-token vocabulary with its merges is well under it)
MAX_TOKENIZER_FILE_BYTES = 256 * 2**20
#: a text longer than this many characters is counted in pieces of about this size
COUNT_PIECE_CHARS = 2**17
LONE_SURROGATE = re.compile("[\ud800-\udfff]")


def check_text(text: object, what: str = "text") -> str:
    """`text` if it is a str of valid Unicode; TypeError for anything else (bytes, None), ValueError naming
    the character for a lone surrogate (what a bad decode or a JSON escape leaves), which UTF-8 cannot hold."""
    if not isinstance(text, str):
        hint = ": decode it first" if isinstance(text, (bytes, bytearray)) else ""
        raise TypeError(f"{what} must be a str, got {type(text).__name__}{hint}")
    bad = LONE_SURROGATE.search(text)
    if bad is not None:
        raise ValueError(
            f"{what} holds a lone surrogate (U+{ord(bad.group()):04X}) at character {bad.start():,}: "
            "not valid Unicode, so it has no UTF-8 bytes to tokenize"
        )
    return text


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

    def encode_within(self, text: str, max_tokens: int, what: str = "input", limit: str = "limit") -> list[int]:
        """`encode(text)`, refusing (ValueError naming `what` and the `limit`) a text of more than `max_tokens`
        tokens before its whole encoding is made (which costs far more memory than the text): every token holds at
        least one UTF-8 byte, so only a text of more bytes than that can be over, and such a text is first counted
        in pieces of about 130,000 characters."""
        check_text(text, what)
        if 4 * len(text) > max_tokens and utf8_length(text) > max_tokens:  # a character has at most 4 bytes
            counted = read = 0
            for piece in pieces_at_spaces(text, COUNT_PIECE_CHARS):
                counted, read = counted + len(self.encode(piece)), read + len(piece)
                if counted > max_tokens:
                    raise ValueError(
                        f"{what} has more tokens in its first {read:,} of {len(text):,} characters than "
                        f"the {limit} of {max_tokens:,}; nothing was run"
                    )
        return self.encode(text)

    def decode(self, ids: Iterable[int]) -> str:
        """The text of `ids`; specials (and embedding rows past a tokenizer's vocabulary) stand for none."""
        raise NotImplementedError

    def ids_within(self, ids: Iterable[int]) -> list[int]:
        """`ids` as ints, or ValueError naming the first that is no id at all (below 0 or past `vocab_size`):
        decoding such an id silently would hide a model or caller that made it."""
        if isinstance(ids, (str, bytes, bytearray)):
            raise TypeError(f"ids must be token ids, not a {type(ids).__name__}: encode the text first")
        if hasattr(ids, "tolist"):  # a tensor or an array: its elements as Python numbers
            ids = ids.tolist()
        if not isinstance(ids, Iterable):
            raise TypeError(f"ids must be a sequence of token ids, got {ids!r}")
        ids = list(ids)
        if not all(type(i) is int for i in ids):  # the common case, plain ints, needs no element-wise conversion
            ids = [whole_id(i, n) for n, i in enumerate(ids)]
        if ids and not (0 <= min(ids) and max(ids) < self.vocab_size):
            bad = next(n for n, i in enumerate(ids) if not 0 <= i < self.vocab_size)
            raise ValueError(
                f"token id {ids[bad]} at position {bad} is outside the vocabulary's 0..{self.vocab_size - 1}"
            )
        return ids

    def byte_length(self, ids: Iterable[int]) -> int:
        """UTF-8 bytes the text tokens `ids` stand for (specials count none), a multi-byte character cut
        between tokens counted by its own bytes: what bits per byte divide by."""
        raise NotImplementedError

    def token_strings(self, ids: Iterable[int]) -> list[str]:
        """A printable string per token (for hover text), specials shown by name."""
        n_text = self.text_vocab_size
        return [SPECIALS[i - n_text] if i >= n_text else self.piece(i) for i in self.ids_within(ids)]

    def piece(self, i: int) -> str:
        """The text of the one text-token id `i`, already checked (`decode([i])` without the check)."""
        raise NotImplementedError

    def save(self, directory: str | Path) -> Path:
        raise NotImplementedError


class ByteTokenizer(Tokenizer):
    """One token per UTF-8 byte (ids 0-255)."""

    kind = "byte"
    text_vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(check_text(text).encode("utf-8"))

    def encode_within(self, text: str, max_tokens: int, what: str = "input", limit: str = "limit") -> list[int]:
        """`encode(text)`, refusing before it a text of more than `max_tokens` bytes (one token each)."""
        check_text(text, what)
        n_bytes = utf8_length(text) if 4 * len(text) > max_tokens else 0
        if n_bytes > max_tokens:
            raise ValueError(
                f"{what} has {n_bytes:,} tokens (one a UTF-8 byte), over the {limit} of {max_tokens:,}; nothing was run"
            )
        return self.encode(text)

    def encode_bytes(self, data: bytes) -> list[int]:
        return list(data)

    def byte_length(self, ids: Iterable[int]) -> int:
        return sum(1 for i in self.ids_within(ids) if i < 256)

    def decode_bytes(self, ids: Iterable[int]) -> bytes:
        return bytes(i for i in self.ids_within(ids) if i < 256)

    def decode(self, ids: Iterable[int]) -> str:
        return self.decode_bytes(ids).decode("utf-8", errors="replace")

    def piece(self, i: int) -> str:
        return bytes([i]).decode("utf-8", errors="replace")

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
        self.check_ids()

    def check_ids(self) -> None:
        """Every token has its own id, and the ids are 0 .. vocab size - 1 (the model's embedding rows; the
        specials follow them): ValueError naming the tokens otherwise."""
        ids: dict[int, list[str]] = {}
        for token, i in self.backend.get_vocab(with_added_tokens=True).items():
            ids.setdefault(i, []).append(token)
        shared = {i: tokens for i, tokens in ids.items() if len(tokens) > 1}
        if shared:
            i, tokens = next(iter(shared.items()))
            raise ValueError(
                f"{sum(len(t) for t in shared.values())} tokens share {len(shared)} id{'s' * (len(shared) > 1)} "
                f"(id {i}: {sorted(tokens)[:4]}); each token needs its own id"
            )
        outside = sorted(i for i in ids if not 0 <= i < self.text_vocab_size)
        if outside:
            raise ValueError(
                f"token ids {outside[:4]} (token {ids[outside[0]][0]!r}) lie outside the vocabulary's "
                f"0..{self.text_vocab_size - 1}"
            )

    @classmethod
    def train(cls, texts: Iterable[str] | Iterator[str], vocab_size: int = 2048) -> BPETokenizer:
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
        return self.backend.encode(check_text(text), add_special_tokens=False).ids

    def decode(self, ids: Iterable[int]) -> str:
        return self.backend.decode([i for i in self.ids_within(ids) if i < self.text_vocab_size])

    def piece(self, i: int) -> str:
        return self.backend.decode([i])

    def byte_length(self, ids: Iterable[int]) -> int:
        if not hasattr(self, "_token_bytes"):  # a byte-level token's string has one character per byte
            self._token_bytes = [len(self.backend.id_to_token(i) or "") for i in range(self.text_vocab_size)]
        return sum(self._token_bytes[i] for i in self.ids_within(ids) if i < self.text_vocab_size)

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / TOKENIZER_FILE
        atomic_write_text(path, self.backend.to_str())
        return path


def whole_id(value: object, position: int) -> int:
    """`value` as an int if it is a whole number (an int, a NumPy or one-element torch integer), TypeError naming
    the position otherwise: a float or a bool is a caller's mistake, not an id."""
    if isinstance(value, (bool, np.bool_)):
        raise TypeError(f"token id at position {position} is {value!r}, a bool, not a whole number")
    try:
        return operator.index(value)  # type: ignore[arg-type]
    except TypeError:
        raise TypeError(f"token id at position {position} is {value!r}, not a whole number") from None


def utf8_length(text: str) -> int:
    """len(text.encode("utf-8")), a piece at a time (no copy of a long text)."""
    return sum(len(text[i : i + COUNT_PIECE_CHARS].encode("utf-8")) for i in range(0, len(text), COUNT_PIECE_CHARS))


def pieces_at_spaces(text: str, size: int) -> Iterator[str]:
    """`text` in consecutive pieces of `size` to `2 size` characters, each cut before a space that follows a
    non-space where there is one (a byte-level BPE's pre-tokenizer cuts there too, so the pieces' tokens are
    about the whole's: good for counting, not for encoding)."""
    start = 0
    while start < len(text):
        cut = text.find(" ", start + size, start + 2 * size)
        while cut != -1 and text[cut - 1].isspace():
            cut = text.find(" ", cut + 1, start + 2 * size)
        end = min(len(text), start + size) if cut == -1 else cut  # a text without spaces is cut anywhere
        yield text[start:end]
        start = end


def load_tokenizer(path: str | Path) -> Tokenizer:
    """Read a `tokenizer.json` written by either tokenizer (its size checked first); raise ValueError if it is
    not one, or if its tokens do not each have their own id inside the vocabulary."""
    try:
        text = read_bytes_within(path, MAX_TOKENIZER_FILE_BYTES, "tokenizer file").decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ValueError(f"not UTF-8 text ({exc.reason} at byte {exc.start})") from exc
    try:
        data = json.loads(text)
    except (json.JSONDecodeError, RecursionError) as exc:
        raise ValueError(f"not valid JSON: {exc}") from exc
    if isinstance(data, dict) and data.get("kind") == "byte":
        return ByteTokenizer()
    from tokenizers import Tokenizer as HFTokenizer

    try:
        backend = HFTokenizer.from_str(text)
    except Exception as exc:  # the tokenizers library raises its own Exception type
        raise ValueError(f"not a byte or BPE tokenizer file: {exc}") from exc
    return BPETokenizer(backend)
