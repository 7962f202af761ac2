"""Rich rendering of eval, comparison and quality receipts (for `ledger show` and `ledger run eval`)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from rich.console import Console
from rich.table import Table

from ledger.cli.common import add_row, print_wide
from ledger.receipts import Receipt


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
            add_row(table, axis, key, str(cell["correct"]), str(docs), f"{cell['correct'] / docs:.4f}" if docs else "-")
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
            add_row(table, axis, key, *(str(cell.get(a, "-")) for a in (*arms, "documents")))
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
        add_row(table, name, str(m["baseline_correct"]), str(m["candidate_correct"]), str(m["gained"]),
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
        add_row(table, name, _num(bool(c["passed"])), _num(c["figure"]), _num(c["threshold"]), str(c.get("rule", "")))
    return table


def receipt_tables(r: Receipt) -> list[str | Table]:
    """The lines and tables of an eval, paired comparison or quality receipt's measurements, built before any is
    printed: measurements of another shape (a receipt written behind the library's back, or appended without the
    fields its kind's tables read) raise one of ledger.errors.SHAPE_ERRORS here, with nothing printed yet."""
    m = r.measurements
    parts: list[str | Table] = []
    if r.kind == "eval" and "breakdowns" in m:
        ret: Mapping[str, Any] = m["retention"] if isinstance(m.get("retention"), dict) else {}
        parts.append(f"{m.get('arm')}: {m.get('correct')}/{m.get('documents')} correct; retention mean NLL "
                     f"{_num(ret.get('mean_nll'))} over {_num(ret.get('probes'))} probes")
        parts.append(breakdown_table(m["breakdowns"]))
    elif r.kind == "comparison" and "gained" in m:
        table = Table(title=f"{m.get('comparison')}: {m['candidate']['arm']} vs {m['baseline']['arm']}",
                      title_justify="left", show_header=False, show_edge=False)
        table.add_column("field", style="bold")
        table.add_column("value", justify="right")
        for key in sorted(k for k in m if k not in ("method", "comparison", "baseline", "candidate", "retention")):
            add_row(table, key, m[key] if isinstance(m[key], str) else repr(m[key]))
        for key, value in sorted((m.get("retention") or {}).items()):
            add_row(table, f"retention {key}", value if isinstance(value, str) else repr(value))
        parts.append(table)
    elif r.kind == "quality" and "conditions" in m:
        parts.append(conditions_table(m["conditions"]))
        learning = m.get("learning") or {}
        arms = ["seed", *m.get("arms", [])]
        if "breakdowns" in learning:
            parts.append(merged_breakdown_table(learning["breakdowns"], arms))
        rows = {f"{a}_vs_seed": c for a, c in (learning.get("comparisons_to_seed") or {}).items()}
        rows.update({k: learning[k] for k in ("local_vs_ddp", "local_vs_single_descriptive") if k in learning})
        if rows:
            parts.append(comparisons_table(rows))
        parts.append(f"quality contract {'PASSED' if m['quality_contract_passed'] else 'FAILED'} "
                     f"(primary arm {m.get('primary_arm')}, baseline {m.get('baseline_arm')})")
    return parts


def render_receipt(console: Console, r: Receipt) -> None:
    """Render an eval, paired comparison or quality receipt's measurements as tables (for `ledger show`); raises
    one of ledger.errors.SHAPE_ERRORS, having printed nothing, for measurements of another shape
    (:func:`receipt_tables`)."""
    for part in receipt_tables(r):
        if isinstance(part, str):
            console.print(part)
        else:
            print_wide(console=console, table=part)
