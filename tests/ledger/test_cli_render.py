"""`ledger show`'s tables of eval, comparison and quality receipts (ledger/cli/render.py) on measurements of any
shape: a receipt written behind the library's back, or appended without the fields the tables read, is shown as
its fields with one warning line, never a traceback."""

from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ledger import digests
from ledger.cli import app
from ledger.cli.render import receipt_tables
from ledger.errors import SHAPE_ERRORS
from ledger.receipts import make_receipt
from ledger.store import Store
from tests.conftest import schema_fill

SELECTION = digests.raw_digest(b"a selection")


def _value(rng: random.Random, depth: int = 0) -> Any:
    """A random JSON value, of the shapes a hand-written receipt holds."""
    pick = rng.randrange(9 if depth < 3 else 6)
    if pick == 0:
        return None
    if pick == 1:
        return rng.choice([True, False])
    if pick == 2:
        return rng.choice([0, 1, -1, 7, 2**63 - 1, -(2**63)])
    if pick == 3:
        return rng.choice([0.0, -0.0, 0.5, 1e-7, 3.25e12, -2.5])
    if pick in (4, 5):
        return rng.choice(["", "x", "arm", "[/]", ":x:", "documents"])
    if pick == 6:
        return [_value(rng, depth + 1) for _ in range(rng.randrange(3))]
    keys = ["documents", "correct", "arm", "family", "passed", "figure", "threshold", "rule", "retention",
            "mean_nll", "probes", "breakdowns", "comparisons_to_seed", "local_vs_ddp", "baseline_correct"]
    return {rng.choice(keys): _value(rng, depth + 1) for _ in range(rng.randrange(4))}


# the fields each kind's tables read, with a filled schema as the starting point
SHAPES = {
    "eval": ("breakdowns", "retention", "arm", "correct", "documents"),
    "comparison": ("gained", "candidate", "baseline", "retention", "lost"),
    "quality": ("conditions", "learning", "arms", "quality_contract_passed", "primary_arm"),
}


@pytest.mark.parametrize("kind", sorted(SHAPES))
def test_any_shape_builds_its_tables_or_raises_a_shape_error(kind: str) -> None:
    rng = random.Random(f"render {kind}")
    built = refused = 0
    for _ in range(400):
        measurements = schema_fill(kind)
        if kind == "comparison":
            measurements["method"] = "paired-exact-match"
        for name in rng.sample(SHAPES[kind], rng.randrange(1, len(SHAPES[kind]) + 1)):
            measurements[name] = _value(rng)
        r = make_receipt(kind, selection=SELECTION, measurements=measurements)
        try:
            receipt_tables(r)
            built += 1
        except SHAPE_ERRORS:
            refused += 1
    assert built and refused  # both outcomes met: the fuzzing reaches the tables and their failures


def _show(db: Path, rid: str) -> Any:
    return CliRunner().invoke(app, ["show", rid, "--db", str(db)])


@pytest.mark.parametrize("kind, measurements", [
    ("eval", {"format": "ledger-eval/1", "breakdowns": {"family": "not a table"}, "retention": {}}),
    ("eval", {"format": "ledger-eval/1", "breakdowns": {"family": {"sort": {"correct": "x", "documents": 2}}}}),
    ("quality", {"format": "ledger-quality/1", "conditions": {"c": 5}, "quality_contract_passed": True}),
    ("comparison", {"method": "paired-exact-match", "gained": 1, "candidate": "arm", "baseline": {}}),
])
def test_show_of_a_receipt_of_another_shape_shows_its_fields_and_warns(ledger_db: Path, kind: str,
                                                                       measurements: dict[str, Any]) -> None:
    r = make_receipt(kind, run="hand-written", selection=SELECTION, measurements=measurements)
    with Store.open(ledger_db) as store:
        store.append(r, check=False)  # as a keeper of the database could write it: no chain rule asked
    result = _show(ledger_db, r.id)
    assert result.exit_code == 0 and "Traceback" not in result.output, result.output
    assert r.id in result.stdout and "hand-written" in result.stdout  # the fields table, whole
    (line,) = result.stderr.splitlines()
    assert line.startswith(f"ledger: warning: receipt {r.id}: its measurements are not in the shape of {kind}")
