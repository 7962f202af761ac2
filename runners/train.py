"""The per-rank training worker and its launcher, emitting receipts as it goes.

The three arms (``single``, ``ddp-four``, ``diloco-four``; see :data:`ledger.experiment.config.ARMS`) differ only in
how their ranks synchronise, which is one strategy per ``Arm.sync`` in :mod:`runners.arms`; everything here is the
same for every arm. One rank: start from the seed model (or restore a checkpoint), train step by step, checkpoint
every K steps and at the end, append a receipt for each, and finish with a ``train-end`` receipt.

All arms see the same data and the same global batch: the documents of step ``s`` and the pretraining windows mixed
into it (``train.pretrain_mix``) are functions of (seed, s) only, split into equal contiguous shards by rank. All
randomness flows from explicit generators derived from (seed, rank), and the intra-op thread count is pinned and
recorded, so a rerun is bit-identical and a run resumed from a checkpoint consumes exactly what the uninterrupted
run did.

Run a worker the way torchrun does: ``torchrun --nproc-per-node 4 -m runners.train --workdir W --db D --arm A``;
:func:`train_arm` launches it on this host and :func:`summarize_arm` appends the arm's summary.
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
from ledger.artifacts import ArtifactStore, workdir_root
from ledger.errors import InputError, LedgerError, RunFailed
from ledger.experiment.config import ARMS, ExperimentConfig
from ledger.experiment.corpus import window_offsets
from ledger.experiment.tasks import Document
from ledger.experiment.tokenizer import Tokenizer
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from runners import numerics
from runners.arms import Strategy, strategy_for
from runners.checkpoint import load_checkpoint, save_checkpoint
from runners.distributed import (
    Comm,
    LaunchResult,
    RankEnv,
    counter_delta,
    device_for,
    init_group,
    interface_counters,
    launch,
    shutdown_group,
)
from runners.hosts import HostSet
from runners.model import build_model
from runners.prepare import Prepared, load_model_weights, load_prepared
from runners.rng import Rngs, seed_global_rngs
from verify.training import arm_figures, ratios

# Ways to resume wrongly, for the negative tests of the recovery proof (never used by a real run).
RESUME_FAULTS = ("numpy-rng", "python-rng", "cursor", "optimizer-moments")


# ------------------------------------------------------------------------------------------------- data


def step_indices(seed: int, step: int, n_docs: int, global_batch: int) -> list[int]:
    """The global batch of ``step``: a function of (seed, step) only, so a resumed run reads the same data."""
    rng = np.random.Generator(np.random.PCG64(np.random.SeedSequence([seed, 0x7261696E, step])))
    return [int(i) for i in rng.choice(n_docs, size=global_batch, replace=False)]


def shard(indices: Sequence[int], rank: int, world: int) -> list[int]:
    per = len(indices) // world
    return list(indices[rank * per : (rank + 1) * per])


def encode_batch(tok: Tokenizer, docs: Sequence[Document], loss_on: str,
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


def window_batch(stream: torch.Tensor | None, cfg: ExperimentConfig, step: int, rank: int,
                 world: int) -> torch.Tensor | None:
    """This rank's pretraining windows of ``step`` (``[n, pretrain_window + 1]`` token ids), or None without a mix.

    The step's ``train.pretrain_windows`` offsets are a function of (seed, step), split into contiguous shards by
    rank like the documents, so single and DDP train on the same windows and a resumed run reads the same ones."""
    count = cfg.train.pretrain_windows
    if stream is None or count == 0:
        return None
    seq_len = cfg.train.pretrain_window
    offsets = window_offsets(cfg.seed, step, len(stream) - seq_len - 1, count)
    mine = offsets if world == 1 else shard(offsets, rank, world)
    return torch.stack([stream[o : o + seq_len + 1] for o in mine])


def documents_loss(model: torch.nn.Module, batch: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
                   denominator: int, windows: torch.Tensor | None = None, weight: float = 1.0) -> torch.Tensor:
    """Sum over documents of each document's mean token NLL, plus ``weight`` times the same for every pretraining
    window, divided by ``denominator`` (the documents of the global batch for DDP, so that summing ranks'
    gradients gives the gradient of the global objective). The objective is therefore the documents' mean loss
    plus ``pretrain_mix * pretrain_weight`` times the windows' mean loss."""
    inputs, targets, mask = batch
    logits = model(inputs)
    nll = F.cross_entropy(logits.transpose(1, 2), targets, reduction="none")
    per_doc = (nll * mask).sum(dim=1) / mask.sum(dim=1)
    total = per_doc.sum()
    if windows is not None:  # a separate forward: windows are longer than documents, so padding them together wastes
        w_logits = model(windows[:, :-1])
        w_nll = F.cross_entropy(w_logits.transpose(1, 2), windows[:, 1:], reduction="none").mean(dim=1).sum()
        total = total + weight * w_nll
    return total / denominator


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



