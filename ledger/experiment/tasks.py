"""Seeded generators for the four task families (filter, lookup, sort, total), four prompt variants each.

A document is a prompt followed by its exact, short answer; a model is right when greedy decoding after the prompt
yields the answer and then EOS. Each document keeps the structured ``fields`` it was rendered from, so its answer
can be recomputed independently, and has a stable digest (domain ``document``) over everything it says.

Randomness: one ``random.Random`` per (seed, split, family, variant), seeded with an integer derived through
``numpy.random.SeedSequence``; only ``randrange`` is used (stable across Python versions), and shuffles are
written out here rather than relying on library shuffle algorithms.

Disjointness: the held-out selection is drawn first; a training document is rejected when its exact prompt, or the
same structured instance of its family (e.g. the same list to sort, in another phrasing), is in the selection.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from ledger import digests
from ledger.errors import InputError, LedgerError

FAMILIES: Final = ("filter", "lookup", "sort", "total")
VARIANTS: Final = (0, 1, 2, 3)
_STREAMS: Final = {"eval": 1, "train": 2, "order": 3}
_MAX_DRAWS_PER_DOC: Final = 200  # rejection-sampling budget before we declare a family exhausted

Fields = dict[str, Any]


@dataclass(frozen=True)
class Document:
    """One task document. ``text`` = prompt + answer; the EOS token after it is the tokenizer's business."""

    family: str
    variant: int
    prompt: str
    answer: str
    fields: Fields

    @property
    def text(self) -> str:
        return self.prompt + self.answer

    def body(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "variant": self.variant,
            "prompt": self.prompt,
            "answer": self.answer,
            "fields": self.fields,
        }

    @property
    def digest(self) -> str:
        """The stable document digest (domain ``document``) over family, variant, prompt, answer and fields."""
        return digests.document_digest(self.body())

    def to_json(self) -> dict[str, Any]:
        """The JSONL record: the body plus its digest under ``document``."""
        return {**self.body(), "document": self.digest}

    @classmethod
    def from_json(cls, record: Any) -> Document:
        """Parse a JSONL record; its ``document`` digest must recompute."""
        if not isinstance(record, dict) or set(record) != {"family", "variant", "prompt", "answer", "fields",
                                                            "document"}:
            raise InputError(f"not a task document record: {str(record)[:120]}")
        doc = cls(record["family"], record["variant"], record["prompt"], record["answer"], record["fields"])
        if doc.digest != record["document"]:
            raise InputError(f"document digest {record['document']} does not recompute ({doc.digest})")
        return doc

    def instance_key(self) -> bytes:
        """The structured instance regardless of phrasing (what train/eval disjointness also excludes)."""
        return digests.canonical_bytes([self.family, self.fields])


# ------------------------------------------------------------------------------------------------ rendering


def _spaced(xs: Sequence[int]) -> str:
    return " ".join(str(x) for x in xs)


def _commas(xs: Sequence[int]) -> str:
    return ",".join(str(x) for x in xs)


def _filter(v: int, f: Fields) -> tuple[str, str]:
    xs, t = f["numbers"], f["threshold"]
    kept = [x for x in xs if x > t]
    if v == 0:
        return f"keep > {t}: {_spaced(xs)} -> ", _spaced(kept)
    if v == 1:
        return f"filter x>{t} [{_commas(xs)}] = ", f"[{_commas(kept)}]"
    if v == 2:
        return f"numbers above {t} in {_spaced(xs)}: ", _spaced(kept)
    return f"{', '.join(map(str, xs))} | drop <= {t} | ", ", ".join(map(str, kept))


