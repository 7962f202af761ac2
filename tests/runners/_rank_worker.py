"""A test-only rank entry point for runners.distributed.launch (run as ``python -m tests.runners._rank_worker``).

Modes (first argument):

* ``die <rank> <code> <timeout_s>``: every rank joins the gloo group; ``<rank>`` then exits with ``<code>`` at once,
  while the others block in an all-reduce that can never complete (bounded by the group's ``timeout_s``).
* ``count <out_dir>``: every rank all-reduces a fixed set of tensors of several dtypes and shapes through
  :class:`runners.distributed.Comm` and writes the reduced values and the byte counts to ``<out_dir>/rank<r>.json``.
* ``hang <trigger> <timeout_s>``: rank 1 writes ``<trigger>`` and waits to be killed (the launcher's ``kill``
  option); the others block in an all-reduce.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from runners.distributed import Comm, RankEnv, init_group, shutdown_group

# (name, dtype, shape) of the tensors the ``count`` mode reduces; rank r fills each with r + 1.
COUNT_TENSORS = (
    ("f32", torch.float32, (3, 5)),
    ("f64", torch.float64, (7,)),
    ("i64", torch.int64, (2, 2, 2)),
    ("bf16", torch.bfloat16, (9,)),
    ("u8", torch.uint8, (11,)),
)


def _blocked_all_reduce() -> None:
    dist.all_reduce(torch.ones(4), op=dist.ReduceOp.SUM)


def main(argv: list[str]) -> int:
    env = RankEnv.from_environ()
    mode = argv[0]
    if mode == "die":
        dying, code, timeout_s = int(argv[1]), int(argv[2]), float(argv[3])
        init_group(env, timeout_s)
        if env.rank == dying:
            os._exit(code)  # no clean shutdown: the peers must find out through their collective
        _blocked_all_reduce()
        return 0
    if mode == "count":
        out_dir = Path(argv[1])
        init_group(env, 30.0)
        comm = Comm(env.world)
        reduced = {}
        for name, dtype, shape in COUNT_TENSORS:
            t = torch.full(shape, env.rank + 1, dtype=dtype)
            comm.all_reduce_sum(t, name)
            reduced[name] = sorted({float(v) for v in t.reshape(-1).tolist()})
        comm.barrier()
        shutdown_group()
        (out_dir / f"rank{env.rank}.json").write_text(json.dumps({
            "sent_bytes": comm.sent_bytes, "calls": comm.calls, "per_op": comm.per_op,
            "seconds": comm.seconds, "reduced": reduced,
        }))
        return 0
    if mode == "hang":
        trigger, timeout_s = Path(argv[1]), float(argv[2])
        init_group(env, timeout_s)
        if env.rank == 1:
            trigger.write_text("1")
            while True:
                signal.pause()
        _blocked_all_reduce()
        return 0
    raise SystemExit(f"unknown mode {mode!r}")


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
