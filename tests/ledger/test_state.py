"""Checkpoint state digests read straight from safetensors files (the torch-free reader of ledger.state), manifests
and verification. The comparison of two states (verify.state) is tested in tests/verify/test_state.py.

Checkpoints here are built with numpy + safetensors.numpy and hand-written safetensors bytes (tests/helpers_state.py),
never with the torch writer, so the reader is tested against the format alone.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

import ledger.state as state_module
from ledger import digests
from ledger.errors import DigestMismatch, InputError, UnsafeFile
from ledger.state import (
    MANIFEST,
    MAX_TENSORS,
    PARALLEL_MIN_BYTES,
    SafetensorsFile,
    StateCache,
    checkpoint_digest,
    component_digest,
    count_scalars,
    hash_buffers,
    hash_file_and_tensors,
    prefetch_states,
    read_manifest,
    read_state,
    read_states,
    recompute,
    scan_checkpoint,
    state_digest,
    tensor_digest,
    verify_checkpoint,
    write_manifest,
)
from tests.helpers_state import (
    OPT_SCALARS,
    flip_bit,
    make_checkpoint,
    model_tensors,
    optimizer_tensors,
    pickle_payloads,
    raw_safetensors,
    write_file,
)

# ----------------------------------------------------------------------------------------------- helpers


def rewrite_header(path: Path, edit: Any) -> None:
    """Apply ``edit(header_dict)`` and rewrite the file with the same data buffer."""
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    edit(header)
    write_file(path, json.dumps(header).encode(), raw[8 + n :])


def b3sum(path: Path) -> str | None:
    exe = shutil.which("b3sum")
    if exe is None:
        return None
    return "blake3:" + subprocess.run([exe, str(path)], capture_output=True, text=True, check=True).stdout.split()[0]


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    return make_checkpoint(tmp_path / "ckpt")


# ------------------------------------------------------------------------------------ digests and manifest


def test_digests_follow_the_documented_structure(ckpt: Path) -> None:
    state = read_state(ckpt)
    arr = model_tensors()["layers.0.weight"]
    data = digests.raw_digest(arr.tobytes())
    t = state.components["model"].tensors["layers.0.weight"]
    assert t.data == data
    assert t.digest == digests.digest_json("tensor", {"name": "layers.0.weight", "dtype": "F32", "shape": [4, 4],
                                                      "data": data})
    model = state.components["model"]
    assert model.digest == digests.digest_json(
        "component", {"component": "model", "tensors": {n: x.digest for n, x in model.tensors.items()},
                      "scalars": {}})
    opt = state.components["optimizer"]
    assert opt.digest == component_digest("optimizer", {n: x.digest for n, x in opt.tensors.items()}, OPT_SCALARS)
    assert state.digest == digests.digest_json("state", {"components": {c: s.digest
                                                                        for c, s in state.components.items()}})
    assert list(state.components) == ["model", "optimizer", "rng"]
    assert state.components["rng"].tensors["noise"].dtype == "BF16"


def test_counts_per_component(ckpt: Path) -> None:
    state = read_state(ckpt)
    assert state.components["model"].counts() == {"tensors": 5, "tensor_elements": 32 + 16 + 4 + 16 + 32,
                                                  "scalars": 0}
    # lr, 2 betas, 3 params, kind; rng: version, gauss_next (null is a leaf), cursor
    assert state.components["optimizer"].counts() == {"tensors": 9, "tensor_elements": 3 * 33, "scalars": 7}
    assert state.components["rng"].counts() == {"tensors": 2, "tensor_elements": 19, "scalars": 3}
    assert count_scalars({"a": [], "b": {}, "c": [[1, 2], {"d": None}]}) == 3


def test_manifest_records_everything_and_file_digests_equal_b3sum(ckpt: Path) -> None:
    manifest = read_manifest(ckpt)
    state = read_state(ckpt, files=True)
    assert manifest.checkpoint == state.digest == checkpoint_digest(ckpt)
    assert manifest.components == {c: s.digest for c, s in state.components.items()}
    assert manifest.tensors["model"] == {n: t.digest for n, t in state.components["model"].tensors.items()}
    assert manifest.meta == {"run": "r", "rank": 0, "step": 5}
    assert set(manifest.files) == {"model.safetensors", "optimizer.safetensors", "optimizer.json",
                                   "rng.safetensors", "rng.json"}
    assert manifest.files == state.files
    for name, d in manifest.files.items():
        assert d == digests.file_digest(ckpt / name)
        expected = b3sum(ckpt / name)
        assert expected is None or d == expected
    # manifest.json is canonical JSON of exactly the documented keys
    doc = digests.parse_canonical((ckpt / MANIFEST).read_bytes())
    assert doc["format"] == "ledger-checkpoint" and doc["version"] == 1
    assert set(doc) == {"format", "version", "checkpoint", "components", "tensors", "files", "meta"}
    # the manifest is not part of the state: rewriting it with other meta keeps the digest
    write_manifest(ckpt, {"note": "rewritten"})
    assert checkpoint_digest(ckpt) == state.digest
    assert recompute(ckpt) == state.digest  # the directory digest registered with ledger.artifacts
    verify_checkpoint(ckpt, expected_state=state.digest, expected_components={"model": manifest.components["model"]})


def test_tensor_data_digest_equals_b3sum_of_the_bytes(tmp_path: Path) -> None:
    data = np.random.default_rng(3).integers(0, 255, size=100_003, dtype=np.uint8).tobytes()
    f = raw_safetensors(tmp_path / "model.safetensors", {"x": ("U8", [len(data)], data)})
    (tmp_path / "x.bin").write_bytes(data)
    state = read_state(f)
    expected = b3sum(tmp_path / "x.bin") or digests.raw_digest(data)
    assert state.components["model"].tensors["x"].data == expected


# ------------------------------------------------------------------------------------------- invariance


def test_tensor_order_resave_and_sharding_keep_state_digests(tmp_path: Path) -> None:
    base = read_state(make_checkpoint(tmp_path / "base"), files=True)
    resaved = read_state(make_checkpoint(tmp_path / "resaved", metadata={"saved_by": "someone else"}), files=True)
    sharded = read_state(make_checkpoint(tmp_path / "sharded", shards=3), files=True)
    assert base.digest == resaved.digest == sharded.digest
    for c in ("model", "optimizer", "rng"):
        assert base.components[c].digest == resaved.components[c].digest == sharded.components[c].digest
    assert base.files is not None and resaved.files is not None and sharded.files is not None
    assert base.files["model.safetensors"] != resaved.files["model.safetensors"]  # header metadata differs
    assert "model.safetensors" not in sharded.files and len(sharded.components["model"].files) == 3
    # tensor order inside the data buffer
    tensors = {"a": ("F32", [2], struct.pack("<2f", 1.0, 2.0)), "b": ("I64", [1], struct.pack("<q", 5))}
    f1 = raw_safetensors(tmp_path / "o1" / "model.safetensors", tensors, order=["a", "b"])
    f2 = raw_safetensors(tmp_path / "o2" / "model.safetensors", tensors, order=["b", "a"])
    assert f1.read_bytes() != f2.read_bytes()
    assert read_state(f1).digest == read_state(f2).digest


def test_same_tensor_in_two_shards_is_refused(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "c", shards=2, manifest=False)
    save_file({"embed.weight": np.zeros((8, 4), np.float32)}, str(root / "model-00002-of-00002.safetensors"))
    with pytest.raises(UnsafeFile, match="also appears in model-00001-of-00002"):
        write_manifest(root, {})


@pytest.mark.parametrize("change", ["data-bit", "dtype", "shape", "name", "scalar"])
def test_each_change_changes_the_digest(tmp_path: Path, change: str) -> None:
    root = make_checkpoint(tmp_path / "c")
    before = read_state(root)
    f = root / "model.safetensors"
    target = "layers.0.weight"
    if change == "data-bit":
        with SafetensorsFile(f) as sf:
            at = sf.tensors[target].begin + 5
        flip_bit(f, at, bit=3)
    elif change == "dtype":  # equal item size, so the file stays valid
        rewrite_header(f, lambda h: h[target].update(dtype="I32"))
    elif change == "shape":
        rewrite_header(f, lambda h: h["embed.weight"].update(shape=[4, 8]))
        target = "embed.weight"
    elif change == "name":
        rewrite_header(f, lambda h: h.__setitem__("layers.0.weightt", h.pop(target)))
    else:
        (root / "optimizer.json").write_bytes(digests.canonical_bytes({**OPT_SCALARS, "kind": "adamw"}))
    after = read_state(root)
    assert after.digest != before.digest
    if change == "scalar":
        assert after.components["optimizer"].digest != before.components["optimizer"].digest
        assert after.components["model"].digest == before.components["model"].digest
        return
    assert after.components["model"].digest != before.components["model"].digest
    assert after.components["optimizer"].digest == before.components["optimizer"].digest
    if change == "name":
        assert target not in after.components["model"].tensors
    else:
        assert after.components["model"].tensors[target].digest != before.components["model"].tensors[target].digest
    changed = {n for n, t in after.components["model"].tensors.items()
               if before.components["model"].tensors.get(n) != t}
    assert changed == ({"layers.0.weightt"} if change == "name" else {target})


# -------------------------------------------------------------------------------------------- bad input

GOOD_HEADER = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}


def _bad_files(tmp: Path) -> dict[str, tuple[Path, str]]:
    """name -> (file, expected message fragment)."""
    good = raw_safetensors(tmp / "good" / "model.safetensors", {"x": ("F32", [2], b"\0" * 8),
                                                               "y": ("I64", [1], b"\1" * 8)})
    full = good.read_bytes()

    def hdr(h: Any, data: bytes = b"\0" * 8, **kw: Any) -> Path:
        return write_file(tmp / f"h{len(cases)}" / "model.safetensors", json.dumps(h).encode(), data, **kw)

    cases: dict[str, tuple[Path, str]] = {}
    t = tmp / "truncated" / "model.safetensors"
    t.parent.mkdir()
    t.write_bytes(full[:-3])
    cases["truncated"] = (t, "run past the end of the data buffer")
    s = tmp / "short" / "model.safetensors"
    s.parent.mkdir()
    s.write_bytes(b"\x10\0\0")
    cases["shorter-than-length"] = (s, "truncated")
    cases["length-past-end"] = (hdr(GOOD_HEADER, length=10_000), "header length 10000 runs past the end")
    cases["header-not-json"] = (write_file(tmp / "nj" / "model.safetensors", b"{not json}", b""),
                                "header is not JSON")
    cases["header-not-object"] = (write_file(tmp / "na" / "model.safetensors", b"[1, 2]", b""),
                                  "header is not a JSON object")
    cases["offsets-past-end"] = (hdr({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}),
                                 "run past the end of the data buffer")
    cases["overlap"] = (hdr({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                             "y": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}), "overlap")
    cases["gap"] = (hdr({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}}), "unused bytes")
    cases["trailing"] = (hdr({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}), "trailing bytes")
    cases["unknown-dtype"] = (hdr({"x": {"dtype": "F4", "shape": [16], "data_offsets": [0, 8]}}),
                              "unknown dtype 'F4'")
    cases["wrong-size"] = (hdr({"x": {"dtype": "F64", "shape": [2], "data_offsets": [0, 8]}}),
                           "needs 16")
    cases["bad-shape"] = (hdr({"x": {"dtype": "U8", "shape": [-8], "data_offsets": [0, 8]}}),
                          "not a list of non-negative integers")
    cases["extra-key"] = (hdr({"x": {**GOOD_HEADER["x"], "extra": 1}}), "exactly dtype, shape and data_offsets")
    cases["duplicate-name"] = (write_file(tmp / "dup" / "model.safetensors",
                                          b'{"x": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}, '
                                          b'"x": {"dtype": "U8", "shape": [4], "data_offsets": [4, 8]}}',
                                          b"\0" * 8), "duplicate key 'x'")
    cases["bad-metadata"] = (hdr({**GOOD_HEADER, "__metadata__": {"a": 1}}), "__metadata__")
    # within the header length limit, more tensors than a file may hold: refused before the header is parsed (the
    # limit read where the reader reads it, so that the test can lower it)
    limit = state_module.MAX_TENSORS
    many = {f"t{i}": {"dtype": "U8", "shape": [0], "data_offsets": [0, 0]} for i in range(limit + 2)}
    cases["too-many-tensors"] = (hdr(many), f"more than a file of at most {limit:,} tensors")
    many.pop("t0")  # one too many, no __metadata__: counted once parsed
    cases["surrogate-name"] = (write_file(tmp / "surrogate" / "model.safetensors",
                                          b'{"\\ud800": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}',
                                          b"\0"), "is not valid Unicode")
    cases["one-too-many"] = (hdr(many), f"more than the {limit:,} a file may hold")
    return cases


def test_damaged_safetensors_files_are_refused_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    assert state_module.MAX_TENSORS == MAX_TENSORS == 200_000  # the documented limit (docs/receipts.md)
    monkeypatch.setattr(state_module, "MAX_TENSORS", 1000)  # the same checks on smaller headers: seconds less
    cases = _bad_files(tmp_path)
    assert len(cases) == 18
    for name, (path, fragment) in cases.items():
        with pytest.raises(UnsafeFile) as info:
            read_state(path)
        msg = info.value.one_line()
        assert fragment in msg, (name, msg)
        assert str(path) in msg and "\n" not in str(info.value)


def test_a_pickle_header_length_does_not_hide_a_valid_file(tmp_path: Path) -> None:
    """A valid safetensors file whose header length starts with 0x80 0x02 is read, not refused as a pickle."""
    name = "w" * 500
    header = {name: {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]}}
    body = json.dumps(header).encode()
    body += b" " * (0x0280 - len(body))  # header length 0x0280: first bytes 80 02, like pickle protocol 2
    f = write_file(tmp_path / "model.safetensors", body, b"\7")
    assert f.read_bytes()[:2] == b"\x80\x02"
    assert read_state(f).components["model"].tensors[name].data == digests.raw_digest(b"\7")


@pytest.mark.parametrize("kind", ["pickle", "pickle0", "pickle1"])
def test_pickle_payload_is_real(tmp_path: Path, kind: str) -> None:
    """The canary works: unpickling the payload (here, deliberately, in the test) does create the marker."""
    marker = tmp_path / "canary"
    pickle.loads(pickle_payloads(tmp_path, marker)[kind])  # noqa: S301 - the test's own bytes
    assert marker.exists()


@pytest.mark.parametrize("kind", ["pickle", "zip", "pickle0", "pickle1"])
@pytest.mark.parametrize("name", ["model.pt", "model.safetensors"])
def test_pickle_and_torch_files_are_refused_and_never_unpickled(tmp_path: Path, kind: str, name: str) -> None:
    marker = tmp_path / "MARKER"
    payload = pickle_payloads(tmp_path, marker)[kind]
    lone = tmp_path / "lone" / name
    lone.parent.mkdir()
    lone.write_bytes(payload)
    with pytest.raises(UnsafeFile, match="is a pickle/torch file"):
        read_state(lone)
    root = make_checkpoint(tmp_path / "ckpt")
    (root / name).write_bytes(payload)  # replaces model.safetensors, or sits beside it as model.pt
    for call in (lambda: read_state(root), lambda: verify_checkpoint(root), lambda: checkpoint_digest(root),
                 lambda: write_manifest(root, {})):
        with pytest.raises(UnsafeFile, match="is a pickle/torch file; refusing to read it"):
            call()
    assert not marker.exists()


def test_directory_layout_errors(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "c")
    (root / "notes.txt").write_text("hello")
    with pytest.raises(UnsafeFile, match="unexpected file in a checkpoint directory"):
        read_state(root)
    (root / "notes.txt").unlink()
    (root / "scheduler.json").write_bytes(b"{}")  # not a known component
    with pytest.raises(UnsafeFile, match="scheduler.json: unexpected file"):
        read_state(root)
    (root / "scheduler.json").unlink()
    (root / "sub").mkdir()
    with pytest.raises(UnsafeFile, match="unexpected directory"):
        read_state(root)
    (root / "sub").rmdir()
    (root / ".model.safetensors.x.tmp").write_bytes(b"")  # a leftover temp file
    with pytest.raises(UnsafeFile, match="unexpected file"):
        read_state(root)
    (root / ".model.safetensors.x.tmp").unlink()
    (root / "optimizer.json").write_bytes(b'{"b": 1, "a": 2}')  # not canonical
    with pytest.raises(UnsafeFile, match="not canonical"):
        read_state(root)
    (root / "optimizer.json").write_bytes(b"[1]")
    with pytest.raises(UnsafeFile, match="must be a JSON object"):
        read_state(root)
    with pytest.raises(InputError, match="not a checkpoint directory"):
        checkpoint_digest(root / "model.safetensors")
    (root / "notes.json").write_bytes(b"{}")
    with pytest.raises(UnsafeFile, match="notes.json"):
        scan_checkpoint(root)


def test_shard_layout_errors(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "c", shards=3)
    (root / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(UnsafeFile, match=r"shard\(s\) \[2\] of 3 are missing"):
        read_state(root)
    shutil.copy(root / "model-00001-of-00003.safetensors", root / "model.safetensors")
    with pytest.raises(UnsafeFile, match="both a single file and sharded"):
        read_state(root)


def test_missing_manifest_is_never_a_valid_checkpoint(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "c", manifest=False)
    for call in (lambda: read_state(root), lambda: checkpoint_digest(root), lambda: verify_checkpoint(root),
                 lambda: recompute(root), lambda: read_manifest(root)):
        with pytest.raises(UnsafeFile, match="incomplete checkpoint"):
            call()
    write_manifest(root, {})
    assert checkpoint_digest(root) == read_manifest(root).checkpoint
    (root / MANIFEST).write_bytes(b'{"format": "ledger-checkpoint"}')
    with pytest.raises(UnsafeFile, match="not canonical"):
        read_manifest(root)
    (root / MANIFEST).write_bytes(digests.canonical_bytes({"format": "ledger-checkpoint"}))
    with pytest.raises(UnsafeFile, match="malformed manifest"):
        verify_checkpoint(root)


# ------------------------------------------------------------------------------------------ verification


def test_verify_names_the_tensor_whose_bytes_changed(ckpt: Path) -> None:
    state = verify_checkpoint(ckpt)
    f = ckpt / "optimizer.safetensors"
    with SafetensorsFile(f) as sf:
        at = sf.tensors["state.1.exp_avg_sq"].end - 1
    flip_bit(f, at, bit=7)
    assert checkpoint_digest(ckpt) != state.digest  # the pure digest changes too
    with pytest.raises(DigestMismatch) as info:
        verify_checkpoint(ckpt, receipt="blake3:" + "ab" * 32)
    msg = info.value.one_line()
    assert "component 'optimizer' tensor 'state.1.exp_avg_sq' (optimizer.safetensors)" in msg
    assert info.value.field == "tensors.optimizer.state.1.exp_avg_sq"
    assert info.value.expected == state.components["optimizer"].tensors["state.1.exp_avg_sq"].digest
    assert "receipt blake3:abab" in msg


def test_verify_names_scalars_files_and_expected_digests(tmp_path: Path) -> None:
    root = make_checkpoint(tmp_path / "c")
    good = read_state(root)
    (root / "optimizer.json").write_bytes(digests.canonical_bytes({**OPT_SCALARS, "kind": "SGD"}))
    with pytest.raises(DigestMismatch, match="component 'optimizer' scalars does not match its manifest"):
        verify_checkpoint(root)
    root = make_checkpoint(tmp_path / "d")
    rewrite_header(root / "model.safetensors", lambda h: h.__setitem__("__metadata__", {"x": "y"}))
    assert checkpoint_digest(root) == good.digest  # same state...
    with pytest.raises(DigestMismatch, match="file 'model.safetensors' does not match its manifest"):
        verify_checkpoint(root)  # ...but the recorded file digest no longer holds
    root = make_checkpoint(tmp_path / "e")
    with pytest.raises(DigestMismatch, match="state digest"):
        verify_checkpoint(root, expected_state=digests.raw_digest(b"other"))
    with pytest.raises(DigestMismatch, match="component 'outer'"):
        verify_checkpoint(root, expected_components={"outer": good.components["model"].digest})
    # a tensor added to the files but not to the manifest
    save_file({"extra": np.ones(2, np.float32), **optimizer_tensors()}, str(root / "optimizer.safetensors"))
    with pytest.raises(DigestMismatch, match="tensor 'extra'") as info:
        verify_checkpoint(root)
    assert info.value.expected == "absent"


# ------------------------------------------------------------------------------------------------ hashing


def test_hash_buffers_matches_plain_blake3_for_every_strategy() -> None:
    rng = np.random.default_rng(5)
    sizes = [0, 1, 1000, 70_000, 1 << 20, 3 << 20, PARALLEL_MIN_BYTES + 17]
    buffers = [rng.integers(0, 255, size=s, dtype=np.uint8).tobytes() for s in sizes]
    seen: list[tuple[int, int]] = []
    out = hash_buffers([memoryview(b) for b in buffers], progress=lambda n, total: seen.append((n, total)))
    assert out == [digests.raw_digest(b, threads=False) for b in buffers]
    assert sum(n for n, _ in seen) == sum(sizes) and {t for _, t in seen} == {sum(sizes)}


def test_zero_size_tensors_and_empty_file(tmp_path: Path) -> None:
    f = raw_safetensors(tmp_path / "model.safetensors", {"e": ("F32", [0, 3], b""), "s": ("I64", [], b"\1" * 8),
                                                        "z": ("U8", [0], b"")})
    t = read_state(f).components["model"].tensors
    assert t["e"].data == digests.raw_digest(b"") and t["e"].shape == (0, 3)
    assert t["s"].numel == 1
    empty = write_file(tmp_path / "e" / "model.safetensors", b"{}", b"")
    assert read_state(empty).components["model"].tensors == {}


def test_mmap_views_are_released(tmp_path: Path) -> None:
    """Files are closed after hashing, so a checkpoint can be deleted or replaced right away (and fds don't leak)."""
    root = make_checkpoint(tmp_path / "c")
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    for _ in range(5):
        read_state(root, files=True)
    after = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    assert after <= before
    sf = SafetensorsFile(root / "model.safetensors")
    v = sf.view("head.weight")
    sf.close()
    with pytest.raises(ValueError):
        bytes(v)


# -------------------------------------------------------------------------------------------- the spec


DOCS = Path(__file__).resolve().parents[2] / "docs"


def _spec_example() -> dict[str, dict[str, str]]:
    """The ```state-example block of the spec: records separated by blank lines, headed by a title line."""
    import re

    text = (DOCS / "receipts.md").read_text(encoding="utf-8")
    found = re.search(r"^```state-example\n(.*?)^```$", text, flags=re.S | re.M)
    if not found:
        pytest.fail("no ```state-example block in docs/receipts.md")
    out: dict[str, dict[str, str]] = {}
    for chunk in found.group(1).strip().split("\n\n"):
        title, *lines = chunk.split("\n")
        rec: dict[str, str] = {}
        for line in lines:
            key, _, value = line.partition(": ")
            rec[key] = rec.get(key, "") + value if key == "hex" else value
        out[title] = rec
    return out


def test_docs_worked_example(tmp_path: Path) -> None:
    ex = _spec_example()
    root = tmp_path / "ckpt"
    root.mkdir()
    (root / "model.safetensors").write_bytes(bytes.fromhex(ex["file model.safetensors"]["hex"]))
    (root / "optimizer.json").write_bytes(ex["file optimizer.json"]["text"].encode())
    meta_title = next(t for t in ex if t.startswith("manifest meta "))
    manifest = write_manifest(root, json.loads(meta_title.removeprefix("manifest meta ")))
    state = read_state(root, files=True)
    assert state.files is not None
    for name in ("model.safetensors", "optimizer.json"):
        assert state.files[name] == ex[f"file {name}"]["file digest"]
    for title, rec in ex.items():
        kind, _, name = title.partition(" ")
        if kind == "tensor":
            comp, tensor = name.split("/")
            t = state.components[comp].tensors[tensor]
            assert t.data == rec["data"]
            assert digests.canonical_bytes(json.loads(rec["json"])) == rec["json"].encode()
            assert digests.digest_bytes("tensor", rec["json"].encode()) == rec["digest tensor"] == t.digest
            assert tensor_digest(t.name, t.dtype, t.shape, t.data) == t.digest
        elif kind == "component":
            c = state.components[name]
            assert digests.digest_bytes("component", rec["json"].encode()) == rec["digest component"] == c.digest
        elif kind == "state":
            assert digests.digest_bytes("state", rec["json"].encode()) == rec["digest state"] == state.digest
            assert state_digest({n: c.digest for n, c in state.components.items()}) == state.digest
    assert (root / MANIFEST).read_bytes() == ex[meta_title]["text"].encode()
    assert manifest.checkpoint == state.digest
    # the sharding claim of the page
    with SafetensorsFile(root / "model.safetensors") as sf:
        parts = {n: (e.dtype, list(e.shape), bytes(sf.view(n))) for n, e in sf.tensors.items()}
    sharded = tmp_path / "sharded"
    raw_safetensors(sharded / "model-00001-of-00002.safetensors", {"bias": parts["bias"]})
    raw_safetensors(sharded / "model-00002-of-00002.safetensors", {"weight": parts["weight"]})
    shutil.copy(root / "optimizer.json", sharded / "optimizer.json")
    write_manifest(sharded, {})
    assert read_state(sharded).digest == state.digest


# ------------------------------------------------------------------- one pass, many checkpoints, one read each


def _unfused(path: Path) -> tuple[str, dict[str, str]]:
    """A file's digest and its tensors' data digests, each hashed on its own (the plain definition)."""
    with SafetensorsFile(path) as sf:
        return (digests.raw_digest(sf.file_view()),
                {name: digests.raw_digest(sf.view(name)) for name in sf.tensors})


def test_one_pass_gives_the_file_and_tensor_digests(tmp_path: Path) -> None:
    rng = np.random.default_rng(3)
    big = rng.integers(0, 255, size=700_000, dtype=np.uint8).tobytes()  # spans several 256 KiB windows
    f = raw_safetensors(tmp_path / "model.safetensors", {
        "a": ("U8", [len(big)], big), "e": ("F32", [0], b""), "s": ("I64", [], b"\1" * 8),
        "z": ("U8", [300_001], big[:300_001])}, order=["s", "a", "e", "z"])
    with SafetensorsFile(f) as sf:
        assert hash_file_and_tensors(sf) == _unfused(f)


def test_many_checkpoints_hashed_at_once_equal_one_at_a_time(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    roots = [make_checkpoint(tmp_path / f"c{i}", model={"w": np.full((64, 64), i, np.float32)}) for i in range(11)]
    alone = [read_state(r, files=True) for r in roots]
    monkeypatch.setattr(state_module, "FUSE_MIN_BYTES", 1)  # every file in one pass (there are many)
    seen: list[tuple[int, int]] = []
    together = read_states(roots, files=True, progress=lambda n, total: seen.append((n, total)))
    assert [s.to_json() for s in together] == [s.to_json() for s in alone]
    assert [s.digest for s in read_states(roots)] == [s.digest for s in alone]
    assert seen and len({t for _, t in seen}) == 1


def test_errors_come_in_the_order_of_the_paths(tmp_path: Path) -> None:
    good = make_checkpoint(tmp_path / "good")
    twice = make_checkpoint(tmp_path / "twice", shards=2, manifest=False)  # fails when assembled
    save_file({"embed.weight": np.zeros((8, 4), np.float32)}, str(twice / "model-00002-of-00002.safetensors"))
    bad = make_checkpoint(tmp_path / "bad")  # fails when opened, after `twice` was hashed
    write_file(bad / "rng.safetensors", b'{"x":', b"")
    with pytest.raises(UnsafeFile) as first:
        read_states([good, twice, bad], require_manifest=False)
    assert str(bad / "rng.safetensors") in str(first.value)
    with pytest.raises(UnsafeFile, match="also appears in"):
        read_states([good, twice], require_manifest=False)


def test_a_state_cache_reads_each_state_once(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    root = make_checkpoint(tmp_path / "c")
    opened: list[Path] = []
    real_open = state_module._open

    def counting_open(p: Path, m: bool, *copies: Any) -> Any:
        opened.append(p)
        return real_open(p, m, *copies)

    monkeypatch.setattr(state_module, "_open", counting_open)
    with StateCache().active():
        with_files = verify_checkpoint(root)
        again = read_state(root)  # served from the cache, without file digests as asked
        assert again.files is None and again.digest == with_files.digest
        assert checkpoint_digest(root) == with_files.digest
        assert read_state(root, files=True) is with_files
    assert opened == [root]
    read_state(root)  # outside the cache: read again
    assert opened == [root, root]


def _json_of(state: Any) -> dict[str, Any]:
    """A state's JSON without its path (copies of a checkpoint differ only there)."""
    out: dict[str, Any] = state.to_json()
    out.pop("path")
    return out


def _counting_files(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """The safetensors files opened (header parsed, tensors mapped) from now on."""
    opened: list[Path] = []
    real = state_module.SafetensorsFile

    class Counting(real):  # type: ignore[misc, valid-type]
        def __init__(self, path: Any, **kw: Any) -> None:
            opened.append(Path(path))
            super().__init__(path, **kw)

    monkeypatch.setattr(state_module, "SafetensorsFile", Counting)
    return opened


def test_a_copy_is_hashed_whole_and_takes_its_tensors_from_the_file_read_first(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    first = make_checkpoint(tmp_path / "first")
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    other = make_checkpoint(tmp_path / "other", model={"w": np.ones((8, 8), np.float32)})  # shares the rest
    alone = [read_state(r, files=True) for r in (first, copy, other)]
    opened = _counting_files(monkeypatch)
    hashed: list[str] = []
    real_fd_digest = digests.fd_digest

    def counting_fd_digest(fd: int, **kw: Any) -> str:
        hashed.append(os.readlink(f"/proc/self/fd/{fd}"))
        return real_fd_digest(fd, **kw)

    monkeypatch.setattr(digests, "fd_digest", counting_fd_digest)
    with StateCache().active():
        together = read_states([first, copy, other], files=True)
    assert [_json_of(s) for s in together] == [_json_of(s) for s in alone]
    assert [s.path for s in together] == [first, copy, other]
    # The first checkpoint's files are opened; the copy's are not, nor the other's optimizer and rng (copies too)...
    assert sorted(p.relative_to(tmp_path).as_posix() for p in opened) == [
        "first/model.safetensors", "first/optimizer.safetensors", "first/rng.safetensors",
        "other/model.safetensors"]
    # ... but every file's own bytes are hashed for its file digest.
    assert sorted(Path(h).relative_to(tmp_path).as_posix() for h in hashed) == sorted(
        f"{r.name}/{f}" for r in (first, copy, other) for f in ("model.safetensors", "optimizer.safetensors",
                                                               "rng.safetensors"))
    # Outside a cache nothing is shared.
    opened.clear()
    read_states([first, copy], files=True)
    assert len(opened) == 6


def test_a_tampered_copy_is_read_from_its_own_bytes(tmp_path: Path) -> None:
    first = make_checkpoint(tmp_path / "first")
    copy = tmp_path / "copy"
    shutil.copytree(first, copy)
    size = (copy / "model.safetensors").stat().st_size
    flip_bit(copy / "model.safetensors", size - 1)  # the last byte of the last tensor
    alone = read_state(copy, files=True)
    with StateCache().active():
        a, b = read_states([first, copy], files=True)
        assert _json_of(b) == _json_of(alone) != _json_of(a)
        assert b.files is not None and b.manifest is not None
        assert b.files["model.safetensors"] != b.manifest.files["model.safetensors"]
        assert b.digest != b.manifest.checkpoint
        with pytest.raises(DigestMismatch):
            verify_checkpoint(copy)


def test_a_copy_whose_first_reading_failed_is_read_itself(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    bad = make_checkpoint(tmp_path / "bad")
    copy = tmp_path / "copy"
    shutil.copytree(bad, copy)
    write_file(bad / "model-x.safetensors", b"{}", b"")  # an unexpected file: the directory fails to open
    expected = read_state(copy, files=True)
    opened = _counting_files(monkeypatch)
    with StateCache().active():
        prefetch_states([bad, copy], files=True)  # bad's files come first, and bad fails
        assert _json_of(read_state(copy, files=True)) == _json_of(expected)
        with pytest.raises(UnsafeFile, match="model-x.safetensors"):
            read_state(bad, files=True)
    assert [p.parent.name for p in opened].count("copy") == 3  # read from its own bytes, once


def test_prefetch_skips_what_fails_and_the_reader_meets_it(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    good = make_checkpoint(tmp_path / "good")
    bad = make_checkpoint(tmp_path / "bad")
    flip_bit(bad / "model.safetensors", 8)  # the header no longer parses
    prefetch_states([good, bad], files=True)  # no active cache: nothing happens
    opened: list[Path] = []
    real_open = state_module._open

    def counting_open(p: Path, m: bool, *copies: Any) -> Any:
        opened.append(p)
        return real_open(p, m, *copies)

    monkeypatch.setattr(state_module, "_open", counting_open)
    with StateCache().active():
        prefetch_states([bad, good], files=True)
        assert verify_checkpoint(good).digest == read_state(good).digest
        with pytest.raises(UnsafeFile) as info:
            verify_checkpoint(bad)
    assert opened.count(good) == 1 and opened.count(bad) == 2
    with pytest.raises(UnsafeFile) as without:
        verify_checkpoint(bad)
    assert str(info.value) == str(without.value)
