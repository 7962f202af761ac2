"""The `ledger` CLI (ledger/cli/) through typer's CliRunner: commands, --json, errors and exit codes.

Tests taking ``ledger_url``, ``db_url`` or ``chain_db`` run on an SQLite file and on PostgreSQL (tests/pg.py), with
``--db`` the URL. Those on ``ledger_db`` alone are about SQLite files or refuse their input before opening the ledger.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from ledger import migrate
from ledger.cli import app
from ledger.database import display_url
from ledger.errors import AmbiguousReceipt, LedgerError, UnknownReceipt
from ledger.models import SCHEMA_HEAD
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from tests.conftest import ReceiptChain, fake_digest
from tests.pg import Cluster, raw_rows

MakeChain = Callable[..., ReceiptChain]
runner = CliRunner()


def run(*args: str | Path, input: bytes | str | None = None, env: dict[str, str] | None = None) -> Result:
    return runner.invoke(app, [str(a) for a in args], input=input, env=env)


def ok(*args: str | Path, input: bytes | str | None = None) -> Result:
    result = run(*args, input=input)
    assert result.exit_code == 0, (result.exit_code, result.output, result.exception)
    assert result.stderr == ""
    return result


def fails(code: int, *args: str | Path, input: bytes | str | None = None) -> str:
    """Run, expect ``code``, and return the single error line from stderr."""
    result = run(*args, input=input)
    assert result.exit_code == code, (result.exit_code, result.output, result.exception)
    lines = result.stderr.splitlines()
    assert len(lines) == 1, result.stderr
    assert lines[0].startswith("ledger: error: ")
    assert result.stdout == ""
    assert not isinstance(result.exception, LedgerError)  # mapped, not leaked (see the LEDGER_DEBUG test)
    return lines[0]


def write_receipts(path: Path, receipts: list[Receipt]) -> Path:
    path.write_bytes(b"".join(r.body + b"\n" for r in receipts))
    return path


def filled(db: str | Path, make_chain: MakeChain) -> tuple[str | Path, ReceiptChain]:
    c = make_chain()
    with Store.open(db) as store:
        store.append_many(c.receipts())
    return db, c


@pytest.fixture
def chain_db(ledger_url: str, make_chain: MakeChain) -> tuple[str | Path, ReceiptChain]:
    """A ledger holding one chain, on SQLite and on PostgreSQL."""
    return filled(ledger_url, make_chain)


@pytest.fixture
def sqlite_chain_db(ledger_db: Path, make_chain: MakeChain) -> tuple[str | Path, ReceiptChain]:
    return filled(ledger_db, make_chain)


def two_sharing_a_prefix() -> tuple[Receipt, Receipt]:
    seen: dict[str, Receipt] = {}
    i = 0
    while True:
        r = make_receipt("note", measurements={"n": i})
        if r.id[7:11] in seen:
            return seen[r.id[7:11]], r
        seen[r.id[7:11]] = r
        i += 1


# ------------------------------------------------------------------------------------------ happy paths


def test_stderr_is_separate_from_stdout() -> None:
    # The assertions below rely on CliRunner keeping stderr apart (click >= 8.2 does by default).
    result = run("show", "abcd", "--db", "/nonexistent/dir/ledger.db")
    assert result.stderr and "ledger: error:" not in result.stdout


def test_help_lists_the_commands() -> None:
    result = ok("--help")
    for command in ("init", "append", "show", "log", "verify", "db"):
        assert command in result.stdout


# SQLite only: a new file in a new place (a PostgreSQL database is made by its operator; the next test inits one).
def test_init_creates_the_database(tmp_path: Path) -> None:
    db = tmp_path / "sub" / "ledger.db"
    db.parent.mkdir()
    result = ok("init", "--db", db)
    assert "ledger ready" in result.stdout and db.exists()
    again = json.loads(ok("init", "--db", db, "--json").stdout)
    assert again == {"db": str(db), "receipts": 0}


def test_init_uses_the_env_variable(db_url: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("LEDGER_DB", db_url)
    assert migrate.current(db_url) is None
    assert json.loads(ok("init", "--json").stdout) == {"db": display_url(db_url), "receipts": 0}
    assert migrate.current(db_url) == SCHEMA_HEAD


def test_append_file_with_several_receipts(tmp_path: Path, ledger_url: str, make_chain: MakeChain) -> None:
    c = make_chain()
    path = write_receipts(tmp_path / "receipts.jsonl", c.receipts())
    result = ok("append", path, "--db", ledger_url)
    assert f"{len(c.receipts())} appended, 0 already present" in result.stdout
    for r in c.receipts():
        assert r.id in result.stdout
    again = json.loads(ok("append", path, "--db", ledger_url, "--json").stdout)
    assert again == {"appended": 0, "existing": len(c.receipts()), "ids": [r.id for r in c.receipts()]}
    with Store.open(ledger_url) as store:
        assert store.count() == len(c.receipts())


def test_append_one_receipt_without_trailing_newline(tmp_path: Path, ledger_url: str) -> None:
    r = make_receipt("note", run="cli", measurements={"x": 1})
    path = tmp_path / "one.json"
    path.write_bytes(r.body)
    out = json.loads(ok("append", path, "--db", ledger_url, "--json").stdout)
    assert out == {"appended": 1, "existing": 0, "ids": [r.id]}


def test_append_from_stdin(ledger_url: str, make_chain: MakeChain) -> None:
    c = make_chain()
    data = b"".join(r.body + b"\n" for r in c.receipts()[:3])
    out = json.loads(ok("append", "-", "--db", ledger_url, "--json", input=data).stdout)
    assert out["appended"] == 3 and out["ids"] == [r.id for r in c.receipts()[:3]]


def test_show_table_json_and_raw(chain_db: tuple[str | Path, ReceiptChain]) -> None:
    db, c = chain_db
    r = c.checkpoints[0]
    table = ok("show", r.id, "--db", db).stdout
    assert table.startswith("checkpoint receipt")
    # rich folds long cells at the runner's 80 columns: glue the value column back together.
    values = "".join(line.split("│")[2].strip() for line in table.splitlines() if line.count("│") == 3)
    for expected in (r.id, "run-a", r.artifacts["state"], c.train_start.id, "0.3333333333333333"):
        assert expected in values

    shown = json.loads(ok("show", r.id[7:19], "--db", db, "--json").stdout)
    assert shown["id"] == r.id and shown["receipt"] == r.to_document()
    assert isinstance(shown["seq"], int) and isinstance(shown["recorded_ns"], int)

    raw = ok("show", r.id, "--db", db, "--raw")
    assert raw.stdout_bytes == r.body + b"\n"
    assert Receipt.from_bytes(raw.stdout_bytes[:-1]).id == r.id


def test_log_filters_and_json(chain_db: tuple[str | Path, ReceiptChain], make_chain: MakeChain) -> None:
    db, c = chain_db
    other = make_chain(run="run-b", rank=1, salt="b-")
    with Store.open(db) as store:
        store.append_many(other.receipts())

    def ids(*args: str) -> list[str]:
        return [entry["id"] for entry in json.loads(ok("log", "--db", db, "--json", *args).stdout)]

    assert len(ids()) == 2 * len(c.receipts())
    assert ids("--kind", "checkpoint") == [r.id for r in (*c.checkpoints, *other.checkpoints)]
    assert ids("--run", "run-b") == [other.train_start.id, *(r.id for r in other.checkpoints),
                                     other.train_end.id, other.eval.id]
    assert set(ids("--prepared", c.prepared)) == {r.id for r in c.receipts()}
    assert c.selection.selection is not None
    assert ids("--selection", c.selection.selection) == [c.selection.id, c.eval.id]
    assert ids("--rank", "1", "--kind", "train-end") == [other.train_end.id]
    assert len(ids("--limit", "2")) == 2
    entry = json.loads(ok("log", "--db", db, "--json", "--kind", "eval", "--run", "run-a").stdout)[0]
    assert entry["receipt"] == c.eval.to_document()

    table = ok("log", "--db", db, "--kind", "train-start").stdout
    assert c.train_start.id[:23] in table and other.train_start.id[:23] in table
    assert "2 receipt(s)" in table


def test_log_prints_every_cell_whole_whatever_the_width(ledger_db: Path, tmp_path: Path) -> None:
    """In an 80-column pipe rich cut the id column to 'blake3:892155f…' beside a long run name (the ellipsis is no
    reference to paste), and it took a minute for 100,000 rows: the table is plain text of the cells' own widths."""
    run_name = "r" * 200  # the longest a name may be
    notes = [make_receipt("note", run=run_name, rank=i, step=10 ** 12 + i) for i in range(3)]
    ok("append", write_receipts(tmp_path / "notes.jsonl", notes), "--db", ledger_db)
    lines = ok("log", "--db", ledger_db).stdout.splitlines()
    assert lines[0].split() == ["seq", "┃", "id", "┃", "kind", "┃", "run", "┃", "rank", "┃", "step", "┃", "parents"]
    assert set(lines[1]) == {"━", "╇"} and lines[-1] == "3 receipt(s)"
    for i, (line, note) in enumerate(zip(lines[2:-1], notes, strict=True)):
        assert line.split() == [str(i + 1), "│", note.id[:23], "│", "note", "│", run_name, "│", str(i), "│",
                                str(10 ** 12 + i), "│", "0"]
    assert len({line.index("│") for line in lines[2:-1]}) == 1  # columns aligned


