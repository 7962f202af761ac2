"""Checkpoints for the state tests (ledger.state and verify.state), built with numpy + safetensors.numpy and
hand-written safetensors bytes (for dtypes numpy lacks and for damaged files), never with the torch writer, so the
reader and the comparison are tested against the format alone."""

from __future__ import annotations

import json
import pickle
import struct
import zipfile
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from ledger import digests
from ledger.state import write_manifest

RNG_SEED = 1234


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
    # protocols 0 and 1 have no header (their first byte is an opcode, their last STOP)
    old = {f"pickle{n}": pickle.dumps({"weight": Marker(marker)}, protocol=n) for n in (0, 1)}
    return {"pickle": plain, "zip": zpath.read_bytes(), **old}