def _lookup(v: int, f: Fields) -> tuple[str, str]:
    pairs, q = f["pairs"], f["query"]
    value = str(dict((k, val) for k, val in pairs)[q])
    if v == 0:
        return " ".join(f"{k}={val}" for k, val in pairs) + f"; {q}? ", value
    if v == 1:
        return "{" + ",".join(f"{k}:{val}" for k, val in pairs) + "}" + f"[{q}] = ", value
    if v == 2:
        return "given " + ", ".join(f"{k} is {val}" for k, val in pairs) + f": {q} is ", value
    return ", ".join(f"{k}->{val}" for k, val in pairs) + f". what is {q}? ", value


def _sort(v: int, f: Fields) -> tuple[str, str]:
    xs = f["numbers"]
    ys = sorted(xs)
    if v == 0:
        return f"sort: {_spaced(xs)} -> ", _spaced(ys)
    if v == 1:
        return f"sorted([{_commas(xs)}]) = ", f"[{_commas(ys)}]"
    if v == 2:
        return f"ascending {_spaced(xs)}: ", _spaced(ys)
    return f"{_commas(xs)} in order: ", _commas(ys)


def _total(v: int, f: Fields) -> tuple[str, str]:
    xs = f["numbers"]
    s = str(sum(xs))
    if v == 0:
        return f"sum: {_spaced(xs)} -> ", s
    if v == 1:
        return "+".join(map(str, xs)) + "=", s
    if v == 2:
        return f"total of {_spaced(xs)}: ", s
    return f"add [{_commas(xs)}] = ", s


RENDER: Final[dict[str, Callable[[int, Fields], tuple[str, str]]]] = {
    "filter": _filter,
    "lookup": _lookup,
    "sort": _sort,
    "total": _total,
}


def render(family: str, variant: int, fields: Fields) -> Document:
    """The document of ``family``/``variant`` for the structured instance ``fields``."""
    if family not in RENDER or variant not in VARIANTS:
        raise InputError(f"unknown task {family!r} variant {variant!r}")
    prompt, answer = RENDER[family](variant, fields)
    return Document(family, variant, prompt, answer, fields)


# ---------------------------------------------------------------------------------------------- sampling


def _digits(rng: random.Random, n: int) -> list[int]:
    return [rng.randrange(10) for _ in range(n)]


def _draw_filter(rng: random.Random) -> Fields:
    while True:  # at least one number kept and one dropped, so the answer is neither empty nor the input
        xs = _digits(rng, 3 + rng.randrange(3))
        t = 2 + rng.randrange(6)
        if any(x > t for x in xs) and any(x <= t for x in xs):
            return {"numbers": xs, "threshold": t}


def _draw_lookup(rng: random.Random) -> Fields:
    n = 3 + rng.randrange(2)
    letters = "abcdefghijklmnopqrstuvwxyz"
    keys: list[str] = []
    while len(keys) < n:
        k = letters[rng.randrange(len(letters))]
        if k not in keys:
            keys.append(k)
    pairs = [[k, rng.randrange(10)] for k in keys]
    return {"pairs": pairs, "query": keys[rng.randrange(n)]}


def _draw_sort(rng: random.Random) -> Fields:
    return {"numbers": _digits(rng, 3 + rng.randrange(3))}


def _draw_total(rng: random.Random) -> Fields:
    return {"numbers": _digits(rng, 2 + rng.randrange(2))}


DRAW: Final[dict[str, Callable[[random.Random], Fields]]] = {
    "filter": _draw_filter,
    "lookup": _draw_lookup,
    "sort": _draw_sort,
    "total": _draw_total,
}


def derived_rng(seed: int, *labels: int) -> random.Random:
    """A ``random.Random`` for (seed, labels...), via SeedSequence so nearby seeds give unrelated streams."""
    state = np.random.SeedSequence([seed, *labels]).generate_state(2, dtype=np.uint64)
    return random.Random(int(state[0]) << 64 | int(state[1]))


def derived_seed(seed: int, *labels: int) -> int:
    """A non-negative 63-bit seed for (seed, labels...) (fits canonical JSON's signed 64-bit integers)."""
    return int(np.random.SeedSequence([seed, *labels]).generate_state(1, dtype=np.uint64)[0]) >> 1


