"""Alembic migrations: one head equal to SCHEMA_HEAD, upgrading an empty database yields exactly the models,
downgrade/upgrade round-trips, receipts survive a table-recreating migration, a populated 0001 database is refused
until upgraded and keeps every receipt (ids, bytes, edges, artifacts) through 0001 -> 0002 and back, databases at
no or an unknown revision are refused with the upgrade command named, the installed wheel carries its migrations.

Tests taking ``db_url`` or ``make_db_url`` run on an SQLite file and on PostgreSQL (tests/pg.py): the migrations
are the same scripts on both, and PostgreSQL is where constraint names share one namespace and foreign keys are
never off. Those on ``tmp_path`` alone are about SQLite's batch mode, its files, or the installed wheel.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sqlite3
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
from alembic import command
from alembic.script import ScriptDirectory
from sqlalchemy import create_engine, inspect, text
from sqlalchemy.exc import IntegrityError
from typer.testing import CliRunner

import migrations
from ledger import migrate
from ledger.cli import app
from ledger.database import display_url, make_engine, resolve_url, sqlite_path
from ledger.errors import EXIT_DATABASE, DatabaseError, SchemaOutOfDate, UnknownSchema
from ledger.models import KNOWN_REVISIONS, SCHEMA_HEAD, Base
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from tests.conftest import ReceiptChain
from tests.pg import MakeDbUrl, raw_rows
from verify.receipts import verify_receipt

REPO = Path(__file__).resolve().parents[2]
TEST_REVISION = "0002_test"
LEDGER_TABLES = set(Base.metadata.tables)
# The tables SQLite stores WITHOUT ROWID: those the models declare so (their primary key is the whole row).
WITHOUT_ROWID = {name for name, table in Base.metadata.tables.items()
                 if table.dialect_options["sqlite"].get("with_rowid") is False}

# A throw-away second revision: batch mode with recreate="always" copies, drops and renames `receipts` (what
# SQLite needs for most ALTERs), the riskiest thing a real migration does to a populated ledger.
_ADD_COLUMN = f'''"""Test-only revision: a nullable column and an index on receipts, by recreating the table."""
import sqlalchemy as sa
from alembic import op

revision = "{TEST_REVISION}"
down_revision = "{SCHEMA_HEAD}"
branch_labels = None
depends_on = None


def upgrade() -> None:
    with op.batch_alter_table("receipts", recreate="always") as batch_op:
        batch_op.add_column(sa.Column("note", sa.Text(), nullable=True))
        batch_op.create_index("ix_receipts_step", ["step"], unique=False)


def downgrade() -> None:
    with op.batch_alter_table("receipts", recreate="always") as batch_op:
        batch_op.drop_index("ix_receipts_step")
        batch_op.drop_column("note")
'''

# A broken revision: deletes a receipt that others cite. env.py must refuse to commit it.
_DANGLING = f'''"""Test-only revision that leaves parent edges pointing nowhere."""
from alembic import op

revision = "{TEST_REVISION}"
down_revision = "{SCHEMA_HEAD}"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.execute("DELETE FROM receipt_artifacts WHERE receipt_seq IN (SELECT seq FROM receipts WHERE kind = 'prepare')")
    op.execute("DELETE FROM receipts WHERE kind = 'prepare'")


def downgrade() -> None:
    pass
'''


# ------------------------------------------------------------------------------------------------ helpers


def url_of(path: Path) -> str:
    return resolve_url(path)


def temp_migrations(tmp_path: Path, revision_source: str) -> Path:
    """A copy of the shipped migrations plus one extra revision; returns the copy's directory."""
    copy = tmp_path / "migrations_copy"
    shutil.copytree(Path(migrations.__file__).parent, copy, ignore=shutil.ignore_patterns("__pycache__"))
    (copy / "versions" / f"{TEST_REVISION}.py").write_text(revision_source)
    return copy


def rows_snapshot(db: str | Path) -> list[tuple[int, str, bytes]]:
    """(seq, id, body) of every receipt, read through a plain engine so nothing of ours is in the way."""
    return [(seq, rid, bytes(body)) for seq, rid, body in
            raw_rows(resolve_url(db), "SELECT seq, id, body FROM receipts ORDER BY seq")]


def edge_count(db: str | Path) -> tuple[int, int]:
    url = resolve_url(db)
    return (raw_rows(url, "SELECT count(*) FROM receipt_parents")[0][0],
            raw_rows(url, "SELECT count(*) FROM receipt_artifacts")[0][0])


