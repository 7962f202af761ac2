"""Chain rules (ledger/chain.py): each rule has a passing and a failing case; ordering; a deep chain."""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import pytest

from ledger import chain, digests
from ledger.errors import ChainBroken
from ledger.receipts import Receipt, make_receipt
from tests.conftest import ReceiptChain, fake_digest

MakeChain = Callable[..., ReceiptChain]


def table(*receipts: Receipt | Iterable[Receipt] | Mapping[str, Receipt]) -> dict[str, Receipt]:
    """An id -> receipt lookup from receipts, lists of them and other lookups."""
    out: dict[str, Receipt] = {}
    for item in receipts:
        if isinstance(item, Mapping):
            item = list(item.values())
        for r in [item] if isinstance(item, Receipt) else item:
            out[r.id] = r
    return out


def broken(receipt: Receipt, known: dict[str, Receipt]) -> ChainBroken:
    with pytest.raises(ChainBroken) as info:
        chain.check_receipt(receipt, known)
    assert info.value.receipt == receipt.id
    assert receipt.id in str(info.value)
    assert info.value.exit_code == 1
    return info.value


def like(r: Receipt, **changes: Any) -> Receipt:
    """A copy of ``r`` with some fields changed (parents given as ids or receipts)."""
    doc: dict[str, Any] = {
        "run": r.run, "rank": r.rank, "step": r.step, "prepared": r.prepared, "selection": r.selection,
        "parents": list(r.parents), "artifacts": dict(r.artifacts), "measurements": dict(r.measurements),
    }
    doc.update(changes)
    return make_receipt(r.kind, **doc)


@pytest.fixture
def c(make_chain: MakeChain) -> ReceiptChain:
    return make_chain()


def test_valid_chain_passes(c: ReceiptChain) -> None:
    assert chain.check_chain(c.receipts()) == len(c.receipts())
    known = table(c.receipts())
    for r in c.receipts():
        chain.check_receipt(r, known)


def test_check_chain_with_known_receipts(c: ReceiptChain) -> None:
    head = c.receipts()[:4]
    assert chain.check_chain(c.receipts()[4:], known=table(head)) == len(c.receipts()) - 4
    with pytest.raises(ChainBroken, match="is missing"):
        chain.check_chain(c.receipts()[4:])


def test_digest_helpers_are_domain_separated() -> None:
    arts = {"data": fake_digest("d")}
    assert digests.prepared_digest(arts) != digests.selection_digest(arts)
    assert digests.prepared_digest(arts) == digests.prepared_digest(dict(arts))
    assert digests.prepared_digest(arts) != digests.prepared_digest({"data": fake_digest("e")})


# ------------------------------------------------------------------------------------------------ prepare


def test_prepare_with_parents_is_broken(c: ReceiptChain) -> None:
    other = make_receipt("note")
    bad = like(c.prepare, parents=[other])
    err = broken(bad, table(other))
    assert err.field == "parents" and err.expected == [] and err.actual == [other.id]


def test_prepare_with_wrong_prepared_digest(c: ReceiptChain) -> None:
    bad = like(c.prepare, prepared=fake_digest("not the prepare artifacts"))
    err = broken(bad, {})
    assert err.field == "prepared"
    assert err.expected == c.prepared and err.actual == fake_digest("not the prepare artifacts")
    # The prepared digest commits to every artifact: adding one without recomputing it breaks the rule.
    err = broken(like(c.prepare, artifacts={**c.prepare.artifacts, "extra": fake_digest("x")}), {})
    assert err.field == "prepared" and err.actual == c.prepared


@pytest.mark.parametrize(("name", "value"), [("rank", 0), ("step", 0), ("selection", fake_digest("s"))])
def test_prepare_forbids_per_rank_fields(c: ReceiptChain, name: str, value: Any) -> None:
    err = broken(like(c.prepare, **{name: value}), {})
    assert err.field == name and err.expected is None and err.actual == value


# ---------------------------------------------------------------------------------------------- selection


def test_selection_digest_wrong(c: ReceiptChain) -> None:
    bad = like(c.selection, selection=digests.prepared_digest(c.selection.artifacts))
    err = broken(bad, table(c.prepare))
    assert err.field == "selection"
    assert err.expected == c.selection.selection and err.actual == bad.selection


def test_selection_needs_its_prepare_parent(c: ReceiptChain) -> None:
    err = broken(like(c.selection, parents=[]), {})
    assert err.field == "parents" and err.expected == 1 and err.actual == 0
    err = broken(like(c.selection, selection=None), table(c.prepare))
    assert err.field == "selection" and err.actual is None


# -------------------------------------------------------------------------------------- contract / start


