"""Serving throughput and overhead on this host: the three serving phases over replica processes on loopback, and
the per-request cost of the HTTP server against a bare in-process forward of the same prompts.

Setup (a temporary experiment, deleted at the end): prepare with the default model size (``--model default``:
d_model 128, 2 layers, max_len 128; or ``--model tiny``), pretraining cut to a few steps (speed does not depend on
the weights), 64 held-out documents. Then, per round:

* ``runners.loadgen.start_replicas`` starts ``--replicas`` replica processes (1 intra-op thread each) and
  ``runners.loadgen.run_serving`` runs the phases single, four and failure at concurrency ``--concurrency`` on the
  64-request set (max_tokens = eval.max_new_tokens); every round is verified with ``verify.serving``;
* overhead: the same prompts one at a time (concurrency 1) against one replica, and the same prompts through
  ``runners.model.greedy_generate`` alone in this process (1 thread), interleaved prompt by prompt so that load
  from other processes hits both alike.

Targets: four/single requests-per-second ratio >= 0.8 x its ceiling here, min(replicas, cores) (the replicas share
the cores with each other and with this client); served latency / bare forward (medians) <= 1.2x. Exit 0 when both
hold.

    python benchmarks/serve_bench.py [--rounds 3] [--replicas 4] [--concurrency 4] [--model default] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx
import torch

from ledger.artifacts import ArtifactStore, read_jsonl, workdir_root
from ledger.experiment.config import config_from_dict
from ledger.store import Store
from runners import loadgen
from runners.model import greedy_generate
from runners.prepare import pinned_threads, prepare
from runners.serve import ReplicaSpec, load_replica
from verify import serving as vs

RATIO_TARGET = 0.8  # of min(replicas, cores)
OVERHEAD_TARGET = 1.2
MODELS: dict[str, dict[str, Any]] = {
    "default": {},  # ModelConfig's defaults
    "tiny": {"d_model": 32, "n_layers": 1, "n_heads": 2, "d_ff": 64, "max_len": 64},
}


def prepare_experiment(root: Path, model: str) -> tuple[ReplicaSpec, list[dict[str, Any]], int]:
    config = config_from_dict({
        "data": {"train_per_variant": 8, "eval_per_variant": 4, "retention_probes": 4},
        "model": MODELS[model],
        "pretrain": {"steps": 3, "batch_size": 2, "seq_len": 32, "task_documents": 8},
    })
    with Store.open(root / "ledger.db", create=True) as store, pinned_threads(1):
        result = prepare(config, root, store)
    arts = ArtifactStore(workdir_root(root))
    a = result.artifacts
    spec = ReplicaSpec(checkpoint=result.seed_checkpoint, state=a["seed_state"], model_digest=a["model"],
                       tokenizer=arts.path_for(a["tokenizer"]), config=arts.path_for(a["config"]), threads=1)
    return spec, read_jsonl(arts, a["eval_selection"]), config.eval.max_new_tokens


class CpuProbe:
    """CPU seconds of the whole machine (/proc/stat), of this client and of the replicas over an interval, so a
    reader sees whether a phase was CPU-bound and how much of the machine other jobs took."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.tick = os.sysconf("SC_CLK_TCK")
        self.t0, self.busy0, self.ours0 = time.perf_counter(), self._busy(), self._ours()

    def _busy(self) -> float:
        fields = [int(x) for x in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
        idle = fields[3] + fields[4]  # idle + iowait
        return (sum(fields[:8]) - idle) / self.tick

    def _proc(self, pid: int | str) -> float:
        try:
            f = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            return float("nan")  # a replica that was killed
        return (int(f[11]) + int(f[12])) / self.tick

    def _ours(self) -> list[float]:
        return [self._proc("self"), *(self._proc(p) for p in self.pids)]

    def stop(self) -> dict[str, float]:
        wall = time.perf_counter() - self.t0
        busy = self._busy() - self.busy0
        ours = [b - a for a, b in zip(self.ours0, self._ours(), strict=True)]
        known = [x for x in ours if x == x]
        return {"wall": wall, "machine_cores": busy / wall, "client_cores": ours[0] / wall,
                "replica_cores": sum(known[1:]) / wall, "other_cores": (busy - sum(known)) / wall}


def serving_round(spec: ReplicaSpec, requests: list[dict[str, Any]], replicas: int, concurrency: int,
                  i: int) -> tuple[dict[str, Any], dict[str, dict[str, float]]]:
    """The phases of runners.loadgen.run_serving, one by one so each gets its CPU accounting; verified."""
    cpu: dict[str, dict[str, float]] = {}
    phases: dict[str, dict[str, Any]] = {}
    with loadgen.start_replicas(replicas, spec) as rs:
        eps = rs.endpoints
        plan = [("single", eps[:1], None), ("four", eps, None),
                ("failure", eps, loadgen.Kill(len(requests) // 4, rs.killer(1), eps[1]))]
        for name, endpoints, kill in plan:
            probe = CpuProbe([r.pid for r in rs.replicas])
            phases[name] = loadgen.run_phase(name, endpoints, requests, concurrency, f"bench-{i}-{name}", kill)
            cpu[name] = probe.stop()
    summary = vs.verify_serving(phases, requests=requests, expected_model_digest=spec.model_digest)
    return summary, cpu


def overhead_round(spec: ReplicaSpec, requests: list[dict[str, Any]], max_tokens: int) -> tuple[list[float],
                                                                                             list[float]]:
    loaded = load_replica(spec)
    tok = loaded.tokenizer
    bare: list[float] = []
    served: list[float] = []
    with loadgen.start_replicas(1, spec) as rs, httpx.Client(trust_env=False, timeout=60) as client, \
            pinned_threads(1):
        url = f"{rs.endpoints[0]}/v1/completions"
        client.post(url, json=requests[0]).raise_for_status()  # connection set up before timing
        greedy_generate(loaded.model, [tok.encode(requests[0]["prompt"], bos=True)], eos_id=tok.eos_id,
                        max_new_tokens=max_tokens)
        for r in requests:
            ids = tok.encode(r["prompt"], bos=True)
            t = time.perf_counter()
            want = greedy_generate(loaded.model, [ids], eos_id=tok.eos_id, max_new_tokens=max_tokens)[0]
            bare.append(time.perf_counter() - t)
            t = time.perf_counter()
            resp = client.post(url, json=r)
            served.append(time.perf_counter() - t)
            resp.raise_for_status()
            if resp.json()["choices"][0]["token_ids"] != want:
                raise SystemExit(f"the replica's tokens differ from greedy_generate for {r['prompt']!r}")
    return bare, served


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--concurrency", type=int, default=4)
    parser.add_argument("--model", choices=sorted(MODELS), default="default")
    parser.add_argument("--dir", type=Path, default=None, help="Parent of the temporary experiment directory")
    parser.add_argument("--json", action="store_true", help="Print the measurements as JSON too")
    args = parser.parse_args()

    root = Path(tempfile.mkdtemp(prefix="serve-bench-", dir=args.dir))
    try:
        spec, documents, max_tokens = prepare_experiment(root, args.model)
        requests = loadgen.request_set(documents, 64, max_tokens=max_tokens)
        torch.set_num_threads(1)
        rounds = [serving_round(spec, requests, args.replicas, args.concurrency, i) for i in range(args.rounds)]
        summaries = [s for s, _ in rounds]
        overheads = [overhead_round(spec, requests, max_tokens) for _ in range(args.rounds)]
    finally:
        shutil.rmtree(root, ignore_errors=True)

    cores = os.cpu_count() or 1
    ceiling = min(args.replicas, cores)
    print(f"model {args.model}, {args.replicas} replicas x 1 thread, concurrency {args.concurrency}, "
          f"64 requests x max_tokens {max_tokens}, {cores} cores, {args.rounds} rounds (medians over rounds)")
    print(f"{'phase':<8} {'req/s':>8} {'p50 ms':>8} {'p95 ms':>8} {'ok':>4} {'retries':>7}   CPU cores busy: "
          f"{'machine':>7} {'client':>6} {'replicas':>8} {'other jobs':>10}")
    for phase in vs.PHASES:
        ps = [s["phases"][phase] for s in summaries]
        med = {k: statistics.median(p[k] for p in ps) for k in ("requests_per_second", "median_latency_seconds",
                                                               "p95_latency_seconds", "successful", "retries")}
        c = {k: statistics.median(cpu[phase][k] for _, cpu in rounds)
             for k in ("machine_cores", "client_cores", "replica_cores", "other_cores")}
        print(f"{phase:<8} {med['requests_per_second']:8.1f} {1000 * med['median_latency_seconds']:8.1f} "
              f"{1000 * med['p95_latency_seconds']:8.1f} {med['successful']:4.0f} {med['retries']:7.0f}   "
              f"{'':16}{c['machine_cores']:7.2f} {c['client_cores']:6.2f} {c['replica_cores']:8.2f} "
              f"{c['other_cores']:10.2f}")
    ratios = [s["four_throughput_ratio"] for s in summaries]
    ratio = statistics.median(ratios)
    ratio_ok = ratio >= RATIO_TARGET * ceiling
    print(f"four/single throughput: {ratio:.2f}x (rounds: {', '.join(f'{r:.2f}' for r in ratios)}); ceiling "
          f"min(replicas, cores) = {ceiling}; target >= {RATIO_TARGET * ceiling:.2f}x: "
          f"{'PASS' if ratio_ok else 'FAIL'}")
    bare = statistics.median(x for b, _ in overheads for x in b)
    served = statistics.median(x for _, s in overheads for x in s)
    overhead = served / bare
    overhead_ok = overhead <= OVERHEAD_TARGET
    print(f"per request, one at a time: bare greedy_generate {1000 * bare:.2f} ms, served over HTTP "
          f"{1000 * served:.2f} ms (+{1000 * (served - bare):.2f} ms): {overhead:.2f}x; target <= "
          f"{OVERHEAD_TARGET}x: {'PASS' if overhead_ok else 'FAIL'}")
    passed = all(s["serving_fixture_passed"] for s in summaries)
    print(f"serving fixture passed (verified) in every round: {passed}")
    if args.json:
        print(json.dumps({"summaries": summaries, "cpu": [cpu for _, cpu in rounds], "ratio": ratio,
                          "ceiling": ceiling, "bare_seconds": bare, "served_seconds": served, "overhead": overhead},
                         indent=1))
    return 0 if ratio_ok and overhead_ok and passed else 1


if __name__ == "__main__":
    sys.exit(main())
