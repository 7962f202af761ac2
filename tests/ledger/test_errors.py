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


def test_a_long_value_is_quoted_cut_short_with_its_length() -> None:
    from ledger.errors import MalformedDigest, quoted

    assert quoted("abc") == "'abc'" and quoted("x" * 80) == repr("x" * 80)
    assert quoted("x" * 81) == repr("x" * 71) + "... (81 characters)"
    assert quoted("a\nb") == "'a\\nb'"  # one line, whatever the value holds
    line = MalformedDigest("--prepared", "blake3:" + "0" * 1_000_000).one_line()
    assert line.endswith("... (1,000,007 characters)") and len(line) < 200
    assert MalformedDigest("parent", 5).one_line().endswith("got 5")  # not "got '5'": a number is not a string
