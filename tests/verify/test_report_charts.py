"""Format 2's figures (verify/report_charts.py): each chart is one inline SVG carrying its accessible name, and
the box plot's quartiles are numpy's."""

from __future__ import annotations

import random
import re

import numpy as np
import pytest

from verify.report_charts import SvgCharts, _quantile
from verify.report_plots import BytesBars, Forest, Timeline, Trajectory


def test_quartiles_are_numpy_s() -> None:
    rng = random.Random(3)
    for n in (1, 2, 5, 40, 101):
        vs = sorted(rng.expovariate(20) for _ in range(n))
        for q in (0.25, 0.5, 0.75):
            assert _quantile(vs, q) == pytest.approx(float(np.quantile(vs, q)), rel=1e-12)


def _charts() -> list[str]:
    c = SvgCharts()
    tr = Trajectory("train/a", 0, [1, 2, 3], [3.0, 2.5, 2.0], [3], ["blake3:" + "0" * 64])
    return [
        c.loss("f1", "N1", {"single": tr}),
        c.seconds("f2", "N2", [("single", [(0, [("update", 1.0), ("synchronization", 0.0), ("checkpoint", 0.5)])])]),
        c.bytes("f3", "N3", BytesBars(["single"], {"single": 0}, {"single": 10}, [10], 2.5)),
        c.timeline("f4", "N4", Timeline(10.0, 5.0, 8.0, 1, 4, 3)),
        c.trajectory("f5", "N5", tr, tr, 2, 2),
        c.accuracy("f6", "N6", [("family", ["a", "b"], {"seed": [0.0, 0.5]})], ["seed"]),
        c.forest("f7", "N7", Forest(["a vs seed"], [0.1], [0.0], [0.2], [(0.05, "contract", "#009E73")], (-0.1, 0.3))),
        c.retention("f8", "N8", {"single": [1, 0, 2]}, [-0.1, 0.0, 0.1, 0.2]),
        c.latency("f9", "N9", {"single": [0.01, 0.02, 0.03, 0.5]}, {"single": 0.03}),
        c.throughput("f10", "N10", {"single": 91.6, "four": 0.0}),
    ]


def test_each_chart_is_one_named_svg() -> None:
    for i, svg in enumerate(_charts(), start=1):
        assert svg.count("<svg") == 1 and svg.endswith("</svg>")
        assert re.match(rf'<svg class="chart" role="img" aria-label="N{i}" ', svg)
        assert f"<title>N{i}</title>" in svg and svg.count("<text") > 3
        assert "nan" not in svg and "inf" not in svg


def test_the_charts_are_the_same_bytes_twice() -> None:
    assert _charts() == _charts()