# ---------------------------------------------------------------------------------------------- worker


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The worker's command line (``python -m runners.train ...``; recover and replay launch it with these)."""
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
    return parser.parse_args(argv)


@dataclass(frozen=True)
class FaultPlan:
    """The faults a run was asked for: the recovery run's planned kill, and the recovery proof's negative tests'
    deliberately wrong resume. A real training run has none."""

    kill_after_step: int | None = None
    kill_rank: int | None = None
    kill_trigger: Path | None = None
    resume_fault: str | None = None

    @classmethod
    def from_args(cls, args: argparse.Namespace) -> FaultPlan:
        return cls(args.kill_after_step, args.kill_rank, args.kill_trigger, args.resume_fault)

    def wrong_resume(self, rngs: Rngs, optimizer: torch.optim.Optimizer, seed: int, rank: int) -> int:
        """Undo one piece of a correct restore (tests of the recovery proof); returns the data-cursor offset."""
        if self.resume_fault is None:
            return 0
        fresh = Rngs.from_seed(seed, rank)
        if self.resume_fault == "numpy-rng":
            rngs.numpy = fresh.numpy
        elif self.resume_fault == "python-rng":
            rngs.python = fresh.python
        elif self.resume_fault == "optimizer-moments":
            optimizer.state.clear()
        elif self.resume_fault == "cursor":
            return 1
        return 0

    def kill_if_planned(self, step: int, rank: int) -> None:
        """After the planned step (and its checkpoint, if any) on the planned rank: tell the launcher, which
        SIGKILLs this process, and wait for it."""
        if self.kill_after_step != step or self.kill_rank != rank or self.kill_trigger is None:
            return
        # Atomic (write, then rename): the launcher kills as soon as the file exists, so it must never see it empty.
        pending = self.kill_trigger.with_name(self.kill_trigger.name + ".tmp")
        pending.write_text(json.dumps({"rank": rank, "step": step}))
        os.replace(pending, self.kill_trigger)
        while True:  # wait for the launcher's SIGKILL; never run past the planned step
            signal.pause()


@dataclass
class Figures:
    update_seconds: float = 0.0
    checkpoint_seconds: float = 0.0
    loop_seconds: float = 0.0
    ledger_seconds: float = 0.0  # appending receipts and recording locations (reported for benchmarks)
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
        "cpu": numerics.describe(),
        "torch": torch.__version__,
        "python": platform.python_version(),
    }


def _state_artifacts(manifest: Any, config_digest: str) -> dict[str, str]:
    """A checkpoint receipt's artifacts: the state digest, each component digest, and the config."""
    arts = {"state": manifest.checkpoint, "config": config_digest}
    arts.update(manifest.components)
    return arts


def _run_dir(args: argparse.Namespace, rank: int) -> Path:
    """Where this rank's checkpoints go; a restarted group never reuses the failed group's names."""
    run_dir = args.out if args.out is not None else args.workdir / "runs" / args.run.replace("/", "_")
    if args.restore is not None and args.out is None:
        run_dir = run_dir / f"restart-{digests.raw_digest(args.restore.read_bytes())[7:19]}"
    return run_dir / f"rank{rank}"


@dataclass
class RankRun:
    """One rank's training: what it was asked, what it trains, and what it has recorded so far."""

    args: argparse.Namespace
    env: RankEnv
    store: Store
    artifacts: ArtifactStore
    prep: Prepared
    device: torch.device
    comm: Comm
    rngs: Rngs
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    strategy: Strategy
    binding: dict[str, Any]
    run_dir: Path
    figures: Figures = field(default_factory=Figures)
    stream: torch.Tensor | None = None  # the seed's pretraining stream, when windows are mixed into the batches

    @property
    def cfg(self) -> ExperimentConfig:
        return self.prep.config

    @property
    def config_digest(self) -> str:
        return self.prep.receipt.artifacts["config"]

    @property
    def last_step(self) -> int:
        return int(self.args.steps if self.args.steps is not None else self.cfg.train.steps)

    def locate(self, receipt: Receipt, directory: Path) -> None:
        """Record ``directory`` as where ``receipt``'s state and model are (one write transaction)."""
        if self.args.no_ledger:
            return
        t0 = time.perf_counter()
        self.store.add_receipt_locations(receipt.id, {name: str(directory.resolve()) for name in ("state", "model")
                                                      if name in receipt.artifacts})
        self.figures.ledger_seconds += time.perf_counter() - t0

    def record(self, receipt: Receipt) -> Receipt:
        """Append ``receipt`` (unless --no-ledger) and return it as stored."""
        if self.args.no_ledger:
            return receipt
        t0 = time.perf_counter()
        stored = self.store.append(receipt).receipt
        self.figures.ledger_seconds += time.perf_counter() - t0
        return stored


