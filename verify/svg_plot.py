"""A small plotting layer that writes SVG text directly: axes with linear or log scales, ticks, grid, a legend row,
lines, markers, bars, error bars and labels. It draws the report page's figures in format 2
(verify/report_charts.py) in a few milliseconds each, where matplotlib took about a second with its import.

The output is a pure function of the calls: every coordinate is printed with one decimal, no ids, no clip paths,
no timestamps, and text stays ``<text>`` (DejaVu Sans, falling back to ``sans-serif``). Layout needs text widths,
which are estimated from per-character advance widths of DejaVu Sans, so it depends on no font file.
"""

from __future__ import annotations

import html
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from ledger.errors import printable

FONT = "DejaVu Sans, sans-serif"
SIZE = 13.0  # px: axis labels and titles
SMALL = 12.0  # px: tick labels and the legend
NOTE = 11.0  # px: annotations
INK = "#333333"
GRID = "#dddddd"

# Advance widths of DejaVu Sans in em, by character class (close enough to lay out labels; a wide glyph not
# listed counts as wide).
_NARROW = set("iljtfI.,:;'!|()[] ")
_WIDE = set("mwMW@%—")


def text_width(s: str, size: float) -> float:
    """About how wide ``s`` is at ``size`` px."""
    em = 0.0
    for ch in s:
        em += 0.33 if ch in _NARROW else 0.92 if ch in _WIDE else 0.72 if ch.isupper() else 0.6
    return em * size


def esc(s: object) -> str:
    """Text from the data as SVG text: markup escaped, and controls shown as their escapes."""
    return html.escape(printable(str(s), lines=False), quote=True)


def _f(v: float) -> str:
    """A coordinate: one decimal, no '-0.0'."""
    t = f"{v:.1f}"
    return "0.0" if t == "-0.0" else t


def _minus(s: str) -> str:
    return s.replace("-", "−")


# ---------------------------------------------------------------------------------------------- scales


def nice_ticks(lo: float, hi: float, n: int = 5) -> tuple[list[float], float]:
    """Round tick values in [lo, hi], at most ``n`` + 1 of them, and their step (the smallest round one)."""
    span = hi - lo
    if not span > 0 or not math.isfinite(span):
        return [lo], 1.0
    raw = span / n
    mag = 10.0 ** math.floor(math.log10(raw))
    step = next(m * mag for m in (1.0, 2.0, 2.5, 5.0, 10.0) if m * mag >= raw * (1 - 1e-9))
    if max(abs(lo), abs(hi)) / step > 1e15:  # floats no longer tell such ticks apart: mark the ends
        return [lo, hi], span
    first, last = math.ceil(lo / step - 1e-9), math.floor(hi / step + 1e-9)
    return [k * step for k in range(first, last + 1)], step


def tick_label(v: float, step: float) -> str:
    """``v`` with as many decimals as ``step`` needs."""
    if abs(v) < step * 1e-9:
        v = 0.0
    decimals = max(0, -math.floor(math.log10(step) + 1e-9))
    if decimals and round(step / 10.0 ** -decimals, 6) % 1:  # a step such as 0.25
        decimals += 1
    return _minus(f"{v:.{decimals}f}")


