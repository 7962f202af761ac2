"""A deterministic character-level tokenizer built from the data, stored as a canonical JSON artifact.

Ids 0..3 are the specials (PAD, BOS, EOS, UNK); then every character seen in the data, sorted by code point, so
the same texts always give the same vocabulary whatever order they come in.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any, Final

from ledger import digests
from ledger.errors import InputError

TOKENIZER_FORMAT: Final = "ledger-char-tokenizer"
TOKENIZER_VERSION: Final = 1
SPECIALS: Final = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID: Final = 0
BOS_ID: Final = 1
EOS_ID: Final = 2
UNK_ID: Final = 3


class CharTokenizer:
    """Characters to ids and back. ``encode`` is strict by default: an unknown character is an error."""

    pad_id: Final = PAD_ID
    bos_id: Final = BOS_ID
    eos_id: Final = EOS_ID
    unk_id: Final = UNK_ID

    def __init__(self, chars: Sequence[str]) -> None:
        if list(chars) != sorted(set(chars)) or any(len(c) != 1 for c in chars):
            raise InputError("tokenizer characters must be distinct single characters sorted by code point")
        self.chars: tuple[str, ...] = tuple(chars)
        self._ids = {c: i + len(SPECIALS) for i, c in enumerate(self.chars)}

    @classmethod
    def build(cls, texts: Iterable[str]) -> CharTokenizer:
        """The tokenizer whose vocabulary is every character of ``texts``."""
        seen: set[str] = set()
        for text in texts:
            seen.update(text)
        return cls(sorted(seen))

    @property
    def vocab_size(self) -> int:
        return len(SPECIALS) + len(self.chars)

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, strict: bool = True) -> list[int]:
        """Token ids of ``text`` (optionally framed by BOS/EOS); unknown characters raise unless not ``strict``."""
        ids = [BOS_ID] if bos else []
        for ch in text:
            i = self._ids.get(ch)
            if i is None:
                if strict:
                    raise InputError(f"character {ch!r} (U+{ord(ch):04X}) is not in the tokenizer's vocabulary")
                i = UNK_ID
            ids.append(i)
        if eos:
            ids.append(EOS_ID)
        return ids

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids``; PAD/BOS/EOS are dropped and UNK becomes U+FFFD."""
        out: list[str] = []
        n = len(SPECIALS)
        for i in ids:
            if i >= n:
                out.append(self.chars[i - n])
            elif i == UNK_ID:
                out.append("\ufffd")
            elif i < 0:
                raise InputError(f"token id {i} is negative")
        return "".join(out)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": TOKENIZER_FORMAT,
            "version": TOKENIZER_VERSION,
            "specials": list(SPECIALS),
            "chars": list(self.chars),
        }

    def canonical_bytes(self) -> bytes:
        return digests.canonical_bytes(self.to_json())

    @classmethod
    def from_json(cls, document: Any) -> CharTokenizer:
        if not isinstance(document, dict) or document.get("format") != TOKENIZER_FORMAT:
            raise InputError(f"not a {TOKENIZER_FORMAT} document")
        if document.get("version") != TOKENIZER_VERSION or document.get("specials") != list(SPECIALS):
            raise InputError(f"unsupported tokenizer version/specials: {document.get('version')!r}")
        return cls(document["chars"])

    @classmethod
    def from_bytes(cls, data: bytes) -> CharTokenizer:
        """Parse the canonical tokenizer artifact."""
        return cls.from_json(digests.parse_canonical(data))

    def __eq__(self, other: object) -> bool:
        return isinstance(other, CharTokenizer) and self.chars == other.chars

    def __hash__(self) -> int:
        return hash(self.chars)
