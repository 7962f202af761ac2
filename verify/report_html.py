"""Render an audit report as one self-contained HTML page: ``render_report(report, figures) -> bytes``.

The page is UTF-8 HTML5 with inline CSS and inline SVG, no JavaScript, and a ``Content-Security-Policy`` of
``default-src 'none'`` so that a browser opening it makes no request at all. It is a pure function of its inputs:
the same ``report``, ``figures`` and format give the same bytes in any process. Only the figures differ between the
formats (verify/report_plots.py): format 2, the one written, draws them in pure Python (verify/report_charts.py);
format 1 drew them with matplotlib (verify/report_charts_mpl.py, imported only to render such a page again).

``report`` is the audit's report dict (``verify.audit.build_report``; shape of
``shared/reference/report-1.7b-four-hosts.json``). Every number the report holds is read from it. ``figures``
holds what the page plots or names but the report does not carry; each value is copied from a receipt (or an
artifact a receipt names), so it can be assembled from the ledger alone:

``audit_receipt``: str, required
    Id of the ``audit`` receipt whose report artifact is ``report``.
``log_head``: str or None, required key
    The exported log head the audit verifies against; None when none was exported (the page says so).
``quality_thresholds``: {condition: float}, optional
    The contract receipt's ``measurements.quality`` (its id is ``report["contract"]``), shown beside each quality
    condition. The efficiency thresholds are read from ``report["training"]["thresholds"]``.
``receipts``: optional, every entry optional
    ``{"training": {arm: id}, "recovery": id, "fault": id, "quality": id, "serving": id}``: the ``arm-summary``
    receipt of each arm's ``train/<arm>`` run, the recovery summary (``comparison``, format ``ledger-recovery/1``),
    the ``fault`` receipt of the killed group, the ``quality`` receipt, and the serving summary receipt. Each
    figure's caption names the ones holding its numbers.
``losses``: {arm: Trajectory}, optional
    The training loss of each arm's ``train/<arm>`` run.
``recovery``: {"uninterrupted": Trajectory, "recovered": Trajectory}, optional
    The uninterrupted and the recovered run of ``report["recovery"]["arm"]``, on the same rank. The recovered
    trajectory holds the failed group's steps up to its last checkpoint, then the restarted group's.
``retention``: {"seed_receipt": id, "arms": {arm: {"receipt": id, "changes": [float]}}}, optional
    Per-probe retention loss change of each arm against the seed (candidate NLL - seed NLL, nats/token, in probe
    order) from the ``retention`` artifacts of the arm's ``eval`` receipt (``receipt``) and the seed's.
``serving``: optional
    ``{"latencies": {phase: [float]}, "replicas": [{"endpoint": str, "model_digest": str, "receipt": id}]}``:
    the ``latency_seconds`` of every successful request per phase (the request-log rows the phase's median and p95
    are computed from), and each replica's proof of the model it loaded.

A Trajectory is ``{"run": str, "rank": int, "steps": [int], "loss": [float], "checkpoints": [int],
"receipts": [id]}``: the rank's recorded loss at each step (``steps`` increasing, ``loss`` of the same length),
and the steps of its checkpoints with the id of each ``checkpoint`` receipt, in the same order; checkpoint
receipt *i* carries the losses of the steps after ``checkpoints[i-1]`` up to ``checkpoints[i]``.

A section whose report part is absent or has a ``status`` (``"not run ..."``) renders a notice instead; an optional
``figures`` part that is missing leaves its plot out with a notice. A malformed ``figures`` part raises
:class:`ledger.errors.InputError` naming the field. Every string from either input is HTML-escaped.
"""

from __future__ import annotations

import html
import math
import re
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ledger.errors import InputError, printable
from ledger.experiment.formats import REPORT_HTML_FORMAT, REPORT_HTML_FORMATS, REPORT_HTML_MATPLOTLIB_FORMAT
from verify.report_plots import BytesBars, Charts, Forest, Timeline, Trajectory

CONTRACTS = ("quality", "efficiency", "recovery", "serving")
ARM_ORDER = ("seed", "single", "ddp-four", "diloco-four")
PHASE_ORDER = ("single", "four", "failure")
LONG_TABLE = 16  # data tables with more rows than this are folded into a <details>

# ------------------------------------------------------------------------------------------------ public


FORMATS = REPORT_HTML_FORMATS  # what render_report renders; the first is written


def render_report(report: Mapping[str, Any], figures: Mapping[str, Any], format: str = REPORT_HTML_FORMAT) -> bytes:
    """The report as one self-contained HTML page (UTF-8 bytes) in ``format`` (one of :data:`FORMATS`); see the
    module docstring for ``figures``."""
    charts = _charts(format)
    if not isinstance(report, Mapping):
        raise InputError(f"report: expected a mapping, got {type(report).__name__}")
    if not isinstance(figures, Mapping):
        raise InputError(f"figures: expected a mapping, got {type(figures).__name__}")
    _check_numbers(report, "report")
    _check_numbers(figures, "figures")
    _require_str(figures, "audit_receipt", "figures")
    if "log_head" not in figures:
        raise InputError("figures.log_head: required (None when no log head was exported)")
    if figures["log_head"] is not None:
        _require_str(figures, "log_head", "figures")
    page = _Page(report, figures, charts)
    with charts.session():
        body = page.body()
    return _document(report, body, charts.format).encode("utf-8")


def _charts(format: str) -> Charts:
    """What draws the figures of ``format``: only the figures differ between the formats."""
    if format == REPORT_HTML_FORMAT:
        from verify.report_charts import SvgCharts

        return SvgCharts()
    if format == REPORT_HTML_MATPLOTLIB_FORMAT:
        from verify.report_charts_mpl import MatplotlibCharts

        return MatplotlibCharts()
    raise InputError(f"format: expected one of {', '.join(FORMATS)}, got {format!r}"[:300])


# ------------------------------------------------------------------------------------------- validation


# Beyond this, sums and spans of the numbers drawn could overflow a float; no measurement comes near it (the BIGINT
# range, as the ledger's integer columns).
_LARGEST = 2**63


def _undrawable(v: Any) -> bool:
    return isinstance(v, int | float) and not isinstance(v, bool) and not -_LARGEST <= v <= _LARGEST


def _check_numbers(value: Any, where: str) -> None:
    """Raise InputError naming the first number in ``value`` that is not finite or beyond :data:`_LARGEST`."""
    todo = [value]
    while todo:  # values only, and a list of numbers at C speed: one Python step per number cost 8 ms a page
        v = todo.pop()
        if type(v) is dict or isinstance(v, Mapping):
            todo.extend(v.values())
        elif type(v) is list or isinstance(v, tuple):
            try:  # all numbers, within the bounds (so their sum is finite unless one is NaN): nothing to look into
                if -_LARGEST <= min(v) and max(v) <= _LARGEST and math.isfinite(sum(v)):
                    continue
            except (TypeError, ValueError, OverflowError):  # not all numbers, or empty
                pass
            todo.extend(v)
        elif _undrawable(v):
            break
    else:
        return
    named = [(value, where)]  # there is one: walk again, in order, with the path of each value
    while named:
        v, at = named.pop()
        if type(v) is dict or isinstance(v, Mapping):
            named.extend((x, f"{at}.{k}") for k, x in reversed(list(v.items())))
        elif type(v) is list or isinstance(v, tuple):
            named.extend((x, f"{at}[{i}]") for i, x in reversed(list(enumerate(v))))
        elif _undrawable(v):
            raise InputError(f"{at}: {v!r} is beyond what the page can draw (a finite number of at most 2**63)"[:300])


