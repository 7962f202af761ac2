"""Exact comparison of two checkpoint states, component by component (ladder level 3, "Equality").

Digests decide equality: both states are recomputed from their files (never taken from a manifest), and tensor
data is read again only to locate a difference: the first differing element (flat index) and both values with
their bit patterns. Bytes are compared, not values, so 0.0 vs -0.0 or two NaN payloads are differences. The
report carries the counts the reference report shows per rank (tensors, tensor_elements, scalars),
``contents_exactly_equal`` and ``file_hashes_equal``.
"""

from __future__ import annotations

import math
import os
import struct
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from ledger import digests
from ledger.artifacts import path_from_uri
from ledger.errors import DigestMismatch, InputError, MissingArtifact, StateMismatch
from ledger.state import (
    CheckpointState,
    ComponentState,
    Progress,
    SafetensorsFile,
    TensorDigest,
    order_components,
    read_states,
)

if TYPE_CHECKING:  # the store (SQLAlchemy) is imported only by callers that resolve receipts
    from ledger.store import Store

DiffKind = Literal["component", "tensor", "dtype", "shape", "data", "scalar", "file"]
ABSENT = "absent"
_BLOCK = 4 << 20  # bytes compared at a time while locating a difference (bounded memory)


# ------------------------------------------------------------------------------------------ report types


@dataclass(frozen=True)
class Difference:
    """One difference between A and B. ``a``/``b`` are rendered values (or dtype/shape, or "absent")."""

    kind: DiffKind
    component: str | None = None
    tensor: str | None = None
    path: str | None = None  # JSON path of a scalar, or the file name of a file difference
    index: int | None = None  # flat index of the first differing element
    numel: int | None = None
    dtype: str | None = None
    a: str | None = None
    b: str | None = None
    a_bits: str | None = None
    b_bits: str | None = None

    def one_line(self) -> str:
        where = f"{self.component}/{self.tensor}" if self.tensor is not None else f"{self.component}"
        if self.kind == "data":
            if self.index is None:
                return f"{where}: data differs ({self.dtype}; not located, locate limit reached)"
            return (f"{where}: first difference at element {self.index} of {self.numel} ({self.dtype}): "
                    f"A {self.a} ({self.a_bits}) vs B {self.b} ({self.b_bits})")
        if self.kind in ("dtype", "shape"):
            return f"{where}: {self.kind} differs: A {self.a} vs B {self.b}"
        if self.kind == "tensor":
            side = "A" if self.b == ABSENT else "B"
            return f"{where}: tensor only in {side} ({self.a if side == 'A' else self.b})"
        if self.kind == "component":
            side = "A" if self.b == ABSENT else "B"
            return f"component {self.component!r}: only in {side}"
        if self.kind == "scalar":
            return f"{self.component} scalars {self.path}: A {self.a} vs B {self.b}"
        return f"file {self.path!r}: A {self.a} vs B {self.b}"

    def to_json(self) -> dict[str, Any]:
        out = {k: v for k, v in self.__dict__.items() if v is not None}
        out["message"] = self.one_line()
        return out


@dataclass(frozen=True)
class ComponentComparison:
    component: str
    digest_a: str | None
    digest_b: str | None
    counts_a: Mapping[str, int] | None
    counts_b: Mapping[str, int] | None
    tensors_equal: bool
    scalars_equal: bool
    differing_tensors: int = 0
    differences: tuple[Difference, ...] = ()

    @property
    def equal(self) -> bool:
        """Present on both sides with equal tensor digests and scalars (for two checkpoints: equal digests)."""
        return self.counts_a is not None and self.counts_b is not None and self.tensors_equal and self.scalars_equal

    def to_json(self) -> dict[str, Any]:
        return {"equal": self.equal, "tensors_equal": self.tensors_equal, "scalars_equal": self.scalars_equal,
                "digest_a": self.digest_a, "digest_b": self.digest_b,
                "a": dict(self.counts_a) if self.counts_a is not None else None,
                "b": dict(self.counts_b) if self.counts_b is not None else None,
                "differing_tensors": self.differing_tensors,
                "differences": [d.to_json() for d in self.differences]}


