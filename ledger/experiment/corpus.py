"""The seed model's pretraining corpus, its token stream, the windows drawn from it, and the retention probes.

Torch-free, so a verifier can rebuild the stream from the ``pretrain_corpus`` artifact and the tokenizer and check
that every probe is a window the seed was pretrained on.

**Records** (the ``pretrain_corpus`` artifact: canonical JSONL, in stream order):

* ``{"source": "pydoc_data.topics", "key": topic, "text": text}``: every ``pydoc_data.topics`` entry (Python's own
  help text, ~465 KB, shipped with Python), in key order;
* ``{"source": "train_data", "document": digest, "prompt": p, "answer": a}``: the first ``pretrain.task_documents``
  training documents in their seeded order, so the seed has seen the task format (never a held-out document).

**Stream**: for each record in order, ``BOS + tokens + EOS``; a pydoc record's tokens are ``encode(text)``, a task
record's ``encode(prompt) + encode(answer)``, exactly as fine-tuning and evaluation tokenize a document. The EOS at
each document's end is what lets the seed stop after an answer (exact match needs the EOS).

**Windows**: ``stream[o : o + seq_len + 1]`` (inputs ``[:-1]``, targets ``[1:]``). Pretraining draws their offsets
from its Python generator; fine-tuning mixes in the windows of :func:`window_offsets`, a function of
(seed, step) split by rank like the documents, so every arm sees the same ones and a resumed run the same.

**Probes**: distinct pretraining windows lying wholly inside one pydoc record (no BOS or EOS inside), chosen by
seed; each keeps its stream offset, the pretraining step it was first seen at, and its decoded text.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

import numpy as np

from ledger import digests
from ledger.errors import InputError
from ledger.experiment.tasks import Document, shuffled
from ledger.experiment.tokenizer import Tokenizer

PYDOC_SOURCE: Final = "pydoc_data.topics"
TASK_SOURCE: Final = "train_data"
PROBE_FORMAT: Final = "pydoc-window"
_WINDOW_STREAM: Final = 0x77696E64  # "wind": the fine-tuning windows' SeedSequence label (documents use "rain")


def pydoc_topics() -> list[tuple[str, str]]:
    """Every ``pydoc_data.topics`` entry as (key, text), in key order."""
    from pydoc_data.topics import topics

    return [(key, topics[key]) for key in sorted(topics)]


def corpus_records(train: Sequence[Document], task_documents: int) -> list[dict[str, Any]]:
    """The pretraining corpus: every pydoc topic, then the first ``task_documents`` training documents."""
    if not 0 <= task_documents <= len(train):
        raise InputError(f"pretrain.task_documents = {task_documents}, but there are {len(train)} training documents")
    records: list[dict[str, Any]] = [{"source": PYDOC_SOURCE, "key": k, "text": t} for k, t in pydoc_topics()]
    records += [{"source": TASK_SOURCE, "document": d.digest, "prompt": d.prompt, "answer": d.answer}
                for d in train[:task_documents]]
    return records


def record_texts(records: Iterable[Mapping[str, Any]]) -> list[str]:
    """Every text of the records (what a character tokenizer's vocabulary must cover)."""
    out: list[str] = []
    for r in records:
        out.extend([r["text"]] if r["source"] == PYDOC_SOURCE else [r["prompt"], r["answer"]])
    return out


@dataclass(frozen=True)
class Stream:
    """The token stream and, per record, the span of its own tokens (between its BOS and its EOS)."""

    ids: list[int]
    spans: list[tuple[int, int]]
    sources: list[str]

    def window(self, offset: int, seq_len: int) -> list[int]:
        return self.ids[offset : offset + seq_len + 1]

    def span(self, seq_len: int) -> int:
        """The largest window offset (windows are ``seq_len + 1`` tokens)."""
        last = len(self.ids) - seq_len - 1
        if last < 0:
            raise InputError(f"the pretraining stream has {len(self.ids)} tokens, fewer than seq_len + 1")
        return last

    def inside_pydoc(self, offset: int, seq_len: int) -> bool:
        """Whether the window at ``offset`` lies wholly inside one pydoc record's tokens."""
        i = bisect.bisect_right(self.spans, (offset, len(self.ids))) - 1
        if i < 0 or self.sources[i] != PYDOC_SOURCE:
            return False
        start, end = self.spans[i]
        return start <= offset and offset + seq_len + 1 <= end


def build_stream(records: Iterable[Mapping[str, Any]], tokenizer: Tokenizer) -> Stream:
    """``BOS + tokens + EOS`` for every record, in order (strict: a character outside the vocabulary raises)."""
    ids: list[int] = []
    spans: list[tuple[int, int]] = []
    sources: list[str] = []
    for r in records:
        if r["source"] == PYDOC_SOURCE:
            tokens = tokenizer.encode(r["text"])
        elif r["source"] == TASK_SOURCE:
            tokens = tokenizer.encode(r["prompt"]) + tokenizer.encode(r["answer"])
        else:
            raise InputError(f"pretraining corpus record of unknown source {r.get('source')!r}")
        ids.append(tokenizer.bos_id)
        spans.append((len(ids), len(ids) + len(tokens)))
        sources.append(str(r["source"]))
        ids.extend(tokens)
        ids.append(tokenizer.eos_id)
    return Stream(ids, spans, sources)


def window_offsets(seed: int, step: int, span: int, count: int) -> list[int]:
    """The offsets of the pretraining windows mixed into fine-tuning step ``step``: a function of (seed, step)
    only, like the step's documents, so a resumed run reads the same windows. Rank r of w takes the contiguous
    shard ``[r * count / w, (r + 1) * count / w)``."""
    if count == 0:
        return []
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, _WINDOW_STREAM, step])))
    return [int(o) for o in rng.integers(0, span + 1, size=count)]