def test_verify_ok_and_json(chain_db: tuple[str | Path, ReceiptChain]) -> None:
    db, c = chain_db
    result = ok("verify", c.eval.id, "--db", db)
    assert result.stdout.startswith(f"OK {c.eval.id}")
    n = len(c.receipts()) - 1  # everything but the contract is an ancestor of the eval
    assert f"{n} receipt(s) recomputed" in result.stdout
    report = json.loads(ok("verify", c.eval.id[7:20], "--db", db, "--json").stdout)
    assert report["ok"] is True and report["receipt"] == c.eval.id
    assert report["receipts_checked"] == n
    # Fake artifact digests have no bytes anywhere: reported missing, not verified.
    assert report["artifacts_verified"] == 0
    cited = {(r.id, name) for r in c.receipts() if r is not c.contract for name in r.artifacts}
    assert {(m["receipt"], m["name"]) for m in report["artifacts_missing"]} == cited


def test_db_current(ledger_url: str) -> None:
    out = json.loads(ok("db", "current", "--db", ledger_url, "--json").stdout)
    assert out == {"db": display_url(ledger_url), "current": SCHEMA_HEAD, "head": SCHEMA_HEAD, "up_to_date": True}
    assert "up to date" in ok("db", "current", "--db", ledger_url).stdout


