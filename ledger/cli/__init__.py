"""The `ledger` command line (ledger/cli/app.py): a thin composition root over the library."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

from ledger.cli.app import main

if TYPE_CHECKING:  # what `from ledger.cli import app` gives at run time (see __getattr__)
    from ledger.cli.app import app

# The name `app` is the whole command line (ledger.cli.app.app), built on first use, not the submodule that the
# import above bound here: so that `ledger` starts without building every command (see ledger/cli/app.py).
globals().pop("app", None)

__all__ = ["app", "main"]


def __getattr__(name: str) -> Any:
    if name == "app":
        value = importlib.import_module("ledger.cli.app").app
        globals()["app"] = value
        return value
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
