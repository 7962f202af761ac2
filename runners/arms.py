"""How the ranks of each training arm synchronise: one strategy per ``Arm.sync``, behind one small interface.

* ``"none"`` (:class:`SingleStrategy`): one rank, nothing to exchange.
* ``"every-step"`` (:class:`FlatDDPStrategy`): data-parallel; after every backward each rank's gradients are
  summed across ranks as one flat buffer in fixed parameter order through a gloo/NCCL all-reduce, and the loss is
  divided by the global batch, so the sum is the gradient of the global mean. One flat buffer, because its summation
  order then never depends on when the process group was built (torch's DistributedDataParallel regroups its
  buckets after the first step of each construction, which makes a resumed run differ in the last bits).
* ``"diloco"`` (:class:`DilocoStrategy`): each rank takes H inner AdamW steps on its shard, then the ranks
  all-reduce the averaged pseudo-gradient (outer copy - local weights) and take an outer SGD (Nesterov) momentum
  step, written out in :class:`Diloco` so a verifier can recompute it from its inputs.

The worker (:mod:`runners.train`) asks :func:`strategy_for` for the arm's strategy and calls its hooks; it never
looks at an arm's name. What differs between arms is exactly the interface of :class:`Strategy`: the loss
denominator and the reported shard loss, what happens after backward and after the optimizer step, the outer state
a checkpoint adds and its restore, and the bytes the rank sends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import ClassVar, Final

import torch

from ledger.errors import InputError
from ledger.experiment.config import Arm, TrainConfig
from runners.checkpoint import OuterState
from runners.distributed import Comm


def flat(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """One contiguous buffer of ``tensors`` in the given order (one all-reduce, one fixed summation order)."""
    return torch.cat([t.reshape(-1) for t in tensors])


def unflat_into(buffer: torch.Tensor, tensors: Sequence[torch.Tensor]) -> None:
    """Copy consecutive slices of ``buffer`` back into ``tensors`` (the inverse of :func:`flat`)."""
    offset = 0
    for t in tensors:
        n = t.numel()
        t.copy_(buffer[offset : offset + n].view_as(t))
        offset += n


def _payload(params: Sequence[torch.Tensor]) -> int:
    """Bytes of one flat buffer over ``params``: what one all-reduce of it counts as sent."""
    return sum(p.numel() * p.element_size() for p in params)


# ------------------------------------------------------------------------------------------------ DiLoCo


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
        """An outer copy of ``model``'s parameters now, zero momentum, no outer step taken."""
        named = [(n, p) for n, p in model.named_parameters()]
        return cls([n for n, _ in named], [p.detach().clone() for _, p in named],
                   [torch.zeros_like(p) for _, p in named], lr, beta, nesterov)

    def state(self) -> OuterState:
        """The checkpointable state; its tensors are the live ones, so loading into it restores this object."""
        tensors = {f"outer.{n}": t for n, t in zip(self.names, self.outer, strict=True)}
        tensors.update({f"momentum.{n}": t for n, t in zip(self.names, self.momentum, strict=True)})
        scalars = {"outer_lr": self.lr, "momentum": self.beta, "nesterov": self.nesterov, "outer_steps": self.steps}
        return OuterState(tensors=tensors, scalars=scalars)

    def load(self, state: OuterState) -> None:
        """Take the outer copy, momentum and outer step count from ``state``."""
        for i, n in enumerate(self.names):
            self.outer[i].copy_(state.tensors[f"outer.{n}"])
            self.momentum[i].copy_(state.tensors[f"momentum.{n}"])
        self.steps = int(state.scalars["outer_steps"])

    @torch.no_grad()
    def sync(self, model: torch.nn.Module, comm: Comm) -> None:
        """One outer step: all-reduce the pseudo-gradient, update the outer copy, set the local weights to it."""
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


# ---------------------------------------------------------------------------------------------- strategies


