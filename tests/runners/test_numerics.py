"""runners/numerics.py: the CPU code paths every runner process pins before torch computes, and what it records."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from runners import numerics
from tests.pg import in_ci

ROOT = Path(__file__).resolve().parents[2]

# Thirty steps of a tiny network with random data, the parameters' bytes hashed: the kinds of operation training
# uses (random fills, matrix products, reductions, softmax, AdamW), in a fresh process that imports the runners
# (which pins) before torch computes, as every runner process does.
_TRAIN = """
import hashlib
import runners.numerics as numerics
import torch
torch.set_num_threads(1)
g = torch.Generator().manual_seed(0)
w = torch.randn(97, 61, generator=g).requires_grad_()
opt = torch.optim.AdamW([w], lr=1e-2)
for _ in range(30):
    x = torch.randn(33, 97, generator=g)
    loss = torch.softmax(x @ w, -1).pow(2).mean() + w.sum() * 1e-3
    opt.zero_grad(); loss.backward(); opt.step()
print(numerics.describe(), hashlib.sha256(w.detach().numpy().tobytes()).hexdigest())
"""


def _clean_env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in numerics.PINNED}
    return {**env, "PYTHONPATH": str(ROOT), **extra}


def _python(*args: str, **extra: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, *args], env=_clean_env(**extra), capture_output=True, text=True,
                          timeout=120, check=True)


def _run(code: str, **extra: str) -> str:
    return _python("-c", code, **extra).stdout.strip()


# MKL's own account of the branch it ran (its verbose log's ``CNR:`` field, one product logged), beside the binding's.
_DESCRIBE_AND_MKL_LOG = """
import runners, runners.numerics as n, torch
print("binding", n.describe(), flush=True)
with torch.backends.mkl.verbose(torch.backends.mkl.VERBOSE_ON):
    torch.ones(8, 8) @ torch.ones(8, 8)
"""


def _binding_and_mkl_log(**extra: str) -> tuple[str, str]:
    """``describe()`` in a fresh process and the branch MKL's verbose log says it ran the product on there."""
    out = _run(_DESCRIBE_AND_MKL_LOG, **extra)
    binding = re.search(r"^binding (.+)$", out, re.M)
    logged = re.search(r"\bCNR:(\S+)", out)
    assert binding and logged, out
    return binding[1], logged[1]


def pinned_binding() -> str:
    """What a pinned process on this host records: MKL runs its AVX2 branch on Intel processors only, AUTO on others
    (measured on AMD EPYC hosts, MKL 2024.2)."""
    vendor = re.search(r"^vendor_id\s*:\s*(\S+)", Path("/proc/cpuinfo").read_text(), re.M)
    return "AVX2 mkl=AVX2" if vendor and vendor[1] == "GenuineIntel" else "AVX2 mkl=AUTO"


def _require_pinnable() -> None:
    if not numerics.can_pin():
        if in_ci():
            pytest.fail("CI=true but this CPU cannot run the pinned AVX2 paths (x86-64 with AVX2 and FMA)")
        pytest.skip("this CPU cannot run the pinned AVX2 paths")


def test_cpu_flags_read_from_a_cpuinfo_file(tmp_path: Path) -> None:
    info = tmp_path / "cpuinfo"
    info.write_text("processor\t: 0\nmodel name\t: Some CPU\nflags\t\t: fpu sse2 avx2 fma\n\n"
                    "processor\t: 1\nflags\t\t: fpu\n")
    assert numerics.cpu_flags(info) == frozenset({"fpu", "sse2", "avx2", "fma"})  # the first processor's
    assert numerics.cpu_flags(tmp_path / "missing") == frozenset()
    (tmp_path / "noflags").write_text("processor\t: 0\n")
    assert numerics.cpu_flags(tmp_path / "noflags") == frozenset()


@pytest.mark.parametrize(("machine", "flags", "expected"), [
    ("x86_64", {"avx2", "fma", "sse2"}, True),
    ("AMD64", {"avx2", "fma"}, True),
    ("x86_64", {"avx2"}, False),  # ATen's AVX2 kernels use FMA too
    ("x86_64", {"avx", "fma"}, False),
    ("aarch64", {"avx2", "fma"}, False),
    ("arm64", set(), False),
])
def test_can_pin_needs_x86_64_with_avx2_and_fma(machine: str, flags: set[str], expected: bool) -> None:
    assert numerics.can_pin(machine, frozenset(flags)) is expected


