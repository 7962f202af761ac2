"""torch.distributed plumbing: a torchrun-compatible launcher, process-group set-up, and collectives that count
the exact payload bytes each rank sends.

Workers read the same environment torchrun sets (RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR, MASTER_PORT), so
`torchrun --nnodes N --nproc-per-node P -m runners.worker ...` runs them across hosts unchanged; our own
:func:`launch` spawns the same entry point on one host and tears the whole group down as soon as one rank dies.

With ``hosts`` (the namespace hosts of :mod:`runners.hosts`), :func:`launch` puts rank K on host K: by default one
torchrun agent per host joining a multi-node c10d rendezvous hosted on host 0 (``launcher="torchrun"``), or each
rank started directly with the env:// variables pointing at host 0 (``launcher="env"``). Either way gloo binds to
the host's own interface (GLOO_SOCKET_IFNAME), so every collective crosses the shaped links.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from runners import hosts as hosts_mod
from runners.hosts import HostSet

LAUNCHERS = ("torchrun", "env")


def free_port() -> int:
    """A TCP port on loopback that was free a moment ago (the launcher passes it as MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world: int
    local_rank: int
    master_addr: str
    master_port: int

    @classmethod
    def from_environ(cls) -> RankEnv:
        return cls(
            rank=int(os.environ.get("RANK", "0")),
            world=int(os.environ.get("WORLD_SIZE", "1")),
            local_rank=int(os.environ.get("LOCAL_RANK", os.environ.get("RANK", "0"))),
            master_addr=os.environ.get("MASTER_ADDR", "127.0.0.1"),
            master_port=int(os.environ.get("MASTER_PORT", "29500")),
        )


def device_for(env: RankEnv) -> torch.device:
    if torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        return torch.device("cuda", env.local_rank)
    return torch.device("cpu")


def init_group(env: RankEnv, timeout_s: float) -> None:
    """Join the process group: gloo on CPU, NCCL on CUDA. ``timeout_s`` bounds how long a collective waits for a
    dead peer, so survivors of a killed rank stop instead of hanging for torch's 30-minute default."""
    if env.world == 1 or dist.is_initialized():
        return
    backend = "nccl" if torch.cuda.is_available() else "gloo"
    dist.init_process_group(
        backend=backend,
        init_method=f"tcp://{env.master_addr}:{env.master_port}",
        rank=env.rank,
        world_size=env.world,
        timeout=timedelta(seconds=timeout_s),
    )


def shutdown_group() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


@dataclass
class Comm:
    """Collectives that count payload bytes (numel x element size of what this rank contributes) and time."""

    world: int
    sent_bytes: int = 0
    calls: int = 0
    seconds: float = 0.0
    per_op: dict[str, int] = field(default_factory=dict)

    def all_reduce_sum(self, tensor: torch.Tensor, op_name: str = "all_reduce") -> None:
        """In-place SUM all-reduce. gloo's all-reduce of one tensor is deterministic for a fixed world size and
        tensor layout, which is why callers always reduce one flat buffer in a fixed parameter order."""
        if self.world == 1:
            return
        nbytes = tensor.numel() * tensor.element_size()
        start = time.perf_counter()
        dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        self.seconds += time.perf_counter() - start
        self.sent_bytes += nbytes
        self.calls += 1
        self.per_op[op_name] = self.per_op.get(op_name, 0) + nbytes

    def barrier(self) -> None:
        if self.world > 1:
            dist.barrier()


def interface_counters() -> dict[str, dict[str, int]]:
    """Host network interface byte counters from /proc/net/dev (Linux); {} elsewhere."""
    path = Path("/proc/net/dev")
    if not path.exists():
        return {}
    out: dict[str, dict[str, int]] = {}
    for line in path.read_text().splitlines()[2:]:
        name, _, rest = line.partition(":")
        cols = rest.split()
        if len(cols) >= 9:
            out[name.strip()] = {"rx": int(cols[0]), "tx": int(cols[8])}
    return out


def counter_delta(before: dict[str, dict[str, int]], after: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    return {
        name: {k: after[name][k] - before.get(name, {}).get(k, 0) for k in ("rx", "tx")}
        for name in sorted(after)
    }


# ----------------------------------------------------------------------------------------------- launcher


@dataclass
class LaunchResult:
    returncodes: list[int]
    seconds: float
    failed_rank: int | None = None
    detect_seconds: float | None = None  # from the first rank's death to every rank gone

    @property
    def ok(self) -> bool:
        return all(rc == 0 for rc in self.returncodes)


def host_command(module: str, args: Sequence[str], world: int, hosts: HostSet, rank: int, port: int,
                 launcher: str = "torchrun", rdzv_id: str = "ledger") -> tuple[list[str], dict[str, str]]:
    """The command line and extra environment of ``rank`` on host ``rank`` of ``hosts``.

    ``torchrun``: an agent per host in a c10d rendezvous on host 0's address. c10d ranks nodes by their sorted
    ``--local-addr``, and the hosts' addresses sort in host order, so host K's worker is rank K (``--node-rank``
    means something only to the static rendezvous). ``env``: the worker itself, with RANK and MASTER_ADDR set as
    torchrun would set them, rendezvousing through our worker's own tcp:// init on host 0."""
    host = hosts[rank]
    extra = {"GLOO_SOCKET_IFNAME": host.ifname}
    if launcher == "torchrun":
        conf = f"is_host={'true' if rank == 0 else 'false'},join_timeout=120"  # is_host: no hostname matching
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", str(world), "--nproc-per-node", "1",
               "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{hosts[0].address}:{port}", "--rdzv-id", rdzv_id,
               "--rdzv-conf", conf, "--local-addr", host.address, "--max-restarts", "0", "-m", module, *args]
    elif launcher == "env":
        cmd = [sys.executable, "-m", module, *args]
        extra.update(RANK=str(rank), LOCAL_RANK="0", WORLD_SIZE=str(world), MASTER_ADDR=hosts[0].address,
                     MASTER_PORT=str(port))
    else:
        raise ValueError(f"launcher {launcher!r}: choose from {', '.join(LAUNCHERS)}")
    return host.argv(cmd), extra


def launch(
    module: str,
    args: Sequence[str],
    world: int,
    *,
    env: dict[str, str] | None = None,
    kill: tuple[int, Path] | None = None,
    grace_s: float = 20.0,
    log_dir: Path | None = None,
    hosts: HostSet | None = None,
    kill_host: bool = False,
) -> LaunchResult:
    """Spawn ``world`` ranks of ``python -m module args`` the way torchrun does, on this host, or with ``hosts``
    one rank per namespace host (see :func:`host_command`; a host that died is recreated first).

    If any rank exits non-zero (or is killed), the others get ``grace_s`` seconds to notice through their
    collectives' timeout and exit, then are killed: no hang. ``kill=(rank, trigger_file)`` SIGKILLs that rank
    as soon as the trigger file appears (the worker writes it after the chosen step), for the recovery run; with
    ``kill_host`` the rank's whole host dies instead (:func:`runners.hosts.fail_host`: link, processes, namespace).
    """
    if kill_host and hosts is None:
        raise ValueError("kill_host needs hosts: only a namespace host can die")
    if hosts is not None:
        if len(hosts) < world:
            raise ValueError(f"{world} ranks need {world} hosts, {len(hosts)} are up")
        hosts = hosts_mod.ensure(hosts)  # a host that died (recovery's second case) is made anew, as a scheduler would
    # A port on host 0: its namespace runs only our processes, so any unprivileged port is free there.
    port = free_port() if hosts is None else random.randrange(20000, 60000)
    procs: list[subprocess.Popen[bytes]] = []
    base = dict(os.environ)
    base.update(env or {})
    if hosts is None:
        base.update({"WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)})
    # One intra-op thread per rank when ranks share cores: the thread count changes float bits and
    # oversubscription is >10x slower here. The worker pins and records it; this keeps BLAS in line too.
    base.setdefault("OMP_NUM_THREADS", "1")
    rdzv_id = f"ledger-{os.getpid()}-{time.time_ns()}"
    start = time.perf_counter()
    for rank in range(world):
        out: Any = subprocess.DEVNULL
        if log_dir is not None:
            log_dir.mkdir(parents=True, exist_ok=True)
            out = open(log_dir / f"rank{rank}.log", "wb")  # noqa: SIM115 - closed when the process ends
        if hosts is None:
            cmd, penv = [sys.executable, "-m", module, *args], dict(base, RANK=str(rank), LOCAL_RANK=str(rank))
        else:
            cmd, extra = host_command(module, args, world, hosts, rank, port, hosts.launcher, rdzv_id)
            penv = dict(base, **extra)
        procs.append(subprocess.Popen(cmd, env=penv, stdout=out, stderr=subprocess.STDOUT))
    failed: int | None = None
    first_death: float | None = None
    killed = False
    while True:
        codes = [p.poll() for p in procs]
        if kill is not None and not killed and kill[1].exists():
            if kill_host:
                assert hosts is not None
                hosts_mod.fail_host(hosts.network, hosts[kill[0]])
            elif hosts is not None and hosts.launcher == "torchrun":
                hosts_mod.kill_tree(procs[kill[0]].pid, include_root=False)  # the worker; its agent then fails
            else:
                procs[kill[0]].send_signal(signal.SIGKILL)
            killed = True
        if failed is None:
            bad = [i for i, c in enumerate(codes) if c is not None and c != 0]
            if bad:
                failed = bad[0]
                first_death = time.perf_counter()
        if all(c is not None for c in codes):
            break
        if first_death is not None and time.perf_counter() - first_death > grace_s:
            for p in procs:
                if p.poll() is None:
                    if hosts is not None:
                        hosts_mod.kill_tree(p.pid)  # a torchrun agent's worker goes with it
                    else:
                        p.kill()
        time.sleep(0.02)
    end = time.perf_counter()
    return LaunchResult(
        returncodes=[int(p.returncode) for p in procs],
        seconds=end - start,
        failed_rank=failed,
        detect_seconds=None if first_death is None else end - first_death,
    )