def _require_str(m: Mapping[str, Any], key: str, where: str) -> str:
    value = m.get(key)
    if not isinstance(value, str) or not value:
        raise InputError(f"{where}.{key}: expected a non-empty string, got {value!r}"[:300])
    return value


def _numbers(value: Any, where: str, kind: type = float) -> list[Any]:
    if not isinstance(value, list):
        raise InputError(f"{where}: expected a list of numbers, got {type(value).__name__}")
    for i, v in enumerate(value):
        ok = isinstance(v, int) if kind is int else isinstance(v, int | float)
        if isinstance(v, bool) or not ok or (isinstance(v, float) and not math.isfinite(v)):
            raise InputError(f"{where}[{i}]: expected a finite {kind.__name__}, got {v!r}"[:300])
    return value


def _trajectory(value: Any, where: str) -> Trajectory:
    if not isinstance(value, Mapping):
        raise InputError(f"{where}: expected a trajectory mapping, got {type(value).__name__}")
    steps = _numbers(value.get("steps"), f"{where}.steps", int)
    loss = _numbers(value.get("loss"), f"{where}.loss")
    if len(steps) != len(loss):
        raise InputError(f"{where}: {len(steps)} steps but {len(loss)} loss values")
    if any(b <= a for a, b in zip(steps, steps[1:], strict=False)):
        raise InputError(f"{where}.steps: expected increasing steps")
    checkpoints = _numbers(value.get("checkpoints", []), f"{where}.checkpoints", int)
    receipts = value.get("receipts", [])
    if not isinstance(receipts, list) or not all(isinstance(r, str) for r in receipts) \
            or len(receipts) != len(checkpoints):
        raise InputError(f"{where}.receipts: expected one receipt id per checkpoint ({len(checkpoints)})")
    rank = value.get("rank", 0)
    if not isinstance(rank, int) or isinstance(rank, bool):
        raise InputError(f"{where}.rank: expected an integer, got {rank!r}"[:300])
    return Trajectory(str(value.get("run", "")), rank, list(steps), [float(x) for x in loss], list(checkpoints),
                       list(receipts))


def _mapping(value: Any, where: str) -> Mapping[str, Any]:
    if value is None:
        return {}
    if not isinstance(value, Mapping):
        raise InputError(f"{where}: expected a mapping, got {type(value).__name__}")
    return value


def _not_run(section: Any) -> str | None:
    """The notice for an absent or not-run report section, or None if it holds data."""
    if not isinstance(section, Mapping) or not section:
        return "not run: the report has no such section"
    status = section.get("status")
    if status is not None:
        return str(status)
    return None


# ---------------------------------------------------------------------------------------------- format


def _e(value: Any) -> str:
    """Text from the data as HTML: markup escaped, and what a browser would not show as written (NUL, ESC and
    other controls, bidi overrides) as its escape (ledger.errors.printable; newlines and tabs kept)."""
    return html.escape(printable(str(value), lines=True), quote=True)


def _num(value: Any, digits: int = 4) -> str:
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, float):
        if value == 0:
            return "0"
        return format(value, f".{digits}g").replace("e-0", "e-").replace("e+0", "e+").replace("-", "−")
    return _e(value)


def _exact(value: float) -> str:
    """The shortest repr that round-trips: shows whether two floats are bit-for-bit the same."""
    return repr(float(value)).replace("-", "−")


def _bytes(value: Any) -> str:
    if not isinstance(value, int) or isinstance(value, bool):
        return _num(value)
    return f"{value:,}"


def _rid(receipt: Any) -> str:
    if not receipt:
        return '<span class="muted">not supplied</span>'
    return f'<code class="rid">{_e(receipt)}</code>'


def _short(digest: Any) -> str:
    s = str(digest)
    body = s.split(":", 1)[1] if ":" in s else s
    return f'<code title="{_e(s)}">{_e(body[:12])}…</code>' if len(body) > 12 else f"<code>{_e(s)}</code>"


def _badge(passed: bool | None, extra: str = "") -> str:
    if passed is None:
        return '<span class="badge na">n/a</span>'
    word, cls = ("PASS", "pass") if passed else ("FAIL", "fail")
    return f'<span class="badge {cls}">{word}</span>{extra}'


def _order(keys: Any, preferred: Sequence[str] = ARM_ORDER) -> list[str]:
    rank = {k: i for i, k in enumerate(preferred)}
    return sorted((str(k) for k in keys), key=lambda k: (rank.get(k, len(rank)), k))


def _sentence(text: Any) -> str:
    """Escaped ``text`` ending in a full stop, so a scope string can run on into the next sentence."""
    t = str(text or "").strip()
    return _e(t if not t or t[-1] in ".!?" else t + ".")


def _table(head: Sequence[str], rows: Sequence[Sequence[str]], caption: str, *, numeric_from: int = 1,
           fold: bool | None = None) -> str:
    """A data table (cells already escaped HTML) in a horizontally scrolling wrapper; long ones folded."""
    num = ' class="n"'
    th = "".join(f'<th scope="col"{num if i >= numeric_from else ""}>{h}</th>' for i, h in enumerate(head))
    body = "".join(
        "<tr>" + "".join((f'<th scope="row">{c}</th>' if i == 0 else
                          f'<td{num if i >= numeric_from else ""}>{c}</td>') for i, c in enumerate(r))
        + "</tr>" for r in rows)
    table = (f'<div class="table-wrap" role="region" tabindex="0" aria-label="{_e(_strip_tags(caption))}">'
             f"<table><caption>{caption}</caption><thead><tr>{th}</tr></thead><tbody>{body}</tbody></table></div>")
    if fold if fold is not None else len(rows) > LONG_TABLE:
        return f"<details><summary>{caption} ({len(rows)} rows)</summary>{table}</details>"
    return table


def _strip_tags(s: str) -> str:
    return html.unescape(re.sub(r"<[^>]*>", "", s))


def _notice(text: str) -> str:
    return f'<p class="notice" role="status"><strong>Not run.</strong> {_e(text)}</p>'


# ------------------------------------------------------------------------------------------------ page


