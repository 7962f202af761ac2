"""What a kind's verification check receives, and the protocol through which the CLI hands verify a way to
re-execute a model (a runner capability: verify itself never imports torch or the runners)."""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ledger.artifacts import ArtifactStore
from ledger.errors import SHAPE_ERRORS, InputError, RecordInvalid, VerificationError
from ledger.receipts import Receipt
from ledger.store import Store


class LoadedModel(Protocol):
    """A model loaded from a verified checkpoint, run exactly as the recorded evaluation ran it."""

    cpu: str  # the CPU code paths computing its floats, as an eval's ``settings.cpu`` records them

    def generate(self, prompts: Sequence[Sequence[int]], *, eos_id: int, max_new_tokens: int,
                 batch_size: int) -> list[list[int]]: ...

    def nll(self, sequences: Sequence[Sequence[int]], *, batch_size: int) -> list[float]: ...


class ModelRunner(Protocol):
    """Re-executes models for verification (``ledger verify --rescore``); runners/reexecute.py implements it."""

    def load(self, checkpoint: Path, config: Any, vocab_size: int, *, state: str, model: str, receipt: str,
             threads: int) -> AbstractContextManager[LoadedModel]: ...


T = TypeVar("T")


class Memo:
    """What the checks of one verification have already computed, by key: an audit verifies many receipts whose
    ancestries overlap (the same evals, selection documents and outcome files), and each is recomputed once.
    Only results are kept; a check that fails raises, and that ends the verification."""

    def __init__(self) -> None:
        self._values: dict[Hashable, Any] = {}
        self.places: set[tuple[Path, str]] = set()  # (place, digest): re-hashed, and the bytes there have that digest

    def once(self, key: Hashable, compute: Callable[[], T]) -> T:
        """``compute()``, the first time ``key`` is asked for; its result afterwards."""
        if key not in self._values:
            self._values[key] = compute()
        return self._values[key]


@dataclass(frozen=True)
class KindCheckContext:
    """What a kind's check gets: the receipt, its verified ancestry, where artifact bytes are, and options."""

    store: Store
    receipt: Receipt
    closure: dict[str, Receipt]
    artifacts: ArtifactStore
    require_artifacts: bool
    rescore: int = 0  # re-execute this many sampled documents per eval receipt (0: recompute statistics only)
    rescore_seed: int = 0
    runner: ModelRunner | None = None  # how to re-execute a model; needed only when rescore > 0
    memo: Memo = field(default_factory=Memo)  # shared by every check of one verification (verify.receipts.Verifier)

    def for_receipt(self, receipt: Receipt, closure: dict[str, Receipt]) -> KindCheckContext:
        """This context's ledger, artifacts and options for another receipt and its ancestry: the fields copied,
        not passed through the frozen dataclass's ``__init__`` (2.2 us, more than the check of a note it serves)."""
        ctx = object.__new__(KindCheckContext)
        ctx.__dict__.update(self.__dict__, receipt=receipt, closure=closure)
        return ctx


# A check raises a VerificationError or returns lines saying what held.
KindCheck = Callable[[KindCheckContext], list[str]]


def guarded(check: KindCheck) -> KindCheck:
    """A malformed stored record (a missing key, a wrong type, inconsistent counts, a zero count divided by, an
    integer too large for a float) is a failed verification of the receipt being checked, never a crash or a usage
    error."""

    def run(ctx: KindCheckContext) -> list[str]:
        try:
            return check(ctx)
        except VerificationError:
            raise
        except (InputError, *SHAPE_ERRORS) as exc:
            detail = exc.one_line() if isinstance(exc, InputError) else f"{type(exc).__name__}: {exc}"
            raise RecordInvalid.at(f"receipt {ctx.receipt.id}: malformed {ctx.receipt.kind} record: {detail}",
                                   receipt=ctx.receipt.id, field="measurements",
                                   expected=f"a well-formed {ctx.receipt.kind} record", actual=detail) from exc

    run.__name__ = getattr(check, "__name__", "check")
    run.__doc__ = check.__doc__
    return run
