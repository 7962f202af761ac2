"""The command line's root (ledger/cli/app.py): the table of commands `ledger` starts from agrees with what the
command modules register, and the lazily built root behaves as the whole app does, starting faster."""

from __future__ import annotations

import importlib
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.core import TyperCommand

from ledger.receipts import make_receipt
from ledger.store import Store

cli_app = importlib.import_module("ledger.cli.app")  # the module (`ledger.cli.app` the attribute is the Typer app)


def _built() -> Any:
    return typer.main.get_command(cli_app.app)


def test_the_table_lists_every_command_of_every_module_in_order() -> None:
    built = _built()
    expected = {}
    for name, cmd in built.commands.items():
        callbacks = [c.callback for c in cmd.commands.values()] if hasattr(cmd, "commands") else [cmd.callback]
        (module,) = {cb.__module__.removeprefix("ledger.cli.") for cb in callbacks}
        expected[name] = module
    table = {name: module for name, (module, _) in cli_app.COMMANDS.items()}
    lines = "\n".join(f"    {name!r}: ({module!r}, ...)," for name, module in expected.items())
    assert list(table.items()) == list(expected.items()), f"ledger/cli/app.py COMMANDS should list:\n{lines}"


@pytest.mark.parametrize("limit", [30, 45, 74, 120, 400])
def test_the_table_gives_each_command_its_own_help(limit: int) -> None:
    built = _built()
    for name, (_, summary) in cli_app.COMMANDS.items():
        assert TyperCommand(name=name, help=summary).get_short_help_str(limit) == \
            built.commands[name].get_short_help_str(limit), f"COMMANDS[{name!r}]: the help's first sentence changed"


def _run(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ledger.cli", *args], capture_output=True, text=True,
                          env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"})


def _run_whole(*args: str) -> subprocess.CompletedProcess[str]:
    code = f"import sys\nfrom ledger.cli import app\nsys.argv = ['ledger', *{list(args)!r}]\napp(prog_name='ledger')\n"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          env={"COLUMNS": "100", "PATH": "/usr/bin:/bin"})


def test_the_lazy_root_answers_as_the_whole_app(tmp_path: Path) -> None:
    db = tmp_path / "ledger.db"
    note = make_receipt("note", run="cli", measurements={"message": "hello"})
    with Store.open(db, create=True) as store:
        store.append(note)
    for args in (["--help"], [], ["show", "--help"], ["db", "--help"], ["run", "--help"], ["verfy", "x"],
                 ["show", note.id, "--db", str(db), "--json"], ["show", "0000", "--db", str(db)],
                 ["log", "--db", str(db)], ["digest", str(tmp_path / "absent")]):
        lazy, whole = _run(*args), _run_whole(*args)
        assert (lazy.returncode, lazy.stdout, lazy.stderr) == (whole.returncode, whole.stdout, whole.stderr), args


def _modules_after(*args: str) -> set[str]:
    code = ("import sys\nfrom ledger.cli import main\n"
            f"sys.argv = ['ledger', *{list(args)!r}]\n"
            "try:\n    main()\nexcept SystemExit:\n    pass\n"
            "print(' '.join(sorted(sys.modules)), file=sys.stderr)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return set(out.stderr.split())


def test_help_imports_no_command_module_nor_rich_nor_the_store() -> None:
    loaded = _modules_after("--help")
    commands = {m for m in loaded if m.startswith("ledger.cli.") and m not in ("ledger.cli.app", "ledger.cli.common")}
    assert not commands
    assert not {m for m in loaded if m.split(".")[0] in ("rich", "sqlalchemy", "torch", "numpy", "verify")}


def test_a_command_imports_its_own_module_only(tmp_path: Path) -> None:
    loaded = _modules_after("show", "--help")
    assert "ledger.cli.records" in loaded
    assert not {m for m in loaded if m in ("ledger.cli.run", "ledger.cli.state", "ledger.cli.transparency",
                                           "ledger.cli.verifying", "ledger.cli.hosts", "ledger.cli.db")}


def test_reading_a_receipt_loads_no_signing_code(tmp_path: Path) -> None:
    """`show` and `log` of an unsigned ledger never sign or check a signature: the note format, Ed25519 and OpenSSL's
    hashlib (about 9 ms of start-up) load only where a key is named or a signature is verified."""
    db = tmp_path / "ledger.db"
    note = make_receipt("note", run="cli", measurements={"message": "hello"})
    with Store.open(db, create=True) as store:
        store.append(note)
    for args in (("show", note.id, "--db", str(db)), ("log", "--db", str(db))):
        loaded = _modules_after(*args)
        assert not {m for m in loaded if m in ("ledger.note", "ledger.signing", "hashlib")
                    or m.startswith("cryptography")}, args
