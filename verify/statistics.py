"""The evaluation statistics, pure and I/O-free: paired comparisons, retention, contract conditions.

Both the eval runner (runners/evaluate.py) and the verifier (verify/evaluation.py) call these same functions, so a
receipt's figures recompute from its stored per-document outcomes. Every formula and every convention (and how it
was derived from the reference report) is written down in docs/statistics.md.

Exactness: sums over documents are exact (integers and :class:`fractions.Fraction` of the stored floats), so the
only roundings are the final conversions to float, one square root and one multiplication by the normal quantile.
The one-sided binomial p is an exact rational rounded once to the nearest float: it never underflows for fewer
than 1,075 discordant pairs (2**-1074 is the smallest positive float), and :func:`log10_one_sided_p` gives its
order of magnitude for any count.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from fractions import Fraction
from statistics import NormalDist
from typing import Any, Final

from ledger.errors import InputError

# The two-sided 99% normal quantile, 2.5758293035489: what the reference report's paired intervals use.
Z_99: Final = NormalDist().inv_cdf(0.995)
# The reference report's retention bounds use the quantile rounded to three decimals (mean + 2.576 * se
# reproduces all three of them exactly; 2.5758293... does not).
RETENTION_Z: Final = 2.576

INTERVAL_SCOPE: Final = "Approximate paired normal interval on this generated distribution, one training run"
RETENTION_SCOPE: Final = "descriptive development comparison; no serving approval"
LEARNING_SCOPE: Final = ("One run on four generated task families and previously exposed public retention probes; "
                         "no broad assistant or serving approval")

# The fields of a paired comparison, exactly as the reference report names them.
PAIRED_FIELDS: Final = ("accuracy_gain", "baseline_correct", "candidate_correct", "documents", "exact_one_sided_p",
                        "gained", "interval_scope", "lost", "normal_99pct_lower", "normal_99pct_upper",
                        "standard_error")
RETENTION_FIELDS: Final = ("documents", "improved", "mean_change", "normal_99pct_upper", "scope",
                           "standard_error", "worsened")

# Comparison names (the reference report's keys): the primary arm is "local", compared with the baseline arm
# (DDP) and, descriptively, with the single-rank arm.
LOCAL_VS_BASELINE: Final = "local_vs_ddp"
LOCAL_VS_SINGLE: Final = "local_vs_single_descriptive"
SEED: Final = "seed"

# The pre-registered quality conditions, in the reference report's order.
CONDITIONS: Final = ("maximum_one_sided_p_vs_seed", "minimum_accuracy_gain_vs_seed",
                     "paired_99pct_lower_vs_ddp_min", "retention_99pct_upper_max")


def vs_seed(arm: str) -> str:
    """The name of the comparison of ``arm`` against the seed model."""
    return f"{arm}_vs_seed"


# ------------------------------------------------------------------------------------------ paired counts


@dataclass(frozen=True)
class PairedCounts:
    """The 2x2 table of a paired comparison: how many documents each model got right and how they disagree."""

    documents: int
    baseline_correct: int
    candidate_correct: int
    gained: int  # candidate right, baseline wrong
    lost: int  # candidate wrong, baseline right

    def __post_init__(self) -> None:
        n, b, c, g, lo = self.documents, self.baseline_correct, self.candidate_correct, self.gained, self.lost
        if min(n, b, c, g, lo) < 0 or g + lo > n or b > n or c > n or c - b != g - lo or g > n - b or lo > b:
            raise InputError(f"inconsistent paired counts: documents {n}, baseline_correct {b}, "
                             f"candidate_correct {c}, gained {g}, lost {lo}")


def paired_counts(baseline: Sequence[bool], candidate: Sequence[bool]) -> PairedCounts:
    """Count a paired comparison from per-document outcomes (the same documents, in the same order)."""
    if len(baseline) != len(candidate):
        raise InputError(f"paired outcomes of different lengths: {len(baseline)} and {len(candidate)}")
    gained = sum(1 for b, c in zip(baseline, candidate, strict=True) if c and not b)
    lost = sum(1 for b, c in zip(baseline, candidate, strict=True) if b and not c)
    return PairedCounts(len(baseline), sum(map(bool, baseline)), sum(map(bool, candidate)), gained, lost)


def exact_one_sided_p(gained: int, lost: int) -> float:
    """P(X >= gained) for X ~ Binomial(gained + lost, 1/2): the exact one-sided sign test on discordant pairs.

    Computed as an exact rational (a sum of binomial coefficients over 2**m) and rounded once, so it is the float
    nearest the true value, however small (no underflow to 0 below 1,075 discordant pairs).
    """
    if gained < 0 or lost < 0:
        raise InputError(f"negative discordant counts: gained {gained}, lost {lost}")
    m = gained + lost
    if gained == 0:
        return 1.0
    if gained > m // 2:  # sum the shorter tail
        tail = _comb_sum(m, gained, m)
    else:
        tail = (1 << m) - _comb_sum(m, 0, gained - 1)
    return float(Fraction(tail, 1 << m))


def _comb_sum(m: int, lo: int, hi: int) -> int:
    """sum(C(m, k) for k in lo..hi), by the exact ratio C(m, k+1) = C(m, k) (m - k) / (k + 1)."""
    term = math.comb(m, lo)
    total = term
    for k in range(lo, hi):
        term = term * (m - k) // (k + 1)
        total += term
    return total


def log10_one_sided_p(gained: int, lost: int) -> float:
    """log10 of :func:`exact_one_sided_p`, in log space (lgamma and log-sum-exp), for any number of pairs."""
    m = gained + lost
    if gained <= 0:
        return 0.0
    logs = [math.lgamma(m + 1) - math.lgamma(k + 1) - math.lgamma(m - k + 1) for k in range(gained, m + 1)]
    top = max(logs)
    return (top + math.log(math.fsum(math.exp(v - top) for v in logs)) - m * math.log(2)) / math.log(10)


def paired_statistics(counts: PairedCounts) -> dict[str, Any]:
    """The reference report's paired comparison fields, from the counts alone.

    d_i = candidate_i - baseline_i in {-1, 0, 1}; gain = mean(d); standard error = sample standard deviation of
    d (n - 1 denominator) / sqrt(n); the interval is gain -/+ z * se with z the 0.995 normal quantile; p is the
    exact one-sided binomial (sign) test on the discordant pairs.
    """
    n, g, lo = counts.documents, counts.gained, counts.lost
    if n < 2:
        raise InputError(f"a paired comparison needs at least 2 documents, got {n}")
    mean = Fraction(g - lo, n)
    # sum(d^2) = g + lo; sample variance = (sum d^2 - n mean^2) / (n - 1), exact
    variance = (Fraction(g + lo) - n * mean * mean) / (n - 1)
    gain = float(mean)
    se = math.sqrt(float(variance / n))
    return {
        "accuracy_gain": gain,
        "baseline_correct": counts.baseline_correct,
        "candidate_correct": counts.candidate_correct,
        "documents": n,
        "exact_one_sided_p": exact_one_sided_p(g, lo),
        "gained": g,
        "interval_scope": INTERVAL_SCOPE,
        "lost": lo,
        "normal_99pct_lower": gain - Z_99 * se,
        "normal_99pct_upper": gain + Z_99 * se,
        "standard_error": se,
    }


def paired_comparison(baseline: Sequence[bool], candidate: Sequence[bool]) -> dict[str, Any]:
    """:func:`paired_statistics` of per-document outcomes."""
    return paired_statistics(paired_counts(baseline, candidate))


# ---------------------------------------------------------------------------------------------- retention


def mean_and_standard_error(values: Sequence[float]) -> tuple[float, float]:
    """Mean and standard error (sample standard deviation with n - 1, over sqrt(n)), summed exactly."""
    n = len(values)
    if n < 2:
        raise InputError(f"a mean with a standard error needs at least 2 values, got {n}")
    exact = [Fraction(v) for v in values]  # floats are exact rationals: no rounding until the end
    mean = sum(exact, Fraction(0)) / n
    variance = sum(((v - mean) ** 2 for v in exact), Fraction(0)) / (n - 1)
    return float(mean), math.sqrt(float(variance / n))


def retention_statistics(baseline_nll: Sequence[float], candidate_nll: Sequence[float]) -> dict[str, Any]:
    """Per-probe loss change (candidate NLL - baseline NLL, nats/token) summarised as in the reference report.

    improved: probes whose loss fell (change < 0); worsened: rose (> 0); an unchanged probe is neither. The upper
    bound is mean + 2.576 * se (:data:`RETENTION_Z`): a positive bound means the loss may have risen.
    """
    if len(baseline_nll) != len(candidate_nll):
        raise InputError(f"retention losses of different lengths: {len(baseline_nll)} and {len(candidate_nll)}")
    for v in (*baseline_nll, *candidate_nll):
        if not math.isfinite(v):
            raise InputError(f"retention loss {v!r} is not finite")
    changes = [Fraction(c) - Fraction(b) for b, c in zip(baseline_nll, candidate_nll, strict=True)]  # exact differences
    n = len(changes)
    if n < 2:
        raise InputError(f"retention statistics need at least 2 probes, got {n}")
    mean = sum(changes, Fraction(0)) / n
    variance = sum(((v - mean) ** 2 for v in changes), Fraction(0)) / (n - 1)
    mean_change = float(mean)
    se = math.sqrt(float(variance / n))
    return {
        "documents": n,
        "improved": sum(1 for v in changes if v < 0),
        "mean_change": mean_change,
        "normal_99pct_upper": mean_change + RETENTION_Z * se,
        "scope": RETENTION_SCOPE,
        "standard_error": se,
        "worsened": sum(1 for v in changes if v > 0),
    }


def exact_mean(values: Sequence[float]) -> float:
    """The mean of floats, summed exactly and rounded once (0.0 for no values)."""
    if not values:
        return 0.0
    return float(sum((Fraction(v) for v in values), Fraction(0)) / len(values))


# --------------------------------------------------------------------------------------------- breakdowns


def breakdowns(rows: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Correct and total documents per family and per variant, from outcome rows {family, variant, correct}."""
    out: dict[str, dict[str, dict[str, int]]] = {"family": {}, "variant": {}}
    for row in rows:
        for axis, key in (("family", str(row["family"])), ("variant", str(row["variant"]))):
            cell = out[axis].setdefault(key, {"correct": 0, "documents": 0})
            cell["documents"] += 1
            cell["correct"] += 1 if row["correct"] else 0
    return {axis: dict(sorted(cells.items())) for axis, cells in out.items()}