class Strategy:
    """What an arm does differently from the others; every hook defaults to "nothing to synchronise".

    The worker calls, each step: :meth:`loss_denominator` for the loss it backpropagates; :meth:`after_backward`;
    then, after gradient clipping and the optimizer step, :meth:`after_optimizer_step`; and :meth:`shard_loss` for
    the loss it records. A checkpoint stores :meth:`outer_state`; a restore loads the checkpoint into it, then
    calls :meth:`restore`. The strategy's collectives go through :attr:`comm`, which counts what it sends.
    """

    sync: ClassVar[str]

    def __init__(self, comm: Comm, params: Sequence[torch.Tensor]) -> None:
        self.comm = comm  # counts every byte and second the strategy's collectives spend
        self.params = list(params)  # the fixed parameter order of every flat buffer

    def loss_denominator(self, shard_size: int) -> int:
        """What the sum of the shard's per-document losses is divided by before backward."""
        return shard_size

    def shard_loss(self, loss: float, shard_size: int) -> float:
        """The mean loss of the rank's shard, from the loss it backpropagated (exact float bits)."""
        return loss

    def after_backward(self) -> None:
        """Synchronise gradients before clipping and the optimizer step."""

    def after_optimizer_step(self, step: int) -> None:
        """Synchronise weights after the optimizer step of ``step``."""

    def outer_state(self) -> OuterState | None:
        """The state the arm adds to a checkpoint (None: none); a restore loads into this very object."""
        return None

    def restore(self, state: OuterState | None) -> None:
        """Take up ``state`` (what :meth:`outer_state` returned, loaded from a checkpoint)."""

    @property
    def outer_steps(self) -> int:
        """Outer synchronisations taken so far (recorded in each checkpoint receipt)."""
        return 0

    def planned_sent_bytes(self, first_step: int, last_step: int) -> int:
        """The payload bytes this rank sends over steps ``first_step..last_step``, as its Comm counts them."""
        return 0


class SingleStrategy(Strategy):
    """One rank with the whole global batch: nothing to exchange."""

    sync = "none"


class FlatDDPStrategy(Strategy):
    """Every step, the sum over ranks of their gradients, as one flat buffer in fixed parameter order; each rank's
    loss is divided by the global batch, so the sum is the gradient of the mean over every rank's documents."""

    sync = "every-step"

    def __init__(self, comm: Comm, params: Sequence[torch.Tensor], global_batch: int) -> None:
        super().__init__(comm, params)
        self.global_batch = global_batch

    def loss_denominator(self, shard_size: int) -> int:
        return self.global_batch

    def shard_loss(self, loss: float, shard_size: int) -> float:
        return loss * (self.global_batch / shard_size)  # this order of operations is what the receipts hold

    def after_backward(self) -> None:
        grads = flat([p.grad for p in self.params])  # type: ignore[misc]
        self.comm.all_reduce_sum(grads, "gradient")
        unflat_into(grads, [p.grad for p in self.params])  # type: ignore[misc]

    def planned_sent_bytes(self, first_step: int, last_step: int) -> int:
        steps = max(0, last_step - first_step + 1)
        return 0 if self.comm.world == 1 else steps * _payload(self.params)


class DilocoStrategy(Strategy):
    """H local AdamW steps, then the outer step of :class:`Diloco` over the ranks' averaged pseudo-gradient."""

    sync = "diloco"

    def __init__(self, comm: Comm, model: torch.nn.Module, outer: Diloco, inner_steps: int) -> None:
        super().__init__(comm, [p for _, p in model.named_parameters()])
        self.model = model
        self.outer = outer
        self.inner_steps = inner_steps

    def after_optimizer_step(self, step: int) -> None:
        if step % self.inner_steps == 0:  # the round ends on multiples of H, so a resume keeps the same rounds
            self.outer.sync(self.model, self.comm)

    def outer_state(self) -> OuterState:
        return self.outer.state()

    def restore(self, state: OuterState | None) -> None:
        if state is not None:  # load_checkpoint already refused a checkpoint without an outer component
            self.outer.load(state)

    @property
    def outer_steps(self) -> int:
        return self.outer.steps

    def planned_sent_bytes(self, first_step: int, last_step: int) -> int:
        rounds = max(0, last_step // self.inner_steps - (first_step - 1) // self.inner_steps)
        return 0 if self.comm.world == 1 else rounds * _payload(self.params)


STRATEGIES: Final[dict[str, type[Strategy]]] = {
    cls.sync: cls for cls in (SingleStrategy, FlatDDPStrategy, DilocoStrategy)
}


def strategy_for(arm: Arm, model: torch.nn.Module, train: TrainConfig, comm: Comm) -> Strategy:
    """The strategy of ``arm`` (by its ``sync`` field) over ``model``'s parameters; its collectives go to ``comm``.

    Build it after the model is on its device and before any training step: DiLoCo's outer copy is taken here.
    """
    if arm.sync == "none":
        return SingleStrategy(comm, [p for _, p in model.named_parameters()])
    if arm.sync == "every-step":
        return FlatDDPStrategy(comm, [p for _, p in model.named_parameters()], train.global_batch)
    if arm.sync == "diloco":
        d = train.diloco
        return DilocoStrategy(comm, model, Diloco.start(model, d.outer_lr, d.outer_momentum, d.nesterov),
                              d.inner_steps)
    raise InputError(f"arm {arm.name}: unknown sync {arm.sync!r}; expected one of {', '.join(STRATEGIES)}")


__all__ = [
    "STRATEGIES",
    "Diloco",
    "DilocoStrategy",
    "FlatDDPStrategy",
    "SingleStrategy",
    "Strategy",
    "flat",
    "strategy_for",
    "unflat_into",
]
