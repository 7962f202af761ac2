"""Tokenizers as canonical JSON artifacts: a character tokenizer built from the data, and a Hugging Face
``tokenizers`` tokenizer taken from a model directory.

:class:`CharTokenizer`: ids 0..3 are the specials (PAD, BOS, EOS, UNK); then every character seen in the data,
sorted by code point, so the same texts always give the same vocabulary whatever order they come in.

:class:`HFTokenizer`: the model directory's ``tokenizer.json`` kept verbatim (as a string, so its bytes are
committed exactly) with the special ids and vocabulary size of the model's ``config.json``. It needs the optional
``tokenizers`` package (no torch), imported only when such a tokenizer is used.

Both answer the same questions (:class:`Tokenizer`); :func:`tokenizer_from_bytes` reads either artifact.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final, Protocol

from ledger import digests
from ledger.errors import InputError

TOKENIZER_FORMAT: Final = "ledger-char-tokenizer"
TOKENIZER_VERSION: Final = 1
HF_TOKENIZER_FORMAT: Final = "ledger-hf-tokenizer"
HF_TOKENIZER_VERSION: Final = 1
SPECIALS: Final = ("<pad>", "<bos>", "<eos>", "<unk>")
PAD_ID: Final = 0
BOS_ID: Final = 1
EOS_ID: Final = 2
UNK_ID: Final = 3


class Tokenizer(Protocol):
    """What prepare, the arms, evaluation and the verifier ask of a tokenizer."""

    @property
    def pad_id(self) -> int: ...
    @property
    def bos_id(self) -> int: ...
    @property
    def eos_id(self) -> int: ...
    @property
    def vocab_size(self) -> int: ...
    @property
    def kind(self) -> str: ...

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, strict: bool = True) -> list[int]: ...
    def decode(self, ids: Iterable[int]) -> str: ...
    def canonical_bytes(self) -> bytes: ...


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

    @property
    def kind(self) -> str:
        return "char"

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


class HFTokenizer:
    """A ``tokenizers`` tokenizer (``tokenizer.json``) with the model's special ids; encodes without adding any
    special token itself (BOS and EOS are placed explicitly, as for :class:`CharTokenizer`)."""

    def __init__(self, tokenizer_json: str, *, bos_id: int, eos_id: int, pad_id: int, vocab_size: int) -> None:
        try:
            from tokenizers import Tokenizer as _Tokenizer
        except ImportError as exc:
            raise InputError("a Hugging Face tokenizer needs the optional package: pip install tokenizers") from exc
        try:
            self._tok = _Tokenizer.from_str(tokenizer_json)
        except Exception as exc:  # the Rust parser raises its own exception type
            raise InputError(f"not a tokenizers tokenizer.json: {str(exc)[:200]}") from exc
        for name, value in (("bos_id", bos_id), ("eos_id", eos_id), ("pad_id", pad_id)):
            if not 0 <= value < vocab_size:
                raise InputError(f"tokenizer {name} {value} is outside the vocabulary [0, {vocab_size})")
        if self._tok.get_vocab_size(with_added_tokens=True) > vocab_size:
            raise InputError(f"tokenizer.json has {self._tok.get_vocab_size(with_added_tokens=True)} tokens, more "
                             f"than the model's vocab_size {vocab_size}")
        self.tokenizer_json = tokenizer_json
        self._bos, self._eos, self._pad, self._vocab = bos_id, eos_id, pad_id, vocab_size

    @classmethod
    def from_model_dir(cls, path: str | Path) -> HFTokenizer:
        """The tokenizer of a local model directory: ``tokenizer.json``, and the special ids and vocabulary size
        of ``config.json`` (PAD falls back to EOS: padded positions are never scored)."""
        root = Path(path)
        try:
            tokenizer_json = (root / "tokenizer.json").read_text(encoding="utf-8")
            model_config = json.loads((root / "config.json").read_text(encoding="utf-8"))
        except (OSError, ValueError) as exc:
            raise InputError(f"model directory {root}: cannot read tokenizer.json and config.json: {exc}") from exc

        def special(name: str) -> int | None:
            value = model_config.get(name)
            if isinstance(value, list):  # several EOS ids (e.g. chat models): the first ends a document
                value = value[0] if value else None
            return value if isinstance(value, int) and not isinstance(value, bool) else None

        bos, eos = special("bos_token_id"), special("eos_token_id")
        vocab = model_config.get("vocab_size")
        if bos is None or eos is None or not isinstance(vocab, int):
            raise InputError(f"model directory {root}: config.json needs bos_token_id, eos_token_id and vocab_size")
        pad = special("pad_token_id")
        return cls(tokenizer_json, bos_id=bos, eos_id=eos, pad_id=eos if pad is None else pad, vocab_size=vocab)

    @property
    def pad_id(self) -> int:
        return self._pad

    @property
    def bos_id(self) -> int:
        return self._bos

    @property
    def eos_id(self) -> int:
        return self._eos

    @property
    def vocab_size(self) -> int:
        return self._vocab

    @property
    def kind(self) -> str:
        return "hf"

    def encode(self, text: str, *, bos: bool = False, eos: bool = False, strict: bool = True) -> list[int]:
        """Token ids of ``text`` (optionally framed by BOS/EOS). ``strict`` is accepted for the common interface;
        a byte-level tokenizer has no unknown characters."""
        ids: list[int] = list(self._tok.encode(text, add_special_tokens=False).ids)
        return ([self._bos] if bos else []) + ids + ([self._eos] if eos else [])

    def decode(self, ids: Iterable[int]) -> str:
        """Text of ``ids`` with the special tokens dropped."""
        values = [int(i) for i in ids]
        if any(i < 0 for i in values):
            raise InputError(f"token id {min(values)} is negative")
        text: str = self._tok.decode(values, skip_special_tokens=True)
        return text

    def to_json(self) -> dict[str, Any]:
        return {"format": HF_TOKENIZER_FORMAT, "version": HF_TOKENIZER_VERSION, "tokenizer_json": self.tokenizer_json,
                "bos_id": self._bos, "eos_id": self._eos, "pad_id": self._pad, "vocab_size": self._vocab}

    def canonical_bytes(self) -> bytes:
        return digests.canonical_bytes(self.to_json())

    @classmethod
    def from_json(cls, document: Any) -> HFTokenizer:
        keys = {"format", "version", "tokenizer_json", "bos_id", "eos_id", "pad_id", "vocab_size"}
        if not isinstance(document, dict) or document.get("format") != HF_TOKENIZER_FORMAT or set(document) != keys:
            raise InputError(f"not a {HF_TOKENIZER_FORMAT} document")
        if document["version"] != HF_TOKENIZER_VERSION:
            raise InputError(f"unsupported {HF_TOKENIZER_FORMAT} version {document['version']!r}")
        return cls(document["tokenizer_json"], bos_id=document["bos_id"], eos_id=document["eos_id"],
                   pad_id=document["pad_id"], vocab_size=document["vocab_size"])

    def __eq__(self, other: object) -> bool:
        return isinstance(other, HFTokenizer) and self.to_json() == other.to_json()

    def __hash__(self) -> int:
        return hash(self.tokenizer_json)


def tokenizer_from_json(document: Any) -> CharTokenizer | HFTokenizer:
    """Either tokenizer artifact, told apart by its ``format``."""
    kind = document.get("format") if isinstance(document, dict) else None
    if kind == HF_TOKENIZER_FORMAT:
        return HFTokenizer.from_json(document)
    return CharTokenizer.from_json(document)


def tokenizer_from_bytes(data: bytes) -> CharTokenizer | HFTokenizer:
    """Parse a canonical tokenizer artifact of either kind."""
    return tokenizer_from_json(digests.parse_canonical(data))
