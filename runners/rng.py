"""Explicit random generators for a rank, and their exact capture and restore.

All randomness a training step consumes flows from a :class:`Rngs` derived from ``(seed, rank)``, plus a data cursor:
the data a step consumes is a function of the step, so the cursor is the next step (or sample) index. Libraries
still draw from the process-global generators (dropout uses torch's default generator), so those are captured and
restored as well: torch's default CPU generator, every CUDA generator when CUDA is available, numpy's legacy global
``RandomState`` and Python's global ``random``.

Derivation (documented so another implementation can reproduce it)::

    words = numpy.random.SeedSequence([seed, rank]).generate_state(4, dtype=numpy.uint64)
    torch generator   = torch.Generator("cpu").manual_seed(words[0])
    numpy generator   = numpy.random.Generator(numpy.random.PCG64(words[1]))
    python generator  = random.Random(words[2])
    globals (seed_global_rngs): torch.manual_seed(words[3]); numpy.random.seed(words[3] % 2**32);
                                random.seed(words[3])

State encoding (the ``rng`` component: tensors go to ``rng.safetensors``, scalars to ``rng.json``):

* torch generator states (explicit and global, each CUDA device): their ``uint8`` state tensors as returned by
  ``get_state`` / ``get_rng_state``.
* Python ``random`` state ``(version, 625 words, gauss_next)``: the 625 words (624 Mersenne Twister words below 2**32
  and the index, at most 624) as one ``int64`` tensor; ``version`` (int) and ``gauss_next`` (float or null) as
  scalars.
* numpy PCG64 state: ``state`` and ``inc`` are 128-bit integers, beyond canonical JSON's signed 64-bit range, so
  they are stored as **decimal strings** (exact, and readable); ``has_uint32`` and ``uinteger`` as integers.
* numpy legacy global MT19937 state: the 624 key words (uint32) as an ``int64`` tensor; ``pos``, ``has_gauss`` and
  ``cached_gaussian`` as scalars.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any, Final

import numpy as np
import torch

from ledger.errors import CheckpointMismatch

# Tensor names inside the rng component.
T_TORCH: Final = "generator.torch"
T_PYTHON: Final = "generator.python"
T_GLOBAL_TORCH: Final = "global.torch"
T_GLOBAL_CUDA: Final = "global.cuda."  # + device index
T_GLOBAL_NUMPY_KEY: Final = "global.numpy.key"
T_GLOBAL_PYTHON: Final = "global.python"

JSON = dict[str, Any]


def _derive_words(seed: int, rank: int) -> list[int]:
    if seed < 0 or rank < 0:
        raise ValueError(f"seed and rank must be non-negative integers, got seed={seed} rank={rank}")
    words = np.random.SeedSequence([seed, rank]).generate_state(4, dtype=np.uint64)
    return [int(w) for w in words]


@dataclass
class Rngs:
    """The explicit generators of one rank. Build with :meth:`from_seed`; pass them to whatever draws randomness."""

    seed: int
    rank: int
    torch: torch.Generator
    numpy: np.random.Generator
    python: random.Random

    @classmethod
    def from_seed(cls, seed: int, rank: int) -> Rngs:
        """Generators derived deterministically from ``(seed, rank)`` (see the module docstring)."""
        w = _derive_words(seed, rank)
        gen = torch.Generator(device="cpu")
        gen.manual_seed(w[0])
        return cls(seed=seed, rank=rank, torch=gen, numpy=np.random.Generator(np.random.PCG64(w[1])),
                   python=random.Random(w[2]))


def seed_global_rngs(seed: int, rank: int) -> None:
    """Seed the process-global generators (torch incl. CUDA, numpy legacy, Python) from ``(seed, rank)``."""
    w = _derive_words(seed, rank)[3]
    torch.manual_seed(w)
    np.random.seed(w % 2**32)
    random.seed(w)


# ------------------------------------------------------------------------------------------------- capture


def _python_state(state: tuple[Any, ...]) -> tuple[torch.Tensor, JSON]:
    version, words, gauss_next = state
    return torch.tensor(words, dtype=torch.int64), {"version": version, "gauss_next": gauss_next}


def capture_rng_state(rngs: Rngs, cursor: int) -> tuple[dict[str, torch.Tensor], JSON]:
    """The full RNG state of this process and ``rngs``, plus the data ``cursor``: (tensors, JSON-safe scalars)."""
    tensors: dict[str, torch.Tensor] = {}
    tensors[T_TORCH] = rngs.torch.get_state().clone()
    tensors[T_PYTHON], py_scalars = _python_state(rngs.python.getstate())

    bit_gen = rngs.numpy.bit_generator
    if not isinstance(bit_gen, np.random.PCG64):
        raise TypeError(f"Rngs.numpy must use a PCG64 bit generator, got {type(bit_gen).__name__}")
    np_state = bit_gen.state
    np_scalars = {
        "bit_generator": np_state["bit_generator"],
        "state": str(np_state["state"]["state"]),
        "inc": str(np_state["state"]["inc"]),
        "has_uint32": int(np_state["has_uint32"]),
        "uinteger": int(np_state["uinteger"]),
    }

    tensors[T_GLOBAL_TORCH] = torch.get_rng_state().clone()
    cuda_devices = 0
    if torch.cuda.is_available():  # pragma: no cover - no GPU in CI
        for i, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"{T_GLOBAL_CUDA}{i}"] = state.cpu().clone()
            cuda_devices += 1

    legacy = np.random.get_state(legacy=True)
    if not isinstance(legacy, tuple) or legacy[0] != "MT19937":
        raise TypeError("numpy's global RandomState must use MT19937 to be captured")
    _, key, pos, has_gauss, cached_gaussian = legacy
    tensors[T_GLOBAL_NUMPY_KEY] = torch.from_numpy(np.asarray(key, dtype=np.int64).copy())
    tensors[T_GLOBAL_PYTHON], global_py = _python_state(random.getstate())

    scalars: JSON = {
        "cursor": int(cursor),
        "seed": int(rngs.seed),
        "rank": int(rngs.rank),
        "generator": {"numpy": np_scalars, "python": py_scalars},
        "global": {
            "cuda_devices": cuda_devices,
            "numpy": {"bit_generator": "MT19937", "pos": int(pos), "has_gauss": int(has_gauss),
                      "cached_gaussian": float(cached_gaussian)},
            "python": global_py,
        },
    }
    return tensors, scalars


# ------------------------------------------------------------------------------------------------- restore


def _need(tensors: dict[str, torch.Tensor], name: str, dtype: torch.dtype, shape: tuple[int, ...] | None,
          where: str) -> torch.Tensor:
    if name not in tensors:
        raise CheckpointMismatch(where, f"rng tensor {name!r} is missing")
    t = tensors[name]
    if t.dtype != dtype or (shape is not None and tuple(t.shape) != shape):
        raise CheckpointMismatch(where, f"rng tensor {name!r} has dtype {t.dtype} shape {tuple(t.shape)}",
                                 expected=(str(dtype), shape), actual=(str(t.dtype), tuple(t.shape)))
    return t


def _python_tuple(words: torch.Tensor, scalars: JSON) -> tuple[Any, ...]:
    return (int(scalars["version"]), tuple(int(x) for x in words.tolist()), scalars["gauss_next"])


@dataclass(frozen=True)
class ParsedRngState:
    """A checked capture, ready to apply (parsing first lets a loader reject a bad checkpoint before changing state)."""

    cursor: int
    seed: int
    rank: int
    torch_state: torch.Tensor
    numpy_state: JSON
    python_state: tuple[Any, ...]
    global_torch: torch.Tensor
    global_cuda: list[torch.Tensor]
    global_numpy: tuple[Any, ...]
    global_python: tuple[Any, ...]


def _check_target(rngs: Rngs, where: str) -> None:
    if not isinstance(rngs.numpy.bit_generator, np.random.PCG64):
        raise CheckpointMismatch(where, "Rngs.numpy must use a PCG64 bit generator to restore into",
                                 expected="PCG64", actual=type(rngs.numpy.bit_generator).__name__)
    if rngs.torch.device.type != "cpu":
        raise CheckpointMismatch(where, "Rngs.torch must be a CPU generator", expected="cpu",
                                 actual=str(rngs.torch.device))


def parse_rng_state(tensors: dict[str, torch.Tensor], scalars: JSON, *, where: str = "rng",
                    into: Rngs | None = None) -> ParsedRngState:
    """Check a capture completely (and that it fits ``into``) without changing anything.

    Raises CheckpointMismatch if the capture is malformed or cannot be applied.
    """
    if into is not None:
        _check_target(into, where)
    try:
        gen_s, glob_s = scalars["generator"], scalars["global"]
        np_s, legacy_s = gen_s["numpy"], glob_s["numpy"]
        if np_s["bit_generator"] != "PCG64" or legacy_s["bit_generator"] != "MT19937":
            raise ValueError("unsupported bit generator")
        cuda_devices = int(glob_s["cuda_devices"])
        parsed = ParsedRngState(
            cursor=int(scalars["cursor"]),
            seed=int(scalars["seed"]),
            rank=int(scalars["rank"]),
            torch_state=_need(tensors, T_TORCH, torch.uint8, None, where),
            numpy_state={
                "bit_generator": "PCG64",
                "state": {"state": int(np_s["state"]), "inc": int(np_s["inc"])},
                "has_uint32": int(np_s["has_uint32"]),
                "uinteger": int(np_s["uinteger"]),
            },
            python_state=_python_tuple(_need(tensors, T_PYTHON, torch.int64, (625,), where), gen_s["python"]),
            global_torch=_need(tensors, T_GLOBAL_TORCH, torch.uint8, None, where),
            global_cuda=[_need(tensors, f"{T_GLOBAL_CUDA}{i}", torch.uint8, None, where) for i in range(cuda_devices)],
            global_numpy=("MT19937", _need(tensors, T_GLOBAL_NUMPY_KEY, torch.int64, (624,), where).numpy()
                          .astype(np.uint32), int(legacy_s["pos"]), int(legacy_s["has_gauss"]),
                          float(legacy_s["cached_gaussian"])),
            global_python=_python_tuple(_need(tensors, T_GLOBAL_PYTHON, torch.int64, (625,), where),
                                        glob_s["python"]),
        )
    except (KeyError, TypeError, ValueError) as exc:
        raise CheckpointMismatch(where, f"rng scalars are not a capture of this format ({exc!r})") from exc
    expected = {T_TORCH, T_PYTHON, T_GLOBAL_TORCH, T_GLOBAL_NUMPY_KEY, T_GLOBAL_PYTHON}
    expected |= {f"{T_GLOBAL_CUDA}{i}" for i in range(cuda_devices)}
    if set(tensors) != expected:
        raise CheckpointMismatch(where, f"unexpected rng tensors {sorted(set(tensors) - expected)}")
    if parsed.global_cuda:  # pragma: no cover - no GPU in CI
        have = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if have != len(parsed.global_cuda):
            raise CheckpointMismatch(where, f"checkpoint holds {len(parsed.global_cuda)} CUDA generator states, "
                                     f"this process has {have} CUDA devices", expected=len(parsed.global_cuda),
                                     actual=have)
    return parsed


def apply_rng_state(rngs: Rngs, parsed: ParsedRngState, *, where: str = "rng") -> int:
    """Set ``rngs`` and the global generators to a parsed capture; return the data cursor."""
    _check_target(rngs, where)
    rngs.torch.set_state(parsed.torch_state.clone())
    rngs.numpy.bit_generator.state = parsed.numpy_state
    rngs.python.setstate(parsed.python_state)
    rngs.seed, rngs.rank = parsed.seed, parsed.rank
    torch.set_rng_state(parsed.global_torch.clone())
    if parsed.global_cuda:  # pragma: no cover - no GPU in CI
        torch.cuda.set_rng_state_all([t.clone() for t in parsed.global_cuda])
    np.random.set_state(parsed.global_numpy)
    random.setstate(parsed.global_python)
    return parsed.cursor

