"""Audit at the speed of hashing (issue 11): the audit, `ledger digest`, start-up, scanning receipts and a
checkpoint at the reference model's scale, each against the plainest tool doing the same reading and hashing.

    python benchmarks/audit_bench.py --experiment EXP          # about 3 to 4 minutes on 2 cores
    python benchmarks/audit_bench.py --experiment EXP --quick  # about 1 minute: 10,000 receipts, no 3.4 GB part

EXP is an experiment directory made by ``ledger run experiment --workdir EXP`` (``--config examples/tiny.toml``
for a small one); without it the audit parts are skipped. Everything else lives in a temporary directory
(``--dir``; 7 GB with the scale part), deleted at the end. Every figure is wall time with the page cache warm
(every file is read once first), each contender run in turn round after round so that load from other processes
hits them alike; ratios use the best round of each. Each line prints its target and PASS or FAIL:

* audit: ``ledger audit --no-record`` (every recorded copy of every artifact re-hashed) against one ``b3sum`` pass
  over every file of EXP, what bounds it (the checkpoint states with their file digests, the report pages rendered
  in-process), and the counts behind it: each checkpoint state read once, each selection document digested once,
  each stored receipt re-hashed once;
* digest: ``ledger digest`` of a 1 GiB file of 256 float32 tensors of 4 MiB (written with safetensors) against
  ``b3sum``, less the start-up ``ledger --help`` also pays; the start-up of ``ledger --help``, ``show`` and
  ``verify`` of one receipt;
* scan: ``Store.iter_rows`` + ``receipt_id`` + ``Receipt.from_bytes`` of 100,000 receipts against raw sqlite3
  reading and BLAKE3; the audit of EXP's ledger with those 100,000 receipts added (as notes of EXP, which the audit
  verifies) against the audit without them; and with 100,000 receipts of another experiment in the ledger;
* scale: a safetensors file shaped like SmolLM2-1.7B (218 BF16 tensors, 1,711,376,384 parameters, 3.4 GB): its
  state digest against ``b3sum``, comparing two copies (state and file digests of both) against ``b3sum`` over both,
  and the peak anonymous memory of each (RSS beyond the file pages they map); then ``ledger verify`` of a receipt
  citing that state at one checkpoint directory, and at two, against ``b3sum`` over the same files (what the audit
  costs per checkpoint at the reference's scale);
* encoder: the fast canonical encoder and parser give the reference's bytes on every document of EXP.
"""

from __future__ import annotations

import argparse
import json
import mmap
import os
import platform
import shutil
import sqlite3
import statistics
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Mapping
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import blake3
import numpy as np

from ledger import digests
from ledger.artifacts import ArtifactStore
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store

TARGET_AUDIT = 1.5  # x one b3sum pass over the experiment's files
TARGET_DIGEST = 1.25  # x b3sum, start-up excluded
TARGET_STARTUP_S = 0.15
TARGET_SCAN = 0.2  # x raw sqlite3 + BLAKE3 (rates)
TARGET_SCALE_DIGEST = 1.1
TARGET_SCALE_COMPARE = 2.2  # x one b3sum pass over both copies
SCALE_FREE_BYTES = 10 * 10**9
# SmolLM2-1.7B: 24 layers, hidden 2048, intermediate 8192, vocabulary 49152, tied embeddings.
SMOL = {"layers": 24, "hidden": 2048, "intermediate": 8192, "vocab": 49152}
SMOL_TENSORS = 218
SMOL_PARAMETERS = 1_711_376_384
SECTIONS = ("audit", "digest", "scan", "scale", "encoder")


# ------------------------------------------------------------------------------------------------ results


@dataclass
class Line:
    section: str
    name: str
    value: str
    target: str = ""
    passed: bool | None = None  # None: a figure without a target

    def render(self) -> str:
        verdict = "" if self.passed is None else ("PASS" if self.passed else "FAIL")
        return f"  {self.name:<58} {self.value:>24}  {self.target:<22} {verdict}".rstrip()


LINES: list[Line] = []
FIGURES: dict[str, Any] = {}


def say(msg: str) -> None:
    print(f"  .. {msg}", file=sys.stderr, flush=True)


def report(section: str, name: str, value: str, target: str = "", passed: bool | None = None) -> None:
    line = Line(section, name, value, target, passed)
    LINES.append(line)
    print(line.render(), flush=True)


def header(title: str) -> None:
    print(f"\n{title}", flush=True)


# ------------------------------------------------------------------------------------------------- timing


def ledger_argv() -> list[str]:
    """The installed ``ledger`` script run by this interpreter (no shell shim in front of it)."""
    script = Path(sys.executable).with_name("ledger")
    return [sys.executable, str(script)] if script.exists() else [sys.executable, "-m", "ledger.cli"]