def test_contract_rules(c: ReceiptChain) -> None:
    chain.check_receipt(c.contract, table(c.prepare))
    err = broken(like(c.contract, parents=[c.selection]), table(c.prepare, c.selection))
    assert err.field == "parents" and err.expected == 1 and err.actual == 0
    err = broken(like(c.contract, prepared=None, parents=[]), {})
    assert err.field == "prepared"


@pytest.mark.parametrize("name", ["run", "rank", "step", "prepared"])
def test_train_start_requires_binding_fields(c: ReceiptChain, name: str) -> None:
    chain.check_receipt(c.train_start, table(c.prepare))
    changes: dict[str, Any] = {name: None}
    parents = table(c.prepare)
    if name == "prepared":  # a parent with another prepared digest is reported first otherwise
        changes["parents"] = []
        parents = {}
    err = broken(like(c.train_start, **changes), parents)
    assert err.field == name and err.expected == "a value" and err.actual is None


# ------------------------------------------------------------------------------------------- checkpoints


def test_checkpoint_steps_must_increase(c: ReceiptChain) -> None:
    first, second = c.checkpoints
    known = table(c.prepare, c.train_start, first)
    chain.check_receipt(second, known)
    for step in (first.step, 1):
        err = broken(like(second, step=step), known)
        assert err.field == "step" and err.expected == f"> {first.step}" and err.actual == step


def test_checkpoint_may_follow_train_start_at_same_step(c: ReceiptChain) -> None:
    known = table(c.prepare, c.train_start)
    chain.check_receipt(like(c.checkpoints[0], step=0), known)


def test_checkpoint_citing_another_ranks_state(c: ReceiptChain, make_chain: MakeChain) -> None:
    other = make_chain(rank=1)
    assert other.prepared == c.prepared
    known = table(c.receipts(), other.receipts())
    err = broken(like(c.checkpoints[1], parents=[other.checkpoints[0]]), known)
    assert err.field == "rank" and err.expected == 1 and err.actual == 0
    assert other.checkpoints[0].id in err.rule


def test_checkpoint_citing_another_runs_state(c: ReceiptChain, make_chain: MakeChain) -> None:
    other = make_chain(run="run-b")
    known = table(c.receipts(), other.receipts())
    err = broken(like(c.checkpoints[1], parents=[other.checkpoints[0]]), known)
    assert err.field == "run" and err.expected == "run-b" and err.actual == "run-a"


def test_checkpoint_needs_exactly_one_previous_state(c: ReceiptChain) -> None:
    known = table(c.receipts())
    err = broken(like(c.checkpoints[1], parents=[c.checkpoints[0], c.train_start]), known)
    assert err.field == "parents" and err.expected == 1 and err.actual == 2
    err = broken(like(c.checkpoints[1], parents=[c.prepare]), known)
    assert err.field == "parents" and err.actual == 0


def test_checkpoint_names_its_state(c: ReceiptChain) -> None:
    arts = {k: v for k, v in c.checkpoints[0].artifacts.items() if k != "state"}
    err = broken(like(c.checkpoints[0], artifacts=arts), table(c.prepare, c.train_start))
    assert err.field == "artifacts.state"


def test_train_end_follows_a_state_of_its_rank(c: ReceiptChain, make_chain: MakeChain) -> None:
    known = table(c.receipts())
    chain.check_receipt(c.train_end, known)
    last = c.checkpoints[-1].step
    assert last is not None
    chain.check_receipt(like(c.train_end, step=last), known)  # training may end at its final checkpoint
    err = broken(like(c.train_end, step=last - 1), known)
    assert err.field == "step" and err.expected == f">= {last}" and err.actual == last - 1
    other = make_chain(rank=2)
    err = broken(like(c.train_end, parents=[other.checkpoints[-1]]), table(known, other.receipts()))
    assert err.field == "rank" and err.expected == 2


# ---------------------------------------------------------------------------------------------- restore


def restore_of(ckpt: Receipt, **changes: Any) -> Receipt:
    fields: dict[str, Any] = {
        "run": ckpt.run, "rank": ckpt.rank, "step": ckpt.step, "prepared": ckpt.prepared,
        "parents": [ckpt], "artifacts": {"state": ckpt.artifacts["state"], "config": ckpt.artifacts["config"]},
    }
    fields.update(changes)
    return make_receipt("restore", **fields)


def test_restore_rules(c: ReceiptChain) -> None:
    ckpt = c.checkpoints[0]
    known = table(c.receipts())
    good = restore_of(ckpt)
    chain.check_receipt(good, known)
    # A checkpoint may follow a restore at the same step or later.
    after = make_receipt("checkpoint", run=good.run, rank=good.rank, step=ckpt.step, prepared=c.prepared,
                         parents=[good], artifacts={"state": fake_digest("after")})
    chain.check_receipt(after, table(known, good))


