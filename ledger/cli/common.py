"""What every command shares: the consoles, JSON output, option aliases, opening the ledger, and the one place that
maps library errors to one line and an exit code.

Nothing here imports rich until something is printed through it: `ledger --help`, and commands that print JSON, start
without it (importing rich costs about as much as importing typer)."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Collection, Iterable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, Final

import typer
from typer.core import TyperGroup

from ledger.errors import EXIT_DATABASE, EXIT_FAILED, EXIT_USAGE, LedgerError, os_error_line, printable

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

ENV_DEBUG = "LEDGER_DEBUG"
INT64_MAX = 2**63 - 1  # the largest integer SQLite and PostgreSQL store: bound of every integer option


class LazyConsole:
    """A rich ``Console``, made (and rich imported) the first time it is used; it stands for one everywhere."""

    def __init__(self, **options: Any) -> None:
        self._options = options
        self._console: Console | None = None

    @property
    def console(self) -> Console:
        if self._console is None:
            from rich.console import Console

            self._console = Console(**self._options)
        return self._console

    def __getattr__(self, name: str) -> Any:
        return getattr(self.console, name)

    def print(self, *objects: Any, **options: Any) -> None:
        """Console.print, each string shown as it is (see :func:`add_row`)."""
        self.console.print(*(printable(o, lines=True) if isinstance(o, str) else o for o in objects), **options)


# No markup and no emoji codes: text read from files and receipts (a tensor named "[/]" or "[red]x", a note saying
# ":x:", which rich shows as an emoji even without markup) is printed, never interpreted.
_PLAIN: Final[dict[str, Any]] = {"highlight": False, "soft_wrap": True, "markup": False, "emoji": False}
out: Console = LazyConsole(**_PLAIN)  # type: ignore[assignment]
err: Console = LazyConsole(stderr=True, **_PLAIN)  # type: ignore[assignment]


def add_row(table: Table, *cells: Any) -> None:
    """``table.add_row`` with each string cell shown as it is: escape sequences, newlines and bidi overrides in a
    name from a file or a receipt are written as escapes (ledger.errors.printable), one row per row."""
    table.add_row(*(printable(c) if isinstance(c, str) else c for c in cells))


class ErrorMappingGroup(TyperGroup):
    """Maps library errors to one line and an exit code, in one place, for every sub-command."""

    def invoke(self, ctx: Any) -> Any:  # typer >= 0.2x vendors click: not `click.Context`
        try:
            return super().invoke(ctx)
        except LedgerError as exc:
            if os.environ.get(ENV_DEBUG):
                raise
            typer.echo(f"ledger: error: {exc.one_line()}", err=True)
            raise typer.Exit(exc.exit_code) from None
        except OSError as exc:
            if os.environ.get(ENV_DEBUG):
                raise
            typer.echo(f"ledger: error: {os_error_line(exc)}", err=True)
            raise typer.Exit(EXIT_USAGE) from None
        except RecursionError:  # a hostile body nested beyond any reader's stack
            if os.environ.get(ENV_DEBUG):
                raise
            typer.echo("ledger: error: input nested too deeply to read", err=True)
            raise typer.Exit(EXIT_USAGE) from None
        except Exception as exc:
            if os.environ.get(ENV_DEBUG):
                raise
            sa = sys.modules.get("sqlalchemy.exc")  # not imported: nothing raised can be SQLAlchemy's
            if sa is not None and isinstance(exc, sa.SQLAlchemyError):
                typer.echo(f"ledger: error: database: {_first_line(exc)}", err=True)
                raise typer.Exit(EXIT_DATABASE) from None
            line = _out_of_memory_line(exc)
            if line is not None:  # what was recorded before stays: each append is its own transaction
                typer.echo(f"ledger: error: {line}", err=True)
                raise typer.Exit(EXIT_FAILED) from None
            raise


_CANT: Final = "can't allocate memory"  # torch's CPU allocator, after its "[enforce fail at ...]" prefix
_OVERFLOWED: Final = "Storage size calculation overflowed"  # torch: a tensor of more than 2**63 bytes


def _out_of_memory_line(exc: BaseException) -> str | None:
    """"out of memory" and what was said, for Python's MemoryError or torch's: its CPU allocator raises a
    RuntimeError saying "can't allocate memory" (kept: what follows), a tensor too large to size one saying its size
    overflowed (torch.OutOfMemoryError is the accelerators'); None for any other error."""
    said = _first_line(exc)
    torch = sys.modules.get("torch")  # not imported: nothing raised can be torch's
    torch_oom = getattr(torch, "OutOfMemoryError", None) if torch is not None else None
    allocator = torch is not None and isinstance(exc, RuntimeError) and (_CANT in said or said.startswith(_OVERFLOWED))
    if not (isinstance(exc, MemoryError) or (torch_oom is not None and isinstance(exc, torch_oom)) or allocator):
        return None
    if _CANT in said:
        said = said[said.find(_CANT) + len(_CANT):].lstrip(": ")
    return f"out of memory: {said}" if said else "out of memory"


def _first_line(exc: BaseException) -> str:
    text = str(getattr(exc, "orig", None) or exc)
    return " ".join(text.split("\n")[0].split())


def make_typer(help_text: str, cls: type[ErrorMappingGroup] = ErrorMappingGroup) -> typer.Typer:
    return typer.Typer(cls=cls, help=help_text, no_args_is_help=True, add_completion=False,
                       pretty_exceptions_show_locals=False, rich_markup_mode=None)


# ----------------------------------------------------------------------------------- shared options

DbOpt = Annotated[
    str | None,
    typer.Option("--db", help="Ledger: an SQLite path or an SQLAlchemy URL. Default $LEDGER_DB or ./ledger.db"),
]
JsonOpt = Annotated[bool, typer.Option("--json", help="Print the result as JSON.")]
ArtifactsOpt = Annotated[
    Path | None,
    typer.Option("--artifacts", help="Artifact directory. Default $LEDGER_ARTIFACTS or artifacts/ beside the db."),
]


def _prepared_option(value: str | None) -> str | None:
    """``--prepared``'s value, refused in one line (MalformedDigest, exit 2) unless ``blake3:<64 hex>``: a typo
    is named as one, not looked up and reported missing."""
    if value is not None:
        from ledger.digests import check_digest

        check_digest(value, "--prepared")
    return value


PreparedOpt = Annotated[str | None, typer.Option(help="Prepared digest (default: the latest prepare).",
                                                  callback=_prepared_option)]
WorkdirOpt = Annotated[Path, typer.Option("--workdir", help="Experiment directory (runs, checkpoints, logs).")]
RunDbOpt = Annotated[
    str | None,
    typer.Option("--db", help="Ledger database. Default $LEDGER_DB, else <workdir>/ledger.db"),
]
ConfigOpt = Annotated[Path | None, typer.Option("--config", help="Experiment config (TOML). Default: built-in.")]


def run_db(db: str | None, workdir: Path) -> str:
    """The run commands keep an experiment self-contained: its ledger defaults to <workdir>/ledger.db."""
    if db is not None:
        return db
    return os.environ.get("LEDGER_DB") or str(workdir / "ledger.db")




def read_input(path: Path, max_bytes: int) -> bytes:
    """A file named on the command line, read whole: a regular file (a FIFO or a device is refused, not waited on or
    read without end) of at most ``max_bytes`` (UnsafeFile, exit 2)."""
    from ledger.digests import read_regular

    return read_regular(path, max_bytes=max_bytes)


def emit_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=True, ensure_ascii=False, default=str) + "\n")