def command(argv: list[str]) -> Callable[[], None]:
    def go() -> None:
        subprocess.run(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
    return go


def b3sum(paths: list[str]) -> Callable[[], None]:
    return command(["b3sum", "--num-threads", str(os.cpu_count() or 1), "--no-names", *paths])


def rounds(contenders: dict[str, Callable[[], object]], n: int) -> dict[str, list[float]]:
    """Every contender once per round, in turn (one untimed run each first); seconds per run."""
    for fn in contenders.values():
        fn()
    times: dict[str, list[float]] = {name: [] for name in contenders}
    for _ in range(n):
        for name, fn in contenders.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return times


def process_seconds(run: Callable[[], object], n: int = 3) -> float:
    """The least CPU time of this process (every thread; not the workers it starts) that ``run`` takes in n runs."""
    out = []
    for _ in range(n):
        start = time.process_time()
        run()
        out.append(time.process_time() - start)
    return min(out)


def best(ts: list[float]) -> float:
    return min(ts)


def ms(t: float) -> str:
    return f"{t * 1000:.1f} ms"


def spread(ts: list[float]) -> str:
    return f"{min(ts) * 1000:.1f} ms (median {statistics.median(ts) * 1000:.0f})"


def warm(paths: list[str]) -> None:
    for p in paths:
        with open(p, "rb") as f:
            while f.read(16 << 20):
                pass


def files_under(root: Path) -> list[str]:
    return sorted(str(Path(d) / f) for d, _, fs in os.walk(root) for f in fs
                  if (Path(d) / f).is_file() and not (Path(d) / f).is_symlink())


# ------------------------------------------------------------------------------------------------- audit


def audit_section(exp: Path, n: int) -> None:
    header(f"audit: {exp}")
    db = exp / "ledger.db"
    paths = files_under(exp)
    nbytes = sum(os.path.getsize(p) for p in paths)
    warm(paths)
    say(f"audit of {exp} vs b3sum over its {len(paths)} files")
    from verify.audit import audit

    store = Store.open(db)
    arts = ArtifactStore(exp / "artifacts")
    times = rounds({
        "b3sum": b3sum(paths),
        "cli": command([*ledger_argv(), "audit", "--no-record", "--db", str(db)]),
        "help": command([*ledger_argv(), "--help"]),
        "inproc": lambda: audit(store, arts, record=False),
    }, n)
    b, cli, hlp, inproc = (best(times[k]) for k in ("b3sum", "cli", "help", "inproc"))
    FIGURES["audit"] = {"files": len(paths), "bytes": nbytes, **{k: times[k] for k in times}}
    report("audit", f"b3sum over every file ({len(paths)} files, {nbytes / 1e6:.0f} MB)", spread(times["b3sum"]))
    report("audit", "ledger audit --no-record (CLI)", spread(times["cli"]))
    report("audit", "ledger --help (the start-up every command pays)", spread(times["help"]))
    report("audit", "audit in-process (verify.audit.audit, record=False)", spread(times["inproc"]))
    report("audit", "CLI audit / b3sum", f"{cli / b:.2f}x")
    report("audit", "(CLI audit - start-up) / b3sum", f"{(cli - hlp) / b:.2f}x", f"<= {TARGET_AUDIT}x",
           (cli - hlp) / b <= TARGET_AUDIT)
    report("audit", "in-process audit / b3sum", f"{inproc / b:.2f}x")
    floor_parts(store, arts, paths, n)
    counts = audit_counts(store, arts)
    for what, (total, distinct) in counts.items():
        report("audit", f"{what}: done / distinct", f"{total} / {distinct}", "each once", total == distinct)
    store.close()


def floor_parts(store: Store, arts: ArtifactStore, paths: list[str], n: int) -> None:
    """What bounds the audit from below, beside b3sum: every checkpoint state read with its file digests (each file
    hashed whole, each distinct file's tensors hashed again, and a Python object per tensor), and rendering the
    report pages, each in the format its receipt records (format 2 in-process, in pure Python; a format-1 page,
    drawn by matplotlib, on a worker process while the audit verifies the rest, verify/report_page.py)."""
    from verify.figures import report_figures
    from verify.report_html import render_report

    dirs = sorted({str(Path(p).parent) for p in paths if Path(p).name == "manifest.json"})
    pages = []
    for stored in store.find(kind="report"):
        r = stored.receipt
        audit_receipt = next(a for a in (store.get(p).receipt for p in r.parents) if a.kind == "audit")
        data = arts.get_bytes(audit_receipt.artifacts["report"])
        if data is not None:
            report_doc = digests.parse_canonical(data)
            pages.append((report_doc, report_figures(store, arts, audit_receipt, report_doc,
                                                     r.measurements["log_head"]), str(r.measurements["format"])))
    contenders: dict[str, Callable[[], object]] = {
        "b3sum": b3sum(paths), "hashing": lambda: hash_floor(paths),
        "states": lambda: states_once(dirs)}
    if pages:
        contenders["render"] = lambda: [render_report(*page) for page in pages]
    times = rounds(contenders, n)
    FIGURES["audit"]["floor"] = times
    hashing = best(times["hashing"]) / best(times["b3sum"])
    report("audit", "  hashing floor: each file, then each distinct file's tensor bytes", spread(times["hashing"]))
    report("audit", "  hashing floor / b3sum (nothing parsed)", f"{hashing:.2f}x",
           f"> {TARGET_AUDIT}x: above the target" if hashing > TARGET_AUDIT else "")
    report("audit", f"  checkpoint states + file digests ({len(dirs)} directories, as an audit reads them)",
           spread(times["states"]))
    ratio = best(times["states"]) / best(times["b3sum"])
    report("audit", "  states / b3sum (the audit's hashing alone)", f"{ratio:.2f}x")
    if pages:
        formats = ", ".join(sorted({f.rsplit("/", 1)[-1] for _, _, f in pages}))
        report("audit", f"  report pages rendered in-process ({len(pages)}, format {formats})", spread(times["render"]))


def states_once(dirs: list[str]) -> None:
    """Every checkpoint state with its file digests, read as a verification reads them: inside a StateCache, where a
    copy of a file read before is hashed whole only (ledger/state.py)."""
    from ledger.state import StateCache, read_states

    with StateCache().active():
        read_states(dirs, files=True)


def hash_floor(paths: list[str]) -> None:
    """What the audit cannot hash less than: every file once (its file digest, what `b3sum` prints), and the tensor
    bytes of each distinct safetensors file a second time (tensor digests hash the same bytes into other BLAKE3
    trees; a copy's tensors are those of the file it equals), both through the audit's own hashing on every core
    (``ledger.state.hash_files``, ``hash_buffers``), no header parsed and no digest compared: a lower bound of the
    audit's hashing (the audit hashes each tensor on its own, most of them small)."""
    from ledger.state import hash_buffers, hash_files

    found = hash_files([Path(p) for p in paths], [os.path.getsize(p) for p in paths])
    seen: set[str] = set()
    with ExitStack() as stack:
        views: list[memoryview] = []
        for path, whole in zip(paths, found, strict=True):
            if whole is None or not path.endswith(".safetensors") or whole in seen or os.path.getsize(path) < 8:
                continue
            seen.add(whole)
            fd = digests.open_regular(path)
            stack.callback(os.close, fd)
            m = stack.enter_context(mmap.mmap(fd, 0, access=mmap.ACCESS_READ))
            start = min(8 + int.from_bytes(m[:8], "little"), len(m))
            view = stack.enter_context(memoryview(m))
            views.append(stack.enter_context(view[start:]))
        hash_buffers(views)


def audit_counts(store: Store, arts: ArtifactStore) -> dict[str, tuple[int, int]]:
    """One audit, counting checkpoint states opened, selection documents digested and stored rows re-hashed."""
    import ledger.state as state
    import verify.receipts as vr
    from verify.audit import audit

    opened: Counter[Path] = Counter()
    documents: Counter[bytes] = Counter()
    rows: Counter[str] = Counter()
    original = (state._open, digests.document_digest, vr.check_row)

    def counting_open(path: Path, require_manifest: bool, prehashed: Mapping[str, str] | None = None,
                      known: set[str] | frozenset[str] = frozenset()) -> Any:
        opened[Path(path)] += 1
        return original[0](path, require_manifest, prehashed, known)

    def counting_document(body: Any) -> str:
        documents[digests.canonical_bytes(dict(body))] += 1
        return original[1](body)

    def counting_row(row: Any, edges: Any, arts: Any) -> Any:
        rows[row.id] += 1
        return original[2](row, edges, arts)

    state._open, digests.document_digest, vr.check_row = counting_open, counting_document, counting_row
    try:
        audit(store, arts, record=False)
    finally:
        state._open, digests.document_digest, vr.check_row = original
    return {"checkpoint states read": (sum(opened.values()), len(opened)),
            "selection documents digested": (sum(documents.values()), len(documents)),
            "stored receipts re-hashed and parsed": (sum(rows.values()), len(rows))}


# ------------------------------------------------------------------------------------- digest and start-up


def write_1gib(path: Path) -> None:
    """256 float32 tensors of 4 MiB, written by safetensors."""
    from safetensors.numpy import save_file

    rng = np.random.default_rng(11)
    block = rng.standard_normal(1 << 20, dtype=np.float32)
    save_file({f"layer.{i:03d}.weight": np.roll(block, i) for i in range(256)}, str(path))


def small_ledger(tmp: Path) -> tuple[Path, str]:
    """A ledger with a prepare receipt (four small artifacts) and a note citing it: what show and verify start on."""
    root = tmp / "small"
    root.mkdir()
    arts = ArtifactStore(root / "artifacts")
    artifacts = {name: arts.put_bytes(f"{name} bytes for the start-up figures\n".encode() * 64)
                 for name in ("config", "data", "seed_model", "tokenizer")}
    prepare = make_receipt("prepare", run="startup", prepared=digests.prepared_digest(artifacts), artifacts=artifacts)
    note = make_receipt("note", run="startup", prepared=prepare.prepared, parents=[prepare],
                        measurements={"message": "start-up"})
    with Store.open(root / "ledger.db", create=True) as store:
        store.append_many([prepare, note])
    return root / "ledger.db", note.id


def digest_section(tmp: Path, n: int) -> None:
    header("digest and start-up")
    say("writing a 1 GiB safetensors file (256 float32 tensors of 4 MiB)")
    path = tmp / "model.safetensors"
    write_1gib(path)
    warm([str(path)])
    from ledger.state import read_state

    db, note = small_ledger(tmp)
    led = ledger_argv()
    times = rounds({
        "b3sum": b3sum([str(path)]),
        "digest": command([*led, "digest", "--json", str(path)]),
        "digest-table": command([*led, "digest", str(path)]),
        "help": command([*led, "--help"]),
        "inproc": lambda: read_state(path),
        "python": command([sys.executable, "-c", "pass"]),
        "show": command([*led, "show", "--db", str(db), note]),
        "verify": command([*led, "verify", "--db", str(db), note]),
    }, n)
    FIGURES["digest"] = times
    size = path.stat().st_size
    b, dig, table, hlp, inproc = (best(times[k]) for k in ("b3sum", "digest", "digest-table", "help", "inproc"))
    report("digest", f"b3sum ({size / 2**30:.2f} GiB, 256 tensors)", spread(times["b3sum"]))
    report("digest", "ledger digest --json (CLI)", spread(times["digest"]))
    report("digest", "ledger digest, tables (CLI)", spread(times["digest-table"]))
    report("digest", "state digest in-process (ledger.state.read_state)", spread(times["inproc"]))
    report("digest", "(ledger digest --json - start-up) / b3sum", f"{(dig - hlp) / b:.2f}x", f"<= {TARGET_DIGEST}x",
           (dig - hlp) / b <= TARGET_DIGEST)
    report("digest", "(ledger digest, tables - start-up) / b3sum", f"{(table - hlp) / b:.2f}x")
    report("digest", "in-process state digest / b3sum", f"{inproc / b:.2f}x")
    report("start-up", "python -c pass (the interpreter alone)", spread(times["python"]))
    for key, name in (("help", "ledger --help"), ("show", "ledger show <id>"), ("verify", "ledger verify <id>")):
        report("start-up", name, spread(times[key]), f"<= {TARGET_STARTUP_S} s", best(times[key]) <= TARGET_STARTUP_S)
    path.unlink()


# ------------------------------------------------------------------------------------------------- scan


def copy_ledger(src: Path, dst: Path) -> None:
    """A copy of the SQLite ledger ``src`` at ``dst``, by SQLite's online backup."""
    source, target = sqlite3.connect(src), sqlite3.connect(dst)
    source.backup(target)
    source.close()
    target.close()


def other_experiment(n: int) -> list[Receipt]:
    """Another experiment's prepare receipt (its artifacts' bytes absent: it is never audited) and ``n`` notes."""
    artifacts = {name: digests.raw_digest(b"other " + name.encode()) for name in ("config", "data", "seed_model")}
    root = make_receipt("prepare", run="audit-bench-other", prepared=digests.prepared_digest(artifacts),
                        artifacts=artifacts)
    return [root, *extra_notes(root, n)]


def extra_notes(root: Receipt, n: int) -> list[Receipt]:
    """``n`` note receipts of ledger_bench's shape (about 500 canonical bytes; each cites the previous one, every 4th
    also ``root``), under ``root``'s prepared digest, citing no artifact (an audit verifies every receipt of its
    experiment, and these have no bytes to re-hash)."""
    out: list[Receipt] = []
    prev = root
    for step in range(n):
        r = make_receipt("note", run="audit-bench-extra", rank=0, step=step, prepared=root.prepared,
                         parents=[prev, root] if step % 4 == 3 else [prev],
                         measurements={"loss": round(2.5 / (1 + step / 1000), 6), "tokens": 4096 * (step + 1),
                                       "seconds": 0.125 + step % 7 / 64, "phase": "train",
                                       "model": digests.raw_digest(b"model %d" % step)})
        r.id  # noqa: B018 - encoded and hashed before anything is timed
        out.append(r)
        prev = r
    return out


def scan_section(tmp: Path, count: int, exp: Path | None, n: int) -> None:
    header(f"scan: {count:,} receipts")
    say(f"appending {count:,} receipts")
    db = tmp / "scan.db"
    root: Receipt
    if exp is not None:  # the extra receipts join the experiment's ledger (a copy): notes under its prepare receipt
        copy_ledger(exp / "ledger.db", db)
        store = Store.open(db)
        root = store.find(kind="prepare")[-1].receipt
        base = store.count()
    else:
        store = Store.open(db, create=True)
        artifacts = {name: digests.raw_digest(name.encode()) for name in ("config", "data", "seed_model")}
        root = make_receipt("prepare", run="audit-bench", prepared=digests.prepared_digest(artifacts),
                            artifacts=artifacts)
        store.append(root)
        base = store.count()
    work = extra_notes(root, count)
    for start in range(0, len(work), 1000):
        store.append_many(work[start : start + 1000])
    raw = tmp / "scan-raw.db"
    con = sqlite3.connect(raw, isolation_level=None)
    con.execute("CREATE TABLE r (id TEXT PRIMARY KEY, body BLOB)")
    con.execute("BEGIN")
    con.executemany("INSERT INTO r VALUES (?, ?)", [(r.id, r.body) for r in work])
    con.execute("COMMIT")
    ids = {r.id for r in work}

    def scan_ours() -> None:
        seen = 0
        for row in store.iter_rows():
            if digests.receipt_id(row.body) != row.id:
                raise AssertionError(f"{row.id} does not recompute")
            Receipt.from_bytes(row.body)
            seen += row.id in ids
        assert seen == count, seen

    def scan_raw() -> None:
        seen = 0
        for _rid, body in con.execute("SELECT id, body FROM r"):
            blake3.blake3(body).digest()
            seen += 1
        assert seen == count, seen

    times = rounds({"ours": scan_ours, "raw": scan_raw}, n)
    # Ours reads the experiment's receipts too: rate over every row it read, raw over the same count of its own.
    rows_read = base + count
    ours_rate, raw_rate = rows_read / best(times["ours"]), count / best(times["raw"])
    FIGURES["scan"] = {"count": count, "rows_read": rows_read, **times}
    report("scan", f"Store.iter_rows + receipt_id + from_bytes ({rows_read:,} rows)",
           f"{ours_rate:,.0f} receipts/s")
    report("scan", f"raw sqlite3 SELECT + BLAKE3 ({count:,} rows)", f"{raw_rate:,.0f} receipts/s")
    report("scan", "ours / raw (rates)", f"{ours_rate / raw_rate:.3f}x", f">= {TARGET_SCAN}x",
           ours_rate / raw_rate >= TARGET_SCAN)
    report("scan", "ours per receipt", f"{best(times['ours']) / rows_read * 1e6:.1f} us")
    con.close()
    if exp is not None:
        from verify.audit import audit

        # As a user runs it: `ledger audit` in a fresh process (a format-1 page would render on a worker there).
        say(f"ledger audit with and without the {count:,} extra receipts")
        plain = Store.open(exp / "ledger.db")
        arts = ArtifactStore(exp / "artifacts")

        def cli_audit(db: Path, *more: str) -> Callable[[], None]:
            return command([*ledger_argv(), "audit", "--no-record", "--db", str(db), "--artifacts",
                            str(exp / "artifacts"), *more])

        at = rounds({"audit": cli_audit(exp / "ledger.db"), "audit+extra": cli_audit(db)}, n)
        extra = best(at["audit+extra"]) - best(at["audit"])
        scan = best(times["ours"]) * count / rows_read  # reading and re-hashing the extra receipts alone
        FIGURES["scan"]["audit"] = at
        report("scan", "ledger audit --no-record, the experiment's ledger", spread(at["audit"]))
        report("scan", f"ledger audit --no-record, with {count:,} extra receipts", spread(at["audit+extra"]))
        report("scan", f"extra cost: {extra * 1e9 / count:+.0f} ns per extra receipt", ms(extra),
               f"<= {ms(scan)} (reading them)", extra <= scan)
        # The work each extra receipt costs on this process's threads (in-process audits): with a format-2 page, the
        # same as the wall time above; with format 1 the wall time overlapped the page's rendering on its worker.
        cpu = process_seconds(lambda: audit(store, arts, record=False)) - process_seconds(
            lambda: audit(plain, arts, record=False))
        report("scan", "  verification work per extra receipt (process CPU time, not wall)",
               f"{cpu * 1e6 / count:.1f} us")
        # The same number of receipts of another experiment appended to the ledger after EXP's: what a shared
        # ledger holds. The audit of EXP must not pay for them more than reading and re-hashing them (raw).
        say(f"audit with {count:,} receipts of another experiment in the ledger")
        copy_ledger(exp / "ledger.db", tmp / "shared.db")
        shared = Store.open(tmp / "shared.db")
        theirs = other_experiment(count)
        for start in range(0, len(theirs), 1000):
            shared.append_many(theirs[start : start + 1000])
        mine = root.prepared
        assert mine is not None  # a prepare receipt's own digest
        at2 = rounds({"audit": cli_audit(exp / "ledger.db", "--prepared", mine),
                      "audit+other": cli_audit(tmp / "shared.db", "--prepared", mine)}, n)
        other = best(at2["audit+other"]) - best(at2["audit"])
        reading = best(times["raw"])  # raw sqlite3 + BLAKE3 over the same count of rows
        FIGURES["scan"]["audit_shared"] = at2
        report("scan", f"ledger audit --no-record, with {count:,} receipts of another experiment",
               spread(at2["audit+other"]))
        report("scan", f"extra cost: {other * 1e9 / count:+.0f} ns per other receipt", ms(other),
               f"<= {ms(reading)} (raw read + hash)", other <= reading)
        shared.close()
        plain.close()
    store.close()


# ------------------------------------------------------------------------------------------------- scale


def smol_tensors() -> list[tuple[str, list[int]]]:
    h, i, layers, v = SMOL["hidden"], SMOL["intermediate"], SMOL["layers"], SMOL["vocab"]
    out: list[tuple[str, list[int]]] = [("model.embed_tokens.weight", [v, h])]
    for k in range(layers):
        p = f"model.layers.{k}."
        out += [(p + "input_layernorm.weight", [h]), (p + "post_attention_layernorm.weight", [h])]
        out += [(p + f"self_attn.{x}_proj.weight", [h, h]) for x in "qkvo"]
        out += [(p + "mlp.gate_proj.weight", [i, h]), (p + "mlp.up_proj.weight", [i, h]),
                (p + "mlp.down_proj.weight", [h, i])]
    return out + [("model.norm.weight", [h])]


def write_bf16(path: Path, tensors: list[tuple[str, list[int]]]) -> int:
    """A safetensors file of BF16 tensors, streamed from one random block (bounded memory); returns its size."""
    header_doc: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    at = 0
    for name, shape in tensors:
        nbytes = int(np.prod(shape, dtype=np.int64)) * 2
        header_doc[name] = {"dtype": "BF16", "shape": shape, "data_offsets": [at, at + nbytes]}
        at += nbytes
    raw = json.dumps(header_doc, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)
    block = np.random.default_rng(17).integers(0, 1 << 16, size=8 << 20, dtype=np.uint16).tobytes()  # 16 MiB
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(raw)) + raw)
        left = at
        while left:
            step = min(left, len(block))
            f.write(block[:step])
            left -= step
    return 8 + len(raw) + at