def populate(db: str | Path, chain: ReceiptChain) -> list[str]:
    """A ledger at head holding ``chain`` plus a second lineage cross-linked into it; returns every id."""
    with Store.open(db, create=True) as store:
        store.append_many(chain.receipts())
        note = make_receipt("note", prepared=chain.prepared, parents=[chain.eval, chain.contract],
                            measurements={"text": "cites two branches"})
        store.append(note)
        return [s.receipt.id for s in store.find()]


def assert_all_verify(store: Store, ids: list[str]) -> None:
    for rid in ids:
        report = verify_receipt(store, rid)
        assert report.receipt == rid


def reflected_names(url: str) -> set[str | None]:
    """Every constraint and index name in the database's ledger tables."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            insp = inspect(conn)
            names: set[str | None] = set()
            for table in LEDGER_TABLES:
                names.add(insp.get_pk_constraint(table)["name"])
                names.update(u["name"] for u in insp.get_unique_constraints(table))
                names.update(f["name"] for f in insp.get_foreign_keys(table))
                names.update(i["name"] for i in insp.get_indexes(table))
            return names
    finally:
        engine.dispose()


def model_names() -> set[str | None]:
    """The same names as the models declare them (through the metadata's naming convention)."""
    names: set[str | None] = set()
    for table in Base.metadata.tables.values():
        names.update(str(c.name) for c in table.constraints)
        names.update(str(i.name) for i in table.indexes)
    return names


def table_names(url: str) -> set[str]:
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            return set(inspect(conn).get_table_names())
    finally:
        engine.dispose()


def without_rowid(path: Path) -> set[str]:
    """The tables SQLite stores WITHOUT ROWID (an option compare_metadata does not look at)."""
    with sqlite3.connect(path) as conn:
        return {name for name, sql in conn.execute("SELECT name, sql FROM sqlite_master WHERE type = 'table'")
                if sql.rstrip().endswith("WITHOUT ROWID")}


def sqlite_checks(url: str) -> None:
    """SQLite's own checks of a file (PostgreSQL has no file to check and never turns foreign keys off)."""
    path = sqlite_path(url)
    if path is None:
        return
    with sqlite3.connect(path) as conn:
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []


def stamp(url: str, revision: str) -> None:
    raw_rows(url, "UPDATE alembic_version SET version_num = :v", {"v": revision})


def edit_without_foreign_keys(url: str, sql: str, params: dict[str, str]) -> None:
    """Write a row no foreign key would allow, as an editor can: SQLite's stdlib driver has them off, and a
    PostgreSQL superuser can switch their triggers off for a transaction."""
    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            if conn.dialect.name == "postgresql":
                conn.exec_driver_sql("SET LOCAL session_replication_role = replica")
            conn.execute(text(sql), params)
    finally:
        engine.dispose()


FIRST = KNOWN_REVISIONS[0]  # 0001_initial: edge and artifact rows keyed by receipt id
Edges = set[tuple[str, str]]
Artifacts = set[tuple[str, str, str]]


def lineage(chain: ReceiptChain) -> list[Receipt]:
    """``chain`` plus a note citing two of its branches (the receipts populate() stores), parents first."""
    note = make_receipt("note", prepared=chain.prepared, parents=[chain.eval, chain.contract],
                        measurements={"text": "cites two branches"})
    return [*chain.receipts(), note]


def ancestry(receipts: list[Receipt], rid: str, *, up: bool = True) -> set[str]:
    """``rid`` and its ancestors (or descendants), from the parents inside the bodies alone."""
    edges = [(r.id, p) for r in receipts for p in r.parents]
    found, todo = {rid}, [rid]
    while todo:
        here = todo.pop()
        step = [p for c, p in edges if c == here] if up else [c for c, p in edges if p == here]
        todo.extend(x for x in step if x not in found)
        found.update(step)
    return found


def populate_first(url: str, receipts: list[Receipt]) -> None:
    """A database at 0001_initial holding ``receipts`` as 0001-era code stored them, written with plain SQL
    (nothing of today's store): edge and artifact rows keyed by the 71-character ids."""
    migrate.upgrade(url, FIRST)
    engine = make_engine(url)
    try:
        with engine.begin() as conn:
            conn.execute(text("INSERT INTO receipts (id, kind, run, rank, step, prepared, selection, body, "
                              "recorded_ns) VALUES (:id, :kind, :run, :rank, :step, :prepared, :selection, :body, "
                              ":ns)"),
                         [{"id": r.id, "kind": r.kind, "run": r.run, "rank": r.rank, "step": r.step,
                           "prepared": r.prepared, "selection": r.selection, "body": r.body, "ns": 1_000 + i}
                          for i, r in enumerate(receipts)])
            conn.execute(text("INSERT INTO receipt_parents (child, parent) VALUES (:c, :p)"),
                         [{"c": r.id, "p": p} for r in receipts for p in r.parents])
            conn.execute(text("INSERT INTO receipt_artifacts (receipt, name, digest) VALUES (:r, :n, :d)"),
                         [{"r": r.id, "n": n, "d": d} for r in receipts for n, d in r.artifacts.items()])
    finally:
        engine.dispose()


def index_rows(url: str) -> tuple[Edges, Artifacts, int, int]:
    """Every edge and artifact row as (ids...) tuples, whichever revision the database is at, and the row counts
    (a row that maps to no receipt would be missing from the sets but not from the counts)."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            if "child_seq" in {c["name"] for c in inspect(conn).get_columns("receipt_parents")}:
                edges = conn.execute(text("SELECT c.id, p.id FROM receipt_parents e JOIN receipts c "
                                          "ON c.seq = e.child_seq JOIN receipts p ON p.seq = e.parent_seq"))
                arts = conn.execute(text("SELECT r.id, a.name, a.digest FROM receipt_artifacts a JOIN receipts r "
                                         "ON r.seq = a.receipt_seq"))
            else:
                edges = conn.execute(text("SELECT child, parent FROM receipt_parents"))
                arts = conn.execute(text("SELECT receipt, name, digest FROM receipt_artifacts"))
            edge_set: Edges = {(c, p) for c, p in edges}
            art_set: Artifacts = {(r, n, d) for r, n, d in arts}
            counts = [conn.execute(text(f"SELECT count(*) FROM {t}")).scalar_one()
                      for t in ("receipt_parents", "receipt_artifacts")]
            return edge_set, art_set, counts[0], counts[1]
    finally:
        engine.dispose()


def from_bodies(receipts: list[Receipt]) -> tuple[Edges, Artifacts, int, int]:
    """What index_rows must return for a ledger holding exactly ``receipts``: derived from their bodies."""
    edges = {(r.id, p) for r in receipts for p in r.parents}
    arts = {(r.id, n, d) for r in receipts for n, d in r.artifacts.items()}
    return edges, arts, len(edges), len(arts)


def receipt_rows(url: str) -> list[tuple[int, str, bytes, int]]:
    """(seq, id, body, recorded_ns) of every receipt in append order, on any backend."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            rows = conn.execute(text("SELECT seq, id, body, recorded_ns FROM receipts ORDER BY seq"))
            return [(seq, rid, bytes(body), ns) for seq, rid, body, ns in rows]
    finally:
        engine.dispose()


def schema_shape(url: str) -> dict[str, object]:
    """Tables, columns (name, type, nullable), keys, foreign keys and indexes with their names, as reflected."""
    engine = make_engine(url)
    try:
        with engine.connect() as conn:
            insp = inspect(conn)
            shape: dict[str, object] = {}
            for t in sorted(insp.get_table_names()):
                shape[t] = (
                    [(c["name"], str(c["type"]), c["nullable"]) for c in insp.get_columns(t)],
                    insp.get_pk_constraint(t),
                    sorted((f["name"] or "", tuple(f["constrained_columns"]), f["referred_table"],
                            tuple(f["referred_columns"])) for f in insp.get_foreign_keys(t)),
                    sorted((i["name"] or "", tuple(str(c) for c in i["column_names"]), i["unique"])
                           for i in insp.get_indexes(t)),
                    sorted((u["name"] or "", tuple(u["column_names"])) for u in insp.get_unique_constraints(t)),
                )
            return shape
    finally:
        engine.dispose()


runner = CliRunner()


def cli(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


# ------------------------------------------------------------------------------------------ head and shape


def test_exactly_one_head_and_it_is_schema_head() -> None:
    assert migrate.heads() == [SCHEMA_HEAD]
    assert KNOWN_REVISIONS[-1] == SCHEMA_HEAD
    # KNOWN_REVISIONS lists every script, oldest first (walk_revisions goes head to base).
    script = ScriptDirectory.from_config(migrate.alembic_config("sqlite://"))
    assert [s.revision for s in script.walk_revisions()][::-1] == list(KNOWN_REVISIONS)


def test_upgrading_an_empty_database_yields_exactly_the_models(db_url: str) -> None:
    url = db_url  # SQLite: an existing zero-byte file, as `touch ledger.db` leaves it
    assert migrate.current(url) is None
    migrate.upgrade(url)
    assert migrate.current(url) == SCHEMA_HEAD
    assert table_names(url) == LEDGER_TABLES | {"alembic_version"}
    # compare_metadata covers columns, types, nullability, indexes and unique constraints (and foreign keys on
    # PostgreSQL) ...
    assert migrate.schema_diff(url) == []
    # ... but not primary or foreign key names on SQLite, so compare every name directly.
    assert reflected_names(url) == model_names()
    for name in ("pk_receipts", "uq_receipts_id", "fk_receipt_parents_child_seq_receipts",
                 "fk_receipt_parents_parent_seq_receipts", "fk_receipt_artifacts_receipt_seq_receipts",
                 "pk_receipt_parents", "pk_receipt_artifacts", "pk_artifact_locations", "ix_receipts_prepared_kind",
                 "ix_receipt_parents_parent_seq"):
        assert name in reflected_names(url)
    path = sqlite_path(url)
    if path is not None:  # the edge and artifact rows are one B-tree each on SQLite (the key is the whole row)
        assert {"receipt_parents", "receipt_artifacts", "receipt_locations"} <= WITHOUT_ROWID
        assert without_rowid(path) == WITHOUT_ROWID


def test_schema_diff_sees_a_drifted_database(db_url: str) -> None:
    """The drift check is only worth something if it can fail: drop an index and it must say so."""
    migrate.upgrade(db_url)
    raw_rows(db_url, "DROP INDEX ix_receipts_kind")
    diff = migrate.schema_diff(db_url)
    assert len(diff) == 1 and diff[0][0] == "add_index" and diff[0][1].name == "ix_receipts_kind"


def test_downgrade_to_base_and_upgrade_round_trips(db_url: str) -> None:
    url = db_url
    migrate.upgrade(url)
    migrate.downgrade(url, "base")
    assert migrate.current(url) is None
    assert table_names(url) & LEDGER_TABLES == set()
    migrate.upgrade(url)
    assert migrate.current(url) == SCHEMA_HEAD
    assert migrate.schema_diff(url) == []
    assert reflected_names(url) == model_names()
    with Store.open(url) as store:
        assert store.count() == 0


# ------------------------------------------------------------------------------------------ data survives


def test_upgrade_at_head_is_a_no_op_for_data(db_url: str, make_chain: Callable[..., ReceiptChain]) -> None:
    ids = populate(db_url, make_chain())
    before = rows_snapshot(db_url)
    code, stdout, stderr = cli("db", "upgrade", "--db", db_url, "--json")
    assert code == 0, stderr
    assert json.loads(stdout) == {"db": display_url(db_url), "from": SCHEMA_HEAD, "to": SCHEMA_HEAD}
    assert rows_snapshot(db_url) == before
    with Store.open(db_url) as store:
        assert_all_verify(store, ids)


# SQLite only: batch mode's copy-drop-rename is how SQLite ALTERs a table; PostgreSQL alters it in place, and there a
# foreign key citing the old table would keep the DROP from happening at all.
def test_receipts_survive_a_table_recreating_migration_and_its_downgrade(
    tmp_path: Path, make_chain: Callable[..., ReceiptChain]
) -> None:
    path = tmp_path / "ledger.db"
    url = url_of(path)
    chain = make_chain(checkpoint_steps=(2, 4, 6, 8), end_step=9)
    ids = populate(path, chain)
    before, edges = rows_snapshot(path), edge_count(path)
    assert len(before) == len(chain.receipts()) + 1 and edges[0] > 0 and edges[1] > 0
    scripts = temp_migrations(tmp_path, _ADD_COLUMN)

    migrate.upgrade(url, script_location=scripts)
    assert migrate.current(url) == TEST_REVISION
    with sqlite3.connect(path) as conn:
        columns = [row[1] for row in conn.execute("PRAGMA table_info(receipts)")]
        assert "note" in columns
        assert conn.execute("PRAGMA integrity_check").fetchone() == ("ok",)
        assert conn.execute("PRAGMA foreign_key_check").fetchall() == []
    # Same rows, same append order, same bytes, same edges.
    assert rows_snapshot(path) == before and edge_count(path) == edges
    # This code only knows revisions up to SCHEMA_HEAD: a newer database is refused, not silently used.
    with pytest.raises(UnknownSchema):
        Store.open(path)
    # The rows themselves still verify (the constructor skips the revision check on purpose).
    store = Store(make_engine(url), url)
    try:
        assert_all_verify(store, ids)
        # The recreated table still enforces its foreign keys.
        with pytest.raises(IntegrityError), store.engine.begin() as conn:
            conn.exec_driver_sql("INSERT INTO receipt_parents (child_seq, parent_seq) VALUES (?, ?)",
                                 (before[-1][0], before[-1][0] + 1000))
    finally:
        store.close()

    migrate.downgrade(url, SCHEMA_HEAD, script_location=scripts)
    assert migrate.current(url) == SCHEMA_HEAD
    assert migrate.schema_diff(url) == [] and reflected_names(url) == model_names()
    assert rows_snapshot(path) == before and edge_count(path) == edges
    with Store.open(path) as store:
        assert_all_verify(store, ids)
        # And the ledger keeps growing where it left off.
        extra = store.append(make_receipt("note", prepared=chain.prepared, parents=[chain.train_end]))
        assert extra.seq == before[-1][0] + 1
        verify_receipt(store, extra.receipt.id)


def test_a_migration_that_breaks_a_foreign_key_is_rolled_back(
    tmp_path: Path, db_url: str, backend: str, make_chain: Callable[..., ReceiptChain]
) -> None:
    """On SQLite foreign keys are off while batch mode recreates tables, and env.py re-checks them before
    committing; PostgreSQL refuses the DELETE itself. Either way the migration rolls back whole."""
    populate(db_url, make_chain())
    before, edges = rows_snapshot(db_url), edge_count(db_url)
    scripts = temp_migrations(tmp_path, _DANGLING)
    refusal = "dangling foreign key" if backend == "sqlite" else "violates foreign key constraint"
    with pytest.raises(DatabaseError, match=refusal):
        migrate.upgrade(db_url, script_location=scripts)
    assert migrate.current(db_url) == SCHEMA_HEAD
    assert rows_snapshot(db_url) == before and edge_count(db_url) == edges


# ------------------------------------------------------------------------- the real 0001 -> 0002 migration


def test_a_database_at_0001_is_refused_and_upgrading_it_keeps_every_receipt(
    db_url: str, make_chain: Callable[..., ReceiptChain]
) -> None:
    """The older known revision, for real: refused with the command named, then upgraded through the CLI with
    every receipt, edge and artifact row carried over and every receipt verifying under the same id. On
    PostgreSQL the rows go through a scratch table (constraint names share one namespace there)."""
    url, shown = db_url, display_url(db_url)
    receipts = lineage(make_chain(checkpoint_steps=(2, 4, 6, 8), end_step=9))
    populate_first(url, receipts)
    before = receipt_rows(url)
    assert [rid for _, rid, _, _ in before] == [r.id for r in receipts]
    assert index_rows(url) == from_bodies(receipts)

    assert FIRST in KNOWN_REVISIONS and FIRST != SCHEMA_HEAD
    with pytest.raises(SchemaOutOfDate) as info:
        Store.open(url)
    assert info.value.current == FIRST and info.value.head == SCHEMA_HEAD
    assert FIRST in str(info.value) and f"`ledger db upgrade --db {shown}`" in str(info.value)
    for args in (("log",), ("verify", receipts[-1].id), ("show", receipts[0].id)):
        code, stdout, stderr = cli(*args, "--db", url)
        assert code == EXIT_DATABASE and stdout == "", (args, code, stdout, stderr)
        assert len(stderr.splitlines()) == 1 and FIRST in stderr and "`ledger db upgrade --db" in stderr
    code, stdout, _ = cli("db", "current", "--db", url, "--json")
    assert code == 0
    assert json.loads(stdout) == {"db": shown, "current": FIRST, "head": SCHEMA_HEAD, "up_to_date": False}

    code, stdout, stderr = cli("db", "upgrade", "--db", url, "--json")
    assert code == 0, stderr
    assert json.loads(stdout) == {"db": shown, "from": FIRST, "to": SCHEMA_HEAD}
    assert migrate.schema_diff(url) == [] and reflected_names(url) == model_names()
    assert table_names(url) == LEDGER_TABLES | {"alembic_version"}  # the scratch table is gone
    path = sqlite_path(url)
    if path is not None:
        assert without_rowid(path) == WITHOUT_ROWID
    sqlite_checks(url)
    # Same rows in the same append order with the same bytes; every index row still says what the bodies say.
    assert receipt_rows(url) == before
    assert index_rows(url) == from_bodies(receipts)

    with Store.open(url) as store:
        assert [s.receipt.id for s in store.find()] == [r.id for r in receipts]
        assert_all_verify(store, [r.id for r in receipts])
        # The recursive queries walk the carried-over edges: they agree with the parents inside the bodies.
        for r in receipts:
            assert {s.receipt.id for s in store.ancestors(r.id)} == ancestry(receipts, r.id, up=True)
            assert {s.receipt.id for s in store.descendants(r.id)} == ancestry(receipts, r.id, up=False)
        # The ledger keeps growing where 0001 left it (on PostgreSQL: its sequence is where the rows are).
        tip = receipts[-1]
        extra = store.append(make_receipt("note", prepared=tip.prepared, parents=[tip]))
        assert extra.seq == before[-1][0] + 1
        assert verify_receipt(store, extra.receipt.id).receipts_checked == len(ancestry(receipts, tip.id)) + 1
    code, stdout, stderr = cli("verify", receipts[-1].id, "--db", url, "--json")
    assert code == 0 and json.loads(stdout)["ok"] is True, stderr


def test_downgrade_to_0001_keeps_every_receipt_and_upgrades_again(
    make_db_url: MakeDbUrl, make_chain: Callable[..., ReceiptChain]
) -> None:
    url = make_db_url("ledger")
    chain = make_chain(checkpoint_steps=(2, 4, 6, 8), end_step=9)
    receipts = lineage(chain)
    ids = populate(url, chain)
    assert ids == [r.id for r in receipts]
    before = receipt_rows(url)
    assert index_rows(url) == from_bodies(receipts)

    code, _, stderr = cli("db", "downgrade", FIRST, "--db", url)
    assert code == 0, stderr
    assert migrate.current(url) == FIRST
    fresh = make_db_url("fresh_0001")
    migrate.upgrade(fresh, FIRST)
    assert schema_shape(url) == schema_shape(fresh)  # exactly 0001's tables, keys and indexes
    path = sqlite_path(url)
    if path is not None:
        assert without_rowid(path) == set()
    assert receipt_rows(url) == before and index_rows(url) == from_bodies(receipts)
    with pytest.raises(SchemaOutOfDate):
        Store.open(url)

    migrate.upgrade(url)
    assert migrate.current(url) == SCHEMA_HEAD
    assert migrate.schema_diff(url) == [] and reflected_names(url) == model_names()
    assert receipt_rows(url) == before and index_rows(url) == from_bodies(receipts)
    with Store.open(url) as store:
        assert_all_verify(store, ids)
        # Appending goes on after the round trip (on PostgreSQL: the sequence survived it).
        extra = store.append(make_receipt("note", prepared=chain.prepared, parents=[receipts[-1]]))
        assert extra.seq > before[-1][0]
        verify_receipt(store, extra.receipt.id)


@pytest.mark.parametrize("table, statement", [
    ("receipt_parents", "INSERT INTO receipt_parents (child, parent) VALUES (:ghost, :real)"),
    ("receipt_artifacts", "INSERT INTO receipt_artifacts (receipt, name, digest) VALUES (:ghost, 'x', :real)"),
], ids=["edge", "artifact"])
def test_upgrade_from_0001_refuses_index_rows_that_cite_no_receipt(
    make_db_url: MakeDbUrl, make_chain: Callable[..., ReceiptChain], table: str, statement: str
) -> None:
    """A 0001 edge or artifact row naming an id that is not stored (only an edit with foreign keys off makes one)
    cannot be keyed by seq: the upgrade stops, names the table, and leaves the database as it was."""
    receipts = lineage(make_chain())
    url, fresh = make_db_url("ledger"), make_db_url("fresh_0001")
    migrate.upgrade(fresh, FIRST)
    populate_first(url, receipts)
    edit_without_foreign_keys(url, statement, {"ghost": "blake3:" + "0" * 64, "real": receipts[0].id})
    before, rows = receipt_rows(url), index_rows(url)
    code, stdout, stderr = cli("db", "upgrade", "--db", url)
    assert code == EXIT_DATABASE and stdout == "", stderr
    assert len(stderr.splitlines()) == 1 and table in stderr and "1 of" in stderr
    assert migrate.current(url) == FIRST
    assert table_names(url) == table_names(fresh)  # 0001's tables, no scratch table, nothing newer
    assert receipt_rows(url) == before and index_rows(url) == rows


# ----------------------------------------------------------------------------- old and unknown revisions


def _unstamped(url: str) -> None:
    """Ledger tables made straight from the models, with no alembic_version at all."""
    engine = make_engine(url)
    Base.metadata.create_all(engine)
    engine.dispose()


def _downgraded(url: str) -> None:
    migrate.upgrade(url)
    migrate.downgrade(url, "base")


def _empty(url: str) -> None:
    """Nothing: the database is empty already (on SQLite a zero-byte file, as `touch ledger.db` leaves it)."""


@pytest.mark.parametrize("make_db", [_unstamped, _downgraded, _empty], ids=["tables-unstamped", "base", "empty"])
def test_a_database_without_a_revision_names_the_upgrade_command(db_url: str, make_db: Callable[[str], None]) -> None:
    url, shown = db_url, display_url(db_url)
    make_db(url)
    with pytest.raises(SchemaOutOfDate) as info:
        Store.open(url)
    # SchemaOutOfDate names the full command: `ledger db upgrade --db <path or URL>`
    assert info.value.exit_code == EXIT_DATABASE and f"`ledger db upgrade --db {shown}`" in str(info.value)

    code, stdout, stderr = cli("log", "--db", url)
    assert code == EXIT_DATABASE and stdout == ""
    assert len(stderr.splitlines()) == 1 and f"`ledger db upgrade --db {shown}`" in stderr

    # Following the advice works: the schema is created, or adopted when the tables already match head.
    code, stdout, stderr = cli("db", "upgrade", "--db", url, "--json")
    assert code == 0, stderr
    assert json.loads(stdout)["to"] == SCHEMA_HEAD
    assert migrate.schema_diff(url) == []
    code, stdout, _ = cli("log", "--db", url, "--json")
    assert code == 0 and json.loads(stdout) == []


def test_unstamped_tables_that_differ_from_head_are_not_adopted(db_url: str) -> None:
    _unstamped(db_url)
    raw_rows(db_url, "DROP INDEX ix_receipt_parents_parent_seq")
    code, stdout, stderr = cli("db", "upgrade", "--db", db_url)
    assert code == EXIT_DATABASE and len(stderr.splitlines()) == 1
    assert "differ from" in stderr and "ix_receipt_parents_parent_seq" in stderr
    assert migrate.current(db_url) is None


def test_an_unknown_revision_is_refused(db_url: str) -> None:
    url = db_url
    migrate.upgrade(url)
    stamp(url, "ffff_future")
    with pytest.raises(UnknownSchema) as info:
        Store.open(url)
    assert info.value.exit_code == EXIT_DATABASE == 4
    assert "ffff_future" in str(info.value) and "`ledger db upgrade`" in str(info.value)

    code, stdout, stderr = cli("log", "--db", url)
    assert code == 4 and stdout == ""
    assert len(stderr.splitlines()) == 1 and "`ledger db upgrade`" in stderr and "ffff_future" in stderr
    # Upgrading with software that does not know the revision is refused the same way, not a traceback.
    code, _, stderr = cli("db", "upgrade", "--db", url)
    assert code == 4 and len(stderr.splitlines()) == 1 and "ffff_future" in stderr
    code, stdout, _ = cli("db", "current", "--db", url, "--json")
    assert code == 0
    assert json.loads(stdout) == {"db": display_url(url), "current": "ffff_future", "head": SCHEMA_HEAD,
                                  "up_to_date": False}


def test_db_upgrade_creates_a_new_database_and_current_reports_it(db_url: str) -> None:
    url, shown = db_url, display_url(db_url)
    path = sqlite_path(url)
    if path is not None:  # SQLite: no file at all yet, only its directory; `db current` reads, as `log` does
        path.unlink()
        code, _, stderr = cli("db", "current", "--db", url, "--json")
        assert code == EXIT_DATABASE and "no ledger at" in stderr and not path.exists()
    else:  # PostgreSQL: an empty database has no revision yet
        code, stdout, _ = cli("db", "current", "--db", url, "--json")
        assert code == 0 and json.loads(stdout)["up_to_date"] is False and json.loads(stdout)["current"] is None
    code, stdout, stderr = cli("db", "upgrade", "--db", url)
    assert code == 0, stderr
    assert f"empty -> {SCHEMA_HEAD}" in stdout
    code, stdout, _ = cli("db", "current", "--db", url, "--json")
    assert code == 0
    assert json.loads(stdout) == {"db": shown, "current": SCHEMA_HEAD, "head": SCHEMA_HEAD, "up_to_date": True}
    assert migrate.schema_diff(url) == []


# SQLite only: a file whose directory is missing (tests/ledger/test_cli.py has a PostgreSQL database that is missing).
def test_db_upgrade_of_an_unopenable_database_is_one_line(tmp_path: Path) -> None:
    path = tmp_path / "missing-dir" / "x.db"
    code, _, stderr = cli("db", "upgrade", "--db", str(path))
    assert code == EXIT_DATABASE and stderr == (f"ledger: error: cannot create a ledger at {path}: the directory "
                                                f"{path.parent} does not exist\n")


def test_db_commands_open_no_fifo_and_create_nothing_they_only_read(tmp_path: Path) -> None:
    """A FIFO given as the ledger was opened by SQLite (a 'disk I/O error' from upgrade); downgrade of a path with
    no ledger created an empty database there."""
    import os

    fifo = tmp_path / "ledger.fifo"
    os.mkfifo(fifo)
    for args in (["upgrade"], ["downgrade", "base"], ["current"]):
        code, _, stderr = cli("db", *args, "--db", str(fifo))
        assert code == EXIT_DATABASE and stderr == f"ledger: error: cannot open {fifo}: it is a FIFO, not an SQLite " \
                                                   "ledger file\n", (args, stderr)
    code, _, stderr = cli("db", "downgrade", "base", "--db", str(tmp_path / "none.db"))
    assert code == EXIT_DATABASE and "no ledger at" in stderr and not (tmp_path / "none.db").exists()


def test_offline_sql_generation_is_refused_clearly() -> None:
    with pytest.raises(SystemExit, match="offline .* not supported.*`ledger db upgrade`"):
        command.upgrade(migrate.alembic_config("sqlite://"), "head", sql=True)


# ----------------------------------------------------------------------------------- non-editable install


@pytest.mark.slow
def test_db_upgrade_works_from_an_installed_wheel(tmp_path: Path) -> None:
    """Build a wheel from a copy of the sources, install it into a bare directory, migrate from outside the repo."""
    if importlib.util.find_spec("setuptools") is None:  # the offline, non-isolated build uses the local backend
        pytest.skip("building the wheel offline needs setuptools installed (pip install setuptools)")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for package in ("ledger", "verify", "runners", "migrations"):
        if (REPO / package).is_dir():
            shutil.copytree(REPO / package, src / package,
                            ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    wheels, site = tmp_path / "wheels", tmp_path / "site"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input"]
    subprocess.run([*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-q", "-w", str(wheels),
                    str(src)], check=True, capture_output=True, timeout=300)
    (wheel,) = wheels.glob("*.whl")
    subprocess.run([*pip, "install", "--no-deps", "--no-index", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=300)
    for shipped in ("migrations/env.py", "migrations/script.py.mako", f"migrations/versions/{SCHEMA_HEAD}.py"):
        assert (site / shipped).is_file(), shipped

    env = {k: v for k, v in os.environ.items() if not k.startswith("LEDGER_")}
    env["PYTHONPATH"] = str(site)
    work = tmp_path / "elsewhere"
    work.mkdir()
    db = tmp_path / "w.db"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, *args], cwd=work, env=env, capture_output=True, text=True,
                              timeout=120)

    where = run("-c", "import json, ledger, migrations; "
                      "print(json.dumps([ledger.__file__, migrations.__file__]))")
    assert where.returncode == 0, where.stderr
    for module_file in json.loads(where.stdout):
        assert Path(module_file).resolve().is_relative_to(site.resolve()), module_file

    up = run("-m", "ledger.cli", "db", "upgrade", "--db", str(db), "--json")
    assert up.returncode == 0, up.stderr
    assert json.loads(up.stdout) == {"db": str(db), "from": None, "to": SCHEMA_HEAD}
    cur = run("-m", "ledger.cli", "db", "current", "--db", str(db), "--json")
    assert cur.returncode == 0, cur.stderr
    assert json.loads(cur.stdout) == {"db": str(db), "current": SCHEMA_HEAD, "head": SCHEMA_HEAD, "up_to_date": True}
    assert migrate.schema_diff(url_of(db)) == []
