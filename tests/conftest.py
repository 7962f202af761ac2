"""Shared fixtures: a fresh SQLite ledger file and a builder for a valid receipt chain."""

from __future__ import annotations

import os
import signal
import sys
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings

from ledger import digests
from ledger.digests import prepared_digest, selection_digest
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from tests.background import Background
from tests.pg import backend, db_url, ledger_url, make_db_url, postgres_cluster, postgres_template  # noqa: F401

# Property tests keep no example database: throw-away files belong under temporary directories, not the repo.
settings.register_profile("ledger", database=None)
settings.load_profile("ledger")


def pytest_configure(config: pytest.Config) -> None:
    # A run stopped by SIGTERM (a CI job's time limit, `kill`) tears down as after Ctrl-C: the fixtures' finalizers
    # stop the throw-away PostgreSQL clusters (tests/pg.py), which run as another user, outside the killed process
    # group, and were left running.
    signal.signal(signal.SIGTERM, signal.default_int_handler)


# Timed against each other, these writers lose most to a loaded machine (four spawned appenders in a busy-wait for
# SQLite's lock took 14 s alone and 50 s beside the tiny experiment's ranks): they run last, when the background
# processes started below are done. Whole modules move, so module-scoped fixtures are still set up once.
RUN_LAST = ("tests/ledger/test_concurrency.py",)


def pytest_collection_modifyitems(session: pytest.Session, config: pytest.Config, items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: item.nodeid.split("::")[0] in RUN_LAST)  # stable: the order is kept otherwise


def pytest_collection_finish(session: pytest.Session) -> None:
    # mypy (half a minute of one core) and the session's tiny experiment (a minute) start now, in processes of their
    # own, and run beside the single-threaded tests; their tests and fixture wait for them.
    if any(item.nodeid.endswith("test_static.py::test_mypy_finds_no_error") for item in session.items):
        from tests.test_static import MYPY

        MYPY.start()
    if any("tiny_experiment" in getattr(item, "fixturenames", ()) for item in session.items):
        TINY_RUN.start()


def pytest_unconfigure(config: pytest.Config) -> None:
    from tests.test_static import MYPY

    MYPY.stop()
    TINY_RUN.stop()


LEDGER_ENV = ("LEDGER_DB", "LEDGER_ARTIFACTS", "LEDGER_DEBUG", "LEDGER_KEYS", "LEDGER_SIGNING_KEY", "LEDGER_WITNESS")


def clear_ledger_env(monkeypatch: pytest.MonkeyPatch) -> None:
    """A developer's LEDGER_DB / LEDGER_ARTIFACTS / LEDGER_DEBUG must not leak into tests (module-scoped fixtures,
    which run before the autouse one, call this with their own MonkeyPatch)."""
    for name in LEDGER_ENV:
        monkeypatch.delenv(name, raising=False)


@pytest.fixture(autouse=True)
def _hermetic_ledger_env(monkeypatch: pytest.MonkeyPatch) -> None:
    clear_ledger_env(monkeypatch)


@pytest.fixture
def ledger_db(tmp_path: Path) -> Iterator[Path]:
    """Path of a fresh SQLite ledger (schema at head) under tmp_path."""
    path = tmp_path / "ledger.db"
    store = Store.open(path, create=True)
    store.close()
    yield path


def schema_fill(kind: str, **given: Any) -> dict[str, Any]:
    """Measurements that fit ``kind``'s schema (ledger/kinds.py): each required field of its first format at a
    neutral value of its type, then ``given`` on top. Hand-built test receipts stay valid records."""
    from ledger.kinds import spec

    shapes = spec(kind).schema.shapes
    if not shapes:
        return dict(given)
    neutral = {bool: False, int: 0, float: 0.0, str: "x", list: [], dict: {}}
    out: dict[str, Any] = dict(shapes[0].when)
    for name, kind_type in shapes[0].fields.items():
        first = kind_type[0] if isinstance(kind_type, tuple) else kind_type
        out[name] = neutral[first]
    return out | given


def fake_digest(label: str) -> str:
    """A well-formed digest standing for an artifact whose bytes the test does not need."""
    return digests.raw_digest(label.encode())


@dataclass(frozen=True)
class ReceiptChain:
    """prepare -> selection, contract, train-start -> checkpoints -> train-end -> eval (one rank of one run)."""

    prepare: Receipt
    selection: Receipt
    contract: Receipt
    train_start: Receipt
    checkpoints: tuple[Receipt, ...]
    train_end: Receipt
    eval: Receipt

    @property
    def prepared(self) -> str:
        assert self.prepare.prepared is not None
        return self.prepare.prepared

    def receipts(self) -> list[Receipt]:
        """Every receipt, parents before children (an order the store accepts in one batch)."""
        return [self.prepare, self.selection, self.contract, self.train_start, *self.checkpoints,
                self.train_end, self.eval]