PEAK_CHILD = """
import sys, time
from pathlib import Path
what, a, b = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
if what == "digest":
    from ledger.state import read_state
    read_state(a)
else:
    from verify.state import compare_states
    assert compare_states(a, b, files=True).equal
"""


def peak_anon(argv: list[str]) -> tuple[float, int]:
    """Run ``argv`` and sample its anonymous resident memory (RSS less mapped file pages) every 2 ms: the
    peak in bytes, and the wall time."""
    start = time.perf_counter()
    child = subprocess.Popen(argv, stdout=subprocess.DEVNULL)
    peak = 0

    def sample() -> None:
        nonlocal peak
        status = Path(f"/proc/{child.pid}/status")
        while child.poll() is None:
            try:
                for line in status.read_text().splitlines():
                    if line.startswith("RssAnon:"):
                        peak = max(peak, int(line.split()[1]) * 1024)
            except OSError:
                return
            time.sleep(0.002)

    t = threading.Thread(target=sample)
    t.start()
    child.wait()
    t.join()
    if child.returncode:
        raise RuntimeError(f"{argv} exited {child.returncode}")
    return time.perf_counter() - start, peak


def scale_section(tmp: Path, n: int) -> None:
    header("scale: a checkpoint shaped like SmolLM2-1.7B (BF16)")
    free = shutil.disk_usage(tmp).free
    if free < SCALE_FREE_BYTES:
        print(f"  SKIPPED: {free / 1e9:.1f} GB free in {tmp}, the two copies need 7 GB and this part asks for "
              f"{SCALE_FREE_BYTES / 1e9:.0f} GB (use --dir elsewhere)")
        return
    tensors = smol_tensors()
    params = sum(int(np.prod(s, dtype=np.int64)) for _, s in tensors)
    report("scale", "tensors / parameters", f"{len(tensors)} / {params:,}", f"{SMOL_TENSORS} / {SMOL_PARAMETERS:,}",
           len(tensors) == SMOL_TENSORS and params == SMOL_PARAMETERS)
    a, b = tmp / "a" / "model.safetensors", tmp / "b" / "model.safetensors"
    a.parent.mkdir()
    b.parent.mkdir()
    say("writing 3.4 GB and a copy")
    size = write_bf16(a, tensors)
    shutil.copyfile(a, b)
    warm([str(a), str(b)])
    from ledger.state import read_state
    from verify.state import compare_states

    times = rounds({
        "b3sum": b3sum([str(a)]),
        "digest": lambda: read_state(a),
        "b3sum-both": b3sum([str(a), str(b)]),
        "compare": lambda: compare_states(a, b, files=True),
    }, n)
    FIGURES["scale"] = {"bytes": size, **times}
    d, c, b1, b2 = (best(times[k]) for k in ("digest", "compare", "b3sum", "b3sum-both"))
    report("scale", f"b3sum ({size / 1e9:.2f} GB)", spread(times["b3sum"]))
    report("scale", "state digest in-process (read_state)", spread(times["digest"]))
    report("scale", "state digest / b3sum", f"{d / b1:.2f}x", f"<= {TARGET_SCALE_DIGEST}x",
           d / b1 <= TARGET_SCALE_DIGEST)
    report("scale", "b3sum over both copies", spread(times["b3sum-both"]))
    report("scale", "compare two copies in-process (state + file digests)", spread(times["compare"]))
    report("scale", "compare / b3sum over both", f"{c / b2:.2f}x", f"<= {TARGET_SCALE_COMPARE}x",
           c / b2 <= TARGET_SCALE_COMPARE)
    for what in ("digest", "compare"):
        wall, peak = peak_anon([sys.executable, "-c", PEAK_CHILD, what, str(a), str(b)])
        FIGURES["scale"][f"{what}_peak_anon"] = peak
        report("scale", f"{what}: peak RSS beyond mapped file pages (a child process)", f"{peak / 2**20:.0f} MiB",
               "bounded (< 512 MiB)", peak < 512 << 20)
    verify_at_scale(tmp, [a.parent, b.parent], n)
    a.unlink()
    b.unlink()