def probe_body(offset: int, text: str) -> dict[str, Any]:
    """What a probe's ``document`` digest commits to."""
    return {"format": PROBE_FORMAT, "source": PYDOC_SOURCE, "offset": offset, "text": text}


def retention_probes(stream: Stream, tokenizer: Tokenizer, windows: Sequence[tuple[int, int]], seq_len: int,
                     count: int, rng: random.Random) -> list[dict[str, Any]]:
    """``count`` distinct pretraining windows inside pydoc records, chosen by ``rng``.

    Each record: probe index, stream ``offset``, the pretraining ``step`` the window was first trained on, its
    decoded ``text``, and its ``document`` digest over :func:`probe_body`. A window whose text re-encodes to more
    than ``seq_len + 1`` tokens (possible only with a subword tokenizer) is passed over. With no pretraining
    (``windows`` empty: a base model used as it is) the candidates are every pydoc offset and ``step`` is null.
    """
    first_seen: dict[int, int | None] = {}
    for step, offset in windows:
        first_seen.setdefault(offset, step)
    if not windows:
        first_seen = {o: None for o in range(stream.span(seq_len) + 1)}
    candidates = sorted(o for o in first_seen if stream.inside_pydoc(o, seq_len))
    if count > len(candidates):
        raise InputError(f"data.retention_probes = {count} but pretraining saw only {len(candidates)} distinct "
                         "windows inside pydoc text; train longer or ask for fewer probes")
    probes: list[dict[str, Any]] = []
    for offset in shuffled(candidates, rng):
        if len(probes) == count:
            break
        text = tokenizer.decode(stream.window(offset, seq_len))
        if not 2 <= len(tokenizer.encode(text, strict=False)) <= seq_len + 1:
            continue
        probes.append({"probe": len(probes), "offset": offset, "step": first_seen[offset], "text": text,
                       "document": digests.document_digest(probe_body(offset, text))})
    if len(probes) < count:
        raise InputError(f"only {len(probes)} of {count} retention probes re-encode within seq_len + 1 tokens")
    return probes


__all__ = [
    "PROBE_FORMAT",
    "PYDOC_SOURCE",
    "TASK_SOURCE",
    "Stream",
    "build_stream",
    "corpus_records",
    "probe_body",
    "pydoc_topics",
    "record_texts",
    "retention_probes",
    "window_offsets",
]