def set_up(args: argparse.Namespace, env: RankEnv, store: Store) -> RankRun:
    """Join the group and build this rank's seed model, optimizer, generators and arm strategy."""
    artifacts = ArtifactStore(workdir_root(args.workdir))
    prep = load_prepared(store, artifacts, store.latest_prepared(args.prepared))
    cfg = prep.config
    tcfg = cfg.train
    arm = ARMS[args.arm]
    if arm.world != env.world:
        raise InputError(f"arm {args.arm} runs on {arm.world} ranks, launched with {env.world}")
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
    strategy = strategy_for(arm, model, tcfg, comm)  # after model.to(device): DiLoCo copies the weights here
    binding = _binding(env, args.arm, args.run, device, torch.get_num_threads())
    stream = torch.tensor(prep.stream().ids, dtype=torch.long) if tcfg.pretrain_windows else None
    return RankRun(args, env, store, artifacts, prep, device, comm, rngs, model, optimizer, strategy, binding,
                   _run_dir(args, env.rank), stream=stream)


def start_or_restore(rr: RankRun, faults: FaultPlan) -> tuple[Receipt, int, int]:
    """Record the start (``train-start``) or restore this rank's checkpoint named in --restore (``restore``).

    Returns (the receipt the next one chains to, the step to continue after, the data-cursor offset: non-zero
    only for a deliberate "cursor" fault)."""
    args, env, prepared = rr.args, rr.env, rr.prep.receipt.prepared
    if args.restore is None:
        contracts = rr.store.find(kind="contract", prepared=prepared)
        parents: list[Receipt] = [rr.prep.receipt] + [c.receipt for c in contracts[-1:]]
        start = rr.record(make_receipt(
            "train-start", run=args.run, rank=env.rank, step=0, prepared=prepared, parents=parents,
            artifacts={"config": rr.config_digest, "model": rr.prep.receipt.artifacts["model"]},
            measurements={"binding": rr.binding, "binding_digest": digests.binding_digest(rr.binding)},
        ))
        return start, 0, 0
    mapping = json.loads(args.restore.read_text())
    ckpt = rr.store.get(mapping[str(env.rank)]).receipt
    state = ckpt.artifacts["state"]
    # The checkpoint's own directory (its receipt location): equal states of other runs share its digest.
    ckpt_dir = rr.artifacts.locate(state, rr.store.evidence_locations(ckpt.id, "state", state), name="state",
                                   directory=True)
    outer = rr.strategy.outer_state()  # the live outer state: loading fills it in place
    loaded = load_checkpoint(ckpt_dir, model=rr.model, optimizer=rr.optimizer, outer=outer, rngs=rr.rngs)
    rr.strategy.restore(outer)
    if ckpt.step != loaded.cursor:
        raise InputError(f"checkpoint receipt {ckpt.id} says step {ckpt.step}, its files say {loaded.cursor}")
    data_offset = faults.wrong_resume(rr.rngs, rr.optimizer, rr.cfg.seed, env.rank)
    restore = rr.record(make_receipt(
        "restore", run=args.run, rank=env.rank, step=loaded.cursor, prepared=prepared, parents=[ckpt],
        artifacts={"state": state, "config": rr.config_digest, "model": ckpt.artifacts["model"]},
        measurements={"binding": rr.binding, "restored_from": ckpt.id, "restored_run": ckpt.run},
    ))
    rr.locate(restore, ckpt_dir)
    return restore, loaded.cursor, data_offset


