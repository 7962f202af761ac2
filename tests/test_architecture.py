"""The layers of docs/architecture.md, kept: import-linter's contracts (pyproject.toml) pass, nothing imports the
CLI but the CLI, and no two modules import each other, directly or through others (imports inside functions
count: grimp reads them all)."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import grimp
import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("ledger", "verify", "runners", "migrations")


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    return grimp.build_graph(*PACKAGES)


def test_import_linter_contracts_are_kept() -> None:
    exe = shutil.which("lint-imports") or str(Path(sys.executable).parent / "lint-imports")
    result = subprocess.run([exe, "--no-cache", "--config", str(ROOT / "pyproject.toml")], cwd=ROOT,
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " 0 broken." in result.stdout and "KEPT" in result.stdout


def strongly_connected(graph: grimp.ImportGraph) -> list[list[str]]:
    """Tarjan's strongly connected components of more than one module: each is an import cycle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.find_modules_directly_imported_by(v)):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10_000))
    for module in sorted(graph.modules):
        if module not in index:
            visit(module)
    return cycles


def test_no_import_cycles(graph: grimp.ImportGraph) -> None:
    assert strongly_connected(graph) == []


def test_cycle_finder_finds_a_cycle() -> None:
    """The check above could fail: the same finder on a graph with a planted cycle reports it."""
    g = grimp.ImportGraph()
    for m in ("a", "a.x", "a.y", "a.z"):
        g.add_module(m)
    g.add_import(importer="a.x", imported="a.y")
    g.add_import(importer="a.y", imported="a.z")
    g.add_import(importer="a.z", imported="a.x")
    assert strongly_connected(g) == [["a.x", "a.y", "a.z"]]


def test_only_the_cli_imports_the_cli(graph: grimp.ImportGraph) -> None:
    cli = {m for m in graph.modules if m == "ledger.cli" or m.startswith("ledger.cli.")}
    importers = {m for c in cli for m in graph.find_modules_that_directly_import(c)} - cli
    assert importers == set()
