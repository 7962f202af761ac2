"""The character-level tokenizer (ledger.experiment.tokenizer): a vocabulary that depends only on the set of
characters, fixed special ids, strict encoding, and the canonical artifact it is stored as."""

from __future__ import annotations

from typing import Any

import pytest

from ledger import digests
from ledger.errors import InputError
from ledger.experiment.tokenizer import BOS_ID, EOS_ID, PAD_ID, SPECIALS, UNK_ID, CharTokenizer

TEXTS = ["def f(x):\n    return x", "héllo wörld", "ζ = 1"]


def test_vocabulary_is_sorted_and_independent_of_text_order() -> None:
    tok = CharTokenizer.build(TEXTS)
    assert tok.chars == tuple(sorted(set("".join(TEXTS))))
    assert CharTokenizer.build(reversed(TEXTS)) == tok
    assert CharTokenizer.build(["".join(reversed("".join(TEXTS)))]) == tok
    assert hash(CharTokenizer.build(reversed(TEXTS))) == hash(tok)
    assert CharTokenizer.build(["abc"]) != CharTokenizer.build(["abd"])
    assert tok.vocab_size == len(SPECIALS) + len(set("".join(TEXTS)))


def test_specials_take_the_first_ids() -> None:
    assert SPECIALS == ("<pad>", "<bos>", "<eos>", "<unk>")
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    tok = CharTokenizer.build(["ba"])
    assert (tok.pad_id, tok.bos_id, tok.eos_id, tok.unk_id) == (0, 1, 2, 3)
    assert tok.encode("ab") == [4, 5]
    assert tok.encode("ab", bos=True, eos=True) == [BOS_ID, 4, 5, EOS_ID]


def test_encode_is_strict_about_unknown_characters() -> None:
    tok = CharTokenizer.build(["abc"])
    with pytest.raises(InputError, match=r"character 'z' \(U\+007A\) is not in the tokenizer's vocabulary"):
        tok.encode("abz")
    assert tok.encode("abz", strict=False) == [4, 5, UNK_ID]
    assert tok.decode(tok.encode("abz", strict=False)) == "ab\ufffd"


def test_encode_decode_round_trip() -> None:
    tok = CharTokenizer.build(TEXTS)
    for text in TEXTS:
        ids = tok.encode(text, bos=True, eos=True)
        assert len(ids) == len(text) + 2 and min(ids[1:-1]) >= len(SPECIALS)
        assert tok.decode(ids) == text  # BOS and EOS are dropped
    assert tok.decode([PAD_ID, *tok.encode("ζ"), PAD_ID]) == "ζ"
    with pytest.raises(InputError, match="token id -1 is negative"):
        tok.decode([4, -1])


def test_bytes_round_trip_and_are_canonical() -> None:
    tok = CharTokenizer.build(["ba"])
    data = tok.canonical_bytes()
    assert data == (b'{"chars":["a","b"],"format":"ledger-char-tokenizer",'
                    b'"specials":["<pad>","<bos>","<eos>","<unk>"],"version":1}')
    assert CharTokenizer.from_bytes(data) == tok
    big = CharTokenizer.build(TEXTS)
    assert CharTokenizer.from_bytes(big.canonical_bytes()) == big
    assert digests.canonical_bytes(digests.parse_canonical(big.canonical_bytes())) == big.canonical_bytes()


GOOD: dict[str, Any] = {"chars": ["a", "b"], "format": "ledger-char-tokenizer",
                        "specials": ["<pad>", "<bos>", "<eos>", "<unk>"], "version": 1}


@pytest.mark.parametrize(("data", "message"), [
    (b'{"chars": ["a"]}', "non-canonical JSON"),
    (b"[]", "not a ledger-char-tokenizer document"),
    (digests.canonical_bytes({**GOOD, "format": "ledger-bpe-tokenizer"}), "not a ledger-char-tokenizer document"),
    (digests.canonical_bytes({**GOOD, "version": 2}), "unsupported tokenizer version/specials: 2"),
    (digests.canonical_bytes({**GOOD, "specials": ["<pad>", "<bos>", "<eos>"]}), "unsupported tokenizer"),
    (digests.canonical_bytes({**GOOD, "chars": ["b", "a"]}), "distinct single characters sorted by code point"),
    (digests.canonical_bytes({**GOOD, "chars": ["a", "a"]}), "distinct single characters"),
    (digests.canonical_bytes({**GOOD, "chars": ["ab"]}), "distinct single characters"),
])
def test_malformed_tokenizer_bytes_are_rejected(data: bytes, message: str) -> None:
    assert CharTokenizer.from_bytes(digests.canonical_bytes(GOOD)) == CharTokenizer(["a", "b"])
    with pytest.raises(InputError, match=message):
        CharTokenizer.from_bytes(data)
