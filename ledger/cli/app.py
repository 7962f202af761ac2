"""The `ledger` command line: the composition root, the one place that wires the library's layers together.

The core (ledger), the verifier (verify) and the runners (runners) never import this package; it imports them, and
hands runner capabilities (re-executing a model) to the verifier as extra checks. Errors reach the user as one line
on stderr with the exit code documented in ledger.errors (and docs/cli.md); ``LEDGER_DEBUG=1`` shows the traceback
instead. Commands that print a result take ``--json``. Nothing imports torch at module level: `ledger --help`,
`show`, `log` and `verify` start in a fraction of a second.

Start-up. Each command module (records, verifying, ...) registers its commands on a Typer app; :data:`COMMANDS`
says which module registers each top-level command and what its help's first sentence is. `ledger` (:func:`main`)
lists the commands from that table, so `ledger --help` imports no command module, and `ledger <command>` imports
and builds only the module of that command. :data:`app` is the whole command line, every module registered, built
on first use (tests drive it through typer's CliRunner); tests/ledger/test_cli_app.py checks that the table and the
modules agree, command for command.
"""

from __future__ import annotations

import importlib
from collections.abc import Iterator, MutableMapping
from typing import Any, Final

import typer
from typer.core import TyperCommand

from ledger.cli.common import ErrorMappingGroup, make_typer

HELP: Final = "Content-addressed receipts and verification for distributed training experiments."
RUN_HELP: Final = "Run the experiment's steps: prepare, train, recover, eval. These import torch."

# The modules in the order they register.
MODULES: Final = ("records", "verifying", "state", "db", "hosts", "run", "transparency")

# Every top-level command and group, in the order `ledger --help` lists them: the module that registers it and the
# first sentence of its help (all `ledger --help` shows of it).
COMMANDS: Final[dict[str, tuple[str, str]]] = {
    "init": ("records", "Create a ledger database (or bring an empty one to the current schema)."),
    "append": ("records", "Append receipts."),
    "show": ("records", "Show one receipt."),
    "log": ("records", "List receipts in append order, filtered by field."),
    "verify": ("verifying", "Recompute a receipt's id and every ancestor's, check parent links, chain rules, "
               "artifact digests and who signed each receipt; with --head, that the ledger extends that head and "
               "includes them (without an id: every receipt of the ledger); with --in-toto, an exported attestation."),
    "audit": ("verifying", "Verify every receipt an experiment's report draws on, recompute the report (training, "
              "recovery, learning, contracts, settlement) from the ledger and artifacts, check who signed the "
              "experiment's receipts, and record it."),
    "report": ("verifying", "Audit the experiment (every receipt verified, the report recomputed) and render the "
               "report as one self-contained HTML page; with --record its digest goes into a `report` receipt that "
               "`ledger verify` renders again."),
    "digest": ("state", "Recompute the state digest of a checkpoint (component and tensor digests) from its files, "
               "without torch."),
    "compare": ("state", "Compare two checkpoints component by component."),
    "serve": ("run", "Serve a checkpoint's model over an OpenAI-compatible HTTP API (POST /v1/completions, GET "
              "/v1/models, /health with the model digest the replica computed from the bytes it loaded, /metrics)."),
    "replay": ("run", "Re-execute the training segment from a checkpoint to the next one (all ranks of its run) and "
               "check the result equals the recorded next checkpoint bit for bit (exit 1 naming rank/tensor "
               "otherwise)."),
    "compare-runs": ("run", "Compare two runs rank by rank: model, optimizer, outer and RNG state (tensors, elements, "
                     "scalars), file hashes, rank binding and the loss trajectory after the resume step."),
    "log-head": ("transparency", "Sign the log's current head (a C2SP checkpoint: origin, size, root) with the "
                 "operator key and print it, or write it to --out."),
    "export": ("transparency", "Write an in-toto Statement v1 attesting a receipt (its artifacts as subjects with "
               "sha256 and blake3, the receipt and its inclusion proof against a checkpoint signed now) in a DSSE "
               "envelope signed by the operator."),
    "db": ("db", "Schema migrations of the ledger database."),
    "hosts": ("hosts", "Test hosts on this machine: network namespaces with shaped links (root only)."),
    "keys": ("transparency", "Operator and witness keys: private halves in 0600 files, public halves in the ledger."),
    "witness": ("transparency", "A witness: cosigns a log's checkpoints that extend the last one it saw."),
    "run": ("run", "Run the experiment's steps: prepare, train, recover, eval."),
}


def register(module: str, target: typer.Typer, run_app: typer.Typer) -> None:
    """Register the commands of ``ledger.cli.<module>`` on ``target`` (and the run module's on ``run_app``)."""
    mod = importlib.import_module(f"ledger.cli.{module}")
    if module == "run":
        mod.register(target, run_app)
    else:
        mod.register(target)


def build_app() -> typer.Typer:
    """The whole command line: every module's commands registered, in order, then the `run` group."""
    whole = make_typer(HELP)
    run_app = make_typer(RUN_HELP)
    for module in MODULES:
        register(module, whole, run_app)
    whole.add_typer(run_app, name="run")
    return whole


class _Commands(MutableMapping[str, Any]):
    """The root group's commands: every name of COMMANDS, each built from its module the first time it is looked
    up (with the other commands that module registers)."""

    def __init__(self) -> None:
        self._built: dict[str, Any] = {}

    def __getitem__(self, name: str) -> Any:
        if name not in self._built:
            module = COMMANDS[name][0]
            part, run_app = make_typer(HELP), make_typer(RUN_HELP)
            register(module, part, run_app)
            if run_app.registered_commands or run_app.registered_groups:
                part.add_typer(run_app, name="run")
            for n, cmd in typer.main.get_group(part).commands.items():
                if COMMANDS.get(n, ("",))[0] == module:
                    self._built.setdefault(n, cmd)
        return self._built[name]

    def __setitem__(self, name: str, cmd: Any) -> None:
        self._built[name] = cmd

    def __delitem__(self, name: str) -> None:
        del self._built[name]

    def __iter__(self) -> Iterator[str]:
        return iter(dict.fromkeys([*COMMANDS, *self._built]))

    def __len__(self) -> int:
        return len(dict.fromkeys([*COMMANDS, *self._built]))


class LazyGroup(ErrorMappingGroup):
    """The `ledger` group of :func:`main`: its commands come from :data:`COMMANDS`, built only when invoked."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.commands = _Commands()

    def list_commands(self, ctx: Any) -> list[str]:
        return list(self.commands)

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        # What the group would print with every command built: their help texts come from the table instead.
        stubs = {name: TyperCommand(name=name, help=COMMANDS[name][1]) for name in COMMANDS}
        limit = formatter.width - 6 - max(len(name) for name in stubs)
        with formatter.section("Commands"):
            formatter.write_dl([(name, cmd.get_short_help_str(limit)) for name, cmd in stubs.items()])


def main() -> None:
    root = make_typer(HELP, cls=LazyGroup)
    root.callback()(_root)  # a group, though no command is registered on it yet
    root(prog_name="ledger")


def _root() -> None:
    pass


_app: typer.Typer | None = None


def __getattr__(name: str) -> Any:
    """``app``: the whole command line (:func:`build_app`), built once, on first use."""
    global _app
    if name == "app":
        if _app is None:
            _app = build_app()
        return _app
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
