"""`ledger digest` and `ledger compare`: checkpoint state digests and exact comparison, read by ledger.state
without torch and compared by verify.state.

rich is imported only to print tables or a progress bar: `ledger digest --json` hashes at the speed of b3sum and
should start nearly as fast (benchmarks/README.md, audit_bench)."""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from ledger.cli.common import DbOpt, JsonOpt, add_row, emit_json, err, open_store, out, plain_table, print_wide
from ledger.errors import EXIT_FAILED, InputError, printable

if TYPE_CHECKING:
    from rich.console import Console


def register(app: typer.Typer) -> None:
    app.command()(digest)
    app.command()(compare)


class _ProgressBar:
    """A transient progress bar on stderr, shown only when stderr is a terminal and the work outlasts a second.

    Passed to ledger.state as its ``progress(bytes_just_hashed, total_bytes)`` callback.
    """

    DELAY = 1.0

    def __init__(self, label: str, console: Console | None = None) -> None:
        self._clock = time.monotonic
        self._start = self._clock()
        self._console = console or err  # err is made (and rich imported) only once the bar may show
        self._label = label
        self._done = 0
        self._bar: Any = None
        self._task: Any = None

    def __call__(self, advance: int, total: int) -> None:
        self._done += advance
        if self._bar is None:
            if self._clock() - self._start < self.DELAY or not self._console.is_terminal:
                return
            from rich.progress import (
                BarColumn,
                DownloadColumn,
                Progress,
                TextColumn,
                TimeRemainingColumn,
                TransferSpeedColumn,
            )

            # the label names a path: shown as it is, never read as markup
            self._bar = Progress(TextColumn("{task.description}", markup=False), BarColumn(), DownloadColumn(),
                                 TransferSpeedColumn(), TimeRemainingColumn(), console=self._console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(printable(self._label), total=total)
        self._bar.update(self._task, completed=self._done)

    @property
    def shown(self) -> bool:
        return self._bar is not None

    def __enter__(self) -> _ProgressBar:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._bar is not None:
            self._bar.stop()


def _shape_text(shape: list[int]) -> str:
    return "[" + ", ".join(map(str, shape)) + "]"


def digest(
    path: Annotated[Path, typer.Argument(help="A checkpoint directory, or a single .safetensors file.")],
    files: Annotated[bool, typer.Option("--files", help="Also hash every file (reads the bytes twice).")] = False,
    tensors: Annotated[bool, typer.Option("--tensors/--no-tensors", help="List every tensor's digest.")] = True,
    json_out: JsonOpt = False,
) -> None:
    """Recompute the state digest of a checkpoint (component and tensor digests) from its files, without torch.

    For a single file, the top-level digest is the component digest of its tensors (component = the file name
    up to its first '-' or '.'). A directory must be a complete checkpoint (with its manifest.json).
    """
    from ledger.state import read_state

    with _ProgressBar(f"hashing {path.name}") as bar:
        state = read_state(path, files=files, progress=bar)
    result = state.to_json(tensors=tensors)
    if state.manifest is not None and state.manifest.checkpoint != state.digest:
        typer.echo(f"ledger: warning: {path}/manifest.json records {state.manifest.checkpoint}, but the files hash "
                   f"to {state.digest} (see `ledger verify`)", err=True)
    differs = next(state.file_differences(), None)  # with --files: the manifest's files against the directory's
    if differs is not None:
        name, recorded, found = differs
        what = (f"records file {name!r} as {recorded}, but its bytes hash to {found}" if recorded and found else
                f"records file {name!r}, which the directory does not hold" if recorded else
                f"does not record file {name!r}, which the directory holds")
        typer.echo(printable(f"ledger: warning: {path}/manifest.json {what} (see `ledger verify`)"), err=True)
    if json_out:
        emit_json(result)
        return
    # Plain text tables (rich's look): measuring and folding a rich Table of a checkpoint's few hundred tensors took
    # longer than hashing a gigabyte of them.
    lines = [printable(f"{state.kind} {path}"), f"digest {state.digest}", "components",
             plain_table(("component", "digest", "tensors", "elements", "scalars"),
                         ((name, c["digest"], str(c["tensors"]), f"{c['tensor_elements']:,}", str(c["scalars"]))
                          for name, c in result["components"].items()), right=(2, 3, 4))]
    if tensors:
        lines += ["tensors", plain_table(("component", "tensor", "dtype", "shape", "digest"),
                                         ((comp, name, t["dtype"], _shape_text(t["shape"]), t["digest"])
                                          for comp, ts in result["tensors"].items() for name, t in ts.items()))]
    if state.files is not None:
        lines += ["files", plain_table(("file", "digest (b3sum)"), state.files.items())]
    typer.echo("\n".join(lines))


def _checkpoint_ref(arg: str, db: str | None, stores: dict[str, Any]) -> Any:
    """A path as itself; otherwise a receipt id/prefix, resolved to its checkpoint directory via the ledger."""
    from verify.state import CheckpointRef, resolve_checkpoint

    if Path(arg).exists():
        return CheckpointRef(Path(arg), arg)
    hexpart = arg.removeprefix("blake3:")
    if not hexpart or any(ch not in "0123456789abcdefABCDEF" for ch in hexpart):
        raise InputError(f"{arg}: no such file or directory, and not a receipt id")
    if "store" not in stores:
        stores["store"] = open_store(db)
    return resolve_checkpoint(stores["store"], arg)


def _counts_text(ca: Any, cb: Any, key: str) -> str:
    a = "-" if ca is None else f"{ca[key]:,}"
    b = "-" if cb is None else f"{cb[key]:,}"
    return a if a == b else f"{a} / {b}"


def compare(
    a: Annotated[str, typer.Argument(help="Checkpoint directory (or .safetensors file), or a checkpoint receipt.")],
    b: Annotated[str, typer.Argument(help="The other one.")],
    db: DbOpt = None,
    ignore_files: Annotated[
        bool, typer.Option("--ignore-files", help="Compare state only: skip file digests (one pass over the bytes).")
    ] = False,
    max_located: Annotated[
        int, typer.Option("--max-located", min=0, help="Locate the first differing element of at most N tensors.")
    ] = 16,
    json_out: JsonOpt = False,
) -> None:
    """Compare two checkpoints component by component. Exit 0 when equal (contents and file hashes), 1 when not.

    The table and, when they differ, a last line `DIFFERENT: <first difference>` go to stdout.
    """
    from verify.state import compare_states

    stores: dict[str, Any] = {}
    ref_a, ref_b = _checkpoint_ref(a, db, stores), _checkpoint_ref(b, db, stores)
    with _ProgressBar("comparing") as bar:
        report = compare_states(ref_a, ref_b, files=not ignore_files, max_located=max_located, progress=bar)
    if json_out:
        emit_json(report.to_json())
    else:
        from rich.table import Table

        out.print(f"A {report.a}  {report.digest_a}")
        out.print(f"B {report.b}  {report.digest_b}")
        table = Table(show_edge=False)
        for col in ("component", "equal", "tensors", "tensor_elements", "scalars", "differing"):
            table.add_column(col, justify="left" if col in ("component", "equal") else "right")
        for c in report.components:
            add_row(table, c.component, "yes" if c.equal else "NO", _counts_text(c.counts_a, c.counts_b, "tensors"),
                          _counts_text(c.counts_a, c.counts_b, "tensor_elements"),
                          _counts_text(c.counts_a, c.counts_b, "scalars"), str(c.differing_tensors))
        print_wide(table)
        files_text = {None: "not compared", True: "yes", False: "NO"}[report.file_hashes_equal]
        out.print(f"contents_exactly_equal: {'yes' if report.contents_exactly_equal else 'NO'}  "
                  f"file_hashes_equal: {files_text}")
        more = [d for c in report.components for d in c.differences] + list(report.file_differences)
        for d in more[1:]:
            out.print(f"  also: {d.one_line()}")
        first = report.first_difference
        out.print("EQUAL" if report.equal else f"DIFFERENT: {first.one_line() if first else 'state digests differ'}")
    if not report.equal:
        raise typer.Exit(EXIT_FAILED)
