"""ledger/errors.py: how an error reaches the user as one line."""

from __future__ import annotations

import errno
from pathlib import Path

from ledger.errors import os_error_line


def test_an_os_error_is_one_printable_line_naming_its_files() -> None:
    assert os_error_line(PermissionError(errno.EACCES, "Permission denied", "/k/a.key")) == \
        "Permission denied: /k/a.key"
    both = OSError(errno.ENOSPC, "No space left on device", Path("/src"), None, "/dst\nx")
    assert os_error_line(both) == "No space left on device: /src -> /dst\\x0ax"
    # a file name given by the caller when the error names none; none at all leaves the bare reason
    assert os_error_line(OSError(errno.EIO, "Input/output error"), Path("/p")) == "Input/output error: /p"
    assert os_error_line(OSError("a reason\non two lines")) == "a reason on two lines"
    terminal = os_error_line(FileNotFoundError(errno.ENOENT, "No such file or directory", "/a\x1b[2Jb"))
    assert "\x1b" not in terminal and "\n" not in terminal