class _Page:
    def __init__(self, report: Mapping[str, Any], figures: Mapping[str, Any], charts: Charts) -> None:
        self.charts = charts
        self.report = report
        self.figures = figures
        self.receipts = _mapping(figures.get("receipts"), "figures.receipts")
        self.n = 0
        self.contracts = _mapping(report.get("contracts"), "report.contracts")

    # -- figure scaffold

    def figure(self, slug: str, draw: Callable[[str, str], str], label: str, caption: str, table: str) -> str:
        """The next figure: ``draw(fid, name)`` gives its SVG, ``table`` its numbers."""
        self.n += 1
        fid = f"fig{self.n}-{slug}"
        svg = draw(fid, _e(f"Figure {self.n}: {label}"))
        return (f'<figure class="plot" id="{fid}" aria-labelledby="{fid}-cap">'
                f'<div class="plot-body"><div class="svg-wrap">{svg}</div><div class="plot-data">{table}</div></div>'
                f'<figcaption id="{fid}-cap"><strong>Figure {self.n}.</strong> {caption}</figcaption></figure>')

    def body(self) -> str:
        parts = [self.header()]
        for slug, title, build in (("training", "Training", self.training), ("recovery", "Recovery", self.recovery),
                                   ("learning", "Learning", self.learning), ("serving", "Serving", self.serving)):
            parts.append(f'<section id="{slug}" aria-labelledby="{slug}-h"><h2 id="{slug}-h">{title}</h2>'
                         f"{build()}</section>")
        return "".join(parts)

    # -- verdict

    def header(self) -> str:
        r, f = self.report, self.figures
        learning = _mapping(r.get("learning"), "report.learning")
        tokens = learning.get("tokens_issued", r.get("tokens_issued"))
        head = f.get("log_head")
        ids = [("Audit receipt", _rid(f["audit_receipt"])),
               ("Log head verified against", _rid(head) if head else
                '<span class="muted">none exported: the audit was not checked against a log head</span>'),
               ("Contract receipt", _rid(r.get("contract"))),
               ("Prepared digest", _rid(r.get("prepared"))),
               ("Selection digest", _rid(learning.get("selection")))]
        dl = "".join(f"<div><dt>{k}</dt><dd>{v}</dd></div>" for k, v in ids)
        cards = "".join(self.contract_card(c) for c in CONTRACTS)
        nav = "".join(f'<a href="#{s}">{s.capitalize()}</a>' for s in ("training", "recovery", "learning", "serving"))
        passed = sum(1 for c in CONTRACTS if self.contracts.get(c) is True)
        return (
            '<header id="verdict" aria-labelledby="title">'
            f'<p class="kicker">training-ledger · {_e(r.get("format", "report"))}</p>'
            '<h1 id="title">Experiment audit report</h1>'
            f'<nav aria-label="Sections">{nav}</nav>'
            '<div class="settle">'
            f'<div class="tokens"><span class="label">Tokens issued</span><span class="value" data-tokens>'
            f"{_num(tokens)}</span></div>"
            f'<p>{passed} of {len(CONTRACTS)} contracts pass. The settlement issues tokens only when the quality, '
            "efficiency, recovery and serving contracts all pass; every figure below was recomputed from the "
            "ledger by the audit.</p></div>"
            f'<dl class="ids">{dl}</dl>'
            f'<h2 class="sr-only">Contracts</h2><div class="contracts">{cards}</div></header>')

    def contract_card(self, name: str) -> str:
        passed = self.contracts.get(name)
        rows, note = getattr(self, f"_{name}_rows")()
        table = _table(["Condition", "Figure", "Threshold", "Result"], rows,
                       f"{name.capitalize()} contract conditions", numeric_from=1, fold=False) if rows else ""
        state = "pass" if passed is True else "fail"
        return (f'<article class="contract {state}" data-contract="{name}" aria-labelledby="c-{name}">'
                f'<h3 id="c-{name}">{name.capitalize()} {_badge(passed is True)}</h3>'
                f"{note}{table}</article>")

    def _quality_rows(self) -> tuple[list[list[str]], str]:
        learning = self.report.get("learning")
        if (why := _not_run(learning)) is not None:
            return [], f'<p class="muted">{_e(why)}</p>'
        assert isinstance(learning, Mapping)
        cmp = _mapping(learning.get("comparisons_to_seed"), "report.learning.comparisons_to_seed")
        vals = [c for c in cmp.values() if isinstance(c, Mapping)]
        local = _mapping(learning.get("local_vs_ddp"), "report.learning.local_vs_ddp")
        def numbers(key: str, of: Sequence[Any]) -> list[float]:  # a figure the report lacks is shown as "—"
            return [c[key] for c in of if isinstance(c.get(key), int | float) and not isinstance(c[key], bool)]

        retention = [c["retention"] for c in vals if isinstance(c.get("retention"), Mapping)]
        uppers = numbers("normal_99pct_upper", retention)
        derived: dict[str, tuple[Any, str, str]] = {
            "minimum_accuracy_gain_vs_seed": (min(numbers("accuracy_gain", vals), default=None), "≥",
                                              "smallest accuracy gain vs seed"),
            "maximum_one_sided_p_vs_seed": (max(numbers("exact_one_sided_p", vals), default=None), "≤",
                                            "largest one-sided p vs seed"),
            "paired_99pct_lower_vs_ddp_min": (local.get("normal_99pct_lower"), "≥",
                                              f"{learning.get('primary_arm', 'primary')} vs DDP, 99% lower bound"),
            "retention_99pct_upper_max": (max(uppers, default=None), "≤", "largest retention change, 99% upper"),
        }
        thresholds = _mapping(self.figures.get("quality_thresholds"), "figures.quality_thresholds")
        rows = []
        for cond, value in sorted(_mapping(learning.get("conditions"), "report.learning.conditions").items()):
            fig, op, text = derived.get(cond, (None, "", cond.replace("_", " ")))
            thr = thresholds.get(cond)
            if isinstance(value, Mapping):  # the quality receipt's {passed, figure, threshold} form
                fig, thr, value = value.get("figure", fig), value.get("threshold", thr), value.get("passed")
            rows.append([_e(text), _num(fig), f"{op} {_num(thr)}" if thr is not None else "—",
                         _badge(bool(value))])
        return rows, ""

    def _efficiency_rows(self) -> tuple[list[list[str]], str]:
        t = _mapping(self.report.get("training"), "report.training")
        if (why := _not_run(t)) is not None:
            return [], f'<p class="muted">{_e(why)}</p>'
        ratios = _mapping(t.get("ratios"), "report.training.ratios")
        thr = _mapping(t.get("thresholds"), "report.training.thresholds")
        known = {"active_time": ("active_seconds_vs_ddp", "active_seconds_vs_ddp_max", "active seconds vs DDP"),
                 "sent_bytes": ("sent_bytes_vs_ddp", "sent_bytes_vs_ddp_max", "sent bytes vs DDP")}
        rows = []
        for cond, value in sorted(_mapping(t.get("conditions"), "report.training.conditions").items()):
            ratio, limit, text = known.get(cond, ("", "", cond.replace("_", " ")))
            rows.append([_e(text), _num(ratios.get(ratio)),
                         f"≤ {_num(thr[limit])}" if limit in thr else "—", _badge(bool(value))])
        missing = t.get("missing_arms") or []
        if missing:
            rows.append(["arms trained", f"missing {_e(', '.join(map(str, missing)))}", "all", _badge(False)])
        return rows, ""

    def _recovery_rows(self) -> tuple[list[list[str]], str]:
        rec = self.report.get("recovery")
        if (why := _not_run(rec)) is not None:
            return [], f'<p class="muted">{_e(why)}</p>'
        assert isinstance(rec, Mapping)
        ranks = [x for x in rec.get("rank_comparisons", []) if isinstance(x, Mapping)]
        equal = sum(1 for x in ranks if x.get("contents_exactly_equal") and x.get("file_hashes_equal"))
        recorded = [x for x in ranks if "trajectory_equal" in x]
        traj = sum(1 for x in recorded if x["trajectory_equal"])
        rows = [["ranks with equal state and files", f"{equal} of {len(ranks)}", "all",
                 _badge(bool(ranks) and equal == len(ranks))],
                ["ranks with equal loss trajectory", f"{traj} of {len(recorded)}" if recorded else "not recorded",
                 "all", _badge(traj == len(ranks)) if recorded else "—"],
                ["killed rank · resume step", f"{_num(rec.get('killed_rank'))} · {_num(rec.get('restore_step'))}",
                 "—", _badge(bool(rec.get("all_rank_state_and_trajectory_comparisons_passed")))]]
        return rows, ""

    def _serving_rows(self) -> tuple[list[list[str]], str]:
        s = self.report.get("serving")
        if (why := _not_run(s)) is not None:
            return [], f'<p class="muted">{_e(why)}</p>'
        assert isinstance(s, Mapping)
        rows = [[_e(c.replace("_", " ")), _num(v), "yes", _badge(bool(v))]
                for c, v in sorted(_mapping(s.get("conditions"), "report.serving.conditions").items())]
        rows.append(["throughput, four replicas vs one", f"× {_num(s.get('four_throughput_ratio'), 3)}", "—", ""])
        rows.append(["client retries in the failure phase", _num(s.get("failure_retries")), "—", ""])
        return rows, ""

    # -- training

    def training(self) -> str:
        t = self.report.get("training")
        if (why := _not_run(t)) is not None:
            return _notice(why)
        assert isinstance(t, Mapping)
        arms = _mapping(t.get("arms"), "report.training.arms")
        out = [f'<p class="scope">{_e(t.get("scope", ""))}</p>']
        if t.get("missing_arms"):
            out.append(f'<p class="notice" role="status">Arms not trained: {_e(", ".join(t["missing_arms"]))}.</p>')
        out.append(self.loss_figure())
        if arms:
            out.append(self.time_figure(arms, t))
            out.append(self.bytes_figure(arms, t))
        else:
            out.append(_notice("no arm summary in the report"))
        return "".join(out)

    def _summary_ids(self, arms: Sequence[str]) -> str:
        ids = _mapping(self.receipts.get("training"), "figures.receipts.training")
        return "; ".join(f"{_e(a)}: {_rid(ids.get(a))}" for a in arms)

    def loss_figure(self) -> str:
        raw = _mapping(self.figures.get("losses"), "figures.losses")
        if not raw:
            return _notice("loss trajectories were not supplied (figures.losses)")
        losses = {a: _trajectory(raw[a], f"figures.losses.{a}") for a in _order(raw)}
        steps = sorted({s for tr in losses.values() for s in tr.steps})
        by = {a: dict(zip(tr.steps, tr.loss, strict=True)) for a, tr in losses.items()}
        ckpt = {a: set(tr.checkpoints) for a, tr in losses.items()}
        rows = [[str(s)] + [(_num(by[a][s], 6) + (" ◆" if s in ckpt[a] else "")) if s in by[a] else "—"
                            for a in losses] for s in steps]
        table = _table(["Step", *(_e(a) for a in losses)], rows, "Loss per step (◆ checkpoint)")
        rec_rows = [[_e(a), str(s), _rid(r)] for a, tr in losses.items()
                    for s, r in zip(tr.checkpoints, tr.receipts, strict=True)]
        rec_table = _table(["Arm", "Checkpoint step", "Checkpoint receipt"], rec_rows,
                           "Checkpoint receipts holding these losses", numeric_from=1, fold=True)
        caption = (f"Training loss per step of each arm, overlaid; diamonds mark checkpoints. Each rank records its "
                   f"shard's loss at every step in the checkpoint receipt that follows (listed below the table); "
                   f"the arm summaries citing them are {self._summary_ids(list(losses))}.")
        return self.figure("loss", lambda fid, name: self.charts.loss(fid, name, losses),
                           "training loss per step per arm with checkpoint markers", caption, table + rec_table)

    def time_figure(self, arms: Mapping[str, Any], t: Mapping[str, Any]) -> str:
        order = _order(arms)
        bars = []
        rows: list[list[str]] = []
        for arm in order:
            ranks = sorted(arms[arm].get("ranks", []), key=lambda r: r.get("rank", 0))
            bars.append((arm, [(rk.get("rank"), [(part, float(rk.get(key) or 0)) for part, key in (
                ("update", "update_seconds"), ("synchronization", "synchronization_seconds"),
                ("checkpoint", "checkpoint_seconds"))]) for rk in ranks]))
            for rk in ranks:
                rows.append([f"{_e(arm)} r{_e(rk.get('rank'))}", _num(rk.get("update_seconds")),
                             _num(rk.get("synchronization_seconds")), _num(rk.get("checkpoint_seconds")),
                             _num(rk.get("active_seconds")), _num(rk.get("loop_seconds"))])
        table = _table(["Arm, rank", "Update s", "Sync s", "Checkpoint s", "Active s", "Loop s"], rows,
                       "Seconds per rank")
        caption = (f"Per-rank loop time of each arm: local update, synchronization and checkpoint seconds, stacked. "
                   f"{_sentence(t.get('timing_scope'))} Numbers from the arm summaries {self._summary_ids(order)}.")
        return self.figure("seconds", lambda fid, name: self.charts.seconds(fid, name, bars),
                           "per-rank update, synchronization and checkpoint seconds, stacked", caption, table)

    def bytes_figure(self, arms: Mapping[str, Any], t: Mapping[str, Any]) -> str:
        order = _order(arms)
        sent = {a: int(arms[a].get("total_sent_bytes") or 0) for a in order}
        every = sorted({i for a in order for r in arms[a].get("ranks", []) for i in (r.get("interface_bytes") or {})})
        # An interface that moved no byte on any rank is named in the caption instead of given a column of zeros.
        ifaces = [i for i in every if any(int(v.get("tx", 0)) or int(v.get("rx", 0)) for a in order
                                          for r in arms[a].get("ranks", [])
                                          for n, v in (r.get("interface_bytes") or {}).items() if n == i)]
        idle = [i for i in every if i not in ifaces]
        tx = {a: sum(int(v.get("tx", 0)) for r in arms[a].get("ranks", [])
                     for v in (r.get("interface_bytes") or {}).values()) for a in order}
        positive = [v for v in (*sent.values(), *tx.values()) if v > 0]
        floor = min(positive) / 4 if positive else 1.0
        drawn = BytesBars(order, sent, tx, positive, floor)
        head = ["Arm, rank", "Sent bytes (collective)"] + [f"{_e(i)} tx / rx" for i in ifaces]
        rows = []
        for a in order:
            for r in sorted(arms[a].get("ranks", []), key=lambda r: r.get("rank", 0)):
                ib = r.get("interface_bytes") or {}
                rows.append([f"{_e(a)} r{_e(r.get('rank'))}", _bytes(r.get("sent_bytes"))] +
                            [f"{_bytes(ib[i].get('tx'))} / {_bytes(ib[i].get('rx'))}" if i in ib else "—"
                             for i in ifaces])
            rows.append([f"<strong>{_e(a)} total</strong>", f"<strong>{_bytes(sent[a])}</strong>"] +
                        ["" for _ in ifaces])
        table = _table(head, rows, "Bytes sent per rank", fold=len(rows) > LONG_TABLE)
        ratio = _mapping(t.get("ratios"), "report.training.ratios").get("sent_bytes_vs_ddp")
        caption = (f"Bytes each arm sent: exactly as counted at every collective call, and from the host's interface "
                   f"counters. The primary arm sent {_num(ratio)} of DDP's collective bytes. "
                   + (f"Interfaces that moved no bytes: {_e(', '.join(idle))}. " if idle else "") +
                   f"{_sentence(t.get('network_scope'))} Numbers from the arm summaries {self._summary_ids(order)}.")
        return self.figure("bytes", lambda fid, name: self.charts.bytes(fid, name, drawn),
                           "bytes sent per arm, collective and interface counters", caption, table)

    # -- recovery

    def recovery(self) -> str:
        rec = self.report.get("recovery")
        if (why := _not_run(rec)) is not None:
            return _notice(why)
        assert isinstance(rec, Mapping)
        out = [f'<p class="scope">{_e(rec.get("scope", ""))}</p>', self.timeline_figure(rec),
               self.equality_table(rec), self.trajectory_figure(rec)]
        return "".join(out)

    def timeline_figure(self, rec: Mapping[str, Any]) -> str:
        failed = float(rec.get("failed_group_seconds") or 0)
        restarted = float(rec.get("restarted_group_seconds") or 0)
        detect = rec.get("detect_seconds")
        kill_at = failed - float(detect) if isinstance(detect, int | float) else None
        kill_step, resume = rec.get("last_observed_step_before_kill"), rec.get("restore_step")
        drawn = Timeline(failed, restarted, kill_at, rec.get("killed_rank"), kill_step, resume)
        rows = [["group started", "0", "0"],
                [f"rank {_e(rec.get('killed_rank'))} killed (SIGKILL)", _num(kill_at), _num(kill_step)],
                ["failure detected, every rank gone", _num(failed), "—"],
                ["restarted group resumes", _num(failed), _num(resume)],
                ["restarted group finished", _num(failed + restarted), "—"]]
        table = _table(["Event", "Seconds", "Step"], rows, "Recovery timeline")
        detect_note = (f"The failure was detected {_num(detect)} s after the kill." if kill_at is not None else
                       "The report records no detection time, so the kill is not placed on the time axis.")
        caption = (f"Recovery timeline of {_e(rec.get('arm', 'the primary arm'))}: a rank is killed, the group "
                   f"fails, and a new group restarts from the last common checkpoint. {detect_note} The pause "
                   f"between the groups is not recorded and not drawn. Numbers from the recovery summary "
                   f"{_rid(self.receipts.get('recovery'))} and the fault receipt {_rid(self.receipts.get('fault'))}.")
        return self.figure("timeline", lambda fid, name: self.charts.timeline(fid, name, drawn),
                           "recovery timeline: kill, detection, restart and resume step", caption, table)

    def equality_table(self, rec: Mapping[str, Any]) -> str:
        ranks = sorted((x for x in rec.get("rank_comparisons", []) if isinstance(x, Mapping)),
                       key=lambda x: x.get("rank", 0))
        comps = _order({c for x in ranks for c in (x.get("comparisons") or {})},
                       ("model", "optimizer", "optimizer.pt", "outer", "outer.pt", "rng"))
        rows, ids = [], []
        for x in ranks:
            ok = bool(x.get("contents_exactly_equal"))
            cells = []
            for c in comps:
                m = (x.get("comparisons") or {}).get(c)
                if not isinstance(m, Mapping):
                    cells.append("—")
                    continue
                cells.append(f'{"=" if ok else "compared:"} {_num(m.get("tensors"))} tensors<br>'
                             f'<span class="muted">{_num(m.get("tensor_elements"))} elements · '
                             f'{_num(m.get("scalars"))} scalars</span>')
            rank = f"rank {_e(x.get('rank'))}"
            rows.append([rank, *cells, _badge(ok), _badge(bool(x.get("file_hashes_equal"))),
                         _badge(bool(x["trajectory_equal"])) if "trajectory_equal" in x else "not recorded"])
            ids.append([rank, _short(x.get("parameter_digest")), _short(x.get("outer_digest")),
                        _short(x.get("uninterrupted_receipt")), _short(x.get("recovered_receipt"))])
        head = ["Rank", *(_e(c) for c in comps), "Contents equal", "File hashes equal", "Trajectory equal"]
        table = _table(head, rows, "Per-rank, per-component equality, recovered vs uninterrupted", fold=False)
        id_table = _table(["Rank", "Parameter digest", "Outer digest", "Uninterrupted end receipt",
                           "Recovered end receipt"], ids, "What each rank's comparison binds", numeric_from=99,
                          fold=False)
        return (f'<div class="block equality"><h3>Equality, rank by rank and component by component</h3>{table}'
                f'<p class="muted">Each component lists what was compared; “=” means every tensor, element and '
                f"scalar of it is exactly equal in the recovered and the uninterrupted run.</p>{id_table}"
                f'<p class="muted">Each rank\'s comparison receipt is a parent of the recovery summary '
                f"{_rid(self.receipts.get('recovery'))}.</p></div>")

    def trajectory_figure(self, rec: Mapping[str, Any]) -> str:
        raw = _mapping(self.figures.get("recovery"), "figures.recovery")
        if not raw:
            return _notice("the uninterrupted and recovered loss trajectories were not supplied (figures.recovery)")
        un = _trajectory(raw.get("uninterrupted"), "figures.recovery.uninterrupted")
        re_ = _trajectory(raw.get("recovered"), "figures.recovery.recovered")
        resume, kill_step = rec.get("restore_step"), rec.get("last_observed_step_before_kill")
        u, r = dict(zip(un.steps, un.loss, strict=True)), dict(zip(re_.steps, re_.loss, strict=True))
        rows = []
        for s in sorted(set(u) | set(r)):
            same = (u[s] == r[s]) if s in u and s in r else None
            rows.append([str(s), _exact(u[s]) if s in u else "—", _exact(r[s]) if s in r else "—",
                         "—" if same is None else ("identical" if same else "<strong>differs</strong>")])
        table = _table(["Step", "Uninterrupted", "Recovered", "Bits"], rows, "Loss per step, exact floats")
        receipts = [[f"{_e(name)} ({_e(tr.run)})", str(s), _rid(rid)] for name, tr in (("uninterrupted", un),
                    ("recovered", re_)) for s, rid in zip(tr.checkpoints, tr.receipts, strict=True)]
        rec_table = _table(["Run", "Checkpoint step", "Checkpoint receipt"], receipts,
                           "Checkpoint receipts holding these losses", numeric_from=1, fold=True)
        caption = (f"Loss trajectory of rank {un.rank} in the uninterrupted run ({_e(un.run)}) and the recovered "
                   f"run ({_e(re_.run)}), overlaid: after the resume step the recovered losses must equal the "
                   f"uninterrupted ones bit for bit. Numbers from the checkpoint receipts listed below the table, "
                   f"compared by the recovery summary {_rid(self.receipts.get('recovery'))}.")
        return self.figure("trajectory",
                           lambda fid, name: self.charts.trajectory(fid, name, un, re_, resume, kill_step),
                           "uninterrupted and recovered loss trajectories overlaid", caption, table + rec_table)

    # -- learning

    def learning(self) -> str:
        ln = self.report.get("learning")
        if (why := _not_run(ln)) is not None:
            return _notice(why)
        assert isinstance(ln, Mapping)
        return "".join([f'<p class="scope">{_e(ln.get("scope", ""))}</p>', self.accuracy_figure(ln),
                        self.forest_figure(ln), self.retention_figure(ln)])

    def _quality_source(self) -> str:
        return f"Numbers from the quality receipt {_rid(self.receipts.get('quality'))}."

    def accuracy_figure(self, ln: Mapping[str, Any]) -> str:
        bd = _mapping(ln.get("breakdowns"), "report.learning.breakdowns")
        kinds = [k for k in ("family", "variant") if k in bd] + sorted(k for k in bd if k not in ("family", "variant"))
        if not kinds:
            return _notice("the report has no per-family or per-variant breakdown")
        arms = _order({a for k in kinds for g in bd[k].values() for a in g if a != "documents"})
        rows = []
        panels = []
        for kind in kinds:
            groups = sorted(bd[kind], key=lambda g: (0, int(g), g) if str(g).isdigit() else (1, 0, str(g)))
            panels.append((str(kind), [str(g) for g in groups], {
                arm: [bd[kind][g].get(arm, 0) / bd[kind][g]["documents"] if bd[kind][g].get("documents") else 0
                      for g in groups] for arm in arms}))
            for g in groups:
                d = bd[kind][g]
                n = d.get("documents") or 0
                rows.append([f"{_e(kind)} {_e(g)}", _num(n)] +
                            [f"{_num(d.get(a))} ({d.get(a, 0) / n:.1%})" if n and a in d else "—" for a in arms])
        table = _table(["Group", "Documents", *(_e(a) for a in arms)], rows, "Correct documents per group")
        caption = ("Exact-match accuracy per task family and per prompt variant of every arm beside the seed "
                   f"(baseline) model, from the per-document outcomes. {self._quality_source()}")
        return self.figure("accuracy", lambda fid, name: self.charts.accuracy(fid, name, panels, arms),
                           "accuracy per family and per variant of each arm beside the seed", caption, table)

    def forest_figure(self, ln: Mapping[str, Any]) -> str:
        primary = ln.get("primary_arm", "primary arm")
        entries: list[tuple[str, Mapping[str, Any]]] = []
        cmp = _mapping(ln.get("comparisons_to_seed"), "report.learning.comparisons_to_seed")
        entries += [(f"{a} vs seed", cmp[a]) for a in _order(cmp)]
        for key, label in (("local_vs_ddp", f"{primary} vs DDP"),
                           ("local_vs_single_descriptive", f"{primary} vs single (descriptive)")):
            if isinstance(ln.get(key), Mapping):
                entries.append((label, ln[key]))
        if not entries:
            return _notice("the report has no paired comparison")
        gains = [float(c.get("accuracy_gain", 0)) for _, c in entries]
        lo = [float(c.get("normal_99pct_lower", g)) for (_, c), g in zip(entries, gains, strict=True)]
        hi = [float(c.get("normal_99pct_upper", g)) for (_, c), g in zip(entries, gains, strict=True)]
        thresholds = _mapping(self.figures.get("quality_thresholds"), "figures.quality_thresholds")
        marks = []
        for key, label, color in (("minimum_accuracy_gain_vs_seed", "contract: min gain vs seed", "#009E73"),
                                  ("paired_99pct_lower_vs_ddp_min", "contract: min lower bound vs DDP", "#D55E00")):
            if isinstance(thresholds.get(key), int | float):
                marks.append((float(thresholds[key]), label, color))
        left, right = min(*lo, *(x for x, _, _ in marks), 0.0), max(*hi, *(x for x, _, _ in marks), 0.0)
        pad = max(right - left, 0.02) * 0.08
        drawn = Forest([n for n, _ in entries], gains, lo, hi, marks, (left - pad, right + pad))
        rows = [[_e(n), _num(c.get("accuracy_gain")), _num(c.get("normal_99pct_lower")),
                 _num(c.get("normal_99pct_upper")), _num(c.get("standard_error")), _num(c.get("gained")),
                 _num(c.get("lost")), _num(c.get("exact_one_sided_p"), 3)] for n, c in entries]
        table = _table(["Comparison", "Gain", "99% lower", "99% upper", "SE", "Gained", "Lost", "One-sided p"], rows,
                       "Paired comparisons")
        scope = next((c.get("interval_scope") for _, c in entries if c.get("interval_scope")), "")
        caption = (f"Paired comparisons on the same documents: accuracy gain with its 99% normal interval, and the "
                   f"exact one-sided binomial p on the discordant pairs. {_sentence(scope)} {self._quality_source()}")
        return self.figure("forest", lambda fid, name: self.charts.forest(fid, name, drawn),
                           "paired comparisons with 99% intervals, forest plot", caption, table)

    def retention_figure(self, ln: Mapping[str, Any]) -> str:
        cmp = _mapping(ln.get("comparisons_to_seed"), "report.learning.comparisons_to_seed")
        stats = {a: cmp[a]["retention"] for a in _order(cmp) if isinstance(cmp[a].get("retention"), Mapping)}
        srows = [[_e(a), _num(s.get("documents")), _num(s.get("improved")), _num(s.get("worsened")),
                  _num(s.get("mean_change")), _num(s.get("standard_error")), _num(s.get("normal_99pct_upper"))]
                 for a, s in stats.items()]
        summary = _table(["Arm", "Probes", "Improved", "Worsened", "Mean change", "SE", "99% upper"], srows,
                         "Retention change vs seed (nats/token)", fold=False)
        raw = _mapping(self.figures.get("retention"), "figures.retention")
        arms_raw = _mapping(raw.get("arms"), "figures.retention.arms")
        if not arms_raw:
            return (f'<div class="block"><h3>Retention</h3>{summary}</div>'
                    + _notice("per-probe retention changes were not supplied (figures.retention)"))
        changes: dict[str, list[float]] = {}
        receipts: dict[str, Any] = {}
        for a in _order(arms_raw):
            entry = _mapping(arms_raw[a], f"figures.retention.arms.{a}")
            changes[a] = [float(v) for v in _numbers(entry.get("changes"), f"figures.retention.arms.{a}.changes")]
            receipts[a] = entry.get("receipt")
        values = [v for vs in changes.values() for v in vs]
        lo, hi = (min(values), max(values)) if values else (-1.0, 1.0)
        if hi - lo < 1e-12:
            lo, hi = lo - 0.5 * (abs(lo) or 1e-3), hi + 0.5 * (abs(hi) or 1e-3)
        k = max(5, min(24, round(math.sqrt(max(len(vs) for vs in changes.values()) or 1)) * 2))
        edges = [lo + (hi - lo) * i / k for i in range(k + 1)]

        def counts(vs: Sequence[float]) -> list[int]:
            out = [0] * k
            for v in vs:
                out[min(k - 1, int((v - lo) / (hi - lo) * k))] += 1
            return out

        hist = {a: counts(vs) for a, vs in changes.items()}
        rows = [[f"[{_num(edges[i])}, {_num(edges[i + 1])}{']' if i == k - 1 else ')'}"]
                + [str(hist[a][i]) for a in hist] for i in range(k)]
        table = _table(["Change bin", *(_e(a) for a in hist)], rows, "Probes per change bin")
        n = max(len(vs) for vs in changes.values())
        probe_rows = [[str(p)] + [_exact(changes[a][p]) if p < len(changes[a]) else "—" for a in changes]
                      for p in range(n)]
        probes = _table(["Probe", *(_e(a) for a in changes)], probe_rows, "Loss change per probe", fold=True)
        src = "; ".join(f"{_e(a)}: {_rid(r)}" for a, r in receipts.items())
        caption = ("Distribution of the per-probe retention loss change of each arm against the seed model, on "
                   "public text the seed model was exposed to. The summary table is the report's; the histogram "
                   f"is from the eval receipts' retention artifacts ({src}; seed: "
                   f"{_rid(raw.get('seed_receipt'))}).")
        return self.figure("retention", lambda fid, name: self.charts.retention(fid, name, hist, edges),
                           "histogram of retention changes per arm", caption, summary + table + probes)

    # -- serving

    def serving(self) -> str:
        s = self.report.get("serving")
        if (why := _not_run(s)) is not None:
            return _notice(why)
        assert isinstance(s, Mapping)
        phases = _mapping(s.get("phases"), "report.serving.phases")
        order = _order(phases, PHASE_ORDER)
        return "".join([f'<p class="scope">{_e(s.get("scope", ""))}</p>', self.latency_figure(s, phases, order),
                        self.throughput_figure(s, phases, order), self.replica_table(s, phases, order)])

    def _serving_source(self) -> str:
        return f"Numbers from the serving receipt {_rid(self.receipts.get('serving'))}."

    def latency_figure(self, s: Mapping[str, Any], phases: Mapping[str, Any], order: list[str]) -> str:
        raw = _mapping(_mapping(self.figures.get("serving"), "figures.serving").get("latencies"),
                       "figures.serving.latencies")
        lat = {p: [float(v) for v in _numbers(raw[p], f"figures.serving.latencies.{p}")] for p in order if p in raw}
        rows = []
        for p in order:
            ph, vs = phases[p], lat.get(p, [])
            rows.append([_e(p), _num(ph.get("requests")), _num(ph.get("successful")),
                         _num(ph.get("median_latency_seconds")), _num(ph.get("p95_latency_seconds")),
                         _num(min(vs)) if vs else "—", _num(max(vs)) if vs else "—"])
        table = _table(["Phase", "Requests", "Successful", "Median s", "p95 s", "Min s", "Max s"], rows,
                       "Latency per phase")
        if not lat:
            return (f'<div class="block"><h3>Latency</h3>{table}</div>'
                    + _notice("per-request latencies were not supplied (figures.serving.latencies)"))
        shown = {p: lat[p] for p in order if p in lat}
        p95 = {p: phases[p].get("p95_latency_seconds") for p in shown}
        caption = ("Latency of every request per phase (one replica; four; four with one down and clients "
                   "retrying): box from the quartiles with the median in orange, points for each request, and the "
                   f"report's p95. {self._serving_source()}")
        return self.figure("latency", lambda fid, name: self.charts.latency(fid, name, shown, p95),
                           "request latency distribution per serving phase", caption, table)

    def throughput_figure(self, s: Mapping[str, Any], phases: Mapping[str, Any], order: list[str]) -> str:
        rps = {p: float(phases[p].get("requests_per_second") or 0) for p in order}
        rows = [[_e(p), _num(phases[p].get("requests_per_second")), _num(phases[p].get("seconds")),
                 _num(phases[p].get("concurrency")), _num(len(phases[p].get("endpoints") or [])),
                 _num(phases[p].get("retries")),
                 _e(", ".join(str(u.get("endpoint", u)) if isinstance(u, Mapping) else str(u)
                              for u in phases[p].get("unavailable") or []) or "none")] for p in order]
        table = _table(["Phase", "Requests/s", "Seconds", "Concurrency", "Replicas", "Retries", "Unavailable"], rows,
                       "Throughput per phase")
        caption = (f"Throughput per phase at fixed concurrency. Four replicas served "
                   f"× {_num(s.get('four_throughput_ratio'), 3)} the single replica's throughput; in the failure "
                   f"phase clients retried {_num(s.get('failure_retries'))} times. {self._serving_source()}")
        return self.figure("throughput", lambda fid, name: self.charts.throughput(fid, name, rps),
                           "throughput per serving phase", caption, table)

    def replica_table(self, s: Mapping[str, Any], phases: Mapping[str, Any], order: list[str]) -> str:
        expected = s.get("parameter_digest")
        raw = _mapping(self.figures.get("serving"), "figures.serving").get("replicas") or []
        if not isinstance(raw, list):
            raise InputError("figures.serving.replicas: expected a list of replicas")
        rows = []
        for i, r in enumerate(raw):
            r = _mapping(r, f"figures.serving.replicas[{i}]")
            d = r.get("model_digest")
            rows.append([_e(r.get("endpoint", f"replica {i}")), _rid(d), _badge(d == expected) if expected else "—",
                         _rid(r.get("receipt"))])
        for p in order:
            d = phases[p].get("model_digest")
            if d is not None:
                rows.append([f"phase {_e(p)} (report)", _rid(d), _badge(d == expected) if expected else "—", "—"])
        table = _table(["Replica", "Model digest it loaded", "Equals the trained model", "Receipt"], rows,
                       "Model digest per replica", numeric_from=99, fold=False)
        return (f'<div class="block"><h3>Model digests per replica</h3>{table}<p class="muted">The trained model '
                f"served ({_e(s.get('arm', ''))}) has parameter digest {_rid(expected)}. "
                f"{self._serving_source()}</p></div>")


