"""The figures of report format ``ledger-report-html/1``, drawn by matplotlib's SVG backend.

Pages recorded in format 1 are verified by rendering them again, so this drawing is frozen: the same inputs must
give the same SVG bytes as when those pages were recorded (matplotlib 3.11). New pages use format 2
(verify/report_charts.py, no matplotlib); change nothing here. Each method takes the page's figure id (the prefix
of the SVG's ids), its accessible name and the values :mod:`verify.report_html` prepared, and returns inline SVG.
matplotlib is imported only when a figure is drawn.
"""

from __future__ import annotations

import io
import re
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any, cast

from ledger.errors import MissingDependency
from ledger.experiment.formats import REPORT_HTML_MATPLOTLIB_FORMAT
from verify.report_plots import PART_COLORS, Bars, BytesBars, Forest, Panels, Timeline, Trajectory, color, human_bytes

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from matplotlib.figure import Figure

FORMAT = REPORT_HTML_MATPLOTLIB_FORMAT
SERIES = "3.11"  # the matplotlib series format-1 pages were drawn with: another one draws other bytes

# The SVG output depends only on these, never on a user's matplotlibrc.
_RC: dict[str, Any] = {
    "svg.fonttype": "none",  # text stays <text>: smaller, searchable, independent of font files
    "svg.image_inline": True,
    "font.family": "sans-serif",
    "font.sans-serif": ["DejaVu Sans"],
    "font.size": 10.0,
    "axes.spines.top": False,
    "axes.spines.right": False,
    "axes.grid": True,
    "axes.axisbelow": True,
    "grid.color": "#dddddd",
    "grid.linewidth": 0.6,
    "legend.frameon": False,
    "figure.facecolor": "white",
}
_SVG_METADATA = {"Date": None, "Creator": None, "Format": None, "Type": None}  # no <metadata>, no timestamp
_FIG_W = 5.6  # inches; 72 pt per inch in SVG: about 540 CSS px, so text stays legible scaled to a phone

_TAG = re.compile(r"<[^>]*>")
_ID = re.compile(r'\sid="([^"]*)"')
_HREF = re.compile(r'((?:xlink:)?href)="#([^"]*)"')
_URL = re.compile(r"url\(#([^)]*)\)")
_PROLOG = re.compile(r"\A.*?(?=<svg\b)", re.S)
_STROKE_STYLE = re.compile(r"\s*<defs>\s*<style[^>]*>\*\{stroke-linejoin: round; stroke-linecap: butt\}</style>\s*"
                           r"</defs>")


def _mt(text: Any) -> str:
    """A data string for a matplotlib label: '$' would start mathtext."""
    return str(text).replace("$", r"\$")


def _legend_above(ax: Axes, ncols: int = 4) -> None:
    """The legend in a row above the plot, where it can never hide data."""
    handles, labels = ax.get_legend_handles_labels()
    fig = ax.get_figure()
    if handles and fig is not None:
        fig.legend(handles, labels, loc="outside upper center", ncols=min(ncols, len(handles)),
                               fontsize=8.5, handlelength=1.6, columnspacing=1.2)


def _figure(height: float, width: float = _FIG_W, **kw: Any) -> Figure:
    from matplotlib.figure import Figure

    return Figure(figsize=(width, height), layout="constrained", **kw)


def _svg(fig: Figure, prefix: str, name: str) -> str:
    """``fig`` as inline SVG: no prolog or DOCTYPE, ids scoped to ``prefix`` (unreferenced ones dropped), and an
    accessible name (already escaped)."""
    import matplotlib

    buf = io.StringIO()
    with matplotlib.rc_context({"svg.hashsalt": f"training-ledger/{prefix}"}):
        fig.savefig(buf, format="svg", metadata=_SVG_METADATA)
    text = _PROLOG.sub("", buf.getvalue(), count=1)
    text = _STROKE_STYLE.sub("", text, count=1)  # the page's CSS holds this rule once
    refs = {m.group(2) for m in _HREF.finditer(text)} | {m.group(1) for m in _URL.finditer(text)}

    def tag(m: re.Match[str]) -> str:
        t = _ID.sub(lambda i: f' id="{prefix}-{i.group(1)}"' if i.group(1) in refs else "", m.group(0))
        t = _HREF.sub(lambda h: f'{h.group(1)}="#{prefix}-{h.group(2)}"', t)
        return _URL.sub(lambda u: f"url(#{prefix}-{u.group(1)})", t)

    text = _TAG.sub(tag, text)  # text content never holds a raw '<', so this only touches tags
    text = re.sub(r"<svg\b", f'<svg class="chart" role="img" aria-label="{name}"', text, count=1)
    return re.sub(r"(<svg\b[^>]*>)", rf"\1<title>{name}</title>", text, count=1).strip()