def verify_at_scale(tmp: Path, dirs: list[Path], n: int) -> None:
    """What the audit does per checkpoint, at the reference's scale: ``ledger verify`` of a receipt whose state is
    recorded at one checkpoint directory, and of one recording it at both ``dirs`` (given their manifests here),
    re-hashes every copy against its manifest (tensor and file digests) and the receipt; against ``b3sum`` over
    the same files, less the start-up ``ledger --help`` also pays. The per-tensor Python of the default
    experiment's audit is negligible there; what is left is the hashing: a copy read alone is hashed twice (its
    tensors' digests and its file's, in one pass over its bytes), a further copy of the same file once (its file
    digest, equal to the first's, vouches for its tensors)."""
    from ledger.state import write_manifest

    say(f"writing the manifests of {len(dirs)} copies, a ledger citing one and both")
    state = [write_manifest(d, {"bench": "audit at scale"}).checkpoint for d in dirs]
    assert len(set(state)) == 1, state
    led = ledger_argv()
    contenders: dict[str, Callable[[], object]] = {"help": command([*led, "--help"])}
    files: dict[int, list[str]] = {}
    for k in (1, len(dirs)):  # a ledger each: the verifier re-hashes every copy recorded for the digest
        root = tmp / f"scale-ledger-{k}"
        root.mkdir()
        arts = ArtifactStore(root / "artifacts")
        inputs = {name: arts.put_bytes(f"{name} of the scale ledger\n".encode()) for name in ("config", "data")}
        prepare = make_receipt("prepare", run="scale", prepared=digests.prepared_digest(inputs), artifacts=inputs)
        cited = make_receipt("note", run="scale", prepared=prepare.prepared, parents=[prepare],
                             artifacts={"state": state[0]}, measurements={"copies": k})
        with Store.open(root / "ledger.db", create=True) as store:
            store.append_many([prepare, cited])
            for d in dirs[:k]:
                store.add_receipt_locations(cited.id, {"state": str(d)})
        files[k] = [str(f) for d in dirs[:k] for f in sorted(d.iterdir())]
        contenders[f"b3sum-{k}"] = b3sum(files[k])
        contenders[f"verify-{k}"] = command([*led, "verify", "--db", str(root / "ledger.db"), "--require-artifacts",
                                             cited.id])
    warm(files[len(dirs)])
    times = rounds(contenders, n)
    FIGURES["scale"]["verify"] = times
    h = best(times["help"])
    for k in files:
        b, v = best(times[f"b3sum-{k}"]), best(times[f"verify-{k}"])
        where = "one copy" if k == 1 else f"{k} copies"
        report("scale", f"b3sum over {where} ({len(files[k])} files with the manifests)", spread(times[f"b3sum-{k}"]))
        report("scale", f"ledger verify of a receipt citing {where} (CLI)", spread(times[f"verify-{k}"]))
        report("scale", f"  (ledger verify - start-up) / b3sum, {where}", f"{(v - h) / b:.2f}x",
               f"(the default experiment's audit: <= {TARGET_AUDIT}x)")


