"""The code stays typed and lint-clean: mypy over the packages, the tests, the benchmarks and the migrations, and
ruff over the whole tree, with the settings of pyproject.toml. Both are in the `test` extra, so the README's test
command runs them on a clean clone.

mypy's first run there takes about half a minute of one core (torch's stubs are large), so when its test is
collected it starts at the beginning of the session (tests/conftest.py) and runs beside the single-threaded tests;
the test waits for it and reads its verdict."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from tests.background import Background

ROOT = Path(__file__).resolve().parents[1]
TYPED = ("ledger", "verify", "runners", "migrations", "tests", "benchmarks")
MYPY_TIMEOUT = 900.0

MYPY = Background("mypy", [sys.executable, "-m", "mypy", "--config-file", str(ROOT / "pyproject.toml"), *TYPED],
                  cwd=ROOT)


def mypy_result() -> tuple[int, str]:
    done = MYPY.wait(MYPY_TIMEOUT)
    return done.code, done.stdout + done.stderr


def run(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_mypy_finds_no_error() -> None:
    code, output = mypy_result()
    assert code == 0, output[-6000:]
    assert output.startswith("Success: no issues found"), output[-2000:]


def test_ruff_finds_no_error() -> None:
    result = run("ruff", "check", "--no-cache", ".", timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
