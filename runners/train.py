"""The three training arms and the per-rank worker that runs them, emitting receipts as it goes.

* ``single``: one rank, the whole global batch each step.
* ``ddp-four``: data-parallel; every step each rank's gradients are summed across ranks and averaged. The
  reduction is one flat buffer in fixed parameter order through a gloo/NCCL all-reduce, so its summation order
  never depends on when the process group was built (torch's DistributedDataParallel regroups its buckets after
  the first step of each construction, which makes a resumed run differ in the last bits).
* ``diloco-four``: each rank takes H inner AdamW steps on its shard, then the ranks all-reduce the averaged
  pseudo-gradient (outer copy - local weights) and take an outer SGD Nesterov step, written out below so a
  verifier can recompute it from its inputs.

All arms see the same data and the same global batch: the documents of step ``s`` are a function of
(seed, s) only, split into equal contiguous shards by rank. All randomness flows from explicit generators derived
from (seed, rank), and the intra-op thread count is pinned and recorded, so a rerun is bit-identical and a run
resumed from a checkpoint consumes exactly what the uninterrupted run did.

Run a worker the way torchrun does: ``torchrun --nproc-per-node 4 -m runners.train --workdir W --db D --arm A``;
:func:`train_arm` launches it on this host.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import signal
import socket
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from ledger import digests
from ledger.artifacts import ArtifactStore, default_root
from ledger.errors import InputError, LedgerError, MissingArtifact
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store, Stored
from runners.checkpoint import OuterState, load_checkpoint, save_checkpoint
from ledger.experiment.config import ARMS, ExperimentConfig
from runners.distributed import (
    Comm,
    RankEnv,
    counter_delta,
    device_for,
    init_group,
    interface_counters,
    launch,
    shutdown_group,
)
from runners.model import build_model
from runners.prepare import load_model_weights, load_prepared
from runners.rng import Rngs, seed_global_rngs
from ledger.experiment.tasks import Document
from ledger.experiment.tokenizer import CharTokenizer
from verify.training import arm_figures, ratios

# Ways to resume wrongly, for the negative tests of the recovery proof (never used by a real run).
RESUME_FAULTS = ("numpy-rng", "python-rng", "cursor", "optimizer-moments")


# --------------------------------------------------------------------------------------- prepared inputs


# ------------------------------------------------------------------------------------------------- data


def step_indices(seed: int, step: int, n_docs: int, global_batch: int) -> list[int]:
    """The global batch of ``step``: a function of (seed, step) only, so a resumed run reads the same data."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x7261696E, step])))
    return [int(i) for i in rng.choice(n_docs, size=global_batch, replace=False)]


def shard(indices: Sequence[int], rank: int, world: int) -> list[int]:
    per = len(indices) // world
    return list(indices[rank * per : (rank + 1) * per])


