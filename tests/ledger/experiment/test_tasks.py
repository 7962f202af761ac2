"""Task generators (determinism, variants, correct answers, train/eval disjointness) and the tokenizer."""

from __future__ import annotations

import re

import pytest

from ledger import digests
from ledger.errors import InputError, LedgerError
from ledger.experiment import tasks
from ledger.experiment.tokenizer import BOS_ID, EOS_ID, PAD_ID, UNK_ID, CharTokenizer

SEED = 11


@pytest.fixture(scope="module")
def selection() -> list[tasks.Document]:
    return tasks.eval_selection(SEED, 16)


@pytest.fixture(scope="module")
def train(selection: list[tasks.Document]) -> list[tasks.Document]:
    return tasks.training_documents(SEED, 64, selection)


def _ints(text: str) -> list[int]:
    return [int(x) for x in re.findall(r"\d+", text)]


def expected_answer_values(doc: tasks.Document) -> list[int]:
    """The answer recomputed from the structured fields, independently of ledger.experiment.tasks."""
    f = doc.fields
    if doc.family == "filter":
        return [x for x in f["numbers"] if x > f["threshold"]]
    if doc.family == "lookup":
        return [next(v for k, v in f["pairs"] if k == f["query"])]
    if doc.family == "sort":
        return sorted(f["numbers"])
    assert doc.family == "total"
    return [sum(f["numbers"])]


def test_same_seed_same_documents_other_seed_differs(selection: list[tasks.Document],
                                                     train: list[tasks.Document]) -> None:
    again = tasks.eval_selection(SEED, 16)
    assert [d.digest for d in again] == [d.digest for d in selection]
    assert [d.digest for d in tasks.training_documents(SEED, 64, again)] == [d.digest for d in train]
    other = tasks.eval_selection(SEED + 1, 16)
    assert {d.prompt for d in other} != {d.prompt for d in selection}


def test_counts_per_family_and_variant(selection: list[tasks.Document], train: list[tasks.Document]) -> None:
    c = tasks.counts(selection)
    assert c["documents"] == 4 * 4 * 16
    assert c["family"] == {f: 64 for f in tasks.FAMILIES}
    assert c["variant"] == {str(v): 64 for v in tasks.VARIANTS}
    assert all(cell == {str(v): 16 for v in tasks.VARIANTS} for cell in c["family_variant"].values())
    assert tasks.counts(train)["documents"] == 4 * 4 * 64


def test_answers_are_correct_and_prompts_show_the_fields(selection: list[tasks.Document],
                                                         train: list[tasks.Document]) -> None:
    for doc in [*selection, *train]:
        assert _ints(doc.answer) == expected_answer_values(doc), doc
        assert doc.text == doc.prompt + doc.answer
        assert doc.answer and doc.answer == doc.answer.strip()
        numbers = doc.fields.get("numbers")
        if numbers is not None:  # the prompt lists the numbers in order (plus the threshold for filter)
            shown = _ints(doc.prompt)
            assert numbers == (shown[1:] if doc.family == "filter" and doc.variant in (0, 1, 2) else
                               shown[:-1] if doc.family == "filter" else shown)
        else:
            pairs = re.findall(r"([a-z])\s*(?:=|:|->| is )\s*(\d)", doc.prompt)
            assert [[k, int(v)] for k, v in pairs] == doc.fields["pairs"]
            assert re.search(rf"\b{doc.fields['query']}\b\W*(?:\?|\]| is)\s*=?\s*$", doc.prompt)


def test_variants_are_distinct_phrasings_of_the_same_instance() -> None:
    rng = tasks.derived_rng(3, 99)
    for family in tasks.FAMILIES:
        fields = tasks.DRAW[family](rng)
        docs = [tasks.render(family, v, fields) for v in tasks.VARIANTS]
        assert len({d.prompt for d in docs}) == 4
        assert len({d.instance_key() for d in docs}) == 1
        assert len({tuple(_ints(d.answer)) for d in docs}) == 1


def test_training_never_overlaps_the_selection(selection: list[tasks.Document],
                                               train: list[tasks.Document]) -> None:
    assert not {d.prompt for d in train} & {d.prompt for d in selection}
    assert not {d.instance_key() for d in train} & {d.instance_key() for d in selection}
    assert len({d.prompt for d in selection}) == len(selection)
    assert len({d.prompt for d in train}) == len(train)
    with pytest.raises(LedgerError, match="overlaps the held-out selection"):
        tasks.check_disjoint([train[0], selection[3]], selection)
    # the same instance in another phrasing counts as an overlap too
    held = selection[0]
    other = tasks.render(held.family, (held.variant + 1) % 4, held.fields)
    with pytest.raises(LedgerError):
        tasks.check_disjoint([other], selection)


def test_document_digest_is_stable_and_checked(selection: list[tasks.Document]) -> None:
    doc = selection[0]
    assert doc.digest == digests.digest_json("document", doc.body())
    record = doc.to_json()
    assert tasks.Document.from_json(record) == doc
    assert tasks.Document.from_json(digests.parse_canonical(digests.canonical_bytes(record))) == doc
    with pytest.raises(InputError, match="does not recompute"):
        tasks.Document.from_json({**record, "answer": record["answer"] + "0"})


def test_exhausted_family_is_reported() -> None:
    with pytest.raises(InputError, match="cannot draw"):
        tasks.eval_selection(SEED, 400)  # 'total' has only 1,100 instances: 4 variants x 400 cannot be distinct


# ----------------------------------------------------------------------------------------------- tokenizer


def test_tokenizer_round_trip_and_specials(selection: list[tasks.Document]) -> None:
    tok = CharTokenizer.build(d.text for d in selection)
    assert (PAD_ID, BOS_ID, EOS_ID, UNK_ID) == (0, 1, 2, 3)
    for doc in selection:
        ids = tok.encode(doc.text, bos=True, eos=True)
        assert ids[0] == BOS_ID and ids[-1] == EOS_ID and len(ids) == len(doc.text) + 2
        assert tok.decode(ids) == doc.text
        assert all(4 <= i < tok.vocab_size for i in ids[1:-1])
    with pytest.raises(InputError, match="not in the tokenizer"):
        tok.encode("é")
    assert tok.encode("é", strict=False) == [UNK_ID]
    assert tok.decode([UNK_ID]) == "\ufffd"


def test_tokenizer_is_deterministic_and_serialises_canonically(selection: list[tasks.Document]) -> None:
    texts = [d.text for d in selection]
    a = CharTokenizer.build(texts)
    b = CharTokenizer.build(reversed(texts))
    assert a == b and a.canonical_bytes() == b.canonical_bytes()
    data = a.canonical_bytes()
    assert digests.parse_canonical(data) == a.to_json()
    assert CharTokenizer.from_bytes(data) == a
    with pytest.raises(InputError):
        CharTokenizer(["b", "a"])  # not sorted
    with pytest.raises(InputError):
        CharTokenizer.from_json({**a.to_json(), "version": 99})
