"""The arms' synchronisation strategies in one process: each one chosen from the Arm table by its sync, the flat
DDP reduction in fixed parameter order, DiLoCo's outer step recomputed by hand bit for bit (and against
torch.optim.SGD), the outer state through a real checkpoint, and the bytes each one says it sends.

Collectives run on a world-1 Comm (the all-reduce is the identity) or on a stand-in for ``world`` identical ranks
(the sum is ``world`` times the buffer, exact in binary for 4), so no process group is needed here; the
multi-process behaviour is tests/runners/test_train.py's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pytest
import torch

from ledger.errors import InputError
from ledger.experiment.config import ARMS, Arm, DilocoConfig, TrainConfig
from runners.arms import (
    STRATEGIES,
    Diloco,
    DilocoStrategy,
    FlatDDPStrategy,
    SingleStrategy,
    Strategy,
    strategy_for,
)
from runners.checkpoint import load_checkpoint, save_checkpoint
from runners.distributed import Comm
from runners.rng import Rngs

EXPECTED = {"none": SingleStrategy, "every-step": FlatDDPStrategy, "diloco": DilocoStrategy}
H = 2


@dataclass
class IdenticalRanks(Comm):
    """A Comm whose all-reduce sums ``world`` identical copies of the buffer (counting bytes like a real one) and
    remembers what it was given."""

    seen: list[tuple[str, torch.Tensor]] = field(default_factory=list)

    def all_reduce_sum(self, tensor: torch.Tensor, op_name: str = "all_reduce") -> None:
        self.seen.append((op_name, tensor.clone()))
        tensor.mul_(self.world)
        nbytes = tensor.numel() * tensor.element_size()
        self.sent_bytes += nbytes
        self.calls += 1
        self.per_op[op_name] = self.per_op.get(op_name, 0) + nbytes


def tiny_model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Tanh(), torch.nn.Linear(3, 2))


def train_config(nesterov: bool = True) -> TrainConfig:
    return TrainConfig(global_batch=8, diloco=DilocoConfig(inner_steps=H, outer_lr=0.7, outer_momentum=0.5,
                                                           nesterov=nesterov))


def n_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ------------------------------------------------------------------------------------------------ choice


@pytest.mark.parametrize("name", list(ARMS))
def test_each_arm_gets_the_strategy_of_its_sync(name: str) -> None:
    arm = ARMS[name]
    strategy = strategy_for(arm, tiny_model(), train_config(), Comm(arm.world))
    assert type(strategy) is EXPECTED[arm.sync] and STRATEGIES[arm.sync] is EXPECTED[arm.sync]
    assert strategy.sync == arm.sync


def test_the_strategy_follows_sync_not_the_arm_name() -> None:
    assert type(strategy_for(Arm("ddp-four", 1, "diloco"), tiny_model(), train_config(), Comm(1))) is DilocoStrategy
    assert type(strategy_for(Arm("eight", 8, "every-step"), tiny_model(), train_config(), Comm(8))) is FlatDDPStrategy
    assert type(strategy_for(Arm("diloco-four", 1, "none"), tiny_model(), train_config(), Comm(1))) is SingleStrategy


def test_an_unknown_sync_is_refused_by_name() -> None:
    arm = Arm("ring-four", 4, "ring")  # type: ignore[arg-type]
    with pytest.raises(InputError) as info:
        strategy_for(arm, tiny_model(), train_config(), Comm(4))
    assert str(info.value) == "arm ring-four: unknown sync 'ring'; expected one of none, every-step, diloco"


# ---------------------------------------------------------------------------------------- loss and bytes


def test_loss_denominator_and_reported_shard_loss() -> None:
    model, cfg = tiny_model(), train_config()
    for arm in (Arm("x", 4, "none"), Arm("x", 4, "diloco")):
        s = strategy_for(arm, model, cfg, Comm(4))
        assert s.loss_denominator(2) == 2 and s.shard_loss(0.1, 2) == 0.1
    ddp = strategy_for(Arm("x", 4, "every-step"), model, cfg, Comm(4))
    # The backpropagated loss is over the global batch; the recorded one is the shard's mean, these exact bits.
    assert ddp.loss_denominator(2) == cfg.global_batch
    assert ddp.shard_loss(0.1, 2) == 0.1 * (8 / 2)


def test_planned_sent_bytes() -> None:
    model, cfg = tiny_model(), train_config()
    n = n_bytes(model)
    single = strategy_for(ARMS["single"], model, cfg, Comm(1))
    ddp = strategy_for(ARMS["ddp-four"], model, cfg, Comm(4))
    diloco = strategy_for(ARMS["diloco-four"], model, cfg, Comm(4))
    assert single.planned_sent_bytes(1, 8) == 0
    assert ddp.planned_sent_bytes(1, 8) == 8 * n and ddp.planned_sent_bytes(5, 8) == 4 * n
    assert diloco.planned_sent_bytes(1, 8) == 4 * n  # outer steps after 2, 4, 6, 8
    assert diloco.planned_sent_bytes(4, 8) == 3 * n and diloco.planned_sent_bytes(5, 8) == 2 * n
    assert diloco.planned_sent_bytes(3, 3) == 0
    assert strategy_for(Arm("x", 1, "every-step"), model, cfg, Comm(1)).planned_sent_bytes(1, 8) == 0


# ----------------------------------------------------------------------------------------------- DDP


def test_flat_ddp_reduces_one_buffer_in_parameter_order() -> None:
    model = tiny_model()
    comm = IdenticalRanks(world=4)
    ddp = strategy_for(ARMS["ddp-four"], model, train_config(), comm)
    model(torch.randn(5, 4)).sum().backward()
    names = [n for n, _ in model.named_parameters()]
    before = [p.grad.clone() for _, p in model.named_parameters()]  # type: ignore[union-attr]
    ddp.after_backward()
    assert len(comm.seen) == 1 and comm.seen[0][0] == "gradient"
    assert torch.equal(comm.seen[0][1], torch.cat([g.reshape(-1) for g in before]))  # named_parameters order
    for name, g, (_, p) in zip(names, before, model.named_parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, g * 4), name  # each slice went back to its own parameter
    assert comm.sent_bytes == n_bytes(model) == ddp.planned_sent_bytes(1, 1)
    ddp.after_optimizer_step(H)  # nothing happens after the optimizer step
    assert ddp.outer_state() is None and ddp.outer_steps == 0 and len(comm.seen) == 1


# ---------------------------------------------------------------------------------------------- DiLoCo


def _by_hand(outer: list[np.ndarray], buf: list[np.ndarray], local: list[np.ndarray], world: int, lr: float,
             beta: float, nesterov: bool) -> None:
    """The outer step of the Diloco docstring in numpy float32, one rounding per operation, in place."""
    lr32, beta32 = np.float32(lr), np.float32(beta)
    for i in range(len(outer)):
        g = ((outer[i] - local[i]) * np.float32(world)) / np.float32(world)  # world identical ranks, averaged
        buf[i] = buf[i] * beta32 + g
        update = g + beta32 * buf[i] if nesterov else buf[i]
        outer[i] = outer[i] - lr32 * update
        local[i] = outer[i].copy()


@pytest.mark.parametrize("world", [1, 4])
@pytest.mark.parametrize("nesterov", [True, False])
def test_diloco_outer_step_recomputed_by_hand_bit_for_bit(nesterov: bool, world: int) -> None:
    model = tiny_model()
    cfg = train_config(nesterov)
    comm = Comm(1) if world == 1 else IdenticalRanks(world=world)
    strategy = strategy_for(Arm("x", world, "diloco"), model, cfg, comm)
    assert isinstance(strategy, DilocoStrategy)
    outer = [p.detach().numpy().copy() for p in model.parameters()]
    buf = [np.zeros_like(o) for o in outer]
    noise = torch.Generator().manual_seed(1)
    for step in range(1, 7):
        with torch.no_grad():  # an inner AdamW step moved the local weights somewhere
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=noise) * 0.1)
        local = [p.detach().numpy().copy() for p in model.parameters()]
        strategy.after_optimizer_step(step)
        if step % H == 0:
            _by_hand(outer, buf, local, world, cfg.diloco.outer_lr, cfg.diloco.outer_momentum, nesterov)
        for i, p in enumerate(model.parameters()):
            assert np.array_equal(p.detach().numpy(), local[i]), (step, i)  # the same bits
            assert np.array_equal(strategy.outer.outer[i].numpy(), outer[i]), (step, i)
            assert np.array_equal(strategy.outer.momentum[i].numpy(), buf[i]), (step, i)
        assert strategy.outer_steps == step // H
    assert comm.sent_bytes == (0 if world == 1 else strategy.planned_sent_bytes(1, 6))


@pytest.mark.parametrize("nesterov", [True, False])
def test_diloco_outer_step_is_torch_sgd(nesterov: bool) -> None:
    """The written-out outer step is torch.optim.SGD(momentum, nesterov, dampening 0) on the outer copy, over
    several outer steps (world 1: the all-reduce is the identity). Equal up to rounding: torch fuses its
    multiply-adds (add with alpha), ours rounds each product, so the last bits may differ."""
    torch.manual_seed(0)
    model = torch.nn.Linear(5, 3)
    reference = [p.detach().clone().requires_grad_(True) for p in model.parameters()]
    sgd = torch.optim.SGD(reference, lr=0.7, momentum=0.5, nesterov=nesterov, dampening=0.0)
    outer = Diloco.start(model, 0.7, 0.5, nesterov)
    for _ in range(3):
        with torch.no_grad():  # local inner steps moved the weights somewhere
            for p in model.parameters():
                p.add_(torch.randn_like(p) * 0.1)
        for r, p in zip(reference, model.parameters(), strict=True):
            r.grad = (r.detach() - p.detach()).clone()
        sgd.step()
        outer.sync(model, Comm(world=1))
        for r, p in zip(reference, model.parameters(), strict=True):
            assert torch.allclose(r.detach(), p.detach(), rtol=0.0, atol=1e-6)
    assert outer.state().scalars["nesterov"] is nesterov


# ------------------------------------------------------------------------------------------- checkpoints


def _rank(model: torch.nn.Module, sync: str) -> tuple[Strategy, torch.optim.Optimizer, Rngs]:
    strategy = strategy_for(Arm("x", 1, sync), model, train_config(), Comm(1))  # type: ignore[arg-type]
    return strategy, torch.optim.AdamW(model.parameters(), lr=1e-2), Rngs.from_seed(7, 0)


def _inner_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, strategy: Strategy, step: int) -> None:
    optimizer.zero_grad(set_to_none=True)
    model(torch.ones(2, 4) * step).sum().backward()
    strategy.after_backward()
    optimizer.step()
    strategy.after_optimizer_step(step)


@pytest.mark.parametrize("sync", list(EXPECTED))
def test_outer_state_through_a_checkpoint_continues_identically(tmp_path: Path, sync: str) -> None:
    """Save after step 3 (between DiLoCo rounds), restore into a fresh rank the way the worker does, and take the
    same next steps on both: the weights stay bit-identical."""
    model = tiny_model()
    strategy, optimizer, rngs = _rank(model, sync)
    for step in (1, 2, 3):
        _inner_step(model, optimizer, strategy, step)
    saved = save_checkpoint(tmp_path / "step3", model=model, optimizer=optimizer, outer=strategy.outer_state(),
                            rngs=rngs, cursor=3, meta={"step": 3})
    assert ("outer" in saved.manifest.components) == (sync == "diloco")

    fresh = tiny_model(seed=1)
    restored, fresh_optimizer, fresh_rngs = _rank(fresh, sync)
    outer = restored.outer_state()
    load_checkpoint(saved.path, model=fresh, optimizer=fresh_optimizer, outer=outer, rngs=fresh_rngs)
    restored.restore(outer)
    assert restored.outer_steps == strategy.outer_steps == (1 if sync == "diloco" else 0)
    for step in (4, 5, 6):
        _inner_step(model, optimizer, strategy, step)
        _inner_step(fresh, fresh_optimizer, restored, step)
    for a, b in zip(model.parameters(), fresh.parameters(), strict=True):
        assert torch.equal(a, b)
    assert restored.outer_steps == strategy.outer_steps