# ----------------------------------------------------------------------------------------------- encoder


def encoder_section(exp: Path) -> None:
    header("encoder: fast path against the reference, on the experiment's documents")
    values: list[Any] = []
    lines: list[bytes] = []
    with Store.open(exp / "ledger.db") as store:
        bodies = [row.body for row in store.iter_rows()]
    values = [digests.parse_canonical_reference(b) for b in bodies]
    for p in files_under(exp / "artifacts"):
        data = Path(p).read_bytes()
        try:
            parts = [data] if not data.endswith(b"\n") else data.split(b"\n")[:-1]
            parsed = [digests.parse_canonical_reference(x) for x in parts]
        except Exception:  # noqa: BLE001 - not canonical JSON (a tokenizer, a data file)
            continue
        lines += parts
        values += parsed
    same = all(digests.canonical_bytes(v) == digests.canonical_bytes_reference(v) for v in values)
    same_parse = all(digests.parse_canonical(x) == digests.parse_canonical_reference(x) for x in lines + bodies)
    t = rounds({"ref": lambda: [digests.canonical_bytes_reference(v) for v in values],
                "fast": lambda: [digests.canonical_bytes(v) for v in values],
                "ref-parse": lambda: [digests.parse_canonical_reference(x) for x in lines + bodies],
                "fast-parse": lambda: [digests.parse_canonical(x) for x in lines + bodies]}, 3)
    report("encoder", f"canonical_bytes == reference on {len(values):,} values", "same bytes" if same else "DIFFER",
           "byte for byte", same)
    report("encoder", f"parse_canonical == reference on {len(lines) + len(bodies):,} documents",
           "same values" if same_parse else "DIFFER", "equal", same_parse)
    report("encoder", "encoding speed-up over the reference", f"{best(t['ref']) / best(t['fast']):.1f}x")
    report("encoder", "parsing speed-up over the reference", f"{best(t['ref-parse']) / best(t['fast-parse']):.1f}x")


