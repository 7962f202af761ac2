"""SIGKILL a process while it writes checkpoints: the previous one verifies, no partial one is ever valid."""

from __future__ import annotations

import functools
import operator
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from ledger import state as ledger_state
from ledger.errors import LedgerError
from runners.checkpoint import cleanup_partial

pytestmark = pytest.mark.slow

TRIALS = 20

# A "zygote" process imports torch once, then forks one writer per trial (importing torch costs ~2 s a process;
# each writer is still its own process, killed with SIGKILL). A writer saves checkpoint A, then writes B1, B2, ...
# (about 50 MB each: 4 x 1024x1024 float32 weights plus AdamW moments) until it is killed, reporting each phase.
# The rename hook prints 'renaming' right before the real rename, so the parent can kill inside that window.
ZYGOTE = textwrap.dedent(
    """
    import os, random, sys, time, traceback
    from pathlib import Path
    import torch
    import runners.checkpoint as ck
    from runners.rng import Rngs

    torch.set_num_threads(1)
    # Pay one-time costs (AdamW's first step imports torch._dynamo, ~1 s) once, before forking.
    warm = torch.nn.Linear(2, 2)
    warm.weight.grad = torch.ones(2, 2)
    torch.optim.AdamW(warm.parameters()).step()
    rename = ck._rename_noreplace
    tag = "-"

    def say(*words):
        # One write(2) per line: a short write is atomic on the shared pipe. print() is not one: with
        # PYTHONUNBUFFERED (CI sets it) each argument is its own write, so a SIGKILL between two of them
        # left half a line that the zygote's "exit" line was glued onto.
        os.write(1, (" ".join(map(str, (tag, *words))) + "\\n").encode())

    def hooked(src, dst):
        say("renaming", dst.name)
        time.sleep(random.random() * 0.002)
        rename(src, dst)
        say("renamed", dst.name)

    ck._rename_noreplace = hooked

    def writer(root):
        random.seed(os.getpid())
        torch.manual_seed(0)
        model = torch.nn.Sequential(*[torch.nn.Linear(1024, 1024, bias=False) for _ in range(4)])
        opt = torch.optim.AdamW(model.parameters())
        for p in model.parameters():
            p.grad = torch.randn_like(p)
        opt.step()
        rngs = Rngs.from_seed(0, 0)
        saved = ck.save_checkpoint(root / "A", model=model, optimizer=opt, rngs=rngs, cursor=0, meta={"step": 0})
        say("saved", "A", saved.digest)
        i = 0
        while True:
            i += 1
            with torch.no_grad():
                model[0].weight[0, 0] += 1.0
            say("writing", f"B{i}")
            saved = ck.save_checkpoint(root / f"B{i}", model=model, optimizer=opt, rngs=rngs, cursor=i,
                                       meta={"step": i})
            say("saved", f"B{i}", saved.digest)

    say("ready")
    for line in iter(sys.stdin.readline, ""):
        tag, root = line.split()
        pid = os.fork()
        if pid == 0:
            try:
                writer(Path(root))
            except BaseException:
                traceback.print_exc()
                sys.stderr.flush()
            os._exit(1)
        say("pid", pid)
        _, status = os.waitpid(pid, 0)
        say("exit", status)
        tag = "-"
    """
)


