"""The experiment's training arms: experiment policy the chain rules, the runners and the verifier all read from here.
A module of its own so that the chain rules (ledger/rules.py) need not import the configuration's loader."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from types import MappingProxyType
from typing import Final, Literal


@dataclass(frozen=True)
class Arm:
    """A training arm: its name, its world size, and how its ranks synchronize (experiment policy that the chain
    rules and the verifier read from here, never from literal arm names)."""

    name: str
    world: int
    sync: Literal["none", "every-step", "diloco"]

    @property
    def identical_replicas(self) -> bool:
        """Every rank ends with the same weights: a single rank trivially, DDP by averaging every step."""
        return self.sync != "diloco"


# The three arms, in the order the experiment runs and reports them.
ARMS: Final[Mapping[str, Arm]] = MappingProxyType({a.name: a for a in (
    Arm("single", 1, "none"), Arm("ddp-four", 4, "every-step"), Arm("diloco-four", 4, "diloco"))})