@dataclass(frozen=True)
class StateComparison:
    """A component-by-component comparison. ``file_hashes_equal`` is None when file digests were not computed."""

    a: str
    b: str
    digest_a: str
    digest_b: str
    components: tuple[ComponentComparison, ...]
    file_hashes_equal: bool | None
    file_differences: tuple[Difference, ...] = ()

    @property
    def contents_exactly_equal(self) -> bool:
        return all(c.equal for c in self.components)

    @property
    def equal(self) -> bool:
        """Contents exactly equal, and file hashes too when they were compared."""
        return self.contents_exactly_equal and self.file_hashes_equal is not False

    @property
    def first_difference(self) -> Difference | None:
        for c in self.components:
            if c.differences:
                return c.differences[0]
        return self.file_differences[0] if self.file_differences else None

    def check_equal(self) -> None:
        """Raise :class:`~ledger.errors.StateMismatch` naming the first difference, if any."""
        if not self.equal:
            first = self.first_difference
            detail = first.one_line() if first else "state digests differ"
            raise StateMismatch(f"{self.a} and {self.b} differ: {detail}", field=_field_of(first),
                                expected=self.digest_a, actual=self.digest_b)

    def to_json(self) -> dict[str, Any]:
        first = self.first_difference
        return {"a": self.a, "b": self.b, "digest_a": self.digest_a, "digest_b": self.digest_b,
                "equal": self.equal, "contents_exactly_equal": self.contents_exactly_equal,
                "file_hashes_equal": self.file_hashes_equal,
                "first_difference": first.to_json() if first else None,
                "components": {c.component: c.to_json() for c in self.components},
                "file_differences": [d.to_json() for d in self.file_differences]}


def _field_of(d: Difference | None) -> str | None:
    if d is None:
        return None
    if d.kind == "file":
        return f"files.{d.path}"
    if d.kind == "scalar":
        return f"{d.component}.scalars{(d.path or '$')[1:]}"
    return f"{d.component}/{d.tensor}" if d.tensor is not None else d.component


# ----------------------------------------------------------------------------------------- element values


def _minifloat(bits: int, exp_bits: int, man_bits: int, bias: int, *, fnuz: bool, ieee: bool) -> float:
    """Decode an 8-bit float. ``fnuz``: 0x80 is the only NaN, no -0/inf; ``ieee``: all-ones exponent is inf/NaN;
    otherwise (E4M3FN) only all-ones exponent and mantissa is NaN."""
    sign = -1.0 if bits >> 7 else 1.0
    e = (bits >> man_bits) & ((1 << exp_bits) - 1)
    m = bits & ((1 << man_bits) - 1)
    top = (1 << exp_bits) - 1
    if fnuz and bits == 0x80:
        return math.nan
    if ieee and e == top:
        return sign * math.inf if m == 0 else math.nan
    if not fnuz and not ieee and e == top and m == (1 << man_bits) - 1:
        return math.nan
    if e == 0:
        return sign * m / (1 << man_bits) * 2.0 ** (1 - bias)
    return sign * (1 + m / (1 << man_bits)) * 2.0 ** (e - bias)