def train_step(rr: RankRun, step: int, data_offset: int) -> float:
    """One optimizer step of this rank (with the arm's synchronisation); returns the loss of its shard."""
    cfg, tcfg, env, figures = rr.cfg, rr.cfg.train, rr.env, rr.figures
    t0 = time.perf_counter()
    sync_before = rr.comm.seconds
    idx = step_indices(cfg.seed, step + data_offset, len(rr.prep.train), tcfg.global_batch)
    mine = idx if env.world == 1 else shard(idx, env.rank, env.world)
    # The rank's explicit generators are consumed every step (so a resume must restore them): numpy orders
    # the shard; Python seeds the step's dropout masks, drawn from the explicit torch generator.
    mine = [mine[i] for i in rr.rngs.numpy.permutation(len(mine))]
    rr.rngs.torch.manual_seed(rr.rngs.python.getrandbits(62))
    batch = encode_batch(rr.prep.tokenizer, [rr.prep.train[i] for i in mine], tcfg.loss_on, cfg.model.max_len)
    windows = window_batch(rr.stream, cfg, step + data_offset, env.rank, env.world)
    figures.tokens += int(batch[2].sum()) + (0 if windows is None else windows[:, 1:].numel())
    for group in rr.optimizer.param_groups:
        group["lr"] = lr_at(cfg, step)
    rr.optimizer.zero_grad(set_to_none=True)
    denominator = rr.strategy.loss_denominator(len(mine))
    loss = documents_loss(rr.model, tuple(t.to(rr.device) for t in batch), denominator,  # type: ignore[arg-type]
                          None if windows is None else windows.to(rr.device), tcfg.pretrain_weight)
    loss.backward()
    rr.strategy.after_backward()
    if tcfg.grad_clip > 0:
        torch.nn.utils.clip_grad_norm_(rr.strategy.params, tcfg.grad_clip)
    rr.optimizer.step()
    rr.strategy.after_optimizer_step(step)
    figures.update_seconds += time.perf_counter() - t0 - (rr.comm.seconds - sync_before)
    return rr.strategy.shard_loss(float(loss.detach()), len(mine))


def checkpoint(rr: RankRun, step: int, previous: Receipt) -> Receipt:
    """Save this rank's full state at ``step``, record where it is, and append its ``checkpoint`` receipt with the
    losses since the previous one."""
    args, env, figures = rr.args, rr.env, rr.figures
    t0 = time.perf_counter()
    meta = {"run": args.run, "arm": args.arm, "rank": env.rank, "world": env.world, "step": step}
    saved = save_checkpoint(rr.run_dir / f"step{step:07d}", model=rr.model, optimizer=rr.optimizer,
                            outer=rr.strategy.outer_state(), rngs=rr.rngs, cursor=step, meta=meta)
    receipt = rr.record(make_receipt(
        "checkpoint", run=args.run, rank=env.rank, step=step, prepared=rr.prep.receipt.prepared, parents=[previous],
        artifacts=_state_artifacts(saved.manifest, rr.config_digest),
        measurements={"arm": args.arm, "world": env.world, "losses": figures.losses,
                      "files": dict(saved.manifest.files), "sent_bytes": rr.comm.sent_bytes,
                      "outer_steps": rr.strategy.outer_steps},
    ))
    # This receipt's own evidence: its directory, where its state (and every component it names) is re-hashed
    # from; recorded under the digests too, so the model is found by its own digest (evaluation, serving).
    rr.locate(receipt, saved.path)
    figures.losses = []
    figures.checkpoint_seconds += time.perf_counter() - t0
    return receipt


def train_loop(rr: RankRun, previous: Receipt, start_step: int, data_offset: int,
               faults: FaultPlan) -> tuple[Receipt, dict[str, dict[str, int]]]:
    """Steps ``start_step + 1 .. last_step``, checkpointing every K steps and at the end; returns the last
    checkpoint receipt and the host's interface byte counters over the loop."""
    tcfg, figures, last_step = rr.cfg.train, rr.figures, rr.last_step
    counters_before = interface_counters()
    loop_start = time.perf_counter()
    rr.model.train()
    for step in range(start_step + 1, last_step + 1):
        value = train_step(rr, step, data_offset)
        figures.losses.append([step, value])
        if rr.args.progress is not None and rr.env.rank == 0:
            rr.args.progress.write_text(json.dumps({"step": step, "loss": value, "tokens": figures.tokens,
                                                    "seconds": time.perf_counter() - loop_start}))
        if step % tcfg.checkpoint_every == 0 or step == last_step:
            previous = checkpoint(rr, step, previous)
        faults.kill_if_planned(step, rr.env.rank)
    figures.loop_seconds = time.perf_counter() - loop_start
    return previous, counter_delta(counters_before, interface_counters())


def finish(rr: RankRun, final: Receipt, start_step: int, counters: dict[str, dict[str, int]]) -> Receipt:
    """Append the ``train-end`` receipt (the final state and this rank's figures) and leave the group."""
    args, env, comm, figures = rr.args, rr.env, rr.comm, rr.figures
    end = rr.record(make_receipt(
        "train-end", run=args.run, rank=env.rank, step=rr.last_step, prepared=rr.prep.receipt.prepared,
        parents=[final], artifacts=dict(final.artifacts),
        measurements={
            "arm": args.arm,
            "world": env.world,
            "binding": rr.binding,
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
            "steps": rr.last_step - start_step,
            "start_step": start_step,
        },
    ))
    if not args.no_ledger:  # the final state's own directory is the train-end's evidence too
        own = rr.store.receipt_locations(final.id).get("state", [])
        if own:
            rr.locate(end, Path(own[0]))
    comm.barrier()
    shutdown_group()
    return end