def emit(value: Any, json_out: bool, text: str) -> None:
    """``value`` as JSON with ``--json``, else ``text``."""
    if json_out:
        emit_json(value)
    else:
        out.print(text)


def open_store(db: str | None, create: bool = False) -> Any:
    from ledger.store import Store

    return Store.open(db, create=create)


def artifact_store(db_url: str, root: Path | None) -> Any:
    """The artifact directory: ``--artifacts``, else :func:`ledger.artifacts.default_root` (a file there is
    refused: :func:`ledger.artifacts.artifact_dir`)."""
    from ledger.artifacts import ArtifactStore, artifact_dir, default_root

    return ArtifactStore(artifact_dir(root) if root is not None else default_root(db_url))


def plain_table(head: Sequence[str], rows: Iterable[Sequence[str]], *, right: Collection[int] = ()) -> str:
    """A table in rich's look (a heavy rule under the header, no outer edge), every cell whole and on one line
    (escaped: :func:`ledger.errors.printable`), built as text instead of measured and folded to the terminal: rich
    took a minute for 100,000 rows of `ledger log`, and cut ids short in an 80-column pipe. Columns whose indices
    are in ``right`` are right-justified (counts)."""
    cells = [[printable(c) for c in row] for row in rows]
    widths = [max([len(h), *(len(r[i]) for r in cells)]) for i, h in enumerate(head)]
    justify = [str.rjust if i in right else str.ljust for i in range(len(head))]

    def line(values: Sequence[str], bar: str) -> str:
        return bar.join(f" {j(v, w)} " for v, w, j in zip(values, widths, justify, strict=True)).rstrip()

    return "\n".join([line(head, "\u2503"), "\u2547".join("\u2501" * (w + 2) for w in widths),
                      *(line(r, "\u2502") for r in cells)])


def print_wide(table: Table, console: Console | None = None, *, at_least: int | None = None) -> None:
    """Print a table at its natural width: digests and tensor names are never elided, even in a pipe. With
    ``at_least``, at the terminal's width or that many columns if wider (long cells fold, but not below it)."""
    from rich.console import Console
    from rich.measure import Measurement

    console = console or out
    if isinstance(console, LazyConsole):
        console = console.console
    need = (at_least if at_least is not None
            else Measurement.get(console, console.options.update(width=100_000), table).maximum)
    Console(**_PLAIN, width=max(console.width, need),
            file=console.file).print(table)
