"""`ledger run eval` and the rich rendering of eval, comparison and quality receipts for `ledger show`.

Nothing here imports torch at module level: `ledger show` imports this module to render a receipt.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.table import Table

from ledger.cli_run import JsonOpt, RunDbOpt, WorkdirOpt, run_db
from ledger.receipts import Receipt

EVAL_KINDS = frozenset({"eval", "comparison", "quality"})


def register(run_app: typer.Typer, app: typer.Typer) -> None:
    """Add `ledger run eval` to ``run_app``. ``app`` (the top-level group) gets nothing: verification of these
    receipts is part of `ledger verify` (with `--rescore N`) and their rendering part of `ledger show`."""
    del app

    @run_app.command("eval")
    def eval_cmd(
        workdir: WorkdirOpt = Path("experiment"),
        db: RunDbOpt = None,
        prepared: Annotated[str | None, typer.Option(help="Prepared digest (default: the latest prepare).")] = None,
        threads: Annotated[int, typer.Option(min=1, help="Intra-op threads, pinned and recorded.")] = 1,
        json_out: JsonOpt = False,
    ) -> None:
        """Evaluate the seed and every trained arm; append eval, paired comparison and quality receipts."""
        from ledger import digests
        from ledger.cli import emit_json, err, out
        from runners.evaluate import run_evaluation

        if prepared is not None:
            digests.check_digest(prepared, "--prepared")
        started = time.perf_counter()
        with err.status("evaluating", spinner="dots") if err.is_terminal else _Null() as status:
            def progress(message: str) -> None:
                if status is not None:
                    status.update(message)

            result = run_evaluation(workdir, run_db(db, workdir), prepared=prepared, threads=threads,
                                    progress=progress)
        summary = result.to_json()
        summary["seconds"]["wall"] = time.perf_counter() - started
        if json_out:
            emit_json(summary)
            return
        out.print(f"prepared {result.prepared}\nselection {result.selection}  (threads {result.threads})")
        evals = Table(title="evaluations", title_justify="left", show_edge=False)
        for col in ("model", "correct", "documents", "accuracy", "retention NLL", "seconds", "receipt"):
            evals.add_column(col, justify="left" if col in ("model", "receipt") else "right")
        for arm, r in result.evals.items():
            m = r.measurements
            evals.add_row(arm, str(m["correct"]), str(m["documents"]), f"{m['correct'] / m['documents']:.4f}",
                          f"{m['retention']['mean_nll']:.4f}",
                          "reused" if arm in result.reused else f"{result.seconds[f'eval/{arm}']:.1f}",
                          r.id)
        _print_wide(out, evals)
        if result.comparisons:
            _print_wide(out, comparisons_table({n: r.measurements for n, r in result.comparisons.items()}))
        if result.quality is not None:
            _print_wide(out, conditions_table(result.quality.measurements["conditions"]))
            passed = result.quality.measurements["quality_contract_passed"]
            out.print(f"quality contract {'PASSED' if passed else 'FAILED'}: {result.quality.id}")
        else:
            out.print(f"quality contract not judged: arms not trained yet: {', '.join(result.missing_arms)}")
        out.print(f"{summary['seconds']['wall']:.1f}s")


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: object) -> None:
        return None


def _print_wide(console: Console, table: Table) -> None:
    """Print at the table's natural width: digests are never elided, even in a pipe."""
    from rich.measure import Measurement

    need = Measurement.get(console, console.options.update(width=100_000), table).maximum
    Console(highlight=False, soft_wrap=True, width=max(console.width, need), file=console.file).print(table)