def test_restore_from_another_runs_checkpoint(c: ReceiptChain) -> None:
    """Mix-and-match: a restarted group restores only checkpoints of its own run."""
    ckpt = c.checkpoints[0]
    err = broken(restore_of(ckpt, run="another-run"), table(c.receipts()))
    assert err.field == "run" and err.expected == ckpt.run and err.actual == "another-run"


def test_restore_at_wrong_step(c: ReceiptChain) -> None:
    ckpt = c.checkpoints[0]
    assert ckpt.step is not None
    err = broken(restore_of(ckpt, step=ckpt.step + 1), table(c.receipts()))
    assert err.field == "step" and err.expected == ckpt.step and err.actual == ckpt.step + 1


def test_restore_of_another_ranks_checkpoint(c: ReceiptChain) -> None:
    err = broken(restore_of(c.checkpoints[0], rank=5), table(c.receipts()))
    assert err.field == "rank" and err.expected == 0 and err.actual == 5


@pytest.mark.parametrize("name", ["config", "state"])
def test_restore_from_another_lineage(c: ReceiptChain, name: str) -> None:
    ckpt = c.checkpoints[0]
    arts = {"state": ckpt.artifacts["state"], "config": ckpt.artifacts["config"], name: fake_digest("other")}
    err = broken(restore_of(ckpt, artifacts=arts), table(c.receipts()))
    assert err.field == f"artifacts.{name}"
    assert err.expected == ckpt.artifacts[name] and err.actual == fake_digest("other")


def test_restore_needs_a_checkpoint(c: ReceiptChain) -> None:
    bad = make_receipt("restore", run="r2", rank=0, step=0, prepared=c.prepared, parents=[c.train_start])
    err = broken(bad, table(c.receipts()))
    assert err.field == "parents" and err.actual == 0


# ------------------------------------------------------------------------------------------ eval, replica


def test_eval_citing_a_model_no_parent_produced(c: ReceiptChain) -> None:
    known = table(c.receipts())
    chain.check_receipt(c.eval, known)
    bad = like(c.eval, artifacts={**c.eval.artifacts, "model": fake_digest("some other model")})
    err = broken(bad, known)
    assert err.field == "artifacts.model"
    assert err.expected == c.train_end.artifacts["model"] and err.actual == fake_digest("some other model")


def test_eval_of_the_seed_model(c: ReceiptChain) -> None:
    seed_eval = like(c.eval, parents=[c.selection, c.prepare], artifacts={"model": c.prepare.artifacts["model"]})
    chain.check_receipt(seed_eval, table(c.receipts()))


def test_eval_needs_selection_and_one_model_source(c: ReceiptChain) -> None:
    known = table(c.receipts())
    err = broken(like(c.eval, parents=[c.train_end]), known)
    assert err.field == "parents" and "an eval receipt cites exactly one selection receipt" in str(err)
    err = broken(like(c.eval, parents=[c.selection, c.train_end, c.checkpoints[-1]]), known)
    assert err.field == "parents" and err.actual == 2
    err = broken(like(c.eval, artifacts={"outcomes": fake_digest("o")}), known)
    assert err.field == "artifacts.model"


def test_eval_with_another_selection(c: ReceiptChain) -> None:
    bad = like(c.eval, selection=fake_digest("other selection"))
    err = broken(bad, table(c.receipts()))
    assert err.field == "selection" and err.expected == c.selection.selection


def test_replica_model_must_match(c: ReceiptChain) -> None:
    known = table(c.receipts())
    good = make_receipt("replica", prepared=c.prepared, parents=[c.train_end],
                        artifacts={"model": c.train_end.artifacts["model"]}, measurements={"port": 8001})
    chain.check_receipt(good, known)
    bad = like(good, artifacts={"model": c.checkpoints[0].artifacts["model"]})
    err = broken(bad, known)
    assert err.field == "artifacts.model"
    assert err.expected == c.train_end.artifacts["model"] and err.actual == c.checkpoints[0].artifacts["model"]


# -------------------------------------------------------------------------------------- cross-cutting rules


def test_parent_with_another_prepared_digest(c: ReceiptChain, make_chain: MakeChain) -> None:
    other = make_chain(salt="other-")
    assert other.prepared != c.prepared
    known = table(c.receipts(), other.receipts())
    err = broken(like(c.checkpoints[1], parents=[other.checkpoints[0]]), known)
    assert err.field == "prepared" and err.expected == other.prepared and err.actual == c.prepared
    # Even kinds without their own rule must share the prepared digest of what they cite.
    note = make_receipt("comparison", prepared=c.prepared, parents=[c.train_end, other.train_end])
    err = broken(note, known)
    assert err.field == "prepared"