# -------------------------------------------------------------------------------------------------- main


def guarded(section: str, run: Callable[[], None]) -> None:
    """Run one part; an error (the experiment does not verify, a command fails) is that part's FAIL, not the end."""
    try:
        run()
    except Exception as exc:  # noqa: BLE001 - reported, and the run goes on
        report(section, f"{section} could not run: {type(exc).__name__}: {str(exc)[:160]}", "error", "runs", False)


def compile_bytecode() -> list[str]:
    """Write the bytecode cache of the project's packages, as installing them does. Every start-up figure depends on
    it: without it (PYTHONDONTWRITEBYTECODE set, as in some environments, and a module changed since its cache was
    written) each command compiles the changed modules from source first, which doubled `ledger verify`'s
    start-up here."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    packages = [name for name in ("ledger", "verify", "runners") if (root / name).is_dir()]
    for name in packages:
        compileall.compile_dir(str(root / name), quiet=1)
    return packages


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--experiment", type=Path, help="an experiment directory (ledger run experiment --workdir)")
    parser.add_argument("--quick", action="store_true", help="10,000 receipts, 3 rounds, no 3.4 GB part")
    parser.add_argument("--rounds", type=int, help="rounds per comparison (default 5, 3 with --quick)")
    parser.add_argument("--receipts", type=int, help="receipts to scan (default 100,000, 10,000 with --quick)")
    parser.add_argument("--scale", action=argparse.BooleanOptionalAction, default=None,
                        help="the 3.4 GB part (default: on, off with --quick)")
    parser.add_argument("--dir", type=Path, help="parent of the temporary directory")
    parser.add_argument("--json", action="store_true", help="also print every timing as one JSON object")
    parser.add_argument("--only", action="append", choices=SECTIONS, help="run only this part (repeatable)")
    args = parser.parse_args(argv)
    n = args.rounds or (3 if args.quick else 5)
    count = args.receipts or (10_000 if args.quick else 100_000)
    scale = args.scale if args.scale is not None else not args.quick
    if shutil.which("b3sum") is None:
        print("b3sum is not installed (apt-get install -y b3sum)", file=sys.stderr)
        return 2
    b3v = subprocess.run(["b3sum", "--version"], capture_output=True, text=True).stdout.strip()
    compiled = compile_bytecode()
    started = time.perf_counter()
    print(f"audit_bench: {time.strftime('%Y-%m-%d %H:%M')}, {platform.platform()}, python "
          f"{platform.python_version()}, {os.cpu_count()} cores, {b3v}, {n} rounds, load average "
          f"{os.getloadavg()[0]:.2f}")
    print(f"bytecode of {', '.join(compiled)} compiled first (as an installation has it)")
    exp = args.experiment
    if exp is not None and not (exp / "ledger.db").is_file():
        print(f"{exp}: no ledger.db; make one with `ledger run experiment --workdir {exp}`", file=sys.stderr)
        return 2
    wanted = set(args.only or SECTIONS)
    with tempfile.TemporaryDirectory(prefix="audit-bench-", dir=args.dir) as tmpdir:
        tmp = Path(tmpdir)
        if "audit" in wanted:
            if exp is not None:
                guarded("audit", lambda: audit_section(exp, n))
            else:
                print("\naudit: SKIPPED (no --experiment)")
        if "digest" in wanted:
            guarded("digest", lambda: digest_section(tmp, n))
        if "scan" in wanted:
            guarded("scan", lambda: scan_section(tmp, count, exp, n))
        if "scale" in wanted:
            if scale:
                guarded("scale", lambda: scale_section(tmp, n))
            else:
                print("\nscale: SKIPPED (--quick or --no-scale)")
        if "encoder" in wanted and exp is not None:
            guarded("encoder", lambda: encoder_section(exp))
    print(f"\nload average at the end {os.getloadavg()[0]:.2f}; {time.perf_counter() - started:.0f} s in all")
    if args.json:
        print(json.dumps(FIGURES, default=str))
    failed = [f"{line.section}: {line.name}" for line in LINES if line.passed is False]
    print("all targets met" if not failed else "targets missed: " + "; ".join(failed))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