def merge_breakdowns(per_arm: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The reference report's ``breakdowns``: {axis: {key: {arm: correct, ..., "documents": n}}}."""
    merged: dict[str, dict[str, dict[str, int]]] = {}
    for arm, b in per_arm.items():
        for axis, cells in b.items():
            for key, cell in cells.items():
                slot = merged.setdefault(axis, {}).setdefault(key, {})
                if slot.get("documents", cell["documents"]) != cell["documents"]:
                    raise InputError(f"breakdowns disagree on the documents of {axis} {key}")
                slot["documents"] = cell["documents"]
                slot[arm] = cell["correct"]
    return merged


# ---------------------------------------------------------------------------------------------- contracts


def _condition(figure: float | None, threshold: float, at_least: bool, rule: str) -> dict[str, Any]:
    passed = figure is not None and (figure >= threshold if at_least else figure <= threshold)
    return {"passed": passed, "figure": figure, "threshold": threshold, "rule": rule}


def quality_conditions(thresholds: Mapping[str, float], arms: Sequence[str],
                       comparisons: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """Judge the pre-registered quality conditions; each {passed, figure, threshold, rule}.

    ``comparisons`` maps comparison names (:func:`vs_seed`, :data:`LOCAL_VS_BASELINE`) to their fields. The
    vs-seed conditions take the worst arm of ``arms`` (the smallest gain, the largest p, the largest retention
    bound); a condition whose figure is missing (an arm not evaluated) fails with figure ``null``.
    """
    seed_cmp = [comparisons.get(vs_seed(a)) for a in arms]
    have = [c for c in seed_cmp if c is not None]
    complete = bool(arms) and len(have) == len(arms)
    gains = [c["accuracy_gain"] for c in have]
    ps = [c["exact_one_sided_p"] for c in have]
    uppers = [c["retention"]["normal_99pct_upper"] for c in have if "retention" in c]
    local = comparisons.get(LOCAL_VS_BASELINE)
    return {
        "maximum_one_sided_p_vs_seed": _condition(
            max(ps) if complete else None, thresholds["maximum_one_sided_p_vs_seed"], False,
            "max over arms of exact_one_sided_p vs seed <= threshold"),
        "minimum_accuracy_gain_vs_seed": _condition(
            min(gains) if complete else None, thresholds["minimum_accuracy_gain_vs_seed"], True,
            "min over arms of accuracy_gain vs seed >= threshold"),
        "paired_99pct_lower_vs_ddp_min": _condition(
            local["normal_99pct_lower"] if local is not None else None,
            thresholds["paired_99pct_lower_vs_ddp_min"], True,
            "primary arm vs baseline arm normal_99pct_lower >= threshold"),
        "retention_99pct_upper_max": _condition(
            max(uppers) if complete and len(uppers) == len(arms) else None,
            thresholds["retention_99pct_upper_max"], False,
            "max over arms of retention normal_99pct_upper vs seed <= threshold"),
    }


def learning_section(*, prepared: str, selection: str, primary_arm: str, arms: Sequence[str],
                     eval_breakdowns: Mapping[str, Mapping[str, Any]],
                     comparisons: Mapping[str, Mapping[str, Any]],
                     conditions: Mapping[str, Mapping[str, Any]]) -> dict[str, Any]:
    """The reference report's ``learning`` section (less the audit's serving_approved and tokens_issued)."""
    def fields(c: Mapping[str, Any], with_retention: bool) -> dict[str, Any]:
        out = {k: c[k] for k in PAIRED_FIELDS}
        if with_retention and "retention" in c:
            out["retention"] = {k: c["retention"][k] for k in RETENTION_FIELDS}
        return out

    section: dict[str, Any] = {
        "breakdowns": merge_breakdowns(eval_breakdowns),
        "comparisons_to_seed": {a: fields(comparisons[vs_seed(a)], True) for a in arms if vs_seed(a) in comparisons},
        "conditions": {name: bool(c["passed"]) for name, c in conditions.items()},
        "prepared": prepared,
        "primary_arm": primary_arm,
        "quality_contract_passed": all(c["passed"] for c in conditions.values()) and bool(conditions),
        "scope": LEARNING_SCOPE,
        "selection": selection,
    }
    for name in (LOCAL_VS_BASELINE, LOCAL_VS_SINGLE):
        if name in comparisons:
            section[name] = fields(comparisons[name], False)
    return section


__all__ = [
    "CONDITIONS",
    "INTERVAL_SCOPE",
    "LEARNING_SCOPE",
    "LOCAL_VS_BASELINE",
    "LOCAL_VS_SINGLE",
    "PAIRED_FIELDS",
    "RETENTION_FIELDS",
    "RETENTION_SCOPE",
    "RETENTION_Z",
    "Z_99",
    "PairedCounts",
    "breakdowns",
    "exact_mean",
    "exact_one_sided_p",
    "learning_section",
    "log10_one_sided_p",
    "mean_and_standard_error",
    "merge_breakdowns",
    "paired_comparison",
    "paired_counts",
    "paired_statistics",
    "quality_conditions",
    "retention_statistics",
    "vs_seed",
]