# ----------------------------------------------------------------------------------------------- errors

# The next five on SQLite only: `ledger append` refuses the input before it opens the ledger.


def test_malformed_receipt_file(tmp_path: Path, ledger_db: Path) -> None:
    path = tmp_path / "bad.json"
    path.write_bytes(b'{"kind":"note"}\n')
    line = fails(2, "append", path, "--db", ledger_db)
    assert "malformed receipt" in line and "fields" in line


def test_malformed_line_names_its_line(tmp_path: Path, ledger_db: Path) -> None:
    good = make_receipt("note")
    doc = good.to_document()
    doc["kind"] = "bogus"
    bad = json.dumps(doc, sort_keys=True, separators=(",", ":")).encode()
    path = tmp_path / "two.jsonl"
    path.write_bytes(good.body + b"\n" + bad + b"\n")
    assert "kind" in fails(2, "append", path, "--db", ledger_db)
    with Store.open(ledger_db) as store:
        assert store.count() == 0


def test_non_canonical_bytes(tmp_path: Path, ledger_db: Path) -> None:
    r = make_receipt("note", measurements={"a": 1})
    pretty = json.dumps(r.to_document(), indent=2, sort_keys=True).encode()
    path = tmp_path / "pretty.json"
    path.write_bytes(pretty)
    assert "non-canonical" in fails(2, "append", path, "--db", ledger_db)
    spaced = r.body.replace(b'"a":1', b'"a": 1')
    assert "non-canonical" in fails(2, "append", "-", "--db", ledger_db, input=spaced)


def test_empty_input(ledger_db: Path) -> None:
    assert "no receipt" in fails(2, "append", "-", "--db", ledger_db, input=b"\n\n")


def test_append_file_not_found(tmp_path: Path, ledger_db: Path) -> None:
    assert "absent.json" in fails(2, "append", tmp_path / "absent.json", "--db", ledger_db)


def test_missing_parents_on_append(tmp_path: Path, ledger_url: str) -> None:
    parent = make_receipt("note", measurements={"p": 1})
    child = make_receipt("note", parents=[parent])
    line = fails(3, "append", write_receipts(tmp_path / "c.jsonl", [child]), "--db", ledger_url)
    assert parent.id in line and "parent" in line
    with Store.open(ledger_url) as store:
        assert store.count() == 0


def test_unknown_id(chain_db: tuple[str | Path, ReceiptChain]) -> None:
    db, _ = chain_db
    absent = make_receipt("note", measurements={"absent": True}).id
    for command in ("show", "verify"):
        assert "no receipt matches" in fails(3, command, absent, "--db", db)


