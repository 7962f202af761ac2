"""The figures of report format ``ledger-report-html/2``, drawn by :mod:`verify.svg_plot` (no matplotlib).

They show what format 1's did (verify/report_charts_mpl.py), in the same colours, from the values
:mod:`verify.report_html` prepares; each method returns one inline SVG. A page's bytes under format 2 are fixed
once pages are recorded in it: a change to what is drawn here is a new format.
"""

from __future__ import annotations

import math
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any

from ledger.experiment.formats import REPORT_HTML_FORMAT
from verify.report_plots import PART_COLORS, Bars, BytesBars, Forest, Panels, Timeline, Trajectory, color, human_bytes
from verify.svg_plot import Legend, Plot

FORMAT = REPORT_HTML_FORMAT
_PX = 96.0  # px per inch: the heights are format 1's figure sizes


def _height(inches: float) -> float:
    return round(inches * _PX)


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """The ``q`` quantile by linear interpolation between order statistics (numpy's default)."""
    pos = (len(sorted_values) - 1) * q
    i = math.floor(pos)
    j = min(i + 1, len(sorted_values) - 1)
    return sorted_values[i] + (sorted_values[j] - sorted_values[i]) * (pos - i)


class SvgCharts:
    """Format 2's figures."""

    format = FORMAT

    @contextmanager
    def session(self) -> Iterator[None]:
        yield

    def loss(self, fid: str, name: str, losses: Mapping[str, Trajectory]) -> str:
        p = Plot(_height(3.3))
        ax = p.ax
        for i, (arm, tr) in enumerate(losses.items()):
            c = color(arm, i)
            ax.line(tr.steps, tr.loss, c, 1.6)
            if len(tr.steps) <= 40:
                ax.markers(tr.steps, tr.loss, "circle", 4, c)
            marked = set(tr.checkpoints)
            at = [(s, v) for s, v in zip(tr.steps, tr.loss, strict=True) if s in marked]
            ax.markers([s for s, _ in at], [v for _, v in at], "diamond", 9, c, fill="#ffffff", width=1.6)
            p.legend.append(Legend(arm, "line", c))
        p.legend.append(Legend("checkpoint", "diamond", "#333333", fill="#ffffff"))
        ax.xlabel = "step"
        ranks = sorted({tr.rank for tr in losses.values()})
        ax.ylabel = f"loss, rank {', '.join(map(str, ranks))} (nats/token)"
        return p.svg(name)

    def seconds(self, fid: str, name: str, bars: Bars) -> str:
        p = Plot(_height(3.1))
        ax = p.ax
        x = 0.0
        ticks: list[tuple[float, str]] = []
        for arm, ranks in bars:
            start = x
            for rank, parts in ranks:
                bottom = 0.0
                for part, v in parts:
                    ax.rect(x - 0.4, x + 0.4, bottom, bottom + v, PART_COLORS[part], "#ffffff", 0.5)
                    bottom += v
                ticks.append((x, f"r{rank}"))
                x += 1
            ax.text((start + x - 1) / 2, 0, str(arm), dy=26, anchor="middle", baseline="top", size=11.5, bold=True)
            x += 0.8
        ax.xticks, ax.xtick_size, ax.extra_bottom = ticks, 10.5, 16
        ax.yzero, ax.ylabel, ax.xgrid = True, "seconds", False
        p.legend.extend(Legend(part, "patch", c) for part, c in PART_COLORS.items())
        return p.svg(name)

    def bytes(self, fid: str, name: str, b: BytesBars) -> str:
        p = Plot(_height(0.9 + 0.55 * len(b.order)))
        ax = p.ax
        log = bool(b.positive)
        base = b.floor if log else 0.0
        for label, vals, off, c in (("collective sent bytes (exact)", b.sent, -0.19, "#0072B2"),
                                    ("interface tx bytes (host counters)", b.tx, 0.19, "#CC79A7")):
            for y, a in enumerate(b.order):
                if vals[a] > 0:
                    ax.rect(base, max(vals[a], b.floor), y + off - 0.18, y + off + 0.18, c)
                ax.text(max(vals[a], b.floor) if log else vals[a], y + off, human_bytes(vals[a]), dx=3)
            p.legend.append(Legend(label, "patch", c))
        if log:
            ax.xlog, ax.xlim = True, (b.floor, max(b.positive) * 30)
        ax.yticks = [(float(y), a) for y, a in enumerate(b.order)]
        ax.invert_y, ax.ygrid, ax.xzero = True, False, True
        ax.xlabel = "bytes over the training loop, sum over ranks (log scale)"
        return p.svg(name)

    def timeline(self, fid: str, name: str, t: Timeline) -> str:
        p = Plot(_height(2.3))
        ax = p.ax
        ax.rect(0, t.failed, 1.6, 2.4, "#f2c6c6", "#b22222", 1.0)
        ax.rect(t.failed, t.failed + t.restarted, 0.6, 1.4, "#c8e6d8", "#007a55", 1.0)
        ax.yticks, ax.ylim = [(2.0, "failed group"), (1.0, "restarted group")], (0.2, 3.2)
        if t.kill_at is not None:
            ax.vline(t.kill_at, "#b22222", 1.6)
            ax.text(t.kill_at, 2.5, f"SIGKILL rank {t.killed_rank}\nafter step {t.kill_step}", dx=-4, dy=-4,
                    anchor="end", baseline="bottom", color="#b22222")
        ax.vline(t.failed, "#333333", 1.2, "5,3")
        ax.text(t.failed, 2.5, "failure detected,\nall ranks gone", dx=4, dy=-4, baseline="bottom")
        ax.text(t.failed, 0.45, f"restart from the step-{t.resume} checkpoint", dx=4, dy=2, baseline="top",
                color="#007a55")
        ax.xlim = (0.0, (t.failed + t.restarted) * 1.02 or 1.0)
        ax.xlabel, ax.ygrid = "seconds since the failed group started", False
        return p.svg(name)

    def trajectory(self, fid: str, name: str, un: Trajectory, re_: Trajectory, resume: Any, kill_step: Any) -> str:
        p = Plot(_height(3.0))
        ax = p.ax
        ax.line(un.steps, un.loss, "#0072B2", 5, opacity=0.35)
        ax.markers(re_.steps, re_.loss, "x", 7, "#D55E00", width=1.5)
        p.legend += [Legend("uninterrupted", "line", "#0072B2", 5, opacity=0.35),
                     Legend("recovered", "x", "#D55E00", 1.5)]
        if isinstance(resume, int | float):
            ax.vline(resume, "#007a55", 1.2, "5,3")
            p.legend.append(Legend(f"resume (step {resume})", "line", "#007a55", 1.2, "5,3"))
        if isinstance(kill_step, int | float):
            ax.vline(kill_step, "#b22222", 1.2, "1.5,2")
            p.legend.append(Legend(f"kill (after step {kill_step})", "line", "#b22222", 1.2, "1.5,2"))
        ax.xlabel, ax.ylabel = "step", f"loss, rank {un.rank} (nats/token)"
        return p.svg(name)

    def accuracy(self, fid: str, name: str, panels: Panels, arms: Sequence[str]) -> str:
        p = Plot(_height(3.0), panels=len(panels), sharey=True)
        width = 0.8 / max(len(arms), 1)
        for ax, (kind, groups, acc_of) in zip(p.axes, panels, strict=True):
            top = 0.0
            for i, arm in enumerate(arms):
                for j, acc in enumerate(acc_of[arm]):
                    x = j + (i - (len(arms) - 1) / 2) * width
                    ax.rect(x - width / 2, x + width / 2, 0, acc, color(arm, i))
                    top = max(top, acc)
            if top == 0:  # bars of height 0 are invisible: say so
                ax.text(0.5, 0.5, "no document answered\ncorrectly by any model", anchor="middle", size=11.5,
                        color="#59636e", fraction=True)
            ax.xticks = [(float(j), g) for j, g in enumerate(groups)]
            ax.title, ax.ylim, ax.xgrid = f"per {kind}", (0.0, 1.0), False
        p.axes[0].ylabel = "exact-match accuracy"
        p.legend.extend(Legend(arm, "patch", color(arm, i)) for i, arm in enumerate(arms))
        return p.svg(name)

    def forest(self, fid: str, name: str, f: Forest) -> str:
        p = Plot(_height(0.8 + 0.42 * len(f.names)))
        ax = p.ax
        ax.vline(0, "#555555", 1)
        for x, label, c in f.marks:
            ax.vline(x, c, 1.2, "5,3")
            p.legend.append(Legend(label, "line", c, 1.2, "5,3"))
        for y, (lo, hi) in enumerate(zip(f.lo, f.hi, strict=True)):
            ax.segment(lo, y, hi, y, "#0072B2", 2.2)
            ax.cap(lo, y, 5, "#0072B2", 1.5)
            ax.cap(hi, y, 5, "#0072B2", 1.5)
        ax.markers(f.gains, list(range(len(f.names))), "circle", 7, "#222222")
        ax.xlim = f.xlim
        ax.yticks = [(float(y), n) for y, n in enumerate(f.names)]
        ax.invert_y, ax.ygrid = True, False
        ax.xlabel = "paired accuracy gain, 99% interval"
        return p.svg(name)

    def retention(self, fid: str, name: str, hist: Mapping[str, list[int]], edges: list[float]) -> str:
        p = Plot(_height(3.0))
        ax = p.ax
        for i, (a, cs) in enumerate(hist.items()):
            ax.steps(edges, cs, color(a, i), 1.8)
            p.legend.append(Legend(a, "line", color(a, i), 1.8))
        ax.vline(0, "#555555", 1)
        ax.yzero = True
        ax.xlabel = "retention loss change vs seed per probe (nats/token; < 0 improved)"
        ax.ylabel = "probes"
        return p.svg(name)

    def latency(self, fid: str, name: str, lat: Mapping[str, list[float]], p95: Mapping[str, Any]) -> str:
        shown = list(lat)
        p = Plot(_height(0.9 + 0.6 * len(shown)))
        ax = p.ax
        for i, ph in enumerate(shown, start=1):
            vs = sorted(lat[ph])
            if vs:  # a box from the quartiles, whiskers to the furthest point within 1.5 IQR
                q1, med, q3 = (_quantile(vs, q) for q in (0.25, 0.5, 0.75))
                lo = min(v for v in vs if v >= q1 - 1.5 * (q3 - q1))
                hi = max(v for v in vs if v <= q3 + 1.5 * (q3 - q1))
                ax.segment(lo, i, q1, i, "#333333")
                ax.segment(q3, i, hi, i, "#333333")
                ax.cap(lo, i, 6, "#333333")
                ax.cap(hi, i, 6, "#333333")
                ax.rect(q1, q3, i - 0.25, i + 0.25, "none", "#333333", 1.0)
                ax.segment(med, i - 0.25, med, i + 0.25, "#D55E00", 2)
            ys = [i + 0.32 * ((j * 0.618034) % 1 - 0.5) for j in range(len(lat[ph]))]  # deterministic jitter
            ax.markers(lat[ph], ys, "circle", 3, "#0072B2", opacity=0.45)
            if isinstance(p95[ph], int | float):
                ax.markers([p95[ph]], [i], "tick", 20, "#222222", width=2)
        if any(isinstance(v, int | float) for v in p95.values()):
            p.legend.append(Legend("p95 (report)", "tick", "#222222", 2))
        ax.yticks = [(float(i), ph) for i, ph in enumerate(shown, start=1)]
        ax.invert_y, ax.ygrid = True, False
        ax.xlabel = "request latency (seconds)"
        return p.svg(name)

    def throughput(self, fid: str, name: str, rps: Mapping[str, float]) -> str:
        order, values = list(rps), list(rps.values())
        p = Plot(_height(0.9 + 0.5 * len(order)))
        ax = p.ax
        colors = ["#0072B2", "#009E73", "#D55E00", "#999999"]
        for i, v in enumerate(values):
            ax.rect(0, v, i - 0.275, i + 0.275, colors[min(i, 3)])
            ax.text(v, i, f"{v:.3g} req/s", dx=3)
        ax.yticks = [(float(i), ph) for i, ph in enumerate(order)]
        ax.xlim = (0.0, max(values + [1e-9]) * 1.25)
        ax.invert_y, ax.ygrid = True, False
        ax.xlabel = "throughput (requests per second)"
        return p.svg(name)


__all__ = ["FORMAT", "SvgCharts"]
