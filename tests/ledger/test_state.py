"""Checkpoint state digests read straight from safetensors files, manifests, verification and comparison.

Checkpoints here are built with numpy + safetensors.numpy and hand-written safetensors bytes (for dtypes numpy
lacks and for damaged files), never with the torch writer, so the verifier is tested against the format alone.
"""

from __future__ import annotations

import json
import os
import pickle
import shutil
import struct
import subprocess
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors.numpy import save_file

from ledger import digests
from ledger.errors import DigestMismatch, InputError, StateMismatch, UnsafeFile
from ledger.state import (
    MANIFEST,
    PARALLEL_MIN_BYTES,
    SafetensorsFile,
    checkpoint_digest,
    component_digest,
    count_scalars,
    hash_buffers,
    read_manifest,
    read_state,
    recompute,
    scan_checkpoint,
    state_digest,
    tensor_digest,
    verify_checkpoint,
    write_manifest,
)
from verify.state import compare_states, element_bits, element_value, scalar_differences

RNG_SEED = 1234


# ----------------------------------------------------------------------------------------------- helpers


def raw_safetensors(path: Path, tensors: dict[str, tuple[str, list[int], bytes]], *,
                    order: list[str] | None = None, metadata: dict[str, str] | None = None) -> Path:
    """Write a safetensors file by hand: {name: (dtype, shape, raw bytes)}, data laid out in ``order``."""
    header: dict[str, Any] = {}
    chunks: list[bytes] = []
    at = 0
    for name in order or list(tensors):
        dtype, shape, data = tensors[name]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + len(data)]}
        chunks.append(data)
        at += len(data)
    if metadata is not None:
        header["__metadata__"] = metadata
    return write_file(path, json.dumps(header).encode(), b"".join(chunks))


def write_file(path: Path, header: bytes, data: bytes, *, length: int | None = None) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(header) if length is None else length) + header + data)
    return path


def model_tensors(seed: int = RNG_SEED) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "embed.weight": rng.standard_normal((8, 4)).astype(np.float32),
        "layers.0.weight": rng.standard_normal((4, 4)).astype(np.float32),
        "layers.0.bias": rng.standard_normal(4).astype(np.float16),
        "layers.1.weight": rng.standard_normal((4, 4)).astype(np.float64),
        "head.weight": rng.standard_normal((4, 8)).astype(np.float32),
    }


def optimizer_tensors(seed: int = RNG_SEED) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed + 1)
    out: dict[str, np.ndarray] = {}
    for i in range(3):
        out[f"state.{i}.exp_avg"] = rng.standard_normal((4, 4)).astype(np.float32)
        out[f"state.{i}.exp_avg_sq"] = np.abs(rng.standard_normal((4, 4))).astype(np.float32)
        out[f"state.{i}.step"] = np.array(7, dtype=np.int64)
    return out


OPT_SCALARS = {"param_groups": [{"lr": 0.001, "betas": [0.9, 0.999], "params": [0, 1, 2]}], "kind": "AdamW"}
RNG_SCALARS = {"python": {"version": 3, "gauss_next": None}, "cursor": 12}


def make_checkpoint(root: Path, *, model: dict[str, np.ndarray] | None = None,
                    optimizer: dict[str, np.ndarray] | None = None, opt_scalars: dict[str, Any] | None = None,
                    shards: int = 1, meta: dict[str, Any] | None = None, manifest: bool = True,
                    metadata: dict[str, str] | None = None) -> Path:
    """A checkpoint directory: model (optionally sharded), optimizer tensors + scalars, rng (bf16 + scalars)."""
    root.mkdir(parents=True, exist_ok=True)
    model = model_tensors() if model is None else model
    names = sorted(model)
    if shards == 1:
        save_file(model, str(root / "model.safetensors"), metadata=metadata)
    else:
        for i in range(shards):
            part = {n: model[n] for n in names[i::shards]}
            save_file(part, str(root / f"model-{i + 1:05d}-of-{shards:05d}.safetensors"), metadata=metadata)
    save_file(optimizer_tensors() if optimizer is None else optimizer, str(root / "optimizer.safetensors"))
    (root / "optimizer.json").write_bytes(digests.canonical_bytes(OPT_SCALARS if opt_scalars is None
                                                                  else opt_scalars))
    raw_safetensors(root / "rng.safetensors", {"torch_cpu": ("U8", [16], bytes(range(16))),
                                               "noise": ("BF16", [3], bytes([0x80, 0x3F, 0, 0x80, 0xC0, 0x7F]))})
    (root / "rng.json").write_bytes(digests.canonical_bytes(RNG_SCALARS))
    if manifest:
        write_manifest(root, meta or {"run": "r", "rank": 0, "step": 5})
    return root


def flip_bit(path: Path, offset: int, bit: int = 0) -> None:
    data = bytearray(path.read_bytes())
    data[offset] ^= 1 << bit
    path.write_bytes(bytes(data))


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
    return cases


def test_damaged_safetensors_files_are_refused_with_one_line(tmp_path: Path) -> None:
    cases = _bad_files(tmp_path)
    assert len(cases) == 15
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


class Marker:
    """Unpickling this creates the marker file: proof that something was unpickled."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, tuple[str, str]]:
        return (open, (str(self.path), "w"))


def pickle_payloads(tmp: Path, marker: Path) -> dict[str, bytes]:
    plain = pickle.dumps({"weight": Marker(marker)}, protocol=4)
    zpath = tmp / "torch-like.zip"
    with zipfile.ZipFile(zpath, "w") as z:  # torch.save's layout: archive/data.pkl inside a zip
        z.writestr("archive/data.pkl", plain)
        z.writestr("archive/version", "3\n")
    return {"pickle": plain, "zip": zpath.read_bytes()}


def test_pickle_payload_is_real(tmp_path: Path) -> None:
    """The canary works: unpickling the payload (here, deliberately, in the test) does create the marker."""
    marker = tmp_path / "canary"
    pickle.loads(pickle_payloads(tmp_path, marker)["pickle"])  # noqa: S301 - the test's own bytes
    assert marker.exists()


@pytest.mark.parametrize("kind", ["pickle", "zip"])
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
                 lambda: compare_states(root, root), lambda: write_manifest(root, {})):
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


# --------------------------------------------------------------------------------------------- comparison


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
    torch = pytest.importorskip("torch")
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


def test_mmap_views_are_released(tmp_path: Path) -> None:
    """Files are closed after hashing, so a checkpoint can be deleted or replaced right away (and fds don't leak)."""
    root = make_checkpoint(tmp_path / "c")
    before = len(os.listdir("/proc/self/fd")) if os.path.isdir("/proc/self/fd") else 0
    for _ in range(5):
        read_state(root, files=True)
        compare_states(root, root)
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