def element_value(dtype: str, raw: bytes) -> str:
    """Render one little-endian element of a safetensors dtype exactly enough to see the difference."""
    u = int.from_bytes(raw, "little")
    if dtype in ("F64", "F32", "F16"):
        return repr(struct.unpack({"F64": "<d", "F32": "<f", "F16": "<e"}[dtype], raw)[0])
    if dtype == "BF16":
        return repr(struct.unpack("<f", (u << 16).to_bytes(4, "little"))[0])
    if dtype == "C64":
        re_, im = struct.unpack("<ff", raw)
        return f"({re_!r}{'+' if im >= 0 or math.isnan(im) else '-'}{abs(im)!r}j)"
    if dtype == "F8_E4M3":
        return repr(_minifloat(u, 4, 3, 7, fnuz=False, ieee=False))
    if dtype == "F8_E4M3FNUZ":
        return repr(_minifloat(u, 4, 3, 8, fnuz=True, ieee=False))
    if dtype == "F8_E5M2":
        return repr(_minifloat(u, 5, 2, 15, fnuz=False, ieee=True))
    if dtype == "F8_E5M2FNUZ":
        return repr(_minifloat(u, 5, 2, 16, fnuz=True, ieee=False))
    if dtype == "F8_E8M0":
        return "nan" if u == 0xFF else repr(2.0 ** (u - 127))
    if dtype == "BOOL":
        return "true" if u == 1 else "false" if u == 0 else f"invalid bool byte {u}"
    return str(int.from_bytes(raw, "little", signed=dtype.startswith("I")))


def element_bits(raw: bytes) -> str:
    return f"0x{int.from_bytes(raw, 'little'):0{2 * len(raw)}x}"


def first_differing_byte(a: memoryview, b: memoryview) -> int | None:
    """Offset of the first byte where ``a`` and ``b`` differ (or where the shorter ends), None if equal."""
    import numpy as np  # only when a difference must be located

    n = min(len(a), len(b))
    for off in range(0, n, _BLOCK):
        x = np.frombuffer(a[off : off + _BLOCK], dtype=np.uint8)
        y = np.frombuffer(b[off : off + _BLOCK], dtype=np.uint8)
        ne = np.not_equal(x, y)
        if ne.any():
            return off + int(ne.argmax())
    return None if len(a) == len(b) else n


def locate(state_a: CheckpointState, state_b: CheckpointState, component_a: str, component_b: str,
           tensor: str) -> Difference:
    """Read both copies of a tensor (same dtype and shape) and name its first differing element."""
    ta = state_a.components[component_a].tensors[tensor]
    tb = state_b.components[component_b].tensors[tensor]
    with SafetensorsFile(state_a.file_of(component_a, tensor)) as fa, \
            SafetensorsFile(state_b.file_of(component_b, tensor)) as fb:
        va, vb = fa.view(tensor), fb.view(tensor)
        at = first_differing_byte(va, vb)
        size = fa.tensors[tensor].itemsize
        if at is None:  # the file changed since it was hashed
            return Difference("data", component_a, tensor, dtype=ta.dtype, numel=ta.numel, a="(equal now)",
                              b="(equal now)")
        index = at // size
        ra = bytes(va[index * size : (index + 1) * size])
        rb = bytes(vb[index * size : (index + 1) * size])
        del va, vb
    return Difference("data", component_a, tensor, index=index, numel=ta.numel, dtype=ta.dtype,
                      a=element_value(ta.dtype, ra), b=element_value(tb.dtype, rb),
                      a_bits=element_bits(ra), b_bits=element_bits(rb))


# ---------------------------------------------------------------------------------------------- scalars


def _key_path(path: str, key: str) -> str:
    return f"{path}.{key}" if key.isidentifier() else f"{path}[{digests.canonical_bytes(key).decode()}]"


def _show(value: Any) -> str:
    text = digests.canonical_bytes(value).decode("utf-8")
    return text if len(text) <= 80 else text[:77] + "..."


def scalar_differences(a: Any, b: Any, path: str = "$") -> Iterator[tuple[str, str, str]]:
    """(JSON path, A value, B value) of each differing leaf, in key order. Types count: 1, 1.0 and true differ."""
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            p = _key_path(path, key)
            if key not in a:
                yield p, ABSENT, _show(b[key])
            elif key not in b:
                yield p, _show(a[key]), ABSENT
            else:
                yield from scalar_differences(a[key], b[key], p)
    elif isinstance(a, list) and isinstance(b, list):
        for i in range(max(len(a), len(b))):
            p = f"{path}[{i}]"
            if i >= len(a):
                yield p, ABSENT, _show(b[i])
            elif i >= len(b):
                yield p, _show(a[i]), ABSENT
            else:
                yield from scalar_differences(a[i], b[i], p)
    elif digests.canonical_bytes(a) != digests.canonical_bytes(b):
        yield path, _show(a), _show(b)