class Zygote:
    def __init__(self) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=subprocess.PIPE, text=True)
        self.lines: list[list[str]] = []
        self.eof = False
        self.cond = threading.Condition()
        threading.Thread(target=self._read, daemon=True).start()
        self.wait_for("-", lambda ln: ln == ["ready"])

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            with self.cond:
                self.lines.append(line.split())
                self.cond.notify_all()
        with self.cond:
            self.eof = True
            self.cond.notify_all()

    def wait_for(self, tag: str, predicate: Callable[[list[str]], bool], timeout: float = 60.0) -> list[str]:
        def found() -> list[str] | None:
            return next((ln[1:] for ln in self.lines if ln[0] == tag and predicate(ln[1:])), None)

        with self.cond:
            self.cond.wait_for(lambda: found() is not None or self.eof, timeout)
            line = found()
        if line is None:
            with self.cond:
                eof, seen = self.eof, [" ".join(ln) for ln in self.lines if ln and ln[0] == tag][-5:]
            self.close()
            stderr = self.proc.stderr.read() if self.proc.stderr else ""
            raise AssertionError(f"no line {tag} ... as expected ({'the zygote ended' if eof else f'{timeout} s'}); "
                                 f"its last lines: {seen}; stderr: {stderr[-3000:]}")
        return line

    def start(self, tag: str, root: Path) -> int:
        assert self.proc.stdin is not None
        self.proc.stdin.write(f"{tag} {root}\n")
        self.proc.stdin.flush()
        return int(self.wait_for(tag, lambda ln: ln[0] == "pid")[1])

    def kill(self, tag: str, pid: int) -> str:
        """SIGKILL the writer; return the last phase it reported."""
        os.kill(pid, signal.SIGKILL)
        status = int(self.wait_for(tag, lambda ln: ln[0] == "exit")[1])
        assert os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGKILL, status
        with self.cond:
            phases = [ln[1] for ln in self.lines if ln[0] == tag and ln[1] not in ("pid", "exit")]
        return phases[-1]

    def close(self) -> None:
        if self.proc.stdin is not None and not self.proc.stdin.closed:
            self.proc.stdin.close()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


@pytest.fixture
def zygote() -> Iterator[Zygote]:
    z = Zygote()
    yield z
    z.close()


def test_sigkill_during_checkpoint_writes(tmp_path: Path, zygote: Zygote) -> None:
    rnd = random.Random(20261130)
    outcomes: dict[str, int] = {}
    partial_seen = unrenamed = complete_b = 0
    for trial in range(TRIALS):
        tag, root = f"t{trial}", tmp_path / f"t{trial}"
        root.mkdir()
        pid = zygote.start(tag, root)
        digest_a = zygote.wait_for(tag, lambda ln: ln[:2] == ["saved", "A"])[2]
        if trial % 4 in (1, 3):  # kill around the rename of a random B: just before it, or just after it
            target, event = f"B{rnd.randint(1, 2)}", "renaming" if trial % 4 == 1 else "renamed"
            zygote.wait_for(tag, functools.partial(operator.eq, [event, target]))
        else:  # kill at a random moment in the stream of writes
            time.sleep(rnd.uniform(0.0, 0.4))
        phase = zygote.kill(tag, pid)
        outcomes[phase] = outcomes.get(phase, 0) + 1

        entries = sorted(root.iterdir())
        final = [p for p in entries if not p.name.startswith(".")]
        temps = [p for p in entries if p.name.startswith(".")]
        assert final[0].name == "A"
        assert ledger_state.verify_checkpoint(root / "A").digest == digest_a
        # Every visible checkpoint is complete and verifies: B is absent or whole, never half-written; and one
        # the writer reported as saved holds exactly the state it reported.
        reported = {ln[2]: ln[3] for ln in zygote.lines if ln[0] == tag and ln[1] == "saved"}
        for path in final:
            digest = ledger_state.verify_checkpoint(path).digest
            assert reported.get(path.name, digest) == digest
        complete_b += len(final) - 1
        for tmp in temps:
            assert tmp.is_dir() and ".tmp-" in tmp.name
            if (tmp / "manifest.json").exists():
                unrenamed += 1  # killed between the manifest and the rename: complete, but never visible
            else:
                partial_seen += 1
                with pytest.raises(LedgerError):
                    ledger_state.verify_checkpoint(tmp)
        assert len(temps) <= 1  # only the write in progress can be left behind
        assert cleanup_partial(root) == temps
        assert sorted(root.iterdir()) == final

    print(f"kill landed after: {outcomes}; temp dirs: {partial_seen} partial, {unrenamed} complete but not renamed; "
          f"complete B checkpoints: {complete_b}")
    assert partial_seen >= 1, "no kill landed mid-write; the test did not exercise a partial write"
    assert outcomes.get("renaming", 0) >= 1 and unrenamed >= 1  # killed with a complete, unrenamed temp dir