def worker(argv: Sequence[str] | None = None) -> int:
    """One rank: set up, optionally restore, train to the end, checkpoint every K steps, emit receipts."""
    args = parse_args(argv)
    env = RankEnv.from_environ()
    faults = FaultPlan.from_args(args)
    with Store.open(args.db) as store:
        rr = set_up(args, env, store)
        previous, start_step, data_offset = start_or_restore(rr, faults)
        final, counters = train_loop(rr, previous, start_step, data_offset, faults)
        end = finish(rr, final, start_step, counters)
    # Every rank reports its end on stdout (its log), so a --no-ledger run's figures are still readable (benchmarks).
    print(json.dumps({"rank": env.rank, "train_end": end.id, "recorded": not args.no_ledger,
                      "loop_seconds": rr.figures.loop_seconds, "sent_bytes": rr.comm.sent_bytes,
                      "ledger_seconds": rr.figures.ledger_seconds}), flush=True)
    return 0


# -------------------------------------------------------------------------------------------- launcher


def summarize_arm(store: Store, prepared: str, arm: str, run: str) -> Receipt:
    """Append the arm summary: per-rank, max-rank and total figures, and ratios against the other arms'
    summaries already in the ledger (which it cites)."""
    ends = [s.receipt for s in store.find(kind="train-end", run=run, prepared=prepared)]
    if len(ends) != ARMS[arm].world:
        raise LedgerError(f"arm {arm} run {run}: expected {ARMS[arm].world} train-end receipts, found {len(ends)}")
    figures = arm_figures(ends)
    if ARMS[arm].identical_replicas and len({e.artifacts["model"] for e in ends}) != 1:
        raise LedgerError(f"{arm} ranks of run {run} ended with different model digests")
    # The baselines the ratios are taken against, by how they synchronise (as verify.training reads them back).
    others: dict[str, Receipt] = {}
    for s in store.find(kind="arm-summary", prepared=prepared):
        other = ARMS.get(str(s.receipt.measurements.get("arm")))
        if other is not None and other.name != arm and other.sync in ("every-step", "none"):
            others[other.sync] = s.receipt
    r = ratios(figures, others["every-step"].measurements if "every-step" in others else None,
               others["none"].measurements if "none" in others else None)
    return store.append(make_receipt(
        "arm-summary", run=run, prepared=prepared, parents=[*ends, *others.values()],
        artifacts={"model": figures["parameter_digest"]},
        measurements={"arm": arm, **figures, "ratios": r},
    )).receipt


def train_arm(workdir: Path, db: str, arm: str, *, run: str | None = None, prepared: str | None = None,
              steps: int | None = None, timeout: float = 30.0, extra: Sequence[str] = (),
              kill: tuple[int, Path] | None = None, check: bool = True, hosts: HostSet | None = None,
              kill_host: bool = False) -> tuple[LaunchResult, str]:
    """Launch every rank of ``arm`` on this host (or one per namespace host of ``hosts``) and wait; returns
    (launch result, run name). ``kill_host``: the planned kill removes the rank's host, not only its process.

    Raises RunFailed (naming the first rank that failed, every exit code and the log directory) if any rank
    failed, unless ``check=False``: a group that is meant to fail (the recovery's killed run, a refused restore)
    returns its result like any other.
    """
    run = run or f"train/{arm}"
    # --run-name, not --run: torchrun (the launcher on hosts) would take --run for its --run-path.
    args = ["--workdir", str(workdir), "--db", str(db), "--arm", arm, "--run-name", run, "--timeout", str(timeout)]
    if prepared:
        args += ["--prepared", prepared]
    if steps is not None:
        args += ["--steps", str(steps)]
    args += list(extra)
    log_dir = workdir / "logs" / run.replace("/", "_")
    result = launch("runners.train", args, ARMS[arm].world, kill=kill, log_dir=log_dir, hosts=hosts,
                    kill_host=kill_host)
    if check and not result.ok:
        raise RunFailed(arm, result.failed_rank, list(result.returncodes), str(log_dir))
    return result, run


if __name__ == "__main__":
    try:
        sys.exit(worker())
    except LedgerError as exc:
        print(f"runners.train: error: {exc.one_line()}", file=sys.stderr, flush=True)
        sys.exit(exc.exit_code)