# ------------------------------------------------------------------------------------------- comparison


def _shape(t: TensorDigest) -> str:
    return "[" + ",".join(map(str, t.shape)) + "]"


@dataclass
class _Budget:
    located: int = 0
    limit: int = 16
    scalar_limit: int = 16


def _tensor_difference(sa: CheckpointState, sb: CheckpointState, comp_a: str, comp_b: str, name: str,
                       budget: _Budget) -> Difference:
    ta = sa.components[comp_a].tensors.get(name)
    tb = sb.components[comp_b].tensors.get(name)
    if ta is None or tb is None:
        present = ta or tb
        assert present is not None
        desc = f"{present.dtype}{_shape(present)}"
        return Difference("tensor", comp_a, name, a=desc if ta else ABSENT, b=desc if tb else ABSENT)
    if ta.dtype != tb.dtype:
        return Difference("dtype", comp_a, name, a=f"{ta.dtype}{_shape(ta)}", b=f"{tb.dtype}{_shape(tb)}")
    if ta.shape != tb.shape:
        return Difference("shape", comp_a, name, dtype=ta.dtype, a=_shape(ta), b=_shape(tb))
    if ta.name != tb.name or ta.data == tb.data:  # cannot happen: same name, dtype, shape and data
        raise AssertionError(f"tensor digests of {name!r} differ with equal fields")
    if budget.located >= budget.limit:
        return Difference("data", comp_a, name, dtype=ta.dtype, numel=ta.numel)
    budget.located += 1
    return locate(sa, sb, comp_a, comp_b, name)


def _compare_component(sa: CheckpointState, sb: CheckpointState, label: str, ca: ComponentState | None,
                       cb: ComponentState | None, budget: _Budget) -> ComponentComparison:
    if ca is None or cb is None:
        diff = Difference("component", label, a="present" if ca else ABSENT, b="present" if cb else ABSENT)
        return ComponentComparison(label, ca.digest if ca else None, cb.digest if cb else None,
                                   ca.counts() if ca else None, cb.counts() if cb else None,
                                   tensors_equal=False, scalars_equal=False, differences=(diff,))
    ta = {n: t.digest for n, t in ca.tensors.items()}
    tb = {n: t.digest for n, t in cb.tensors.items()}
    scalars_equal = digests.canonical_bytes(dict(ca.scalars)) == digests.canonical_bytes(dict(cb.scalars))
    differing = [n for n in sorted(set(ta) | set(tb)) if ta.get(n) != tb.get(n)]
    diffs = [_tensor_difference(sa, sb, ca.name, cb.name, n, budget) for n in differing]
    if not scalars_equal:
        for i, (p, va, vb) in enumerate(scalar_differences(dict(ca.scalars), dict(cb.scalars))):
            if i >= budget.scalar_limit:
                break
            diffs.append(Difference("scalar", label, path=p, a=va, b=vb))
    return ComponentComparison(label, ca.digest, cb.digest, ca.counts(), cb.counts(), tensors_equal=not differing,
                               scalars_equal=scalars_equal, differing_tensors=len(differing),
                               differences=tuple(diffs))


