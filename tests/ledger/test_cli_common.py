"""ledger/cli/common.py: the one place that turns what a command raises into one line and an exit code. Here, a
process that cannot allocate what it asks for: real allocations far beyond any machine, refused at once."""

from __future__ import annotations

import typer
from typer.testing import CliRunner

from ledger.cli.common import make_typer
from ledger.errors import EXIT_FAILED

FAR_TOO_MUCH = 2**62  # bytes: refused by the allocator before any page is touched


def _app() -> typer.Typer:
    app = make_typer("out-of-memory probes")

    @app.command()
    def tensor() -> None:
        import torch

        torch.empty(FAR_TOO_MUCH, dtype=torch.uint8)

    @app.command()
    def shape() -> None:
        import torch

        torch.empty((2**40, 2**40))  # 2**80 elements: torch cannot even size it

    @app.command()
    def buffer() -> None:
        bytearray(FAR_TOO_MUCH)

    return app


def test_running_out_of_memory_is_one_line_and_a_failed_run() -> None:
    app = _app()
    torch_said = CliRunner().invoke(app, ["tensor"])
    assert torch_said.exit_code == EXIT_FAILED and "Traceback" not in torch_said.output, torch_said.output
    (line,) = torch_said.stderr.splitlines()  # torch's words after its "[enforce fail at ...]" prefix
    assert line.startswith("ledger: error: out of memory: ") and f"allocate {FAR_TOO_MUCH} bytes" in line, line
    assert "enforce fail" not in line
    shape_said = CliRunner().invoke(app, ["shape"])
    assert shape_said.exit_code == EXIT_FAILED and shape_said.stderr == (
        "ledger: error: out of memory: Storage size calculation overflowed with sizes=[1099511627776, "
        "1099511627776]\n"), shape_said.output
    python_said = CliRunner().invoke(app, ["buffer"])
    assert python_said.exit_code == EXIT_FAILED and python_said.stderr == "ledger: error: out of memory\n"


def test_other_errors_still_reach_the_user_as_they_were() -> None:
    app = make_typer("a runtime error that is not about memory")

    @app.command()
    def fail() -> None:
        raise RuntimeError("something else")

    @app.command()
    def other() -> None:  # a second command, so that `fail` is a sub-command as in the CLI
        pass

    result = CliRunner().invoke(app, ["fail"])
    assert result.exit_code == 1 and isinstance(result.exception, RuntimeError)  # an internal error, not hidden