@dataclass
class Scale:
    lo: float
    hi: float
    log: bool = False

    def __post_init__(self) -> None:
        # Limits no axis can show (from absurd data: 1e308 on both sides, a log axis reaching 0) become ones it
        # can, so that such data draws off the chart instead of failing the page.
        lo, hi = self.lo, self.hi
        if self.log and not (0 < lo < hi and math.isfinite(math.log10(hi) - math.log10(lo))):
            self.lo, self.hi = 1.0, 10.0
        elif not (math.isfinite(lo) and math.isfinite(hi) and math.isfinite(hi - lo)):
            self.lo, self.hi = 0.0, 1.0

    def frac(self, v: float) -> float:
        if self.log:
            v = min(max(v, self.lo), 1e308)
            return (math.log10(v) - math.log10(self.lo)) / ((math.log10(self.hi) - math.log10(self.lo)) or 1.0)
        return (v - self.lo) / ((self.hi - self.lo) or 1.0)

    def shows(self, v: float) -> bool:
        """Whether ``v`` is on the axis (its ends included, up to rounding)."""
        return -1e-9 <= self.frac(v) <= 1 + 1e-9

    def ticks(self, n: int = 5) -> list[tuple[float, str]]:
        if self.log:
            a, b = math.ceil(math.log10(self.lo) - 1e-9), math.floor(math.log10(self.hi) + 1e-9)
            every = max(1, math.ceil((b - a + 1) / 8))
            return [(10.0 ** k, f"10^{k}") for k in range(a, b + 1, every)]
        values, step = nice_ticks(self.lo, self.hi, n)
        return [(v, tick_label(v, step)) for v in values]


def _limits(values: Sequence[float], margin: float = 0.05, zero: bool = False) -> tuple[float, float]:
    """Data limits with a margin on each side (none below 0 when the data are bars from 0)."""
    if not values:
        return (0.0, 1.0)
    lo, hi = min(values), max(values)
    if zero:
        lo = min(lo, 0.0)
    if hi - lo < 1e-12:
        pad = abs(hi) * 0.05 or 0.5
        return (lo - pad, hi + pad)
    pad = (hi - lo) * margin
    return (lo if zero and lo == 0 else lo - pad, hi + pad)


# ------------------------------------------------------------------------------------------------ axes

@dataclass(frozen=True)
class Frame:
    """Where a panel is drawn: its box in px and its scales."""

    x0: float
    x1: float
    top: float
    bottom: float
    sx: Scale
    sy: Scale
    invert_y: bool

    def X(self, v: float) -> float:
        return self.x0 + self.sx.frac(v) * (self.x1 - self.x0)

    def Y(self, v: float) -> float:
        f = self.sy.frac(v)
        return self.top + f * (self.bottom - self.top) if self.invert_y else self.bottom - f * (self.bottom - self.top)


Draw = Callable[[Frame], str]


@dataclass
class Legend:
    label: str
    kind: str  # "line", "patch" or a marker: "circle", "diamond", "x", "tick"
    color: str
    width: float = 1.6
    dash: str | None = None
    fill: str | None = None
    opacity: float | None = None


