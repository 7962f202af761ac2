"""The chain rules: which receipts may follow which. Pure and I/O-free.

The store (or anyone holding receipts) feeds receipts in; these functions answer by returning ``None`` or raising
:class:`~ledger.errors.ChainBroken` naming the receipt, the rule and both values. Rules are documented in
docs/receipts.md ("Chain rules"); each kind's rule is one small function registered in ``RULES``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

from ledger import digests
from ledger.errors import ChainBroken
from ledger.receipts import Receipt

Parents = Mapping[str, Receipt]
Rule = Callable[[Receipt, list[Receipt]], None]

# Kinds that hold a rank's training state, and so may precede a checkpoint or a train-end.
STATE_KINDS = frozenset({"train-start", "checkpoint", "restore"})
# Kinds whose receipt names a trained or seed model in artifacts["model"].
MODEL_KINDS = frozenset({"prepare", "checkpoint", "train-end"})


def prepared_digest(artifacts: Mapping[str, str]) -> str:
    """The `prepared` digest: commits to every artifact of the prepare step (data, tokenizer, seed, config)."""
    return digests.digest_json("prepared", dict(artifacts))


def selection_digest(artifacts: Mapping[str, str]) -> str:
    """The `selection` digest: commits to the evaluation selection and the retention probes."""
    return digests.digest_json("selection", dict(artifacts))


def _broken(r: Receipt, rule: str, field: str | None = None, expected: object = None,
            actual: object = None) -> ChainBroken:
    return ChainBroken(r.id, rule, field=field, expected=expected, actual=actual)


def _require(r: Receipt, *names: str) -> None:
    for name in names:
        if getattr(r, name) is None:
            raise _broken(r, f"a {r.kind} receipt needs `{name}`", field=name, expected="a value", actual=None)


def _forbid(r: Receipt, *names: str) -> None:
    for name in names:
        if getattr(r, name) is not None:
            raise _broken(r, f"a {r.kind} receipt has no `{name}`", field=name, expected=None,
                          actual=getattr(r, name))


def _one_parent(r: Receipt, parents: list[Receipt], kinds: frozenset[str] | set[str], what: str) -> Receipt:
    found = [p for p in parents if p.kind in kinds]
    if len(found) != 1:
        raise _broken(r, f"a {r.kind} receipt cites exactly one {what} ({'/'.join(sorted(kinds))})",
                      field="parents", expected=1, actual=len(found))
    return found[0]


# --------------------------------------------------------------------------------------------- kind rules


def _prepare(r: Receipt, parents: list[Receipt]) -> None:
    _forbid(r, "rank", "step", "selection")
    if parents:
        raise _broken(r, "a prepare receipt has no parents", field="parents", expected=[], actual=list(r.parents))
    expected = prepared_digest(r.artifacts)
    if r.prepared != expected:
        raise _broken(r, "prepared must be the digest of the prepare artifacts", field="prepared",
                      expected=expected, actual=r.prepared)


def _selection(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "selection")
    _one_parent(r, parents, {"prepare"}, "prepare receipt")
    expected = selection_digest(r.artifacts)
    if r.selection != expected:
        raise _broken(r, "selection must be the digest of the selection artifacts", field="selection",
                      expected=expected, actual=r.selection)


def _contract(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared")
    _one_parent(r, parents, {"prepare"}, "prepare receipt")


def _train_start(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "run", "rank", "step")
    _one_parent(r, parents, {"prepare"}, "prepare receipt")


def _previous_state(r: Receipt, parents: list[Receipt], *, after_checkpoint: bool = True) -> Receipt:
    """The one state receipt ``r`` continues from. A checkpoint must be later than the checkpoint before it; a
    train-end may sit at its final checkpoint's step (``after_checkpoint=False``)."""
    prev = _one_parent(r, parents, STATE_KINDS, "previous state")
    if prev.rank != r.rank:
        raise _broken(r, f"the previous state {prev.id} belongs to another rank", field="rank",
                      expected=prev.rank, actual=r.rank)
    if prev.run != r.run:
        raise _broken(r, f"the previous state {prev.id} belongs to another run", field="run",
                      expected=prev.run, actual=r.run)
    assert prev.step is not None and r.step is not None
    strict = prev.kind == "checkpoint" and after_checkpoint
    if not (r.step > prev.step if strict else r.step >= prev.step):
        raise _broken(r, f"steps must increase after {prev.kind} {prev.id}", field="step",
                      expected=f"> {prev.step}" if strict else f">= {prev.step}", actual=r.step)
    return prev


def _checkpoint(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "run", "rank", "step")
    _previous_state(r, parents)
    if "state" not in r.artifacts:
        raise _broken(r, "a checkpoint names its state digest in artifacts.state", field="artifacts.state")


def _train_end(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "run", "rank", "step")
    _previous_state(r, parents, after_checkpoint=False)


def _restore(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "run", "rank", "step")
    ckpt = _one_parent(r, parents, {"checkpoint"}, "checkpoint to restore")
    if ckpt.step != r.step:
        raise _broken(r, f"a restore resumes at its checkpoint's step ({ckpt.id})", field="step",
                      expected=ckpt.step, actual=r.step)
    if ckpt.rank != r.rank:
        raise _broken(r, f"a rank restores its own rank's checkpoint ({ckpt.id})", field="rank",
                      expected=ckpt.rank, actual=r.rank)
    if ckpt.run != r.run:  # a restarted group continues its own run: no mixing in another run's state
        raise _broken(r, f"a restore continues the run of its checkpoint {ckpt.id} (another lineage)",
                      field="run", expected=ckpt.run, actual=r.run)
    for name in ("state", "config"):
        if name in r.artifacts and r.artifacts.get(name) != ckpt.artifacts.get(name):
            raise _broken(r, f"restored {name} differs from checkpoint {ckpt.id} (another lineage)",
                          field=f"artifacts.{name}", expected=ckpt.artifacts.get(name), actual=r.artifacts[name])


