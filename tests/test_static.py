"""The code stays typed and lint-clean: mypy over the packages, the tests, the benchmarks and the migrations, and
ruff over the whole tree, with the settings of pyproject.toml. Both are in the `test` extra, so the README's test
command runs them on a clean clone (mypy's first run there takes about a minute: torch's stubs are large)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
TYPED = ("ledger", "verify", "runners", "migrations", "tests", "benchmarks")


def run(*argv: str, timeout: float) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", *argv], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_mypy_finds_no_error() -> None:
    result = run("mypy", "--config-file", str(ROOT / "pyproject.toml"), *TYPED, timeout=600)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
    assert result.stdout.startswith("Success: no issues found"), result.stdout[-2000:]


def test_ruff_finds_no_error() -> None:
    result = run("ruff", "check", "--no-cache", ".", timeout=120)
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
