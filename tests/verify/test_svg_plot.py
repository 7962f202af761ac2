"""The SVG plotting layer of report format 2 (verify/svg_plot.py): round ticks, exact labels, escaping, geometry that
stays inside the figure."""

from __future__ import annotations

import math
import random
import re

import pytest

from verify.svg_plot import Legend, Plot, Scale, nice_ticks, text_width, tick_label

ROUND = {1.0, 2.0, 2.5, 5.0}


@pytest.mark.parametrize("seed", range(200))
def test_ticks_are_round_evenly_spaced_and_inside_the_range(seed: int) -> None:
    rng = random.Random(seed)
    lo = rng.uniform(-1e3, 1e3) * 10 ** rng.randint(-6, 3)
    hi = lo + rng.uniform(1e-3, 1e3) * 10 ** rng.randint(-6, 3)
    n = rng.randint(3, 9)
    ticks, step = nice_ticks(lo, hi, n)
    mantissa = step / 10 ** math.floor(math.log10(step) + 1e-12)
    assert any(math.isclose(mantissa, m, rel_tol=1e-9) for m in ROUND)
    assert 2 <= len(ticks) <= n + 1 or step > (hi - lo) / 2
    assert all(lo - 1e-9 * abs(step) <= t <= hi + 1e-9 * abs(step) for t in ticks)
    ulp = 1e-12 * max(abs(lo), abs(hi))  # a tick far from 0 is only as exact as floats are there
    assert all(math.isclose(b - a, step, rel_tol=1e-6, abs_tol=ulp) for a, b in zip(ticks, ticks[1:], strict=False))
    assert step >= (hi - lo) / n * (1 - 1e-9)  # the smallest round step that keeps at most n intervals


def test_tick_labels_show_the_step_s_decimals_and_a_true_minus() -> None:
    assert [tick_label(v, 0.25) for v in (-0.5, -0.25, 0.0, 0.25)] == ["−0.50", "−0.25", "0.00", "0.25"]
    assert tick_label(-1e-17, 0.02) == "0.00"  # no "−0.00" from a rounding error
    assert tick_label(4.65, 0.05) == "4.65" and tick_label(10.0, 5.0) == "10"


def test_a_log_scale_ticks_whole_decades() -> None:
    assert [t for _, t in Scale(3e5, 4e8, log=True).ticks()] == ["10^6", "10^7", "10^8"]
    assert Scale(1.0, 100.0, log=True).frac(10.0) == pytest.approx(0.5)


def test_hostile_text_is_escaped_in_the_svg() -> None:
    p = Plot(200)
    p.ax.line([0, 1], [0, 1], "#000000")
    p.ax.xlabel = '<script>alert(1)</script> & "q"'
    p.ax.text(0.5, 0.5, "\x1b[31m</text><a href='x'>", fraction=True)
    p.legend.append(Legend("<b>&amp;</b>", "line", "#000000"))
    svg = p.svg("name")
    assert "<script" not in svg and "<a " not in svg and "<b>" not in svg and "\x1b" not in svg
    assert "&lt;script&gt;" in svg and "&amp;amp;" in svg


def _coordinates(svg: str) -> tuple[list[float], list[float]]:
    """Every x and every y the SVG places something at (attributes, polyline and polygon points)."""
    xs = [float(v) for v in re.findall(r'\s(?:x|x1|x2|cx)="(-?[0-9.]+)"', svg)]
    ys = [float(v) for v in re.findall(r'\s(?:y|y1|y2|cy)="(-?[0-9.]+)"', svg)]
    for points in re.findall(r'points="([^"]*)"', svg):
        for pair in points.split():
            x, y = pair.split(",")
            xs.append(float(x))
            ys.append(float(y))
    return xs, ys


def test_everything_drawn_stays_inside_the_figure() -> None:
    rng = random.Random(7)
    p = Plot(300, panels=2, sharey=True)
    for ax in p.axes:
        xs = sorted(rng.uniform(-5, 5) for _ in range(30))
        ax.line(xs, [rng.gauss(0, 1) for _ in xs], "#0072B2")
        ax.markers(xs, [rng.gauss(0, 1) for _ in xs], "diamond", 9, "#E69F00")
        ax.rect(-1, 1, 0, 2, "#cccccc")
        ax.vline(0, "#555555", 1, "5,3")
        ax.xlabel, ax.title = "x", "a panel"
    p.axes[0].ylabel = "a quantity"
    p.legend += [Legend(f"series {i}", "line", "#000000") for i in range(9)]  # wraps to two rows
    svg = p.svg("test")
    xs, ys = _coordinates(svg)
    assert xs and ys
    assert min(xs) >= 0 and max(xs) <= 540
    assert min(ys) >= 0 and max(ys) <= 300


def test_the_same_calls_give_the_same_bytes() -> None:
    def draw() -> str:
        p = Plot(250)
        p.ax.line([1, 2, 3], [0.1, 0.3, 0.2], "#0072B2")
        p.ax.steps([0.0, 1.0, 2.0], [3, 1], "#009E73")
        return p.svg("x")

    assert draw() == draw()


def test_text_width_grows_with_the_text() -> None:
    assert text_width("", 12) == 0
    assert text_width("iiii", 12) < text_width("mmmm", 12)
    assert text_width("diloco-four vs single (descriptive)", 12) == pytest.approx(200, rel=0.25)