def test_ambiguous_prefix(ledger_url: str) -> None:
    a, b = two_sharing_a_prefix()
    with Store.open(ledger_url) as store:
        store.append_many([a, b])
    for command in ("show", "verify"):
        line = fails(3, command, a.id[7:11], "--db", ledger_url)
        assert "matches 2 receipts" in line and a.id[:19] in line and b.id[:19] in line


# SQLite only: each bad reference is refused before any query.
def test_truncated_hex(sqlite_chain_db: tuple[str | Path, ReceiptChain]) -> None:
    db, c = sqlite_chain_db
    for command in ("show", "verify"):  # an id cut short, as `ledger log` prints it, is a prefix
        assert c.eval.id in ok(command, c.eval.id[:23], "--db", db, "--json").stdout
        assert "neither an id nor a prefix" in fails(2, command, c.eval.id + "0", "--db", db)
    assert "too short" in fails(2, "show", c.eval.id[7:9], "--db", db)
    assert "too short" in fails(2, "show", c.eval.id[:9], "--db", db)
    assert "--prepared" in fails(2, "log", "--db", db, "--prepared", c.prepared[:-1])


def test_missing_database(tmp_path: Path) -> None:
    absent = tmp_path / "absent.db"
    for args in (("show", "abcd"), ("log",), ("verify", "abcd"), ("append", "-")):
        line = fails(4, *args, "--db", absent, input=make_receipt("note").body)
        assert "ledger init" in line
    assert not absent.exists()


def test_missing_postgresql_database(postgres_cluster: Cluster) -> None:
    """A server without the named database: one line naming it (password hidden), exit 4, for every command."""
    url = postgres_cluster.url("absent").replace("postgres@", "postgres:secret@")
    for args in (("init",), ("show", "abcd"), ("log",), ("verify", "abcd"), ("append", "-"), ("db", "upgrade")):
        line = fails(4, *args, "--db", url, input=make_receipt("note").body)
        assert '"absent" does not exist' in line and "secret" not in line, (args, line)


def test_database_at_unknown_revision(ledger_url: str) -> None:
    raw_rows(ledger_url, "UPDATE alembic_version SET version_num = 'zzzz'")
    line = fails(4, "log", "--db", ledger_url)
    assert "zzzz" in line and "ledger db upgrade" in line
    out = json.loads(ok("db", "current", "--db", ledger_url, "--json").stdout)
    assert out["current"] == "zzzz" and out["up_to_date"] is False


def test_debug_env_lets_the_exception_through(chain_db: tuple[str | Path, ReceiptChain]) -> None:
    db, c = chain_db
    absent = make_receipt("note", measurements={"absent": True}).id
    result = run("show", absent, "--db", db, env={"LEDGER_DEBUG": "1"})
    assert isinstance(result.exception, UnknownReceipt)
    assert result.exit_code != 0
    a_prefix = c.eval.id[7:9]
    result = run("show", a_prefix, "--db", db, env={"LEDGER_DEBUG": "1"})
    assert isinstance(result.exception, LedgerError) and result.exception.exit_code == 2


def test_debug_env_ambiguous(ledger_url: str) -> None:
    a, b = two_sharing_a_prefix()
    with Store.open(ledger_url) as store:
        store.append_many([a, b])
    result: Any = run("verify", a.id[7:11], "--db", ledger_url, env={"LEDGER_DEBUG": "1"})
    assert isinstance(result.exception, AmbiguousReceipt)