def test_pin_sets_what_is_unset_and_keeps_the_users_own() -> None:
    env = {"MKL_CBWR": "AUTO", "OTHER": "x"}
    numerics.pin(env, pinnable=True)
    assert env == {"MKL_CBWR": "AUTO", "OTHER": "x", "ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    untouched = {"OTHER": "x"}
    numerics.pin(untouched, pinnable=False)
    assert untouched == {"OTHER": "x"}


def test_importing_the_runners_pins_the_process_and_the_binding_says_so() -> None:
    _require_pinnable()
    assert _run("import runners, runners.numerics as n; print(n.describe())") == pinned_binding()
    # A user's own choice is kept, and recorded as what ran.
    assert _run("import runners, runners.numerics as n; print(n.describe())",
                ATEN_CPU_CAPABILITY="default", MKL_CBWR="COMPATIBLE") == "DEFAULT mkl=COMPATIBLE"


@pytest.mark.parametrize(("setting", "expected"), [
    (None, "{pinned}"),  # the pinned AVX2 (AUTO in its place on a non-Intel processor)
    ("COMPATIBLE", "COMPATIBLE"),
    ("", "OFF"),  # no branch at all: MKL runs without CNR, and the binding says so (it once said AUTO)
    ("AVX2,STRICT", "{pinned},STRICT"),
])
def test_the_binding_names_the_branch_mkl_reports_running(setting: str | None, expected: str) -> None:
    """The binding's MKL branch is what MKL's own log says it ran, not the MKL_CBWR that asked for one: on an AMD
    host, MKL_CBWR=AVX2 runs AUTO and once was recorded as AVX2."""
    _require_pinnable()
    binding, logged = _binding_and_mkl_log(**({} if setting is None else {"MKL_CBWR": setting}))
    assert binding == f"AVX2 mkl={logged}"
    assert logged == expected.format(pinned=pinned_binding().removeprefix("AVX2 mkl="))


def test_a_branch_mkl_cannot_be_asked_for_is_recorded_as_asked_not_as_run(monkeypatch: pytest.MonkeyPatch) -> None:
    """A torch whose MKL exports no mkl_cbwr_get: the binding marks the requested branch with ``?``."""
    import torch

    if not torch.backends.mkl.is_available():  # then the branch is 'none' and nothing is asked
        if in_ci():
            pytest.fail("CI=true but this torch has no MKL (constraints-cpu.txt installs one that has)")
        pytest.skip("this torch has no MKL")
    monkeypatch.setattr(numerics, "_mkl_cbwr_get", lambda: None)
    monkeypatch.setenv("MKL_CBWR", "AVX2")
    assert numerics.mkl_branch() == "AVX2?"
    monkeypatch.delenv("MKL_CBWR")
    assert numerics.mkl_branch() == "OFF?"


def test_the_pinned_paths_decide_the_bits_and_are_reproducible() -> None:
    _require_pinnable()
    pinned = [_run(_TRAIN) for _ in range(2)]
    scalar = _run(_TRAIN, ATEN_CPU_CAPABILITY="default", MKL_CBWR="COMPATIBLE")
    assert pinned[0] == pinned[1] and pinned[0].startswith(pinned_binding() + " ")
    assert scalar.startswith("DEFAULT mkl=COMPATIBLE ")
    # The recorded paths are not decoration: the same computation on the other paths ends in other bits.
    assert scalar.split()[-1] != pinned[0].split()[-1]


def _fingerprint(**env: str) -> dict[str, str]:
    """``python -m runners.fingerprint`` in a fresh process (a clean environment, ``env`` on top): name -> value."""
    done = _python("-m", "runners.fingerprint", **env)
    assert done.stderr == "", done.stderr
    return dict(re.split(r" {2,}", line, maxsplit=1) for line in done.stdout.splitlines())


def test_the_fingerprint_repeats_names_its_paths_and_tells_them_apart() -> None:
    _require_pinnable()
    pinned = _fingerprint()
    assert _fingerprint() == pinned  # another process, the same bits
    computed = [v for k, v in pinned.items() if k not in ("cpu", "torch", "threads")]
    assert len(computed) == 10 and all(v.startswith("blake3:") for v in computed)
    assert len(set(computed)) == len(computed)  # each line digests its own computation
    assert pinned["threads"] == "1"
    scalar = _fingerprint(ATEN_CPU_CAPABILITY="default", MKL_CBWR="COMPATIBLE")
    assert (pinned["cpu"], scalar["cpu"]) == (pinned_binding(), "DEFAULT mkl=COMPATIBLE")
    differ = {k for k in pinned if pinned[k] != scalar[k]} - {"cpu"}
    # Scalar against AVX2 code: the vectorised maths and MKL's products round otherwise (so do the fills here).
    assert {"exp, tanh, log1p (ATen vectorised maths)", "matmul 257x263 @ 263x131 (MKL sgemm)"} <= differ, differ
