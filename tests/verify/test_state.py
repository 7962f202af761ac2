"""Exact comparison of two checkpoint states (verify.state): the report, the first difference down to the element
and its bits, the receipts' checkpoints (resolve_checkpoint, CheckpointRef), and what is refused.

Checkpoints are built with numpy and hand-written safetensors bytes (tests/helpers_state.py), never with torch.
"""

from __future__ import annotations

import os
import struct
from pathlib import Path

import numpy as np
import pytest
from safetensors.numpy import save_file

from ledger.digests import prepared_digest
from ledger.errors import DigestMismatch, InputError, MissingArtifact, StateMismatch, UnsafeFile
from ledger.receipts import Receipt, make_receipt
from ledger.state import SafetensorsFile, read_state, write_manifest
from ledger.store import Store
from tests.conftest import fake_digest, schema_fill
from tests.helpers_state import (
    OPT_SCALARS,
    flip_bit,
    make_checkpoint,
    model_tensors,
    pickle_payloads,
    raw_safetensors,
)
from verify.state import (
    CheckpointRef,
    compare_states,
    element_bits,
    element_value,
    resolve_checkpoint,
    scalar_differences,
)

# ------------------------------------------------------------------------------------------------ the report


def test_equal_checkpoints_compare_equal(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a")
    b = make_checkpoint(tmp_path / "b")
    report = compare_states(a, b)
    assert report.contents_exactly_equal and report.file_hashes_equal and report.equal
    assert report.first_difference is None
    report.check_equal()
    model = report.components[0]
    assert model.component == "model" and model.counts_a == model.counts_b and model.counts_a is not None
    assert model.counts_a["tensors"] == 5
    doc = report.to_json()
    assert doc["components"]["optimizer"]["a"] == {"tensors": 9, "tensor_elements": 99, "scalars": 7}
    # equal contents, other file bytes: contents equal, file hashes not
    c = make_checkpoint(tmp_path / "c", shards=2)
    report = compare_states(a, c)
    assert report.contents_exactly_equal and report.file_hashes_equal is False and not report.equal
    assert report.first_difference is not None and report.first_difference.kind == "file"
    assert compare_states(a, c, files=False).file_hashes_equal is None
    assert compare_states(a, c, files=False).equal


def _model_with(name: str, value: np.ndarray) -> dict[str, np.ndarray]:
    m = model_tensors()
    m[name] = value
    return m


def test_data_difference_names_component_tensor_index_values_and_bits(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a")
    w = model_tensors()["layers.0.weight"].copy()
    w[2, 1] = 0.5
    w[3, 3] = -2.0
    b = make_checkpoint(tmp_path / "b", model=_model_with("layers.0.weight", w))
    report = compare_states(a, b)
    assert not report.contents_exactly_equal and not report.file_hashes_equal
    d = report.first_difference
    assert d is not None and (d.kind, d.component, d.tensor, d.index) == ("data", "model", "layers.0.weight", 9)
    original = float(model_tensors()["layers.0.weight"][2, 1])
    assert d.a == repr(original) and d.b == "0.5" and d.b_bits == "0x3f000000"
    assert d.numel == 16 and d.dtype == "F32"
    assert "model/layers.0.weight: first difference at element 9 of 16 (F32): A" in d.one_line()
    model = report.components[0]
    assert not model.equal and model.differing_tensors == 1 and model.scalars_equal
    assert all(c.equal for c in report.components[1:])
    with pytest.raises(StateMismatch, match="element 9"):
        report.check_equal()


def test_signed_zero_and_nan_payloads_are_differences(tmp_path: Path) -> None:
    zeros = np.zeros(4, np.float32)
    neg = zeros.copy()
    neg[2] = -0.0
    assert np.array_equal(zeros, neg)  # equal as values...
    nan1 = np.array([0x7FC00000, 0x7FC00001], np.uint32).view(np.float32)
    for (x, y), index, bits in (((zeros, neg), 2, ("0x00000000", "0x80000000")),
                                ((nan1, nan1[::-1].copy()), 0, ("0x7fc00000", "0x7fc00001"))):
        a = save_and_state(tmp_path / f"a{index}", x)
        b = save_and_state(tmp_path / f"b{index}", y)
        report = compare_states(a, b, files=False)
        d = report.first_difference
        assert not report.contents_exactly_equal  # ...but not as bytes
        assert d is not None and d.index == index and (d.a_bits, d.b_bits) == bits


def save_and_state(root: Path, arr: np.ndarray) -> Path:
    root.mkdir(parents=True)
    save_file({"x": arr}, str(root / "model.safetensors"))
    write_manifest(root, {})
    return root


@pytest.mark.parametrize(("dtype", "a", "b", "va", "vb"), [
    ("BF16", bytes([0x80, 0x3F]), bytes([0x81, 0x3F]), "1.0", "1.0078125"),
    ("F16", struct.pack("<e", 1.5), struct.pack("<e", -1.5), "1.5", "-1.5"),
    ("F8_E4M3", bytes([0x38]), bytes([0x7F]), "1.0", "nan"),
    ("F8_E5M2", bytes([0x3C]), bytes([0x7C]), "1.0", "inf"),
    ("I64", struct.pack("<q", -3), struct.pack("<q", 3), "-3", "3"),
    ("U16", struct.pack("<H", 65535), struct.pack("<H", 1), "65535", "1"),
])
def test_narrow_dtypes_compare_raw_bytes_and_show_values(tmp_path: Path, dtype: str, a: bytes, b: bytes,
                                                         va: str, vb: str) -> None:
    pad = b"\0" * len(a)
    fa = raw_safetensors(tmp_path / "a" / "model.safetensors", {"t": (dtype, [2], pad + a)})
    fb = raw_safetensors(tmp_path / "b" / "model.safetensors", {"t": (dtype, [2], pad + b)})
    d = compare_states(fa, fb).first_difference
    assert d is not None and d.kind == "data" and d.index == 1 and (d.a, d.b) == (va, vb)
    assert d.a_bits == element_bits(a) and d.b_bits == element_bits(b)


def test_float8_decoding_matches_torch() -> None:
    import torch  # a dependency of the project, only verify itself stays torch-free

    raw = bytes(range(256))
    for dtype, tdtype in (("F8_E4M3", "float8_e4m3fn"), ("F8_E5M2", "float8_e5m2"),
                          ("F8_E4M3FNUZ", "float8_e4m3fnuz"), ("F8_E5M2FNUZ", "float8_e5m2fnuz")):
        if not hasattr(torch, tdtype):
            continue
        values = torch.frombuffer(bytearray(raw), dtype=torch.uint8).view(getattr(torch, tdtype)).double().tolist()
        ours = [element_value(dtype, bytes([i])) for i in range(256)]
        assert ours == [repr(v) for v in values], dtype


@pytest.mark.parametrize("change", ["dtype", "shape", "only-a", "only-b", "component", "scalar"])
def test_structural_differences_are_named(tmp_path: Path, change: str) -> None:
    a = make_checkpoint(tmp_path / "a")
    m = model_tensors()
    opt = None
    scal = None
    if change == "dtype":
        m["head.weight"] = m["head.weight"].view(np.int32)
    elif change == "shape":
        m["head.weight"] = m["head.weight"].reshape(8, 4)
    elif change == "only-a":
        del m["head.weight"]
    elif change == "only-b":
        m["zzz"] = np.ones(3, np.float32)
    elif change == "scalar":
        scal = {**OPT_SCALARS, "param_groups": [{"lr": 0.002, "betas": [0.9, 0.999], "params": [0, 1, 2]}]}
    b = make_checkpoint(tmp_path / "b", model=m, optimizer=opt, opt_scalars=scal, manifest=change != "component")
    if change == "component":
        (b / "rng.safetensors").unlink()
        (b / "rng.json").unlink()
        write_manifest(b, {})
    d = compare_states(a, b).first_difference
    assert d is not None
    line = d.one_line()
    expected = {
        "dtype": "model/head.weight: dtype differs: A F32[4,8] vs B I32[4,8]",
        "shape": "model/head.weight: shape differs: A [4,8] vs B [8,4]",
        "only-a": "model/head.weight: tensor only in A (F32[4,8])",
        "only-b": "model/zzz: tensor only in B (F32[3])",
        "component": "component 'rng': only in A",
        "scalar": "optimizer scalars $.param_groups[0].lr: A 0.001 vs B 0.002",
    }[change]
    assert line == expected


def test_scalar_differences_respect_types_and_paths() -> None:
    diffs = list(scalar_differences({"a": 1, "b": [1, 2], "c": {"x y": True}, "d": 0},
                                    {"a": 1.0, "b": [1], "c": {"x y": 1}, "e": 0}))
    assert diffs == [("$.a", "1", "1.0"), ("$.b[1]", "2", "absent"), ('$.c["x y"]', "true", "1"),
                     ("$.d", "0", "absent"), ("$.e", "absent", "0")]


def test_locating_is_bounded_and_reads_only_differing_tensors(tmp_path: Path) -> None:
    a = make_checkpoint(tmp_path / "a")
    m = {n: v + np.ones_like(v) for n, v in model_tensors().items()}
    b = make_checkpoint(tmp_path / "b", model=m)
    report = compare_states(a, b, max_located=2)
    model = report.components[0]
    assert model.differing_tensors == 5
    located = [d for d in model.differences if d.index is not None]
    assert len(located) == 2 and all(d.index == 0 for d in located)
    assert "not located" in model.differences[-1].one_line()
    # lone files compare by tensors even under other file stems
    fa = raw_safetensors(tmp_path / "x" / "first.safetensors", {"t": ("U8", [1], b"\1")})
    fb = raw_safetensors(tmp_path / "y" / "second.safetensors", {"t": ("U8", [1], b"\1")})
    report = compare_states(fa, fb)
    assert report.contents_exactly_equal and report.components[0].component == "first|second"
    with pytest.raises(InputError, match="cannot compare"):
        compare_states(a, fa)


def test_comparison_releases_its_files(tmp_path: Path) -> None:
    """Comparing, and locating a difference (which reads tensor data again), leaves no file open."""
    a = make_checkpoint(tmp_path / "a")
    b = make_checkpoint(tmp_path / "b", model=_model_with("head.weight", np.zeros((4, 8), np.float32)))
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    for _ in range(5):
        assert compare_states(a, a).equal
        d = compare_states(a, b).first_difference
        assert d is not None and d.kind == "data" and d.tensor == "head.weight"
    after = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    assert after <= before


@pytest.mark.parametrize("kind", ["pickle", "zip"])
@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
def test_pickle_and_torch_files_are_refused_and_never_unpickled(tmp_path: Path, kind: str, name: str) -> None:
    marker = tmp_path / "MARKER"
    payload = pickle_payloads(tmp_path, marker)[kind]
    clean = make_checkpoint(tmp_path / "clean")
    root = make_checkpoint(tmp_path / "ckpt")
    (root / name).write_bytes(payload)  # replaces model.safetensors, or sits beside it as model.pt
    for a, b in ((root, root), (clean, root), (root, clean)):
        with pytest.raises(UnsafeFile, match="is a pickle/torch file; refusing to read it"):
            compare_states(a, b)
    assert not marker.exists()


# ------------------------------------------------------------------------------ checkpoints named by receipts


def _checkpoint_receipt(store: Store, root: Path) -> Receipt:
    """prepare -> train-start -> a checkpoint receipt naming the state of ``root`` (no location recorded)."""
    arts = {"data": fake_digest("data"), "config": fake_digest("config")}
    prepare = make_receipt("prepare", prepared=prepared_digest(arts), artifacts=arts,
                           measurements=schema_fill("prepare"))
    start = make_receipt("train-start", run="r", rank=0, step=0, prepared=prepare.prepared, parents=[prepare],
                         measurements=schema_fill("train-start"))
    state = read_state(root)
    ck = make_receipt("checkpoint", run="r", rank=0, step=4, prepared=prepare.prepared, parents=[start],
                      artifacts={"state": state.digest, "model": state.components["model"].digest},
                      measurements=schema_fill("checkpoint"))
    store.append_many([prepare, start, ck])
    return ck


def test_resolve_checkpoint_reads_the_recorded_locations(ledger_db: Path, tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ckpt")
    with Store.open(ledger_db) as store:
        ck = _checkpoint_receipt(store, root)
        state = ck.artifacts["state"]
        store.add_location(state, "s3://bucket/ckpt")  # not readable here
        store.add_location(state, str(tmp_path / "moved"))  # no longer there
        with pytest.raises(MissingArtifact, match="s3://bucket/ckpt") as info:
            resolve_checkpoint(store, ck.id)
        assert info.value.digest == state and f"state of receipt {ck.id}" in str(info.value)
        store.add_location(state, root.resolve().as_uri())
        ref = resolve_checkpoint(store, ck.id)
        assert ref == CheckpointRef(root.resolve(), f"checkpoint {ck.id[:19]} ({root.resolve()})", ck.id, state)
        with pytest.raises(InputError, match="names no state artifact"):
            resolve_checkpoint(store, ck.parents[0])  # the train-start receipt
    report = compare_states(ref, root)
    assert report.equal and report.a == ref.label and report.b == str(root)


def test_a_receipts_checkpoint_must_still_hold_its_state(ledger_db: Path, tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "ckpt")
    other = make_checkpoint(tmp_path / "other")
    with Store.open(ledger_db) as store:
        ck = _checkpoint_receipt(store, root)
        store.add_location(ck.artifacts["state"], str(root))
        ref = resolve_checkpoint(store, ck.id)
    with SafetensorsFile(root / "model.safetensors") as sf:
        at = sf.tensors["embed.weight"].begin
    flip_bit(root / "model.safetensors", at, bit=1)  # edited after its receipt
    for a, b in ((ref, other), (other, ref)):
        with pytest.raises(DigestMismatch, match=f"checkpoint {root}: state digest") as info:
            compare_states(a, b)
        assert (info.value.receipt, info.value.field) == (ck.id, "artifacts.state")
        assert info.value.expected == ck.artifacts["state"] and info.value.actual == read_state(root).digest
    assert not compare_states(root, other).equal  # as plain paths they compare, and differ
