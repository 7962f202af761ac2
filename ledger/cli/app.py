"""The `ledger` command line: the composition root, the one place that wires the library's layers together.

The core (ledger), the verifier (verify) and the runners (runners) never import this package; it imports them, and
hands runner capabilities (re-executing a model) to the verifier as extra checks. Errors reach the user as one line
on stderr with the exit code documented in ledger.errors (and docs/cli.md); ``LEDGER_DEBUG=1`` shows the traceback
instead. Commands that print a result take ``--json``. Nothing imports torch at module level: `ledger --help`,
`show`, `log` and `verify` start in a fraction of a second.
"""

from __future__ import annotations

from ledger.cli import db, records, run, state, verifying
from ledger.cli.common import make_typer

app = make_typer("Content-addressed receipts and verification for distributed training experiments.")
run_app = make_typer("Run the experiment's steps: prepare, train, recover, eval. These import torch.")

records.register(app)
verifying.register(app)
state.register(app)
db.register(app)
run.register(app, run_app)
app.add_typer(run_app, name="run")


def main() -> None:
    app(prog_name="ledger")
