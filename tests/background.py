"""A process the test session starts early and a test or fixture waits for later (mypy, the tiny experiment).

Each runs in a process group of its own, with its output in files under a temporary directory of its own; ``stop``
kills the whole group (a training run's ranks and replicas too) and removes the directory. tests/conftest.py starts
them when collection finishes and stops every one at the end of the session, however it ends."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Finished:
    code: int
    root: Path  # the process's working directory, kept until the session ends
    stdout: str
    stderr: str


class Background:
    def __init__(self, name: str, argv: Sequence[str], *, cwd: Path | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        self.name = name
        self.argv = list(argv)
        self.cwd = cwd
        self.env = dict(env) if env is not None else None
        self.proc: subprocess.Popen[bytes] | None = None
        self.root: Path | None = None

    def start(self) -> None:
        """Start the process (once; later calls do nothing)."""
        if self.proc is not None:
            return
        self.root = Path(tempfile.mkdtemp(prefix=f"ledger-{self.name}-"))
        with open(self.root / "stdout", "wb") as out, open(self.root / "stderr", "wb") as err:
            self.proc = subprocess.Popen(self.argv, stdin=subprocess.DEVNULL, stdout=out, stderr=err, env=self.env,
                                         cwd=self.cwd or self.root, start_new_session=True)

    def wait(self, timeout: float) -> Finished:
        """Start it if it was not, wait for it to end (killing it past ``timeout``), and return what it printed."""
        self.start()
        assert self.proc is not None and self.root is not None
        try:
            code = self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.stop()
            raise
        return Finished(code, self.root, (self.root / "stdout").read_text(errors="replace"),
                        (self.root / "stderr").read_text(errors="replace"))

    def stop(self) -> None:
        """Kill the process group if it still runs (Ctrl-C, a failed collection) and remove its directory."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        if self.root is not None:
            shutil.rmtree(self.root, ignore_errors=True)