def shuffled(items: Sequence[Any], rng: random.Random) -> list[Any]:
    """Fisher-Yates with ``randrange`` only (spelled out so the order never depends on a library's choice)."""
    out = list(items)
    for i in range(len(out) - 1, 0, -1):
        j = rng.randrange(i + 1)
        out[i], out[j] = out[j], out[i]
    return out


def _draw_unique(family: str, variant: int, n: int, rng: random.Random, taken_prompts: set[str],
                 taken_instances: set[bytes], excluded_instances: frozenset[bytes] = frozenset()) -> list[Document]:
    """``n`` documents whose prompts and instances are not taken yet (both sets are updated) nor excluded."""
    docs: list[Document] = []
    budget = n * _MAX_DRAWS_PER_DOC
    while len(docs) < n:
        if budget == 0:
            raise InputError(f"cannot draw {n} distinct {family}/{variant} documents; lower the count")
        budget -= 1
        doc = render(family, variant, DRAW[family](rng))
        key = doc.instance_key()
        if doc.prompt in taken_prompts or key in taken_instances or key in excluded_instances:
            continue
        taken_prompts.add(doc.prompt)
        taken_instances.add(key)
        docs.append(doc)
    return docs


def eval_selection(seed: int, per_variant: int) -> list[Document]:
    """The held-out selection: ``per_variant`` documents per (family, variant), in family/variant order.

    No two selection documents share a prompt or a structured instance (not even across variants).
    """
    docs: list[Document] = []
    for fi, family in enumerate(FAMILIES):
        prompts: set[str] = set()
        instances: set[bytes] = set()
        for variant in VARIANTS:
            rng = derived_rng(seed, _STREAMS["eval"], fi, variant)
            docs.extend(_draw_unique(family, variant, per_variant, rng, prompts, instances))
    return docs


def training_documents(seed: int, per_variant: int, held_out: Iterable[Document]) -> list[Document]:
    """Training documents in a seeded order: ``per_variant`` per (family, variant), distinct within their
    variant, and sharing neither a prompt nor a structured instance with ``held_out``."""
    held = list(held_out)
    docs: list[Document] = []
    held_prompts = frozenset(d.prompt for d in held)
    for fi, family in enumerate(FAMILIES):
        excluded = frozenset(d.instance_key() for d in held if d.family == family)
        for variant in VARIANTS:
            rng = derived_rng(seed, _STREAMS["train"], fi, variant)
            docs.extend(_draw_unique(family, variant, per_variant, rng, set(held_prompts), set(), excluded))
    docs = shuffled(docs, derived_rng(seed, _STREAMS["order"]))
    check_disjoint(docs, held)
    return docs


def check_disjoint(train: Iterable[Document], held_out: Iterable[Document]) -> None:
    """Raise if any held-out prompt or instance also occurs in training (an invariant, checked every time)."""
    held = list(held_out)
    prompts = {d.prompt for d in held}
    instances = {d.instance_key() for d in held}
    for d in train:
        if d.prompt in prompts or d.instance_key() in instances:
            raise LedgerError(f"training document {d.digest} overlaps the held-out selection ({d.prompt!r})")


def counts(docs: Iterable[Document]) -> dict[str, Any]:
    """Documents per family, per variant and per family/variant (the selection receipt's measurements)."""
    by_family: dict[str, int] = {}
    by_variant: dict[str, int] = {}
    cells: dict[str, dict[str, int]] = {}
    total = 0
    for d in docs:
        total += 1
        by_family[d.family] = by_family.get(d.family, 0) + 1
        by_variant[str(d.variant)] = by_variant.get(str(d.variant), 0) + 1
        cell = cells.setdefault(d.family, {})
        cell[str(d.variant)] = cell.get(str(d.variant), 0) + 1
    return {"documents": total, "family": by_family, "variant": by_variant, "family_variant": cells}