class MatplotlibCharts:
    """Format 1's figures."""

    format = FORMAT

    @contextmanager
    def session(self) -> Iterator[None]:
        try:
            import matplotlib
            import matplotlib.style
        except ImportError as e:
            raise MissingDependency(f"a {FORMAT} report page is drawn by matplotlib {SERIES}, which is not installed "
                                    f"(pip install 'matplotlib=={SERIES}.*')") from e
        version = str(getattr(matplotlib, "__version__", "unknown"))
        if version.split(".")[:2] != SERIES.split("."):
            raise MissingDependency(f"a {FORMAT} report page is drawn by matplotlib {SERIES}; this is matplotlib "
                                    f"{version}, which draws other bytes (pip install 'matplotlib=={SERIES}.*')")

        with matplotlib.style.context("default"), matplotlib.rc_context(cast(Any, _RC)):
            yield

    def loss(self, fid: str, name: str, losses: Mapping[str, Trajectory]) -> str:
        fig = _figure(3.3)
        ax = fig.add_subplot()
        for i, (arm, tr) in enumerate(losses.items()):
            c = color(arm, i)
            ax.plot(tr.steps, tr.loss, color=c, lw=1.6, label=_mt(arm), marker="o" if len(tr.steps) <= 40 else None,
                    ms=3)
            at = [(s, v) for s, v in zip(tr.steps, tr.loss, strict=True) if s in set(tr.checkpoints)]
            ax.plot([s for s, _ in at], [v for _, v in at], ls="none", marker="D", ms=7, mfc="white", mec=c,
                    mew=1.6)
        ax.plot([], [], ls="none", marker="D", ms=7, mfc="white", mec="#333333", mew=1.6, label="checkpoint")
        ax.set_xlabel("step")
        ranks = sorted({tr.rank for tr in losses.values()})
        ax.set_ylabel(f"loss, rank {', '.join(map(str, ranks))} (nats/token)")
        _legend_above(ax, 4)
        return _svg(fig, fid, name)

    def seconds(self, fid: str, name: str, bars: Bars) -> str:
        fig = _figure(3.1)
        ax = fig.add_subplot()
        x = 0.0
        labels: list[tuple[float, str]] = []
        groups: list[tuple[float, str]] = []
        first = True
        for arm, ranks in bars:
            start = x
            for rank, parts in ranks:
                bottom = 0.0
                for part, v in parts:
                    ax.bar(x, v, bottom=bottom, width=0.8, color=PART_COLORS[part], edgecolor="white", lw=0.5,
                           label=part if first else None)
                    bottom += v
                first = False
                labels.append((x, f"r{rank}"))
                x += 1
            groups.append(((start + x - 1) / 2, arm))
            x += 0.8
        ax.set_xticks([p for p, _ in labels], [lab for _, lab in labels], fontsize=8)
        for pos, arm in groups:
            ax.annotate(_mt(arm), (pos, 0), xycoords=("data", "axes fraction"), xytext=(0, -24),
                        textcoords="offset points", ha="center", va="top", fontsize=9, fontweight="bold")
        ax.set_ylabel("seconds")
        ax.grid(axis="x", visible=False)
        _legend_above(ax, 3)
        return _svg(fig, fid, name)

    def bytes(self, fid: str, name: str, b: BytesBars) -> str:
        order = b.order
        fig = _figure(0.9 + 0.55 * len(order))
        ax = fig.add_subplot()
        ys = list(range(len(order)))
        for label, vals, off, c in (("collective sent bytes (exact)", b.sent, -0.19, "#0072B2"),
                                    ("interface tx bytes (host counters)", b.tx, 0.19, "#CC79A7")):
            heights = [max(vals[a], b.floor) if vals[a] > 0 else 0 for a in order]
            ax.barh([y + off for y in ys], heights, height=0.36, color=c, label=label, left=0)
            for y, a in zip(ys, order, strict=True):
                ax.annotate(human_bytes(vals[a]), (max(vals[a], b.floor), y + off), xytext=(3, 0),
                            textcoords="offset points", va="center", fontsize=8)
        if b.positive:
            ax.set_xscale("log")
            ax.set_xlim(b.floor, max(b.positive) * 30)
        ax.set_yticks(ys, [_mt(a) for a in order])
        ax.invert_yaxis()
        ax.set_xlabel("bytes over the training loop, sum over ranks (log scale)")
        ax.grid(axis="y", visible=False)
        _legend_above(ax, 2)
        return _svg(fig, fid, name)

    def timeline(self, fid: str, name: str, t: Timeline) -> str:
        failed, restarted, kill_at = t.failed, t.restarted, t.kill_at
        fig = _figure(2.3)
        ax = fig.add_subplot()
        ax.broken_barh([(0, failed)], (1.6, 0.8), color="#f2c6c6", edgecolor="#b22222")
        ax.broken_barh([(failed, restarted)], (0.6, 0.8), color="#c8e6d8", edgecolor="#007a55")
        ax.set_yticks([2.0, 1.0], ["failed group", "restarted group"])
        ax.set_ylim(0.2, 3.2)
        if kill_at is not None:
            ax.axvline(kill_at, color="#b22222", lw=1.6)
            ax.annotate(f"SIGKILL rank {_mt(t.killed_rank)}\nafter step {_mt(t.kill_step)}", (kill_at, 2.5),
                        xytext=(-4, 4), textcoords="offset points", ha="right", va="bottom", fontsize=8,
                        color="#b22222")
        ax.axvline(failed, color="#333333", lw=1.2, ls="--")
        ax.annotate("failure detected,\nall ranks gone", (failed, 2.5), xytext=(4, 4), textcoords="offset points",
                    ha="left", va="bottom", fontsize=8)
        ax.annotate(f"restart from the step-{_mt(t.resume)} checkpoint", (failed, 0.45), xytext=(4, -2),
                    textcoords="offset points", ha="left", va="top", fontsize=8, color="#007a55")
        ax.set_xlim(0, (failed + restarted) * 1.02 or 1)
        ax.set_xlabel("seconds since the failed group started")
        ax.grid(axis="y", visible=False)
        return _svg(fig, fid, name)

    def trajectory(self, fid: str, name: str, un: Trajectory, re_: Trajectory, resume: Any, kill_step: Any) -> str:
        fig = _figure(3.0)
        ax = fig.add_subplot()
        ax.plot(un.steps, un.loss, color="#0072B2", lw=5, alpha=0.35, label="uninterrupted")
        ax.plot(re_.steps, re_.loss, color="#D55E00", lw=0, marker="x", ms=6, mew=1.5, label="recovered")
        if isinstance(resume, int | float):
            ax.axvline(resume, color="#007a55", ls="--", lw=1.2, label=f"resume (step {resume})")
        if isinstance(kill_step, int | float):
            ax.axvline(kill_step, color="#b22222", ls=":", lw=1.2, label=f"kill (after step {kill_step})")
        ax.set_xlabel("step")
        ax.set_ylabel(f"loss, rank {un.rank} (nats/token)")
        _legend_above(ax, 2)
        return _svg(fig, fid, name)

    def accuracy(self, fid: str, name: str, panels: Panels, arms: Sequence[str]) -> str:
        fig = _figure(3.0)
        axes: list[Axes] = list(fig.subplots(1, len(panels), sharey=True, squeeze=False)[0])
        width = 0.8 / max(len(arms), 1)
        for ax, (kind, groups, acc_of) in zip(axes, panels, strict=True):
            top = 0.0
            for i, arm in enumerate(arms):
                acc = acc_of[arm]
                ax.bar([j + (i - (len(arms) - 1) / 2) * width for j in range(len(groups))], acc, width=width,
                       color=color(arm, i), label=_mt(arm) if kind == panels[0][0] else None)
                top = max(top, *acc)
            if top == 0:  # bars of height 0 are invisible: say so
                ax.text(0.5, 0.5, "no document answered\ncorrectly by any model", transform=ax.transAxes,
                        ha="center", va="center", fontsize=9, color="#59636e")
            ax.set_xticks(range(len(groups)), [_mt(g) for g in groups])
            ax.set_title(f"per {_mt(kind)}", fontsize=10)
            ax.set_ylim(0, 1)
            ax.grid(axis="x", visible=False)
        axes[0].set_ylabel("exact-match accuracy")
        fig.legend(loc="outside upper center", ncols=len(arms), fontsize=8.5)
        return _svg(fig, fid, name)

    def forest(self, fid: str, name: str, f: Forest) -> str:
        from matplotlib.ticker import MaxNLocator

        fig = _figure(0.8 + 0.42 * len(f.names))
        ax = fig.add_subplot()
        ys = list(range(len(f.names)))
        gains, lo, hi = f.gains, f.lo, f.hi
        ax.errorbar(gains, ys, xerr=[[g - a for g, a in zip(gains, lo, strict=True)],
                                     [b - g for g, b in zip(gains, hi, strict=True)]],
                    fmt="o", color="#222222", ecolor="#0072B2", elinewidth=2.2, capsize=4, ms=5)
        ax.axvline(0, color="#555555", lw=1)
        for x, label, c in f.marks:
            ax.axvline(x, color=c, lw=1.2, ls="--", label=label)
        ax.set_xlim(*f.xlim)
        ax.xaxis.set_major_locator(MaxNLocator(nbins=5))
        ax.set_yticks(ys, [_mt(n) for n in f.names])
        ax.invert_yaxis()
        ax.set_xlabel("paired accuracy gain, 99% interval")
        ax.grid(axis="y", visible=False)
        _legend_above(ax, 2)
        return _svg(fig, fid, name)

    def retention(self, fid: str, name: str, hist: Mapping[str, list[int]], edges: list[float]) -> str:
        fig = _figure(3.0)
        ax = fig.add_subplot()
        for i, (a, cs) in enumerate(hist.items()):
            ax.stairs(cs, edges, color=color(a, i), lw=1.8, label=_mt(a))
        ax.axvline(0, color="#555555", lw=1)
        ax.set_xlabel("retention loss change vs seed per probe (nats/token; < 0 improved)")
        ax.set_ylabel("probes")
        _legend_above(ax, 4)
        return _svg(fig, fid, name)

    def latency(self, fid: str, name: str, lat: Mapping[str, list[float]], p95: Mapping[str, Any]) -> str:
        shown = list(lat)
        fig = _figure(0.9 + 0.6 * len(shown))
        ax = fig.add_subplot()
        ax.boxplot([lat[p] for p in shown], orientation="horizontal", widths=0.5, showfliers=False,
                   medianprops={"color": "#D55E00", "lw": 2}, tick_labels=[_mt(p) for p in shown])
        for i, p in enumerate(shown, start=1):
            vs = lat[p]
            ys = [i + 0.32 * ((j * 0.618034) % 1 - 0.5) for j in range(len(vs))]  # deterministic jitter
            ax.plot(vs, ys, ls="none", marker="o", ms=2.5, alpha=0.45, color="#0072B2")
            if isinstance(p95[p], int | float):
                ax.plot([p95[p]], [i], marker="|", ms=16, mew=2, color="#222222", ls="none",
                        label="p95 (report)" if i == 1 else None)
        ax.invert_yaxis()
        ax.set_xlabel("request latency (seconds)")
        ax.grid(axis="y", visible=False)
        _legend_above(ax, 2)
        return _svg(fig, fid, name)

    def throughput(self, fid: str, name: str, rps: Mapping[str, float]) -> str:
        order, values = list(rps), list(rps.values())
        fig = _figure(0.9 + 0.5 * len(order))
        ax = fig.add_subplot()
        ax.barh(range(len(order)), values, color=["#0072B2", "#009E73", "#D55E00", "#999999"][: len(order)]
                + ["#999999"] * max(0, len(order) - 4), height=0.55)
        for i, v in enumerate(values):
            ax.annotate(f"{v:.3g} req/s", (v, i), xytext=(3, 0), textcoords="offset points", va="center", fontsize=8)
        ax.set_yticks(range(len(order)), [_mt(p) for p in order])
        ax.invert_yaxis()
        ax.set_xlim(0, max(values + [1e-9]) * 1.25)
        ax.set_xlabel("throughput (requests per second)")
        ax.grid(axis="y", visible=False)
        return _svg(fig, fid, name)


__all__ = ["FORMAT", "MatplotlibCharts"]