def test_missing_parent(c: ReceiptChain) -> None:
    err = broken(c.checkpoints[0], table(c.prepare))
    assert err.field == "parents" and err.expected == c.train_start.id and err.actual is None


def test_parent_table_entry_must_recompute(c: ReceiptChain) -> None:
    known = table(c.prepare)
    known[c.train_start.id] = c.contract  # a forged lookup: the key is not the value's id
    err = broken(c.checkpoints[0], known)
    assert err.field == "parents" and err.expected == c.train_start.id and err.actual == c.contract.id


def test_kinds_without_rules_accept_anything_well_formed() -> None:
    for kind in ("note", "fault", "comparison"):
        chain.check_receipt(make_receipt(kind, measurements={"k": kind}), {})


def _ends(c: ReceiptChain, models: list[str]) -> list[Receipt]:
    last = c.checkpoints[-1]
    return [make_receipt("train-end", run=last.run, rank=rank, step=last.step, prepared=c.prepared, parents=[last],
                         artifacts={"model": fake_digest(m)}) for rank, m in enumerate(models)]


@pytest.mark.parametrize("arm", ["ddp-four", "diloco-four"])
def test_arm_summary_ddp_ranks_must_agree(c: ReceiptChain, arm: str) -> None:
    same = _ends(c, ["m", "m"])
    ok = make_receipt("arm-summary", run=same[0].run, prepared=c.prepared, parents=same,
                      artifacts={"model": fake_digest("m")}, measurements={"arm": arm})
    chain.check_receipt(ok, table(c.receipts(), *same))
    differ = _ends(c, ["m", "other"])
    summary = make_receipt("arm-summary", run=differ[0].run, prepared=c.prepared, parents=differ,
                           artifacts={"model": fake_digest("m")}, measurements={"arm": arm})
    if arm == "ddp-four":
        err = broken(summary, table(c.receipts(), *differ))
        assert err.field == "artifacts.model"
    else:  # DiLoCo ranks may differ between outer steps
        chain.check_receipt(summary, table(c.receipts(), *differ))


def test_arm_summary_needs_its_runs_ends(c: ReceiptChain) -> None:
    err = broken(make_receipt("arm-summary", run="x", prepared=c.prepared, parents=[c.checkpoints[-1]]),
                 table(c.receipts()))
    assert err.field == "parents"


# ---------------------------------------------------------------------------------------- ordering, depth


def test_topological_puts_parents_first(c: ReceiptChain) -> None:
    receipts = c.receipts()
    for seed in range(5):
        shuffled = receipts[:]
        random.Random(seed).shuffle(shuffled)
        order = chain.topological(shuffled)
        assert sorted(r.id for r in order) == sorted(r.id for r in receipts)
        position = {r.id: i for i, r in enumerate(order)}
        for r in order:
            for p in r.parents:
                assert position[p] < position[r.id]
        assert chain.check_chain(shuffled) == len(receipts)


def test_topological_ignores_parents_outside_the_set(c: ReceiptChain) -> None:
    order = chain.topological(c.checkpoints[::-1])
    assert [r.id for r in order] == [r.id for r in c.checkpoints]


def deep_chain(depth: int) -> list[Receipt]:
    arts = {"data": fake_digest("deep")}
    prepared = digests.prepared_digest(arts)
    prepare = make_receipt("prepare", prepared=prepared, artifacts=arts)
    prev = make_receipt("train-start", run="deep", rank=0, step=0, prepared=prepared, parents=[prepare])
    out = [prepare, prev]
    for step in range(1, depth - 1):
        prev = make_receipt("checkpoint", run="deep", rank=0, step=step, prepared=prepared, parents=[prev],
                            artifacts={"state": fake_digest(f"deep/{step}")})
        out.append(prev)
    return out


def test_check_chain_1000_deep() -> None:
    receipts = deep_chain(1000)
    assert len(receipts) == 1000
    shuffled = receipts[::-1]
    start = time.perf_counter()
    assert chain.check_chain(shuffled) == 1000
    elapsed = time.perf_counter() - start
    assert elapsed < 2.0, f"check_chain on 1000 receipts took {elapsed:.3f}s"
    # One bad link deep inside is found.
    bad = like(receipts[500], step=receipts[499].step)
    tail = [bad, *[like(r) for r in receipts[501:502]]]
    with pytest.raises(ChainBroken) as info:
        chain.check_chain([*receipts[:500], *tail])
    assert info.value.receipt == bad.id and info.value.field == "step"