def encode_batch(tok: CharTokenizer, docs: Sequence[Document], loss_on: str,
                 max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Inputs, targets and loss mask (answer + EOS tokens, or every token) padded to the longest document."""
    rows: list[list[int]] = []
    masks: list[list[float]] = []
    for d in docs:
        prompt = tok.encode(d.prompt, bos=True)
        ids = prompt + tok.encode(d.answer, eos=True)
        if len(ids) > max_len + 1:
            raise InputError(f"document {d.digest} has {len(ids)} tokens; the model takes {max_len + 1}")
        first = len(prompt) - 1 if loss_on == "answer" else 0  # target positions predicting the answer
        masks.append([1.0 if i >= first else 0.0 for i in range(len(ids) - 1)])
        rows.append(ids)
    width = max(len(r) for r in rows)
    ids_t = torch.full((len(rows), width), tok.pad_id, dtype=torch.long)
    mask_t = torch.zeros((len(rows), width - 1))
    for i, (r, m) in enumerate(zip(rows, masks, strict=True)):
        ids_t[i, : len(r)] = torch.tensor(r)
        mask_t[i, : len(m)] = torch.tensor(m)
    return ids_t[:, :-1], ids_t[:, 1:], mask_t


def documents_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   denominator: int) -> torch.Tensor:
    """Sum over documents of each document's mean token NLL, divided by ``denominator`` (the global batch for
    DDP, so that summing ranks' gradients gives the gradient of the global mean)."""
    inputs, targets, mask = batch
    logits = model(inputs)
    nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    per_doc = (nll * mask).sum(dim=1) / mask.sum(dim=1)
    return per_doc.sum() / denominator


def lr_at(cfg: ExperimentConfig, step: int) -> float:
    """Linear warm-up over steps 1..warmup, then ``train.schedule``: constant, or cosine decay to min_lr_ratio * lr
    at ``train.steps`` (the config's, not a --steps cut, so a shortened run follows the same curve)."""
    t = cfg.train
    if t.warmup_steps > 0 and step < t.warmup_steps:
        return t.lr * step / t.warmup_steps
    if t.schedule == "constant":
        return t.lr
    progress = min(1.0, max(0.0, (step - t.warmup_steps) / max(1, t.steps - t.warmup_steps)))
    return t.lr * (t.min_lr_ratio + (1.0 - t.min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


# ------------------------------------------------------------------------------------------------ arms


def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in tensors])


def unflat_into(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(buffer[offset : offset + n].view_as(t))
        offset += n


@dataclass
class Diloco:
    """The outer optimizer: SGD with (by default Nesterov) momentum over an outer copy of the parameters.

    With pseudo-gradient g (the rank-average of outer - local), momentum m and outer lr η:
        buf <- m * buf + g ;  update <- g + m * buf (Nesterov) or buf ;  outer <- outer - η * update ;
        local <- outer
    which is torch.optim.SGD(momentum=m, nesterov=..., dampening=0) with a zero initial buffer, up to rounding
    (torch fuses the multiply-adds; this form is the one a verifier recomputes).
    """

    names: list[str]
    outer: list[torch.Tensor]
    momentum: list[torch.Tensor]
    lr: float
    beta: float
    nesterov: bool = True
    steps: int = 0

    @classmethod
    def start(cls, model: torch.nn.Module, lr: float, beta: float, nesterov: bool = True) -> Diloco:
        named = [(n, p) for n, p in model.named_parameters()]
        return cls([n for n, _ in named], [p.detach().clone() for _, p in named],
                   [torch.zeros_like(p) for _, p in named], lr, beta, nesterov)

    def state(self) -> OuterState:
        tensors = {f"outer.{n}": t for n, t in zip(self.names, self.outer, strict=True)}
        tensors.update({f"momentum.{n}": t for n, t in zip(self.names, self.momentum, strict=True)})
        scalars = {"outer_lr": self.lr, "momentum": self.beta, "nesterov": self.nesterov, "outer_steps": self.steps}
        return OuterState(tensors=tensors, scalars=scalars)

    def load(self, state: OuterState) -> None:
        for i, n in enumerate(self.names):
            self.outer[i].copy_(state.tensors[f"outer.{n}"])
            self.momentum[i].copy_(state.tensors[f"momentum.{n}"])
        self.steps = int(state.scalars["outer_steps"])

    @torch.no_grad()
    def sync(self, model: torch.nn.Module, comm: Comm) -> None:
        params = [p for _, p in model.named_parameters()]
        pseudo = flat([o - p.detach() for o, p in zip(self.outer, params, strict=True)])
        comm.all_reduce_sum(pseudo, "pseudo_gradient")
        pseudo /= comm.world
        offset = 0
        for o, buf in zip(self.outer, self.momentum, strict=True):
            n = o.numel()
            g = pseudo[offset : offset + n].view_as(o)
            offset += n
            buf.mul_(self.beta).add_(g)
            o.sub_(self.lr * (g + self.beta * buf if self.nesterov else buf))
        for o, p in zip(self.outer, params, strict=True):
            p.copy_(o)
        self.steps += 1


# ---------------------------------------------------------------------------------------------- worker


def _inject_resume_fault(fault: str | None, rngs: Rngs, optimizer: torch.optim.Optimizer, seed: int,
                         rank: int) -> int:
    """Undo one piece of a correct restore (tests of the recovery proof); returns the data-cursor offset."""
    if fault is None:
        return 0
    fresh = Rngs.from_seed(seed, rank)
    if fault == "numpy-rng":
        rngs.numpy = fresh.numpy
    elif fault == "python-rng":
        rngs.python = fresh.python
    elif fault == "optimizer-moments":
        optimizer.state.clear()
    elif fault == "cursor":
        return 1
    return 0


@dataclass
class Figures:
    update_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    loop_seconds: float = 0.0
    tokens: int = 0
    losses: list[list[Any]] = field(default_factory=list)  # [step, loss] of the current segment


def _binding(env: RankEnv, arm: str, run: str, device: torch.device, threads: int) -> dict[str, Any]:
    return {
        "run": run,
        "arm": arm,
        "rank": env.rank,
        "world": env.world,
        "host": socket.gethostname(),
        "device": str(device),
        "backend": "nccl" if device.type == "cuda" else ("gloo" if env.world > 1 else "none"),
        "threads": threads,
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _state_artifacts(manifest: Any, config_digest: str) -> dict[str, str]:
    """A checkpoint receipt's artifacts: the state digest, each component digest, and the config."""
    arts = {"state": manifest.checkpoint, "config": config_digest}
    arts.update(manifest.components)
    return arts


def worker(argv: Sequence[str] | None = None) -> int:
    """One rank: set up, optionally restore, train to the end, checkpoint every K steps, emit receipts."""
    parser = argparse.ArgumentParser(prog="runners.train")
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--db", required=True)
    parser.add_argument("--arm", choices=sorted(ARMS), required=True)
    # --run-name: torchrun's own parser takes "--run" for an abbreviation of its --run-path and refuses it.
    parser.add_argument("--run", "--run-name", dest="run", required=True)
    parser.add_argument("--prepared", default=None)
    parser.add_argument("--restore", type=Path, default=None, help="JSON file: {rank: checkpoint receipt id}")
    parser.add_argument("--kill-after-step", type=int, default=None)
    parser.add_argument("--kill-rank", type=int, default=None)
    parser.add_argument("--kill-trigger", type=Path, default=None)
    parser.add_argument("--steps", type=int, default=None, help="Stop after this step (default: config)")
    parser.add_argument("--timeout", type=float, default=30.0, help="Collective timeout (s) for a dead peer")
    parser.add_argument("--progress", type=Path, default=None)
    parser.add_argument("--no-ledger", action="store_true",
                        help="Append no receipts (benchmark baseline, replay); the ledger is only read")
    parser.add_argument("--out", type=Path, default=None, help="Checkpoint directory root (default: workdir/runs)")
    parser.add_argument("--resume-fault", choices=RESUME_FAULTS, default=None,
                        help="Deliberately resume wrongly, to show the verifier catches it (tests only)")
    args = parser.parse_args(argv)

    env = RankEnv.from_environ()
    store = Store.open(args.db)
    artifacts = ArtifactStore(default_root(store.url))
    prep = load_prepared(store, artifacts, store.latest_prepared(args.prepared))
    prepared = prep.receipt.prepared
    contracts = store.find(kind="contract", prepared=prepared)
    cfg = prep.config
    tcfg = cfg.train
    if ARMS[args.arm].world != env.world:
        raise InputError(f"arm {args.arm} runs on {ARMS[args.arm].world} ranks, launched with {env.world}")
    torch.set_num_threads(tcfg.threads_per_rank)
    torch.use_deterministic_algorithms(True)
    device = device_for(env)
    init_group(env, args.timeout)
    comm = Comm(env.world)

    # Every rank starts from the seed model; generators derive from (seed, rank).
    seed_global_rngs(cfg.seed, env.rank)
    rngs = Rngs.from_seed(cfg.seed, env.rank)
    model = build_model(cfg.model, prep.tokenizer.vocab_size, cfg.seed)
    load_model_weights(prep.seed_checkpoint, model)
    model.to(device)
    model.dropout_generator = rngs.torch  # dropout (if configured) draws from the rank's explicit generator
    optimizer = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    diloco = Diloco.start(model, tcfg.diloco.outer_lr, tcfg.diloco.outer_momentum, tcfg.diloco.nesterov) \
        if args.arm == "diloco-four" else None
    last_step = args.steps if args.steps is not None else tcfg.steps
    config_digest = prep.receipt.artifacts["config"]
    threads = torch.get_num_threads()
    binding = _binding(env, args.arm, args.run, device, threads)

    ledger_seconds = [0.0]  # time spent appending receipts and recording locations (reported for benchmarks)

    def record(receipt: Receipt) -> Receipt:
        if args.no_ledger:
            return receipt
        t0 = time.perf_counter()
        stored = store.append(receipt).receipt
        ledger_seconds[0] += time.perf_counter() - t0
        return stored

    start_step = 0
    data_offset = 0  # only a deliberate "cursor" fault makes it non-zero
    if args.restore is not None:
        mapping = json.loads(args.restore.read_text())
        ckpt = store.get(mapping[str(env.rank)]).receipt
        ckpt_dir = artifacts.locate(ckpt.artifacts["state"], store.locations(ckpt.artifacts["state"]), name="state", directory=True)
        outer_state = diloco.state() if diloco is not None else None
        loaded = load_checkpoint(ckpt_dir, model=model, optimizer=optimizer, outer=outer_state, rngs=rngs)
        if diloco is not None and outer_state is not None:
            diloco.load(outer_state)
        start_step = loaded.cursor
        if ckpt.step != start_step:
            raise InputError(f"checkpoint receipt {ckpt.id} says step {ckpt.step}, its files say {start_step}")
        data_offset = _inject_resume_fault(args.resume_fault, rngs, optimizer, cfg.seed, env.rank)
        previous = record(make_receipt(
            "restore", run=args.run, rank=env.rank, step=start_step, prepared=prepared, parents=[ckpt],
            artifacts={"state": ckpt.artifacts["state"], "config": config_digest, "model": ckpt.artifacts["model"]},
            measurements={"binding": binding, "restored_from": ckpt.id, "restored_run": ckpt.run},
        ))
    else:
        parents: list[Receipt] = [prep.receipt] + [c.receipt for c in contracts[-1:]]
        previous = record(make_receipt(
            "train-start", run=args.run, rank=env.rank, step=0, prepared=prepared, parents=parents,
            artifacts={"config": config_digest, "model": prep.receipt.artifacts["model"]},
            measurements={"binding": binding, "binding_digest": digests.digest_json("json", binding)},
        ))

    params = [p for _, p in model.named_parameters()]
    figures = Figures()
    run_dir = args.out if args.out is not None else args.workdir / "runs" / args.run.replace("/", "_")
    if args.restore is not None and args.out is None:  # a restarted group never reuses the failed group's names
        run_dir = run_dir / f"restart-{digests.raw_digest(args.restore.read_bytes())[7:19]}"
    run_dir = run_dir / f"rank{env.rank}"
    counters_before = interface_counters()
    loop_start = time.perf_counter()
    model.train()

    def checkpoint(step: int) -> Receipt:
        t0 = time.perf_counter()
        meta = {"run": args.run, "arm": args.arm, "rank": env.rank, "world": env.world, "step": step}
        saved = save_checkpoint(run_dir / f"step{step:07d}", model=model, optimizer=optimizer,
                                outer=diloco.state() if diloco is not None else None, rngs=rngs, cursor=step,
                                meta=meta)
        # The directory is where the state (and with it every component it names) is re-hashed from; the model is
        # also looked up by its own digest (evaluation, serving). One write transaction each, so no more than these.
        if not args.no_ledger:
            t1 = time.perf_counter()
            for digest in (saved.digest, saved.manifest.components["model"]):
                store.add_location(digest, str(saved.path.resolve()))
            ledger_seconds[0] += time.perf_counter() - t1
        receipt = record(make_receipt(
            "checkpoint", run=args.run, rank=env.rank, step=step, prepared=prepared, parents=[previous],
            artifacts=_state_artifacts(saved.manifest, config_digest),
            measurements={"arm": args.arm, "world": env.world, "losses": figures.losses,
                          "files": dict(saved.manifest.files), "sent_bytes": comm.sent_bytes,
                          "outer_steps": diloco.steps if diloco is not None else 0},
        ))
        figures.losses = []
        figures.checkpoint_seconds += time.perf_counter() - t0
        return receipt

    for step in range(start_step + 1, last_step + 1):
        t0 = time.perf_counter()
        sync_before = comm.seconds
        idx = step_indices(cfg.seed, step + data_offset, len(prep.train), tcfg.global_batch)
        mine = idx if env.world == 1 else shard(idx, env.rank, env.world)
        # The rank's explicit generators are consumed every step (so a resume must restore them): numpy orders
        # the shard; Python seeds the step's dropout masks, drawn from the explicit torch generator.
        mine = [mine[i] for i in rngs.numpy.permutation(len(mine))]
        rngs.torch.manual_seed(rngs.python.getrandbits(62))
        batch = encode_batch(prep.tokenizer, [prep.train[i] for i in mine], tcfg.loss_on, cfg.model.max_len)
        figures.tokens += int(batch[2].sum())
        for group in optimizer.param_groups:
            group["lr"] = lr_at(cfg, step)
        optimizer.zero_grad(set_to_none=True)
        denominator = tcfg.global_batch if args.arm == "ddp-four" else len(mine)
        loss = documents_loss(model, tuple(t.to(device) for t in batch), denominator)  # type: ignore[arg-type]
        loss.backward()
        if args.arm == "ddp-four":
            grads = flat([p.grad for p in params])  # type: ignore[misc]
            comm.all_reduce_sum(grads, "gradient")
            unflat_into(grads, [p.grad for p in params])  # type: ignore[misc]
        if tcfg.grad_clip > 0:
            torch.nn.utils.clip_grad_norm_(params, tcfg.grad_clip)
        optimizer.step()
        if diloco is not None and step % tcfg.diloco.inner_steps == 0:
            diloco.sync(model, comm)
        figures.update_seconds += time.perf_counter() - t0 - (comm.seconds - sync_before)
        # The loss of the rank's shard (DDP: scaled back to the shard's mean), exact float bits.
        value = float(loss.detach()) * (tcfg.global_batch / len(mine) if args.arm == "ddp-four" else 1.0)
        figures.losses.append([step, value])
        if args.progress is not None and env.rank == 0:
            args.progress.write_text(json.dumps({"step": step, "loss": value, "tokens": figures.tokens,
                                                 "seconds": time.perf_counter() - loop_start}))
        if step % tcfg.checkpoint_every == 0 or step == last_step:
            previous = checkpoint(step)
        if args.kill_after_step == step and args.kill_rank == env.rank and args.kill_trigger is not None:
            # Atomic (write, then rename): the launcher kills as soon as the file exists, so it must never see
            # it empty.
            pending = args.kill_trigger.with_name(args.kill_trigger.name + ".tmp")
            pending.write_text(json.dumps({"rank": env.rank, "step": step}))
            os.replace(pending, args.kill_trigger)
            while True:  # wait for the launcher's SIGKILL; never run past the planned step
                signal.pause()

    figures.loop_seconds = time.perf_counter() - loop_start
    counters = counter_delta(counters_before, interface_counters())
    final = previous
    end = record(make_receipt(
        "train-end", run=args.run, rank=env.rank, step=last_step, prepared=prepared, parents=[final],
        artifacts=dict(final.artifacts),
        measurements={
            "arm": args.arm,
            "world": env.world,
            "binding": binding,
            "update_seconds": figures.update_seconds,
            "synchronization_seconds": comm.seconds,
            "active_seconds": figures.update_seconds + comm.seconds,
            "checkpoint_seconds": figures.checkpoint_seconds,
            "loop_seconds": figures.loop_seconds,
            "sent_bytes": comm.sent_bytes,
            "collective_calls": comm.calls,
            "sent_bytes_by_op": comm.per_op,
            "interface_bytes": counters,
            "tokens": figures.tokens,
            "steps": last_step - start_step,
            "start_step": start_step,
        },
    ))
    comm.barrier()
    shutdown_group()
    store.close()
    # Every rank reports its end on stdout (its log), so a --no-ledger run's figures are still readable (benchmarks).
    print(json.dumps({"rank": env.rank, "train_end": end.id, "recorded": not args.no_ledger,
                      "loop_seconds": figures.loop_seconds, "sent_bytes": comm.sent_bytes,
                      "ledger_seconds": ledger_seconds[0]}), flush=True)
    return 0


# -------------------------------------------------------------------------------------------- launcher


@dataclass
class ArmResult:
    arm: str
    run: str
    ends: list[Stored]
    summary: Receipt
    seconds: float


def summarize_arm(store: Store, prepared: str, arm: str, run: str) -> Receipt:
    """Append the arm summary: per-rank, max-rank and total figures, and ratios against the other arms'
    summaries already in the ledger (which it cites)."""
    ends = [s.receipt for s in store.find(kind="train-end", run=run, prepared=prepared)]
    if len(ends) != ARMS[arm].world:
        raise LedgerError(f"arm {arm} run {run}: expected {ARMS[arm].world} train-end receipts, found {len(ends)}")
    figures = arm_figures(ends)
    if arm == "ddp-four" and len({e.artifacts["model"] for e in ends}) != 1:
        raise LedgerError(f"DDP ranks of run {run} ended with different model digests")
    others: dict[str, Receipt] = {}
    for s in store.find(kind="arm-summary", prepared=prepared):
        other_arm = s.receipt.measurements.get("arm")
        if other_arm in ("single", "ddp-four") and other_arm != arm:
            others[other_arm] = s.receipt
    r = ratios(figures, others["ddp-four"].measurements if "ddp-four" in others else None,
               others["single"].measurements if "single" in others else None)
    return store.append(make_receipt(
        "arm-summary", run=run, prepared=prepared, parents=[*ends, *others.values()],
        artifacts={"model": figures["parameter_digest"]},
        measurements={"arm": arm, **figures, "ratios": r},
    )).receipt


def train_arm(workdir: Path, db: str, arm: str, *, run: str | None = None, prepared: str | None = None,
              steps: int | None = None, timeout: float = 30.0, summarize: bool = True,
              extra: Sequence[str] = (), kill: tuple[int, Path] | None = None) -> tuple[Any, str]:
    """Launch every rank of ``arm`` on this host and wait; returns (launch result, run name)."""
    run = run or f"train/{arm}"
    args = ["--workdir", str(workdir), "--db", str(db), "--arm", arm, "--run", run, "--timeout", str(timeout)]
    if prepared:
        args += ["--prepared", prepared]
    if steps is not None:
        args += ["--steps", str(steps)]
    args += list(extra)
    result = launch("runners.train", args, ARMS[arm].world, kill=kill, log_dir=workdir / "logs" / run.replace("/", "_"))
    return result, run


if __name__ == "__main__":
    try:
        sys.exit(worker())
    except LedgerError as exc:
        print(f"runners.train: error: {exc.one_line()}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