def _num(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "NO"
    if isinstance(value, float):
        return f"{value:.3e}" if value != 0 and (abs(value) < 1e-3 or abs(value) >= 1e6) else f"{value:.6f}"
    return str(value)


# ----------------------------------------------------------------------------------------------- tables


def breakdown_table(breakdowns: Mapping[str, Mapping[str, Mapping[str, int]]], title: str = "breakdowns") -> Table:
    """One eval's correct/documents per family and per variant."""
    table = Table(title=title, title_justify="left", show_edge=False)
    for col in ("axis", "key", "correct", "documents", "accuracy"):
        table.add_column(col, justify="left" if col in ("axis", "key") else "right")
    for axis, cells in breakdowns.items():
        for key, cell in cells.items():
            docs = cell["documents"]
            table.add_row(axis, key, str(cell["correct"]), str(docs), f"{cell['correct'] / docs:.4f}" if docs else "-")
    return table


def merged_breakdown_table(merged: Mapping[str, Mapping[str, Mapping[str, int]]], arms: Sequence[str]) -> Table:
    """The reference report's breakdowns: correct per model, one row per family and variant."""
    table = Table(title="breakdowns (correct)", title_justify="left", show_edge=False)
    table.add_column("axis")
    table.add_column("key")
    for arm in (*arms, "documents"):
        table.add_column(arm, justify="right")
    for axis, cells in merged.items():
        for key, cell in cells.items():
            table.add_row(axis, key, *(str(cell.get(a, "-")) for a in (*arms, "documents")))
    return table


def comparisons_table(comparisons: Mapping[str, Mapping[str, Any]]) -> Table:
    """Paired comparisons, one per row (the reference report's fields)."""
    table = Table(title="paired comparisons", title_justify="left", show_edge=False)
    cols = ("comparison", "baseline_correct", "candidate_correct", "gained", "lost", "accuracy_gain", "standard_error",
            "normal_99pct_lower", "normal_99pct_upper", "exact_one_sided_p", "retention mean_change",
            "retention 99% upper")
    for col in cols:
        table.add_column(col, justify="left" if col == "comparison" else "right")
    for name, m in comparisons.items():
        ret = m.get("retention") or {}
        table.add_row(name, str(m["baseline_correct"]), str(m["candidate_correct"]), str(m["gained"]),
                      str(m["lost"]), _num(m["accuracy_gain"]), _num(m["standard_error"]),
                      _num(m["normal_99pct_lower"]), _num(m["normal_99pct_upper"]), _num(m["exact_one_sided_p"]),
                      _num(ret.get("mean_change")), _num(ret.get("normal_99pct_upper")))
    return table


def conditions_table(conditions: Mapping[str, Mapping[str, Any]]) -> Table:
    """The pre-registered quality conditions: passed, figure, threshold, rule."""
    table = Table(title="quality contract", title_justify="left", show_edge=False)
    for col in ("condition", "passed", "figure", "threshold", "rule"):
        table.add_column(col, justify="right" if col in ("figure", "threshold") else "left")
    for name, c in conditions.items():
        table.add_row(name, _num(bool(c["passed"])), _num(c["figure"]), _num(c["threshold"]), str(c.get("rule", "")))
    return table


def render_receipt(console: Console, r: Receipt) -> None:
    """Render an eval, paired comparison or quality receipt's measurements as tables (for `ledger show`)."""
    m = r.measurements
    if r.kind == "eval" and "breakdowns" in m:
        console.print(f"{m.get('arm')}: {m['correct']}/{m['documents']} correct; retention mean NLL "
                      f"{m['retention']['mean_nll']:.6f} over {m['retention']['probes']} probes")
        _print_wide(console, breakdown_table(m["breakdowns"]))
    elif r.kind == "comparison" and "gained" in m:
        table = Table(title=f"{m.get('comparison')}: {m['candidate']['arm']} vs {m['baseline']['arm']}",
                      title_justify="left", show_header=False, show_edge=False)
        table.add_column("field", style="bold")
        table.add_column("value", justify="right")
        for key in sorted(k for k in m if k not in ("method", "comparison", "baseline", "candidate", "retention")):
            table.add_row(key, m[key] if isinstance(m[key], str) else repr(m[key]))
        for key, value in sorted((m.get("retention") or {}).items()):
            table.add_row(f"retention {key}", value if isinstance(value, str) else repr(value))
        _print_wide(console, table)
    elif r.kind == "quality" and "conditions" in m:
        _print_wide(console, conditions_table(m["conditions"]))
        learning = m.get("learning") or {}
        arms = ["seed", *m.get("arms", [])]
        if "breakdowns" in learning:
            _print_wide(console, merged_breakdown_table(learning["breakdowns"], arms))
        rows = {f"{a}_vs_seed": c for a, c in (learning.get("comparisons_to_seed") or {}).items()}
        rows.update({k: learning[k] for k in ("local_vs_ddp", "local_vs_single_descriptive") if k in learning})
        if rows:
            _print_wide(console, comparisons_table(rows))
        console.print(f"quality contract {'PASSED' if m['quality_contract_passed'] else 'FAILED'} "
                      f"(primary arm {m.get('primary_arm')}, baseline {m.get('baseline_arm')})")