def build_chain(
    *,
    run: str = "run-a",
    rank: int = 0,
    checkpoint_steps: Sequence[int] = (2, 4),
    end_step: int = 6,
    salt: str = "",
    prepare_artifacts: Mapping[str, str] | None = None,
) -> ReceiptChain:
    """Build a valid chain with make_receipt; ``salt`` makes an otherwise identical chain distinct."""
    prep_arts = {
        "data": fake_digest(f"{salt}data"),
        "tokenizer": fake_digest(f"{salt}tokenizer"),
        "model": fake_digest(f"{salt}seed-model"),
        "config": fake_digest(f"{salt}config"),
        **(prepare_artifacts or {}),
    }
    prepared = prepared_digest(prep_arts)
    prepare = make_receipt("prepare", prepared=prepared, artifacts=prep_arts, measurements=schema_fill("prepare"))
    sel_arts = {"eval_selection": fake_digest(f"{salt}documents"), "retention_probes": fake_digest(f"{salt}probes")}
    selection = make_receipt("selection", prepared=prepared, selection=selection_digest(sel_arts),
                             parents=[prepare], artifacts=sel_arts, measurements=schema_fill("selection"))
    contract = make_receipt("contract", prepared=prepared, parents=[prepare],
                            measurements=schema_fill("contract", min_gain=0.05, max_bytes_ratio=0.1))
    start = make_receipt("train-start", run=run, rank=rank, step=0, prepared=prepared, parents=[prepare],
                         measurements=schema_fill("train-start", world=1))
    prev = start
    checkpoints = []
    for step in checkpoint_steps:
        prev = make_receipt(
            "checkpoint", run=run, rank=rank, step=step, prepared=prepared, parents=[prev],
            artifacts={"state": fake_digest(f"{salt}{run}/{rank}/state/{step}"),
                       "model": fake_digest(f"{salt}{run}/{rank}/model/{step}"),
                       "config": prep_arts["config"]},
            measurements=schema_fill("checkpoint", loss=1.0 / (step + 1)),
        )
        checkpoints.append(prev)
    final_model = fake_digest(f"{salt}{run}/{rank}/model/final")
    end = make_receipt("train-end", run=run, rank=rank, step=end_step, prepared=prepared, parents=[prev],
                       artifacts={"model": final_model}, measurements=schema_fill("train-end", loop_seconds=1.5))
    ev = make_receipt("eval", run=run, prepared=prepared, selection=selection.selection,
                      parents=[selection, end],
                      artifacts={"model": final_model, "outcomes": fake_digest(f"{salt}{run}/outcomes")},
                      measurements=schema_fill("eval", exact_match=17, documents=1024))
    return ReceiptChain(prepare, selection, contract, start, tuple(checkpoints), end, ev)


@pytest.fixture
def make_chain() -> Callable[..., ReceiptChain]:
    """The chain builder (see :func:`build_chain` for its keyword arguments)."""
    return build_chain


# ------------------------------------------------------------------------- one tiny experiment per test session

TINY_CONFIG = Path(__file__).resolve().parents[1] / "examples" / "tiny.toml"


@dataclass(frozen=True)
class TinyExperiment:
    """A whole experiment (`ledger run experiment` on examples/tiny.toml), trained once per test session.

    Tests that only read it use it as it is; a test that changes anything works on :meth:`copy`, whose ledger's
    recorded locations point into the copy (locations are a lookup, not part of any receipt)."""

    workdir: Path
    summary: Mapping[str, Any]

    @property
    def db(self) -> Path:
        return self.workdir / "ledger.db"

    @property
    def artifacts(self) -> Path:
        return self.workdir / "artifacts"

    def copy(self, dest: Path) -> TinyExperiment:
        import shutil
        import sqlite3

        shutil.copytree(self.workdir, dest, symlinks=True)
        conn = sqlite3.connect(dest / "ledger.db")
        with conn:
            for table in ("artifact_locations", "receipt_locations"):  # every recorded place, both lookups
                conn.execute(f"UPDATE {table} SET uri = replace(uri, ?, ?)",
                             (str(self.workdir.resolve()), str(dest.resolve())))
        conn.close()
        return TinyExperiment(dest, {**self.summary, "db": str(dest / "ledger.db")})


# The README's own main-job command at the tiny configuration; a developer's ledger settings stay out of it.
TINY_RUN = Background("tiny-experiment",
                      [sys.executable, "-m", "ledger.cli", "run", "experiment", "--workdir", "work",
                       "--config", str(TINY_CONFIG), "--json"],
                      env={k: v for k, v in os.environ.items() if k not in LEDGER_ENV})


@pytest.fixture(scope="session")
def tiny_experiment() -> TinyExperiment:
    """The session's tiny experiment; read it, or :meth:`TinyExperiment.copy` it before changing anything."""
    import json

    done = TINY_RUN.wait(timeout=900.0)
    assert done.code == 0, f"ledger run experiment exited {done.code}:\n{done.stderr[-4000:]}"
    return TinyExperiment(done.root / "work", json.loads(done.stdout))
