"""Checkpoint state digest and comparison speed vs `b3sum` and `sha256sum` on the same files, page cache warm.

Builds (in a temporary directory, deleted at the end) a checkpoint of >= 1 GiB with several hundred tensors of
mixed dtypes (BF16/F32 model, F32 AdamW moments and I64 steps in two shards, F16 outer momentum, U8 RNG state),
seeded, and a byte-identical copy. Then, interleaving the contenders round by round so that background load
hits them alike, it times:

* our state digest in-process (``ledger.state.read_state``) and through the CLI (``ledger digest --json``),
* ``b3sum`` and ``sha256sum`` over the same files,
* comparing the two equal copies (``verify.state.compare_states``: both state digests and all file digests)
  vs one ``b3sum`` pass over both copies,

and prints best-of-N and median times, ratios, and PASS/FAIL against the targets (state digest <= 1.25x b3sum;
comparison <= 2.5x b3sum over both copies). Install b3sum first: ``apt-get install -y b3sum``.

    python benchmarks/digest_bench.py [--gib 1.1] [--rounds 7] [--dir /tmp] [--keep]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import struct
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

from ledger import digests
from ledger.state import read_state, write_manifest
from verify.state import compare_states

TARGET_DIGEST = 1.25
TARGET_COMPARE = 2.5


# ----------------------------------------------------------------------------------------- the checkpoint


def _write_safetensors(path: Path, tensors: list[tuple[str, str, list[int]]], rng: np.random.Generator) -> int:
    """Stream a safetensors file of seeded random tensors (name, dtype, shape) without holding it in memory."""
    sizes = {"BF16": 2, "F16": 2, "F32": 4, "I64": 8, "U8": 1}
    header: dict[str, object] = {}
    at = 0
    for name, dtype, shape in tensors:
        n = int(np.prod(shape, dtype=np.int64)) * sizes[dtype]
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [at, at + n]}
        at += n
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        for _name, dtype, shape in tensors:
            count = int(np.prod(shape, dtype=np.int64))
            if dtype in ("F32", "F16"):
                arr = rng.standard_normal(count, dtype=np.float32)
                f.write((arr if dtype == "F32" else arr.astype(np.float16)).tobytes())
            elif dtype == "BF16":  # numpy has no bfloat16: keep the high half of float32 bits
                bits = rng.standard_normal(count, dtype=np.float32).view(np.uint32) >> 16
                f.write(bits.astype(np.uint16).tobytes())
            elif dtype == "I64":
                f.write(np.full(count, 1000, dtype=np.int64).tobytes())
            else:
                f.write(rng.integers(0, 256, size=count, dtype=np.uint8).tobytes())
    return 8 + len(raw) + at


def _params(hidden: int, inter: int, layers: int, vocab: int) -> list[tuple[str, list[int]]]:
    out: list[tuple[str, list[int]]] = [("embed_tokens.weight", [vocab, hidden])]
    for i in range(layers):
        p = f"layers.{i}."
        out += [(p + "input_layernorm.weight", [hidden]), (p + "post_attention_layernorm.weight", [hidden])]
        out += [(p + f"self_attn.{x}_proj.weight", [hidden, hidden]) for x in "qkvo"]
        out += [(p + "mlp.gate_proj.weight", [inter, hidden]), (p + "mlp.up_proj.weight", [inter, hidden]),
                (p + "mlp.down_proj.weight", [hidden, inter])]
    return out + [("norm.weight", [hidden])]


def build_checkpoint(root: Path, gib: float, seed: int = 0) -> tuple[int, int]:
    """A >= ``gib`` GiB checkpoint directory; returns (bytes, tensors)."""
    rng = np.random.default_rng(seed)
    hidden, inter, vocab = 768, 2048, 16384
    per_layer = 4 * hidden * hidden + 3 * hidden * inter + 2 * hidden
    # model BF16 (2 B) + two F32 moments (8 B) + F16 outer momentum (2 B) = 12 bytes per parameter
    layers = max(1, int(np.ceil((gib * 2**30 / 12 - vocab * hidden) / per_layer)))
    params = _params(hidden, inter, layers, vocab)
    root.mkdir(parents=True)
    total = 0
    total += _write_safetensors(root / "model.safetensors",
                                [(n, "F32" if len(s) == 1 else "BF16", s) for n, s in params], rng)
    opt = [(f"state.{i}.{k}", dt, s if k != "step" else [])
           for i, (_n, s) in enumerate(params) for k, dt in (("exp_avg", "F32"), ("exp_avg_sq", "F32"),
                                                              ("step", "I64"))]
    half = len(opt) // 2
    total += _write_safetensors(root / "optimizer-00001-of-00002.safetensors", opt[:half], rng)
    total += _write_safetensors(root / "optimizer-00002-of-00002.safetensors", opt[half:], rng)
    total += _write_safetensors(root / "outer.safetensors", [(f"momentum.{n}", "F16", s) for n, s in params], rng)
    total += _write_safetensors(root / "rng.safetensors", [("torch_cpu", "U8", [5056]), ("numpy", "U8", [2512])],
                                rng)
    groups = {"param_groups": [{"lr": 0.0003, "betas": [0.9, 0.95], "weight_decay": 0.1,
                                "params": list(range(len(params)))}]}
    for name, scalars in (("optimizer", groups), ("outer", {"lr": 0.7, "momentum": 0.9, "nesterov": True}),
                          ("rng", {"python": {"version": 3, "gauss_next": None}, "cursor": 4096})):
        (root / f"{name}.json").write_bytes(digests.canonical_bytes(scalars))
    return total, len(params) * 5 + 2


# ------------------------------------------------------------------------------------------------- timing


def _files(root: Path) -> list[str]:
    return sorted(str(p) for p in root.iterdir())


def _run(cmd: list[str]) -> Callable[[], None]:
    def go() -> None:
        subprocess.run(cmd, stdout=subprocess.DEVNULL, check=True)
    return go


def _time(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _warm(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass


def _rounds(contenders: dict[str, Callable[[], object]], rounds: int, slow: set[str]) -> dict[str, list[float]]:
    """Run every contender once per round, in turn, so that background load hits them alike."""
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for fn in contenders.values():  # one untimed warm-up each
        fn()
    for r in range(rounds):
        for name, fn in contenders.items():
            if name in slow and r >= 2:
                continue
            times[name].append(_time(fn))
    return times


def _row(name: str, ts: list[float], nbytes: int) -> str:
    best = min(ts)
    return (f"  {name:<34} best {best * 1000:8.1f} ms   median {statistics.median(ts) * 1000:8.1f} ms   "
            f"{nbytes / best / 1e9:5.2f} GB/s   (n={len(ts)})")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--gib", type=float, default=1.1, help="checkpoint size in GiB (>= 1 for the targets)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--dir", type=Path, default=None, help="parent of the temporary directory")
    ap.add_argument("--keep", action="store_true", help="keep the generated checkpoints")
    args = ap.parse_args(argv)
    b3sum, sha256sum = shutil.which("b3sum"), shutil.which("sha256sum")
    if b3sum is None or sha256sum is None:
        print("b3sum and sha256sum are needed: apt-get install -y b3sum coreutils", file=sys.stderr)
        return 2
    ledger_exe = shutil.which("ledger") or ""
    tmp = Path(tempfile.mkdtemp(prefix="digest-bench-", dir=args.dir))
    try:
        a, b = tmp / "a", tmp / "b"
        t0 = time.perf_counter()
        nbytes, ntensors = build_checkpoint(a, args.gib)
        build_s = time.perf_counter() - t0
        manifest_s = _time(lambda: write_manifest(a, {"bench": "digest_bench"}))
        shutil.copytree(a, b)
        files_a, files_b = _files(a), _files(b)
        _warm(files_a + files_b)
        state = read_state(a)
        assert compare_states(a, b).equal
        print(f"checkpoint: {nbytes / 2**30:.2f} GiB, {ntensors} tensors in {len(files_a)} files "
              f"(components {', '.join(state.components)}); built in {build_s:.1f} s; cpus {os.cpu_count()}")
        print(f"write_manifest (state + file digests, cold-ish cache): {manifest_s * 1000:.0f} ms")

        digest_times = _rounds({
            "b3sum (all files)": _run([b3sum, *files_a]),
            "ledger state digest (in-process)": lambda: read_state(a),
            "ledger digest --json (CLI)": _run([ledger_exe, "digest", "--json", str(a)]) if ledger_exe
            else _run([sys.executable, "-m", "ledger.cli", "digest", "--json", str(a)]),
            "state + file digests (in-process)": lambda: read_state(a, files=True),
            "sha256sum (all files)": _run([sha256sum, *files_a]),
        }, args.rounds, slow={"sha256sum (all files)"})
        compare_times = _rounds({
            "b3sum over both copies": _run([b3sum, *files_a, *files_b]),
            "compare (state + files, in-process)": lambda: compare_states(a, b),
            "compare --ignore-files (in-process)": lambda: compare_states(a, b, files=False),
            "ledger compare --json (CLI)": _run([ledger_exe, "compare", "--json", str(a), str(b)]) if ledger_exe
            else _run([sys.executable, "-m", "ledger.cli", "compare", "--json", str(a), str(b)]),
        }, args.rounds, slow=set())

        print("\none checkpoint:")
        for name, ts in digest_times.items():
            print(_row(name, ts, nbytes))
        print("two equal checkpoints:")
        for name, ts in compare_times.items():
            print(_row(name, ts, 2 * nbytes))

        base = min(digest_times["b3sum (all files)"])
        base2 = min(compare_times["b3sum over both copies"])
        checks = [
            ("state digest / b3sum", min(digest_times["ledger state digest (in-process)"]) / base, TARGET_DIGEST),
            ("compare / b3sum over both", min(compare_times["compare (state + files, in-process)"]) / base2,
             TARGET_COMPARE),
        ]
        infos = [
            ("CLI digest / b3sum", min(digest_times["ledger digest --json (CLI)"]) / base),
            ("state + files / b3sum", min(digest_times["state + file digests (in-process)"]) / base),
            ("sha256sum / b3sum", min(digest_times["sha256sum (all files)"]) / base),
            ("state digest / sha256sum", min(digest_times["ledger state digest (in-process)"])
             / min(digest_times["sha256sum (all files)"])),
            ("compare --ignore-files / b3sum over both", min(compare_times["compare --ignore-files (in-process)"])
             / base2),
            ("CLI compare / b3sum over both", min(compare_times["ledger compare --json (CLI)"]) / base2),
        ]
        print("\nratios (best of rounds):")
        ok = True
        for name, ratio, target in checks:
            passed = ratio <= target
            ok &= passed
            print(f"  {name:<42} {ratio:5.2f}x   target <= {target}x   {'PASS' if passed else 'FAIL'}")
        for name, ratio in infos:
            print(f"  {name:<42} {ratio:5.2f}x")
        return 0 if ok else 1
    finally:
        if args.keep:
            print(f"kept {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
