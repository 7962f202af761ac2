"""Explicit generators derived from (seed, rank) and the exact capture and restore of every generator a step draws
from (runners.rng)."""

from __future__ import annotations

import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import torch

from ledger import digests
from ledger.errors import CheckpointMismatch
from runners.rng import (
    T_GLOBAL_NUMPY_KEY,
    T_PYTHON,
    T_TORCH,
    Rngs,
    apply_rng_state,
    capture_rng_state,
    parse_rng_state,
    seed_global_rngs,
)


@pytest.fixture(autouse=True)
def _keep_global_rngs() -> Iterator[None]:
    """These tests reseed the process-global generators; give other tests theirs back."""
    saved = torch.get_rng_state(), np.random.get_state(), random.getstate()
    yield
    torch.set_rng_state(saved[0])
    np.random.set_state(saved[1])
    random.setstate(saved[2])


def draws(rngs: Rngs) -> dict[str, Any]:
    """A few values from every generator: the explicit ones and the process-global ones."""
    return {
        "torch": torch.rand(3, generator=rngs.torch).tolist(),
        "numpy": rngs.numpy.integers(0, 2**62, size=3).tolist() + rngs.numpy.integers(0, 9, 3, np.int32).tolist(),
        "python": [rngs.python.random(), rngs.python.gauss(0.0, 1.0)],
        "global.torch": torch.rand(3).tolist(),
        "global.numpy": np.random.standard_normal(3).tolist(),
        "global.python": [random.random(), random.gauss(0.0, 1.0)],
    }


# ---------------------------------------------------------------------------------------------- derivation


def test_generators_follow_the_documented_derivation() -> None:
    words = [int(w) for w in np.random.SeedSequence([1234, 3]).generate_state(4, dtype=np.uint64)]
    rngs = Rngs.from_seed(1234, 3)
    assert torch.equal(torch.rand(4, generator=rngs.torch),
                       torch.rand(4, generator=torch.Generator("cpu").manual_seed(words[0])))
    assert rngs.numpy.random(4).tolist() == np.random.Generator(np.random.PCG64(words[1])).random(4).tolist()
    assert rngs.python.random() == random.Random(words[2]).random()
    seed_global_rngs(1234, 3)
    got = torch.rand(2).tolist(), np.random.random(2).tolist(), random.random()
    torch.manual_seed(words[3])
    np.random.seed(words[3] % 2**32)
    random.seed(words[3])
    assert got == (torch.rand(2).tolist(), np.random.random(2).tolist(), random.random())


def test_generators_are_deterministic_and_distinct_per_rank_and_seed() -> None:
    def explicit(seed: int, rank: int) -> dict[str, Any]:
        r = Rngs.from_seed(seed, rank)
        return {"torch": torch.rand(3, generator=r.torch).tolist(), "numpy": r.numpy.random(3).tolist(),
                "python": [r.python.random() for _ in range(3)]}

    assert explicit(7, 0) == explicit(7, 0)
    others = [explicit(7, 1), explicit(7, 2), explicit(8, 0)]
    for other in others:
        for name, values in explicit(7, 0).items():
            assert other[name] != values, name
    assert len({tuple(o["torch"]) for o in others}) == 3
    with pytest.raises(ValueError, match="seed and rank must be non-negative integers, got seed=1 rank=-1"):
        Rngs.from_seed(1, -1)


# ----------------------------------------------------------------------------------------- capture, apply


def test_capture_then_apply_continues_every_generator_exactly() -> None:
    rngs = Rngs.from_seed(5, 2)
    seed_global_rngs(5, 2)
    draws(rngs)  # mid-stream: Python's and numpy's cached gaussians and numpy's buffered uint32 are in play
    tensors, scalars = capture_rng_state(rngs, cursor=11)
    expected = draws(rngs)
    # the stored form: tensors, and scalars that survive canonical JSON (128-bit PCG64 words as decimal strings)
    stored = digests.parse_canonical(digests.canonical_bytes(scalars))
    assert isinstance(stored["generator"]["numpy"]["state"], str) and stored["global"]["python"]["gauss_next"]
    target = Rngs.from_seed(99, 0)
    seed_global_rngs(99, 0)
    draws(target)
    parsed = parse_rng_state({n: t.clone() for n, t in tensors.items()}, stored, into=target)
    assert apply_rng_state(target, parsed) == 11
    assert (target.seed, target.rank) == (5, 2)
    assert draws(target) == expected


@pytest.mark.parametrize(("tensors_edit", "scalars_edit", "message"), [
    (lambda t: t.pop(T_TORCH), None, "rng tensor 'generator.torch' is missing"),
    (lambda t: t.update({T_PYTHON: t[T_PYTHON].to(torch.int32)}), None,
     "rng tensor 'generator.python' has dtype torch.int32 shape (625,)"),
    (lambda t: t.update({T_GLOBAL_NUMPY_KEY: t[T_GLOBAL_NUMPY_KEY][:10]}), None,
     "rng tensor 'global.numpy.key' has dtype torch.int64 shape (10,)"),
    (lambda t: t.update(extra=torch.zeros(1)), None, "unexpected rng tensors ['extra']"),
    (None, lambda s: s.pop("cursor"), "rng scalars are not a capture of this format (KeyError('cursor'))"),
    (None, lambda s: s["generator"]["numpy"].update(bit_generator="MT19937"),
     "(ValueError('unsupported bit generator'))"),
    (None, lambda s: s["generator"]["numpy"].update(state="0x12"), "rng scalars are not a capture of this format"),
    (None, lambda s: s["global"].update(cuda_devices=1), "rng tensor 'global.cuda.0' is missing"),
])
def test_malformed_state_is_rejected_naming_what(tensors_edit: Callable[[dict[str, torch.Tensor]], Any] | None,
                                                 scalars_edit: Callable[[dict[str, Any]], Any] | None,
                                                 message: str) -> None:
    tensors, scalars = capture_rng_state(Rngs.from_seed(1, 0), cursor=0)
    parse_rng_state(tensors, scalars)  # the capture itself is fine
    if tensors_edit is not None:
        tensors_edit(tensors)
    if scalars_edit is not None:
        scalars_edit(scalars)
    with pytest.raises(CheckpointMismatch) as info:
        parse_rng_state(tensors, scalars, where="step-4/rng")
    assert str(info.value).startswith("checkpoint step-4/rng: ") and message in str(info.value), str(info.value)


def test_only_pcg64_explicit_generators_are_captured_or_restored_into() -> None:
    tensors, scalars = capture_rng_state(Rngs.from_seed(1, 0), cursor=0)
    mt = Rngs.from_seed(1, 0)
    mt.numpy = np.random.Generator(np.random.MT19937(1))
    with pytest.raises(CheckpointMismatch, match="Rngs.numpy must use a PCG64 bit generator") as info:
        parse_rng_state(tensors, scalars, into=mt)
    assert (info.value.expected, info.value.actual) == ("PCG64", "MT19937")
    with pytest.raises(TypeError, match="PCG64"):
        capture_rng_state(mt, cursor=0)