def _model_source(r: Receipt, parents: list[Receipt]) -> None:
    source = _one_parent(r, parents, MODEL_KINDS, "model source")
    if "model" not in r.artifacts:
        raise _broken(r, f"a {r.kind} receipt names its model in artifacts.model", field="artifacts.model")
    if source.artifacts.get("model") != r.artifacts["model"]:
        raise _broken(r, f"the model differs from the one {source.kind} {source.id} produced",
                      field="artifacts.model", expected=source.artifacts.get("model"), actual=r.artifacts["model"])


def _eval(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared", "selection")
    _one_parent(r, parents, {"selection"}, "selection receipt")
    _model_source(r, parents)


def _quality(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared")
    _one_parent(r, parents, {"contract"}, "contract receipt")
    others = sorted({p.kind for p in parents} - {"contract"})
    if others != ["comparison"]:
        raise _broken(r, "a quality receipt cites its contract and the comparison receipts it judges, nothing else",
                      field="parents", expected=["comparison"], actual=others)


def _replica(r: Receipt, parents: list[Receipt]) -> None:
    _require(r, "prepared")
    _model_source(r, parents)


def _arm_summary(r: Receipt, parents: list[Receipt]) -> None:
    """A data-parallel arm's ranks hold identical weights at the end: its train-end receipts name one model."""
    ends = [p for p in parents if p.kind == "train-end" and p.run == r.run]
    if not ends:
        raise _broken(r, "an arm summary cites the train-end receipts of its run", field="parents")
    if r.measurements.get("arm") == "ddp-four":
        models = sorted({p.artifacts.get("model", "") for p in ends})
        if len(models) != 1:
            raise _broken(r, "DDP ranks ended with different model digests", field="artifacts.model",
                          expected=models[0], actual=models[1:])
    first = min(ends, key=lambda p: p.rank or 0)
    if "model" in r.artifacts and r.artifacts["model"] != first.artifacts.get("model"):
        raise _broken(r, "the summary's model is not its rank 0's", field="artifacts.model",
                      expected=first.artifacts.get("model"), actual=r.artifacts["model"])


def _no_rule(r: Receipt, parents: list[Receipt]) -> None:
    return None


RULES: dict[str, Rule] = {
    "prepare": _prepare,
    "selection": _selection,
    "contract": _contract,
    "train-start": _train_start,
    "checkpoint": _checkpoint,
    "train-end": _train_end,
    "restore": _restore,
    "eval": _eval,
    "quality": _quality,
    "replica": _replica,
    "arm-summary": _arm_summary,
    "fault": _no_rule,
    "comparison": _no_rule,
    "serve-phase": _no_rule,
    "audit": _no_rule,
    "settlement": _no_rule,
    "note": _no_rule,
}


# ------------------------------------------------------------------------------------------- entry points


def check_receipt(receipt: Receipt, parents: Parents) -> None:
    """Check one receipt against its parents (every parent id must be a key of ``parents``)."""
    cited: list[Receipt] = []
    for pid in receipt.parents:
        parent = parents.get(pid)
        if parent is None:
            raise _broken(receipt, f"parent {pid} is missing", field="parents", expected=pid, actual=None)
        if parent.id != pid:
            raise _broken(receipt, f"parent {pid} recomputes to {parent.id}", field="parents",
                          expected=pid, actual=parent.id)
        cited.append(parent)
    if receipt.kind != "prepare":
        for p in cited:
            if p.prepared != receipt.prepared:
                raise _broken(receipt, f"parent {p.id} has another prepared digest", field="prepared",
                              expected=p.prepared, actual=receipt.prepared)
            if p.selection is not None and receipt.selection is not None and p.selection != receipt.selection:
                raise _broken(receipt, f"parent {p.id} has another selection digest", field="selection",
                              expected=p.selection, actual=receipt.selection)
    RULES[receipt.kind](receipt, cited)


def topological(receipts: Iterable[Receipt]) -> list[Receipt]:
    """Order receipts so that every parent inside the set comes before its children (Kahn's algorithm)."""
    pending = {r.id: r for r in receipts}
    children: dict[str, list[str]] = {}
    waiting: dict[str, int] = {}
    for rid, r in pending.items():
        inside = [p for p in r.parents if p in pending]
        waiting[rid] = len(inside)
        for p in inside:
            children.setdefault(p, []).append(rid)
    ready = sorted(rid for rid, n in waiting.items() if n == 0)
    order: list[Receipt] = []
    while ready:
        rid = ready.pop()
        order.append(pending[rid])
        for child in children.get(rid, ()):
            waiting[child] -= 1
            if waiting[child] == 0:
                ready.append(child)
    if len(order) != len(pending):  # impossible with content addressing; guard against forged input anyway
        raise ChainBroken(min(set(pending) - {r.id for r in order}), "receipts form a cycle")
    return order


def check_chain(receipts: Iterable[Receipt], known: Parents | None = None) -> int:
    """Check every receipt of a closed set (plus ``known`` receipts already checked); return how many."""
    table: dict[str, Receipt] = dict(known or {})
    ordered = topological(receipts)
    table.update((r.id, r) for r in ordered)
    for r in ordered:
        check_receipt(r, table)
    return len(ordered)