def compare_read_states(sa: CheckpointState, sb: CheckpointState, *, label_a: str | None = None,
                        label_b: str | None = None, max_located: int = 16) -> StateComparison:
    """Compare two recomputed states; reads tensor data only to locate differing tensors (at most
    ``max_located`` of them, in component then name order)."""
    if sa.kind != sb.kind:
        raise InputError(f"cannot compare a {sa.kind} ({sa.path}) with a {sb.kind} ({sb.path})")
    budget = _Budget(limit=max_located)
    rows: list[ComponentComparison] = []
    if sa.kind == "file":  # lone files: pair their single components whatever the file stems
        (ca,), (cb,) = sa.components.values(), sb.components.values()
        label = ca.name if ca.name == cb.name else f"{ca.name}|{cb.name}"
        rows.append(_compare_component(sa, sb, label, ca, cb, budget))
    else:
        for comp in order_components(set(sa.components) | set(sb.components)):
            rows.append(_compare_component(sa, sb, comp, sa.components.get(comp), sb.components.get(comp), budget))
    files_equal: bool | None = None
    file_diffs: list[Difference] = []
    if sa.files is not None and sb.files is not None:
        for name in sorted(set(sa.files) | set(sb.files)):
            fa, fb = sa.files.get(name, ABSENT), sb.files.get(name, ABSENT)
            if fa != fb:
                file_diffs.append(Difference("file", path=name, a=fa, b=fb))
        files_equal = not file_diffs
    return StateComparison(label_a or str(sa.path), label_b or str(sb.path), sa.digest, sb.digest, tuple(rows),
                           files_equal, tuple(file_diffs))


@dataclass(frozen=True)
class CheckpointRef:
    """A checkpoint to compare: a path, and when it came from a receipt, that receipt and its state digest."""

    path: Path
    label: str
    receipt: str | None = None
    expected_state: str | None = None


def compare_states(
    a: str | os.PathLike[str] | CheckpointRef,
    b: str | os.PathLike[str] | CheckpointRef,
    *,
    files: bool = True,
    max_located: int = 16,
    progress: Progress | None = None,
) -> StateComparison:
    """Recompute both states (and file digests unless ``files=False``) and compare them component by component.

    Both must be complete checkpoint directories, or both single safetensors files. A side that came from a
    receipt must recompute to that receipt's state digest, else :class:`~ledger.errors.DigestMismatch`.
    """
    refs = [x if isinstance(x, CheckpointRef) else CheckpointRef(Path(x), str(x)) for x in (a, b)]
    if refs[0].path.is_dir() != refs[1].path.is_dir():  # refuse before hashing anything
        raise InputError(f"cannot compare a checkpoint directory with a single file ({refs[0].path}, {refs[1].path})")
    sa, sb = read_states([r.path for r in refs], files=files, progress=progress)
    for ref, s in zip(refs, (sa, sb), strict=True):
        if ref.expected_state is not None and s.digest != ref.expected_state:
            raise DigestMismatch(f"checkpoint {ref.path}: state digest", expected=ref.expected_state,
                                 actual=s.digest, receipt=ref.receipt, field="artifacts.state")
    return compare_read_states(sa, sb, label_a=refs[0].label, label_b=refs[1].label, max_located=max_located)


def resolve_checkpoint(store: Store, ref: str) -> CheckpointRef:
    """The checkpoint directory that is a receipt's own evidence for its state: the location the receipt recorded
    (``receipt_locations``). Equal states share one digest, so another receipt's copy would prove nothing about this
    one; only a receipt written before schema 0003, which recorded none, falls back to the digest's locations."""
    stored = store.get(ref)
    r = stored.receipt
    state = r.artifacts.get("state")
    if state is None:
        raise InputError(f"receipt {r.id} ({r.kind}) names no state artifact to compare")
    own = bool(store.receipt_locations(r.id).get("state"))
    uris = store.evidence_locations(r.id, "state", state)
    for uri in uris:
        p = path_from_uri(uri)
        if p is not None and p.is_dir():
            return CheckpointRef(p, f"{r.kind} {r.id[:19]} ({p})", r.id, state)
    where = ", ".join(uris) or "no recorded location"
    raise MissingArtifact(state, f"state of receipt {r.id}" + (" (its own checkpoint)" if own else ""), where)