@dataclass
class Axes:
    """One panel: its drawing in data coordinates, its scales and labels."""

    xlabel: str = ""
    ylabel: str = ""
    title: str = ""
    xlim: tuple[float, float] | None = None
    ylim: tuple[float, float] | None = None
    xlog: bool = False
    invert_y: bool = False
    xgrid: bool = True
    ygrid: bool = True
    xzero: bool = False  # bars from x = 0: no margin below 0
    yzero: bool = False
    xticks: list[tuple[float, str]] | None = None  # categories instead of numbers
    yticks: list[tuple[float, str]] | None = None
    xtick_size: float = SMALL
    items: list[Draw] = field(default_factory=list)
    xs: list[float] = field(default_factory=list)
    ys: list[float] = field(default_factory=list)
    extra_bottom: float = 0.0  # room below the tick labels (group labels)

    def _extent(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        self.xs.extend(xs)
        self.ys.extend(ys)

    def line(self, xs: Sequence[float], ys: Sequence[float], color: str, width: float = 1.6,
             dash: str | None = None, opacity: float | None = None) -> None:
        if not xs:
            return
        self._extent(xs, ys)
        pts, more = list(zip(xs, ys, strict=True)), _stroke(color, width, dash, opacity)
        self.items.append(lambda F: '<polyline fill="none"' + more + ' points="'
                          + " ".join(f"{_f(F.X(x))},{_f(F.Y(y))}" for x, y in pts) + '"/>')

    def steps(self, edges: Sequence[float], counts: Sequence[float], color: str, width: float = 1.8) -> None:
        """A histogram's outline: up from 0 at the first edge, each count over its bin, down to 0 at the last."""
        self._extent(edges, [0.0, *counts])
        more = _stroke(color, width, None, None)

        def draw(F: Frame) -> str:
            d = f"M{_f(F.X(edges[0]))},{_f(F.Y(0))}"
            for i, c in enumerate(counts):
                d += f"V{_f(F.Y(c))}H{_f(F.X(edges[i + 1]))}"
            d += f"V{_f(F.Y(0))}"
            return f'<path fill="none"{more} d="{d}"/>'

        self.items.append(draw)

    def markers(self, xs: Sequence[float], ys: Sequence[float], kind: str, size: float, color: str,
                fill: str | None = None, width: float = 1.0, opacity: float | None = None) -> None:
        """Markers of ``size`` px across: "circle", "diamond", "x" or "tick" (a vertical bar)."""
        if not xs:
            return
        self._extent(xs, ys)
        pts = list(zip(xs, ys, strict=True))
        self.items.append(lambda F: "".join(_marker(F.X(x), F.Y(y), kind, size, color, fill, width, opacity)
                                               for x, y in pts))

    def rect(self, x0: float, x1: float, y0: float, y1: float, fill: str, stroke: str | None = None,
             width: float = 0.8) -> None:
        self._extent([x0, x1], [y0, y1])
        edge = f' stroke="{stroke}" stroke-width="{width:g}"' if stroke else ""

        def draw(F: Frame) -> str:
            a, b, c, d = F.X(x0), F.X(x1), F.Y(y0), F.Y(y1)
            return (f'<rect x="{_f(min(a, b))}" y="{_f(min(c, d))}" width="{_f(abs(b - a))}" '
                    f'height="{_f(abs(d - c))}" fill="{fill}"{edge}/>')

        self.items.append(draw)

    def segment(self, x0: float, y0: float, x1: float, y1: float, color: str, width: float = 1.0) -> None:
        self._extent([x0, x1], [y0, y1])
        more = _stroke(color, width, None, None)
        self.items.append(lambda F: f'<line x1="{_f(F.X(x0))}" y1="{_f(F.Y(y0))}" x2="{_f(F.X(x1))}" '
                          f'y2="{_f(F.Y(y1))}"{more}/>')

    def cap(self, x: float, y: float, half: float, color: str, width: float = 1.0) -> None:
        """A vertical bar ``half`` px above and below (x, y), as error bars end."""
        self._extent([x], [y])
        more = _stroke(color, width, None, None)
        self.items.append(lambda F: f'<line x1="{_f(F.X(x))}" y1="{_f(F.Y(y) - half)}" x2="{_f(F.X(x))}" '
                          f'y2="{_f(F.Y(y) + half)}"{more}/>')

    def vline(self, x: float, color: str, width: float = 1.0, dash: str | None = None) -> None:
        """A vertical line across the whole panel at data x."""
        self.xs.append(x)
        more = _stroke(color, width, dash, None)
        self.items.append(lambda F: f'<line x1="{_f(F.X(x))}" y1="{_f(F.top)}" x2="{_f(F.X(x))}" '
                          f'y2="{_f(F.bottom)}"{more}/>')

    def text(self, x: float, y: float, s: str, *, dx: float = 0, dy: float = 0, anchor: str = "start",
             baseline: str = "middle", size: float = NOTE, color: str = INK, bold: bool = False,
             fraction: bool = False) -> None:
        """``s`` at data (x, y) shifted (dx, dy) px (or at a fraction of the panel); lines split at newlines,
        ``baseline`` "top", "middle" or "bottom" placing the block."""
        lines = s.split("\n")
        lead = size * 1.2
        shift = {"top": size * 0.8, "middle": size * 0.35 - lead * (len(lines) - 1) / 2,
                 "bottom": -lead * (len(lines) - 1) - size * 0.2}[baseline]
        weight = ' font-weight="bold"' if bold else ""

        def draw(F: Frame) -> str:
            px, py = ((F.x0 + x * (F.x1 - F.x0), F.bottom - y * (F.bottom - F.top)) if fraction
                      else (F.X(x), F.Y(y)))
            out = []
            for i, ln in enumerate(lines):
                out.append(f'<text x="{_f(px + dx)}" y="{_f(py + dy + shift + i * lead)}" font-size="{size:g}" '
                           f'text-anchor="{anchor}" fill="{color}"{weight}>{esc(ln)}</text>')
            return "".join(out)

        if not fraction:
            self._extent([x], [y])
        self.items.append(draw)


def _stroke(color: str, width: float, dash: str | None, opacity: float | None) -> str:
    out = f' stroke="{color}" stroke-width="{width:g}"'
    if dash:
        out += f' stroke-dasharray="{dash}"'
    if opacity is not None:
        out += f' stroke-opacity="{opacity:g}"'
    return out


def _marker(x: float, y: float, kind: str, size: float, color: str, fill: str | None, width: float,
            opacity: float | None) -> str:
    r = size / 2
    op = f' opacity="{opacity:g}"' if opacity is not None else ""
    if kind == "circle":
        return f'<circle cx="{_f(x)}" cy="{_f(y)}" r="{r:g}" fill="{fill or color}"{op}/>'
    if kind == "diamond":
        return (f'<polygon points="{_f(x)},{_f(y - r)} {_f(x + r)},{_f(y)} {_f(x)},{_f(y + r)} {_f(x - r)},{_f(y)}" '
                f'fill="{fill or color}" stroke="{color}" stroke-width="{width:g}"{op}/>')
    if kind == "x":
        return (f'<path d="M{_f(x - r)},{_f(y - r)}L{_f(x + r)},{_f(y + r)}M{_f(x - r)},{_f(y + r)}'
                f'L{_f(x + r)},{_f(y - r)}" stroke="{color}" stroke-width="{width:g}" fill="none"{op}/>')
    if kind == "tick":
        return (f'<line x1="{_f(x)}" y1="{_f(y - r)}" x2="{_f(x)}" y2="{_f(y + r)}" stroke="{color}" '
                f'stroke-width="{width:g}"{op}/>')
    raise ValueError(f"unknown marker {kind!r}")


# ---------------------------------------------------------------------------------------------- figure


@dataclass
class Plot:
    """A figure: panels side by side sharing its height, and a legend row above them."""

    height: float  # px
    panels: int = 1
    width: float = 540.0
    sharey: bool = False
    legend: list[Legend] = field(default_factory=list)
    axes: list[Axes] = field(init=False)

    def __post_init__(self) -> None:
        self.axes = [Axes() for _ in range(self.panels)]

    @property
    def ax(self) -> Axes:
        return self.axes[0]

    def svg(self, name: str) -> str:
        """The figure as inline SVG with the accessible ``name`` (already escaped HTML)."""
        W, H = self.width, self.height
        out: list[str] = []
        top = 8.0 + self._legend(out)
        if any(a.title for a in self.axes):
            top += SIZE + 8
        scales = [self._scales(a) for a in self.axes]
        if self.sharey and scales:
            lo = min(s[1].lo for s in scales)
            hi = max(s[1].hi for s in scales)
            scales = [(sx, Scale(lo, hi, sy.log)) for sx, sy in scales]
        bottom = H - 6 - max((SMALL + 8 + (SIZE + 6 if a.xlabel else 0) + a.extra_bottom for a in self.axes),
                             default=0.0)
        ylabels = [a.yticks if a.yticks is not None else sy.ticks(_ybins(bottom - top))
                   for a, (_, sy) in zip(self.axes, scales, strict=True)]
        gutters = [max((text_width(t, SMALL) for _, t in labels), default=0.0) + 8
                   + (SIZE + 8 if a.ylabel else 0) for a, labels in zip(self.axes, ylabels, strict=True)]
        if self.sharey:
            gutters = [gutters[0]] + [8.0] * (len(gutters) - 1)
        free = W - 10 - sum(gutters) - 14 * (len(self.axes) - 1)
        x = 0.0
        for i, (a, (sx, sy), labels) in enumerate(zip(self.axes, scales, ylabels, strict=True)):
            x += gutters[i]
            x0, x1 = x, x + free / len(self.axes)
            self._panel(out, a, sx, sy, labels, i == 0 or not self.sharey, x0, x1, top, bottom)
            x = x1 + 14
        return (f'<svg class="chart" role="img" aria-label="{name}" xmlns="http://www.w3.org/2000/svg" '
                f'width="{W:g}" height="{H:g}" viewBox="0 0 {W:g} {H:g}" font-family="{FONT}">'
                f"<title>{name}</title>"
                f'<rect width="{W:g}" height="{H:g}" fill="#ffffff"/>' + "".join(out) + "</svg>")

    def _legend(self, out: list[str]) -> float:
        """Draw the legend rows centred above the panels; their height."""
        if not self.legend:
            return 0.0
        swatch, gap, col = 20.0, 5.0, 16.0
        widths = [swatch + gap + text_width(e.label, SMALL) for e in self.legend]
        rows: list[list[int]] = [[]]
        room = self.width - 20
        for i, w in enumerate(widths):
            used = sum(widths[j] for j in rows[-1]) + col * len(rows[-1])
            if rows[-1] and used + w > room:
                rows.append([])
            rows[-1].append(i)
        lead = SMALL + 7
        for r, row in enumerate(rows):
            total = sum(widths[i] for i in row) + col * (len(row) - 1)
            x, y = (self.width - total) / 2, 8 + r * lead + SMALL / 2
            for i in row:
                e = self.legend[i]
                out.append(_swatch(e, x, y, swatch))
                out.append(f'<text x="{_f(x + swatch + gap)}" y="{_f(y + SMALL * 0.35)}" font-size="{SMALL:g}" '
                           f'fill="{INK}">{esc(e.label)}</text>')
                x += widths[i] + col
        return len(rows) * lead

    @staticmethod
    def _scales(a: Axes) -> tuple[Scale, Scale]:
        if a.xlim is not None:
            sx = Scale(*a.xlim, log=a.xlog)
        elif a.xticks:
            pos = [p for p, _ in a.xticks] + a.xs
            sx = Scale(min(pos) - 0.6, max(pos) + 0.6)
        else:
            sx = Scale(*_limits(a.xs, zero=a.xzero), log=a.xlog)
        if a.ylim is not None:
            sy = Scale(*a.ylim)
        elif a.yticks:
            pos = [p for p, _ in a.yticks]
            sy = Scale(min(pos) - 0.6, max(pos) + 0.6)
        else:
            sy = Scale(*_limits(a.ys, zero=a.yzero))
        return sx, sy

    @staticmethod
    def _panel(out: list[str], a: Axes, sx: Scale, sy: Scale, yt: list[tuple[float, str]], labelled: bool,
               x0: float, x1: float, top: float, bottom: float) -> None:
        F = Frame(x0, x1, top, bottom, sx, sy, a.invert_y)
        xt = a.xticks if a.xticks is not None else sx.ticks(_xbins(x1 - x0))
        ylabels = yt if labelled else []
        inside = [(v, t) for v, t in xt if sx.shows(v)]
        if a.xgrid and a.xticks is None:
            out.extend(f'<line x1="{_f(F.X(v))}" y1="{_f(top)}" x2="{_f(F.X(v))}" y2="{_f(bottom)}" stroke="{GRID}" '
                       f'stroke-width="0.6"/>' for v, _ in inside)
        if a.ygrid and a.yticks is None:
            out.extend(f'<line x1="{_f(x0)}" y1="{_f(F.Y(v))}" x2="{_f(x1)}" y2="{_f(F.Y(v))}" stroke="{GRID}" '
                       f'stroke-width="0.6"/>' for v, _ in yt if sy.shows(v))
        for draw in a.items:
            out.append(draw(F))
        out.append(f'<path d="M{_f(x0)},{_f(top)}V{_f(bottom)}H{_f(x1)}" fill="none" stroke="{INK}" '
                   f'stroke-width="0.8"/>')
        for v, t in inside:
            out.append(f'<line x1="{_f(F.X(v))}" y1="{_f(bottom)}" x2="{_f(F.X(v))}" y2="{_f(bottom + 3.5)}" '
                       f'stroke="{INK}" stroke-width="0.8"/>' + _label(F.X(v), bottom + 5 + a.xtick_size * 0.8, t,
                                                                     "middle", a.xtick_size))
        for v, t in ylabels:
            if sy.shows(v):
                out.append(f'<line x1="{_f(x0 - 3.5)}" y1="{_f(F.Y(v))}" x2="{_f(x0)}" y2="{_f(F.Y(v))}" '
                           f'stroke="{INK}" stroke-width="0.8"/>' + _label(x0 - 6, F.Y(v) + SMALL * 0.35, t, "end",
                                                                          SMALL))
        if a.xlabel:
            out.append(f'<text x="{_f((x0 + x1) / 2)}" y="{_f(bottom + 8 + SMALL + a.extra_bottom + SIZE)}" '
                       f'font-size="{SIZE:g}" text-anchor="middle" fill="{INK}">{esc(a.xlabel)}</text>')
        if a.ylabel and ylabels:
            width = max((text_width(t, SMALL) for _, t in ylabels), default=0.0)
            cx, cy = x0 - width - 10 - SIZE * 0.3, (top + bottom) / 2
            out.append(f'<text transform="translate({_f(cx)},{_f(cy)}) rotate(-90)" font-size="{SIZE:g}" '
                       f'text-anchor="middle" fill="{INK}">{esc(a.ylabel)}</text>')
        if a.title:
            out.append(f'<text x="{_f((x0 + x1) / 2)}" y="{_f(top - 8)}" font-size="{SIZE:g}" '
                       f'text-anchor="middle" fill="{INK}">{esc(a.title)}</text>')


def _xbins(px: float) -> int:
    """At most this many tick intervals on an axis ``px`` long: labels about 55 px apart."""
    return max(3, int(px / 55))


def _ybins(px: float) -> int:
    return max(3, int(px / 38))


def _label(x: float, y: float, t: str, anchor: str, size: float) -> str:
    """A tick label; "10^k" is drawn with its exponent raised."""
    if t.startswith("10^"):
        body = f'10<tspan dy="-{size * 0.4:g}" font-size="{size * 0.75:g}">{esc(_minus(t[3:]))}</tspan>'
    else:
        body = esc(t)
    return f'<text x="{_f(x)}" y="{_f(y)}" font-size="{size:g}" text-anchor="{anchor}" fill="{INK}">{body}</text>'


def _swatch(e: Legend, x: float, y: float, w: float) -> str:
    if e.kind == "patch":
        return f'<rect x="{_f(x)}" y="{_f(y - 5)}" width="{_f(w)}" height="10" fill="{e.color}"/>'
    if e.kind == "line":
        return (f'<line x1="{_f(x)}" y1="{_f(y)}" x2="{_f(x + w)}" y2="{_f(y)}"'
                f'{_stroke(e.color, e.width, e.dash, e.opacity)}/>')
    return _marker(x + w / 2, y, e.kind, 8.0, e.color, e.fill, e.width, e.opacity)


__all__ = ["Axes", "Legend", "Plot", "Scale", "esc", "nice_ticks", "text_width", "tick_label"]