def test_append_reads_line_by_line_and_names_the_line(ledger_db: Path, tmp_path: Path, make_chain: MakeChain,
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """The first bad line ends the read (`yes | ledger append -` no longer reads forever), its number is named, a
    line longer than MAX_LINE is refused as it is read, and a device is refused as any other non-regular file."""
    import ledger.cli.records as records

    good = make_chain().prepare.body
    (tmp_path / "two.jsonl").write_bytes(good + b"\n" + b"{not json}\n")
    result = run("append", tmp_path / "two.jsonl", "--db", ledger_db)
    assert result.exit_code == 2 and "two.jsonl line 2: " in result.stderr, result.output
    assert run("log", "--db", ledger_db, "--json").stdout.strip() == "[]"  # all or nothing
    result = run("append", "-", "--db", ledger_db, input=b"y\n" * 100_000)
    assert result.exit_code == 2 and "stdin line 1: " in result.stderr, result.output
    monkeypatch.setattr(records, "MAX_LINE", 1000)
    result = run("append", "-", "--db", ledger_db, input=b"0" * 5000)
    assert result.exit_code == 2 and "stdin line 1: longer than 1,000 bytes" in result.stderr, result.output
    result = run("append", "/dev/zero", "--db", ledger_db)
    assert result.exit_code == 2 and "is a character device" in result.stderr, result.output


def test_a_home_of_an_unknown_user_is_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """pathlib raises RuntimeError for ~user of a user this machine does not know: that was a traceback."""
    for args in (["log", "--db", "~no-such-user-here/x.db"], ["keys", "list", "--dir", "~no-such-user-here/k"]):
        line = fails(2, *args)
        assert "cannot expand '~no-such-user-here': no such user here" in line, line
    monkeypatch.setenv("LEDGER_DB", "~no-such-user-here/x.db")
    assert "no such user here" in fails(2, "log")


@pytest.mark.parametrize("args", [["--limit", "99999999999999999999999"], ["--rank", str(2**63)], ["--limit", "-1"]])
def test_integer_filters_out_of_range_are_usage_errors(ledger_db: Path, args: list[str]) -> None:
    """SQLite binds at most 2**63 - 1 (an OverflowError traceback), and a negative limit returned everything."""
    result = run("log", *args, "--db", ledger_db)
    assert result.exit_code == 2 and "is not in the range" in result.stderr and "Traceback" not in result.output


def test_show_clips_a_long_measurement_name_and_json_keeps_it(ledger_db: Path, tmp_path: Path) -> None:
    """A name is as long as a value may be: unclipped, it widened every row of the table to its length."""
    from ledger.cli.records import SHOWN_MAX

    name = "k" * (SHOWN_MAX * 50)
    r = make_receipt("note", measurements={name: 1, "short": 2})
    assert run("append", write_receipts(tmp_path / "r.jsonl", [r]), "--db", ledger_db).exit_code == 0
    result = run("show", r.id, "--db", ledger_db)
    assert result.exit_code == 0 and f"{SHOWN_MAX * 50:,} characters in all" in result.stdout, result.stdout[:500]
    assert len(result.stdout) < SHOWN_MAX * 40 and r.id in result.stdout
    shown = json.loads(run("show", r.id, "--db", ledger_db, "--json").stdout)
    assert shown["receipt"]["measurements"][name] == 1


def test_show_prints_text_from_a_receipt_as_it_is_no_emoji_codes(ledger_db: Path, tmp_path: Path) -> None:
    """rich replaces ":x:" with an emoji even without markup: a receipt's text must be shown as the receipt holds it."""
    r = make_receipt("note", run="emoji", measurements={"message": "loss :x: then :thumbs_up:", ":warning:": 1})
    assert run("append", write_receipts(tmp_path / "r.jsonl", [r]), "--db", ledger_db).exit_code == 0
    shown = ok("show", r.id, "--db", ledger_db).stdout
    assert "loss :x: then :thumbs_up:" in shown and ":warning:" in shown
    assert not any(ord(c) > 0x2fff for c in shown), shown  # box-drawing characters only, no emoji


def test_show_clips_a_long_measurement_and_json_keeps_it(ledger_db: Path, tmp_path: Path) -> None:
    """rich folds a long cell in time quadratic in its length (a 16 MB note took 87 s to show): the table shows the
    first SHOWN_MAX characters and says how many there are; --json and --raw hold them all."""
    from ledger.cli.records import SHOWN_MAX

    r = make_receipt("note", measurements={"message": "x" * (SHOWN_MAX * 10)})
    assert run("append", write_receipts(tmp_path / "r.jsonl", [r]), "--db", ledger_db).exit_code == 0
    result = run("show", r.id, "--db", ledger_db)
    flat = "".join(c for c in result.stdout if not c.isspace() and c != "│")  # the cell is folded over lines
    assert result.exit_code == 0 and f"{SHOWN_MAX * 10:,}charactersinall" in flat, result.stdout
    assert result.stdout.count("x") < SHOWN_MAX * 2
    shown = json.loads(run("show", r.id, "--db", ledger_db, "--json").stdout)
    assert shown["receipt"]["measurements"]["message"] == "x" * (SHOWN_MAX * 10)


def test_db_commands_refuse_what_is_not_a_ledger_and_unknown_revisions(tmp_path: Path, ledger_db: Path) -> None:
    """`db current` reads as `log` does (a missing path or a device is exit 4, and nothing is created); a target
    revision no script knows is the user's typo (exit 2), not the database's."""
    assert "character device" in fails(4, "db", "current", "--db", "/dev/null")
    assert "no ledger at" in fails(4, "db", "current", "--db", tmp_path / "absent.db")
    assert not (tmp_path / "absent.db").exists()
    line = fails(2, "db", "upgrade", "0001_bogus", "--db", ledger_db)
    assert "unknown schema revision '0001_bogus'" in line and "0001_initial" in line
    assert "unknown schema revision" in fails(2, "db", "downgrade", "nope", "--db", ledger_db)


@pytest.mark.parametrize("url", ["sqlite://", "sqlite:///:memory:", "sqlite:///file:led?mode=memory&uri=true"])
def test_an_in_memory_ledger_is_refused(url: str) -> None:
    """`ledger init --db sqlite://` said 'ledger ready (0 receipts)' for a database gone when the command ended, and
    every other command advised `ledger db upgrade --db sqlite://`, which leaves nothing either."""
    for args in (("init",), ("log",), ("db", "upgrade"), ("audit", "--no-record")):
        line = fails(2, *args, "--db", url)
        assert line == (f"ledger: error: the ledger database {url} is an in-memory SQLite database: it would hold "
                        "nothing from one command to the next; give a file path or a server's URL"), args


def test_a_malformed_database_url_or_a_missing_driver_is_one_line() -> None:
    """SQLAlchemy raises a bare ValueError for a port that is not a number, and importing an absent driver is a
    ModuleNotFoundError: both were tracebacks. The password never reaches the line."""
    line = fails(2, "log", "--db", "postgresql://alice:s3cret@db.example:abc/ledger")
    assert line == ("ledger: error: the ledger database 'postgresql://***@db.example:abc/ledger' is not a database URL "
                    "(invalid literal for int() with base 10: 'abc')")
    assert "is not a database URL" in fails(2, "log", "--db", "postgresql://[::1")
    assert "is not a database URL" in fails(2, "show", "abcd", "--db", "://ledger")
    import importlib.util

    assert importlib.util.find_spec("MySQLdb") is None  # not a dependency of ours: the driver that is missing
    line = fails(4, "log", "--db", "mysql://alice:s3cret@db.example/ledger")
    assert line == ("ledger: error: database mysql://***@db.example/ledger: its driver is not installed (no module "
                    "MySQLdb)")


def test_an_empty_db_option_is_refused_and_an_empty_environment_variable_is_unset(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """``--db ''`` (``--db "$DB"`` with DB unset) was taken as the current directory; an empty LEDGER_DB is unset,
    as shells have it, so the default ./ledger.db is opened."""
    monkeypatch.chdir(tmp_path)
    for args in (["log", "--db", ""], ["db", "current", "--db", ""], ["audit", "--no-record", "--db", ""]):
        assert "the ledger database is empty" in fails(2, *args)
    assert "the ledger database is empty" in fails(2, "run", "experiment", "--workdir", str(tmp_path / "exp"),
                                                    "--db", "")
    assert not (tmp_path / "exp").exists()  # refused before its work directory or its operator key is made
    monkeypatch.setenv("LEDGER_DB", "")
    assert f"no ledger at {tmp_path / 'ledger.db'}" in fails(4, "log")  # the default file, absent here


def test_run_train_without_an_experiment_writes_nothing(ledger_db: Path, tmp_path: Path) -> None:
    """The experiment is looked up before the work directory's logs are made (a failed command left `logs/`)."""
    workdir = tmp_path / "new-workdir"
    line = fails(3, "run", "train", "--arm", "single", "--workdir", workdir, "--db", ledger_db)
    assert line == "ledger: error: no prepare receipt in the ledger: run `ledger run prepare` first"
    assert not workdir.exists()


def test_show_prints_ids_and_digests_whole_in_an_80_column_pipe(ledger_db: Path, tmp_path: Path) -> None:
    """rich folded a 71-character id across two lines at 80 columns: copied or grepped, it was two halves."""
    root = make_receipt("note", measurements={"i": 0})
    child = make_receipt("note", parents=[root], measurements={"model": fake_digest("m"), "long": "x" * 300})
    ok("append", write_receipts(tmp_path / "r.jsonl", [root, child]), "--db", ledger_db)
    result = run("show", child.id, "--db", ledger_db, env={"COLUMNS": "80"})
    assert result.exit_code == 0, result.output
    lines = result.stdout.splitlines()
    for whole in (child.id, root.id, fake_digest("m")):
        assert sum(whole in line for line in lines) == 1, (whole, result.stdout)
    assert all(len(line) <= len(child.id) + len("parent") + 7 for line in lines)  # a long value still folds
