"""What each figure of the report page plots, as plain values, and the interface that draws them.

:mod:`verify.report_html` validates its inputs and prepares these values; a :class:`Charts` draws them as inline
SVG: :class:`verify.report_charts.SvgCharts` for format 2 (the current one, pure Python), and
:class:`verify.report_charts_mpl.MatplotlibCharts` for format 1 (matplotlib, kept to verify pages recorded in it).
The page around the figures (tables, captions, text) is the same in both formats.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

# Okabe-Ito: distinguishable with the common colour-vision deficiencies.
ARM_COLORS = {"seed": "#7f7f7f", "single": "#0072B2", "ddp-four": "#E69F00", "diloco-four": "#009E73"}
EXTRA_COLORS = ("#CC79A7", "#56B4E9", "#D55E00", "#000000")
PART_COLORS = {"update": "#0072B2", "synchronization": "#E69F00", "checkpoint": "#999999"}


def color(arm: str, i: int = 0) -> str:
    return ARM_COLORS.get(arm, EXTRA_COLORS[i % len(EXTRA_COLORS)])


def human_bytes(value: float) -> str:
    for unit, size in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if abs(value) >= size:
            return f"{value / size:.3g} {unit}"
    return f"{value:.0f} B"


@dataclass(frozen=True)
class Trajectory:
    run: str
    rank: int
    steps: list[int]
    loss: list[float]
    checkpoints: list[int]
    receipts: list[str]


# Per arm, per rank: the rank and its (part, seconds) stack, bottom first.
Bars = Sequence[tuple[str, Sequence[tuple[Any, Sequence[tuple[str, float]]]]]]


@dataclass(frozen=True)
class BytesBars:
    order: list[str]
    sent: dict[str, int]  # collective bytes per arm
    tx: dict[str, int]  # interface tx bytes per arm
    positive: list[int]  # the values above 0 (a log axis needs some)
    floor: float  # bars shorter than this are drawn this long, so they show on the log axis


@dataclass(frozen=True)
class Timeline:
    failed: float  # seconds of the failed group
    restarted: float  # seconds of the restarted group
    kill_at: float | None  # seconds into the failed group, when the detection time is known
    killed_rank: Any
    kill_step: Any
    resume: Any


@dataclass(frozen=True)
class Forest:
    names: list[str]
    gains: list[float]
    lo: list[float]
    hi: list[float]
    marks: list[tuple[float, str, str]]  # (x, label, colour) of each contract threshold
    xlim: tuple[float, float]


# One panel per breakdown kind: (kind, its groups, {arm: accuracy per group}).
Panels = Sequence[tuple[str, list[str], dict[str, list[float]]]]


class Charts(Protocol):
    """Draws each figure; ``fid`` prefixes the SVG's ids, ``name`` (escaped HTML) is its accessible name."""

    format: str

    def session(self) -> AbstractContextManager[None]: ...
    def loss(self, fid: str, name: str, losses: Mapping[str, Trajectory]) -> str: ...
    def seconds(self, fid: str, name: str, bars: Bars) -> str: ...
    def bytes(self, fid: str, name: str, b: BytesBars) -> str: ...
    def timeline(self, fid: str, name: str, t: Timeline) -> str: ...
    def trajectory(self, fid: str, name: str, un: Trajectory, re_: Trajectory, resume: Any, kill_step: Any) -> str: ...
    def accuracy(self, fid: str, name: str, panels: Panels, arms: Sequence[str]) -> str: ...
    def forest(self, fid: str, name: str, f: Forest) -> str: ...
    def retention(self, fid: str, name: str, hist: Mapping[str, list[int]], edges: list[float]) -> str: ...
    def latency(self, fid: str, name: str, lat: Mapping[str, list[float]], p95: Mapping[str, Any]) -> str: ...
    def throughput(self, fid: str, name: str, rps: Mapping[str, float]) -> str: ...


__all__ = ["ARM_COLORS", "Bars", "BytesBars", "Charts", "Forest", "Panels", "Timeline", "Trajectory",
           "color", "human_bytes"]