# --------------------------------------------------------------------------------------------- document

_CSS = """
:root{--fg:#1b1f24;--muted:#59636e;--line:#d8dee4;--bg:#fff;--soft:#f6f8fa;--pass:#0a7a3d;--fail:#b42318;
--passbg:#e7f6ec;--failbg:#fdecea}
*{box-sizing:border-box}
html{-webkit-text-size-adjust:100%}
body{margin:0;background:var(--bg);color:var(--fg);font:15px/1.5 system-ui,-apple-system,"Segoe UI",Roboto,
"DejaVu Sans",sans-serif}
main{max-width:1240px;margin:0 auto;padding:16px}
h1{font-size:1.9rem;margin:.1em 0 .3em;line-height:1.2}
h2{font-size:1.45rem;margin:1.6em 0 .5em;padding-top:.4em;border-top:2px solid var(--line)}
h3{font-size:1.08rem;margin:1.1em 0 .4em}
p{margin:.4em 0 .8em}
code{font:12px/1.4 ui-monospace,"DejaVu Sans Mono",Menlo,Consolas,monospace}
code.rid{overflow-wrap:anywhere;word-break:break-all;background:var(--soft);padding:0 .2em;border-radius:3px}
.kicker{color:var(--muted);font-size:.85rem;margin:0;text-transform:uppercase;letter-spacing:.06em}
nav{display:flex;flex-wrap:wrap;gap:.3em 1em;margin:.2em 0 1em}
nav a{color:#0550ae}
.muted,.scope{color:var(--muted)}
.scope{font-size:.92rem;max-width:75ch}
.settle{display:flex;flex-wrap:wrap;align-items:center;gap:.5em 1.5em;background:var(--soft);
border:1px solid var(--line);border-radius:8px;padding:.8em 1em;margin-bottom:1em}
.settle p{flex:1 1 24em;margin:0}
.tokens{display:flex;flex-direction:column}
.tokens .label{font-size:.8rem;color:var(--muted);text-transform:uppercase;letter-spacing:.05em}
.tokens .value{font-size:2.2rem;font-weight:700;line-height:1.1}
dl.ids{display:grid;grid-template-columns:1fr;gap:.15em 1em;margin:0 0 1em}
dl.ids div{display:grid;grid-template-columns:minmax(9em,14em) minmax(0,1fr);gap:.8em}
dl.ids dt{color:var(--muted);font-size:.9rem}
dl.ids dd{margin:0}
.contracts{display:grid;grid-template-columns:repeat(auto-fit,minmax(min(100%,540px),1fr));gap:12px}
.contract{border:1px solid var(--line);border-left:6px solid var(--fail);border-radius:8px;padding:.2em .9em .6em;
min-width:0}
.contract.pass{border-left-color:var(--pass)}
.contract h3{display:flex;align-items:center;gap:.5em;margin:.5em 0}
.badge{display:inline-block;font-size:.78rem;font-weight:700;letter-spacing:.04em;padding:.05em .5em;
border-radius:999px;white-space:nowrap}
.badge.pass{color:var(--pass);background:var(--passbg)}
.badge.fail{color:var(--fail);background:var(--failbg)}
.badge.na{color:var(--muted);background:var(--soft)}
.notice{background:#fff8e1;border:1px solid #f0d58a;border-radius:6px;padding:.6em .9em}
figure.plot{margin:1.2em 0 1.8em;padding:0}
.plot-body{display:grid;grid-template-columns:minmax(0,1fr);gap:12px;align-items:start}
@media (min-width:1000px){.plot-body{grid-template-columns:minmax(0,11fr) minmax(0,9fr)}}
.svg-wrap{min-width:0}
svg.chart{display:block;max-width:100%;height:auto}
svg.chart *{stroke-linejoin:round;stroke-linecap:butt}
.plot-data{min-width:0}
figcaption{font-size:.9rem;color:var(--muted);margin-top:.5em;max-width:110ch}
figcaption strong{color:var(--fg)}
.table-wrap{overflow-x:auto;max-width:100%;margin:0 0 .6em}
.table-wrap:focus{outline:2px solid #0550ae}
table{border-collapse:collapse;font-size:.84rem;width:100%}
caption{text-align:left;font-weight:600;padding:.2em 0 .3em;color:var(--fg)}
th,td{border-bottom:1px solid var(--line);padding:.25em .5em;text-align:left;vertical-align:top}
thead th{background:var(--soft);white-space:nowrap}
.n{text-align:right;font-variant-numeric:tabular-nums}
td.n{white-space:nowrap}
tbody th{font-weight:500;white-space:nowrap}
.contract tbody th{white-space:normal}
.contract table{font-size:.82rem}
details{margin:0 0 .6em}
summary{cursor:pointer;color:#0550ae;font-size:.88rem}
.block{margin:1.2em 0}
.equality thead th{white-space:normal}
.equality td{white-space:nowrap}
.sr-only{position:absolute;width:1px;height:1px;overflow:hidden;clip:rect(0 0 0 0);white-space:nowrap}
footer{margin:2.5em 0 1em;color:var(--muted);font-size:.85rem;border-top:1px solid var(--line);padding-top:.6em}
@media (max-width:600px){body{font-size:14px}main{padding:10px}h1{font-size:1.5rem}
dl.ids div{grid-template-columns:1fr;gap:0}.tokens .value{font-size:1.8rem}}
"""

# Everything the page needs is inline; this makes a browser refuse anything else, so the page cannot phone home.
_CSP = "default-src 'none'; style-src 'unsafe-inline'; img-src data:; base-uri 'none'; form-action 'none'"


def _document(report: Mapping[str, Any], body: str, format: str) -> str:
    css = " ".join(line.strip() for line in _CSS.strip().splitlines())
    return ("<!DOCTYPE html>\n"
            '<html lang="en"><head><meta charset="utf-8">'
            f'<meta http-equiv="Content-Security-Policy" content="{_CSP}">'
            '<meta name="viewport" content="width=device-width, initial-scale=1">'
            f'<meta name="generator" content="training-ledger {format}">'
            f"<title>Audit report · {_e(str(report.get('prepared', ''))[:19])}</title>"
            f"<style>{css}</style></head>"
            f"<body><main>{body}"
            f"<footer>Rendered by <code>ledger report</code> ({format}) from the audit report and the "
            "receipts named beside each figure; every string from the ledger is escaped, and the page loads "
            "nothing from anywhere.</footer></main></body></html>\n")


__all__ = ["FORMATS", "REPORT_HTML_FORMAT", "render_report"]
