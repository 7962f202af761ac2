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
reason say so.
"""

from __future__ import annotations

import os
import platform
from collections.abc import MutableMapping
from pathlib import Path
from typing import Final

PINNED: Final = {"ATEN_CPU_CAPABILITY": "avx2", "MKL_CBWR": "AVX2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
_CPUINFO: Final = Path("/proc/cpuinfo")


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
    """What computes this process's floats, for a binding: ATen's kernel set and MKL's branch, e.g. ``AVX2
    mkl=AVX2``. Imports torch (only callers that compute do)."""
    import torch

    return f"{torch.backends.cpu.get_cpu_capability()} mkl={os.environ.get('MKL_CBWR') or 'AUTO'}"
