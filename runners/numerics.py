"""Which CPU code paths compute the experiment's floats: pinned, so another x86-64 host gives the same bits.

Left to themselves, PyTorch's ATen kernels and MKL pick the widest vector instructions the CPU has. Reductions,
random fills and matrix products then sum in another order on an AVX-512 host than on an AVX2 one, and the same
config trains to other weights: on this project's 2-core AMD host, 30 steps of the tiny model end in other weights
under ATen's scalar kernels than under its AVX2 ones, and one matrix product differs between MKL's scalar
``COMPATIBLE`` branch and its AVX2 one. Every process that computes for an experiment imports this package, so
:func:`pin` runs before torch computes anything there: ATen's AVX2 kernels, MKL's conditional numerical
reproducibility branch for AVX2 (``MKL_CBWR``, which Intel documents as giving the same results on its processors
that have AVX2; other vendors' are not promised), oneDNN capped at AVX2. On this AVX2 host they are the native
paths (same bits, same speed: 1.06-1.09 s for those 30 steps pinned, 1.03-1.39 s native; the scalar paths took
2.8 s); on an AVX-512 host they trade some speed for the bits of the AVX2 hosts.

A variable already in the environment is kept (a user who wants other paths sets them, e.g.
``ATEN_CPU_CAPABILITY=avx512 MKL_CBWR=AUTO``), and a CPU without AVX2 and FMA, or
not x86-64, is left to its native paths: :func:`describe` records what actually ran in every rank's binding, the
prepare receipt, the evaluation settings and each serving replica's binding, so two runs whose bits differ for this
reason say so. What actually ran, not what was asked: MKL takes its ISA branches (``AVX2``) on Intel processors
only and runs ``AUTO`` instead on others (an AMD EPYC, measured), so MKL itself is asked which branch it runs.
"""

from __future__ import annotations

import ctypes
import functools
import os
import platform
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Final

PINNED: Final = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
_CPUINFO: Final = Path("/proc/cpuinfo")
# MKL's conditional-numerical-reproducibility settings (mkl_cbwr.h): what mkl_cbwr_get(MKL_CBWR_BRANCH) returns,
# named as MKL_CBWR and MKL_VERBOSE's ``CNR:`` field name them. ``OFF``: MKL_CBWR unset, no CNR at all.
_MKL_BRANCHES: Final = {1: "OFF", 2: "AUTO", 3: "COMPATIBLE", 4: "SSE2", 6: "SSSE3", 7: "SSE4_1", 8: "SSE4_2",
                        9: "AVX", 10: "AVX2", 11: "AVX512_MIC", 12: "AVX512", 13: "AVX512_MIC_E1", 14: "AVX512_E1"}
_MKL_CBWR_BRANCH: Final = 1
_MKL_CBWR_ALL: Final = -1  # ~0: the branch and the STRICT flag
_MKL_CBWR_STRICT: Final = 0x10000


def cpu_flags(cpuinfo: Path = _CPUINFO) -> frozenset[str]:
    """The first processor's flags in ``cpuinfo`` (Linux), empty where it cannot be read."""
    try:
        with cpuinfo.open("rb") as f:
            for line in f:
                key, _, value = line.partition(b":")
                if key.strip() == b"flags":
                    return frozenset(value.decode("ascii", "replace").split())
    except OSError:
        pass
    return frozenset()


def can_pin(machine: str | None = None, flags: frozenset[str] | None = None) -> bool:
    """Whether the pinned paths run here: an x86-64 CPU with AVX2 and FMA (what ATen's AVX2 kernels use)."""
    machine = platform.machine() if machine is None else machine
    flags = cpu_flags() if flags is None else flags
    return machine.lower() in ("x86_64", "amd64") and {"avx2", "fma"} <= flags


def pin(environ: MutableMapping[str, str] = os.environ, *, pinnable: bool | None = None) -> None:
    """Set the pinned variables in ``environ`` where it has none of its own and this CPU can run them."""
    if can_pin() if pinnable is None else pinnable:
        for key, value in PINNED.items():
            environ.setdefault(key, value)


def describe() -> str:
    """What computes this process's floats, for a binding: ATen's kernel set and MKL's branch as MKL reports it,
    e.g. ``AVX2 mkl=AVX2`` on an Intel host, ``AVX2 mkl=AUTO`` on an AMD one. Imports torch (callers that compute)."""
    import torch

    return f"{torch.backends.cpu.get_cpu_capability()} mkl={mkl_branch()}"


def mkl_branch() -> str:
    """The CNR branch MKL computes on, as MKL itself reports it (the ``CNR:`` of its verbose log): ``AVX2``, ``AUTO``,
    ``COMPATIBLE``, ``OFF`` (MKL_CBWR unset), with ``,STRICT`` when strict; ``none`` for a torch without MKL, and
    the requested value with a ``?`` where this torch's MKL cannot be asked (so never an unchecked claim)."""
    import torch

    if not torch.backends.mkl.is_available():
        return "none"
    get = _mkl_cbwr_get()
    if get is None:
        return f"{os.environ.get('MKL_CBWR') or 'OFF'}?"
    branch = get(_MKL_CBWR_BRANCH)
    name = _MKL_BRANCHES.get(branch, f"branch-{branch}")
    return f"{name},STRICT" if get(_MKL_CBWR_ALL) & _MKL_CBWR_STRICT else name


@functools.cache
def _mkl_cbwr_get() -> Callable[[int], int] | None:
    """MKL's ``mkl_cbwr_get``. PyTorch's Linux wheels link MKL into libtorch_cpu, which exports it by its service
    name (``mkl_serv_cbwr_get``, the same signature; tests/runners/test_numerics.py checks what it returns against
    MKL's verbose log); a build that loads MKL as a shared library of its own exports the documented name."""
    import torch

    libraries = [str(Path(torch.__file__).parent / "lib" / "libtorch_cpu.so"), None]  # None: the global namespace
    for library in libraries:
        try:
            lib = ctypes.CDLL(library)
        except OSError:
            continue
        for symbol in ("mkl_cbwr_get", "mkl_serv_cbwr_get"):
            function = getattr(lib, symbol, None)
            if function is not None:
                function.restype, function.argtypes = ctypes.c_int, (ctypes.c_int,)
                return function
    return None
