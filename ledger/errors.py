"""Typed errors. Each carries what was expected and what was found, and renders as one line.

Exit codes (documented in docs/cli.md and the README):
  0 success · 1 verification failed / a run failed · 2 usage or malformed input · 3 unknown or ambiguous id,
  missing artifact · 4 database unusable or at the wrong schema revision.
"""

from __future__ import annotations

import os
import re
from typing import Any, Final

EXIT_OK = 0
EXIT_FAILED = 1
EXIT_USAGE = 2
EXIT_LOOKUP = 3
EXIT_DATABASE = 4

# What reading a parsed JSON record of the wrong shape raises (a string where a mapping goes, a missing key, text
# formatted as a number, a count of zero divided by, an integer too large for a float): JSON values give nothing
# else. A reader of records catches these to name the record instead of crashing (verify/context.py: guarded).
SHAPE_ERRORS: Final = (TypeError, KeyError, AttributeError, ValueError, ArithmeticError, IndexError)


# What a terminal acts on rather than shows: C0 and C1 controls (escape sequences, carriage return, backspace), the
# line and paragraph separators and the bidirectional overrides and isolates (text that reads other than it is).
_ACTED_ON = "\x00-\x08\x0b-\x1f\x7f-\x9f\u2028\u2029\u202a-\u202e\u2066-\u2069"  # all but tab and newline
_UNPRINTABLE = re.compile(f"[\t\n{_ACTED_ON}]")
_UNPRINTABLE_BUT_LINES = re.compile(f"[{_ACTED_ON}]")


def _escape(m: re.Match[str]) -> str:
    code = ord(m.group(0))
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"


def printable(text: str, *, lines: bool = False) -> str:
    """``text`` with every character a terminal would act on written as its escape (``\\x1b``, ``\\u202e``): a
    tensor name read from a file, a message quoting one, shows as what it is and cannot move the cursor or recolour
    the screen. ``lines`` keeps newlines and tabs (text laid out in lines on purpose)."""
    return (_UNPRINTABLE_BUT_LINES if lines else _UNPRINTABLE).sub(_escape, text)


def os_error_line(exc: OSError, path: object = None) -> str:
    """An operating-system error as one printable line: what failed and on which file(s) (``path`` when the error
    names none), e.g. ``Permission denied: /keys/a.key``."""
    names = [printable(os.fspath(n) if isinstance(n, os.PathLike) else str(n))  # a newline in a name shows as \n
             for n in (exc.filename if exc.filename is not None else path, exc.filename2) if n is not None]
    what = printable(" ".join(str(exc.strerror or exc).split()))
    return f"{what}: {' -> '.join(names)}" if names else what


def quoted(value: str, limit: int = 80) -> str:
    """A value the user gave, quoted for an error line: its repr, or at most ``limit`` - 9 characters of it and its
    length (a megabyte pasted by mistake is not a megabyte of error line)."""
    return repr(value) if len(value) <= limit else f"{value[:limit - 9]!r}... ({len(value):,} characters)"


class LedgerError(Exception):
    """Base of every error the library raises on purpose."""

    exit_code: int = EXIT_FAILED

    def one_line(self) -> str:
        return printable(" ".join(str(self).split()))


# -------------------------------------------------------------------------------------------- input errors


class InputError(LedgerError):
    """The input is malformed (not a receipt, not canonical, not a digest, ...)."""

    exit_code = EXIT_USAGE


class NonCanonical(InputError):
    """Bytes that are not canonical JSON, or a value canonical JSON cannot encode exactly."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"non-canonical JSON: {detail}")
        self.detail = detail


class MalformedDigest(InputError):
    def __init__(self, what: str, value: object) -> None:
        shown = quoted(value) if isinstance(value, str) else repr(value)[:100]
        super().__init__(f"{what}: expected 'blake3:' followed by 64 lowercase hex digits, got {shown}")
        self.what = what
        self.value = value


class MalformedReceipt(InputError):
    def __init__(self, detail: str, receipt: str | None = None) -> None:
        where = f"receipt {receipt}: " if receipt else ""
        super().__init__(f"malformed receipt: {where}{detail}")
        self.detail = detail
        self.receipt = receipt


class UnsafeFile(InputError):
    """A file we refuse to read (a pickle, a truncated or inconsistent safetensors file...)."""

    def __init__(self, path: str, detail: str) -> None:
        super().__init__(f"{path}: {detail}")
        self.path = path
        self.detail = detail


class CheckpointExists(InputError):
    """A checkpoint directory already exists; checkpoints are immutable, so it is never overwritten."""

    def __init__(self, path: str) -> None:
        super().__init__(f"checkpoint {path} already exists; checkpoints are immutable (choose a new name)")
        self.path = path


class CheckpointMismatch(InputError):
    """A checkpoint does not fit the objects it is loaded into (names, shapes, dtypes, classes, components)."""

    def __init__(self, path: str, detail: str, *, expected: Any = None, actual: Any = None) -> None:
        super().__init__(f"checkpoint {path}: {detail}")
        self.path = path
        self.detail = detail
        self.expected = expected
        self.actual = actual


# ------------------------------------------------------------------------------------------- lookup errors


class LookupFailed(LedgerError):
    exit_code = EXIT_LOOKUP


class UnknownReceipt(LookupFailed):
    def __init__(self, ref: str) -> None:
        super().__init__(f"no receipt matches {ref!r}")
        self.ref = ref


class UnknownExperiment(LookupFailed):
    """No prepare receipt with the prepared digest asked for (or none at all, when none was given)."""

    def __init__(self, prepared: str | None) -> None:
        super().__init__("no prepare receipt in the ledger: run `ledger run prepare` first" if prepared is None
                         else f"no prepare receipt with prepared digest {prepared}")
        self.prepared = prepared


class AmbiguousReceipt(LookupFailed):
    def __init__(self, ref: str, candidates: list[str]) -> None:
        shown = ", ".join(c[:19] for c in candidates[:3])
        more = f" and {len(candidates) - 3} more" if len(candidates) > 3 else ""
        super().__init__(f"prefix {ref!r} matches {len(candidates)} receipts ({shown}{more}); give more digits")
        self.ref = ref
        self.candidates = candidates


class MissingParents(LookupFailed):
    def __init__(self, receipt: str, missing: list[str]) -> None:
        super().__init__(f"receipt {receipt} refused: parent(s) not in the ledger: {', '.join(missing)}")
        self.receipt = receipt
        self.missing = missing


class MissingArtifact(LookupFailed):
    def __init__(self, digest: str, name: str | None = None, where: str | None = None) -> None:
        label = f"artifact {name!r} " if name else "artifact "
        at = f" (looked in {where})" if where else ""
        super().__init__(f"{label}{digest} is missing{at}")
        self.digest = digest
        self.name = name


class MissingComponent(LookupFailed):
    """A checkpoint lacks a component the caller needs (e.g. no outer optimizer state for a DiLoCo arm)."""

    def __init__(self, path: str, component: str, present: list[str]) -> None:
        super().__init__(f"checkpoint {path} has no {component!r} component (it has: {', '.join(present) or 'none'})")
        self.path = path
        self.component = component
        self.present = present


# ----------------------------------------------------------------------------------------- database errors


class DatabaseError(LedgerError):
    exit_code = EXIT_DATABASE


class SchemaOutOfDate(DatabaseError):
    def __init__(self, url: str, current: str | None, head: str) -> None:
        cur = current or "no schema"
        super().__init__(
            f"database {url} is at revision {cur}, this ledger needs {head}: run `ledger db upgrade"
            + (f" --db {url}`" if url else "`")
        )
        self.current = current
        self.head = head


class UnknownSchema(DatabaseError):
    def __init__(self, url: str, current: str, head: str) -> None:
        super().__init__(
            f"database {url} is at unknown revision {current} (newer software wrote it?); this ledger knows "
            f"up to {head}: upgrade the ledger package, or run `ledger db upgrade` with the version that wrote it"
        )
        self.current = current
        self.head = head


# ------------------------------------------------------------------------------------- verification errors


class VerificationError(LedgerError):
    """Verification failed. Subclasses say what; each names the receipt and field and carries both values."""

    exit_code = EXIT_FAILED

    def __init__(self, message: str, *, receipt: str | None = None, field: str | None = None,
                 expected: Any = None, actual: Any = None) -> None:
        super().__init__(message)
        self.receipt = receipt
        self.field = field
        self.expected = expected
        self.actual = actual

    @classmethod
    def at(cls, message: str, *, receipt: str | None, field: str, expected: Any, actual: Any) -> VerificationError:
        """An error of this type with a message of the caller's, still carrying the receipt, field and both
        values (subclasses build their own message in ``__init__``; this keeps a more specific one)."""
        err = cls.__new__(cls)
        VerificationError.__init__(err, message, receipt=receipt, field=field, expected=expected, actual=actual)
        return err

    def diagnostics(self) -> dict[str, Any]:
        return {
            "error": type(self).__name__,
            "message": self.one_line(),
            "receipt": self.receipt,
            "field": self.field,
            "expected": self.expected,
            "actual": self.actual,
        }


class DigestMismatch(VerificationError):
    def __init__(self, what: str, *, expected: str, actual: str, receipt: str | None = None,
                 field: str | None = None) -> None:
        where = f"receipt {receipt}: " if receipt else ""
        super().__init__(f"{where}{what}: expected {expected}, recomputed {actual}",
                         receipt=receipt, field=field, expected=expected, actual=actual)


class RecordMismatch(VerificationError):
    """A stored row disagrees with the receipt's canonical body (a tampered index row)."""

    def __init__(self, receipt: str, field: str, *, expected: Any, actual: Any) -> None:
        super().__init__(f"receipt {receipt}: stored {field} {actual!r} differs from its body's {expected!r}",
                         receipt=receipt, field=field, expected=expected, actual=actual)


class ChainBroken(VerificationError):
    def __init__(self, receipt: str, rule: str, *, field: str | None = None, expected: Any = None,
                 actual: Any = None) -> None:
        super().__init__(f"receipt {receipt}: chain rule broken: {rule}", receipt=receipt, field=field,
                         expected=expected, actual=actual)
        self.rule = rule


class StateMismatch(VerificationError):
    """Two states differ; names the component, tensor and first differing element."""


class ResumeDivergence(VerificationError):
    """A recovered run differs from the uninterrupted one; names step, rank, component, tensor."""


class MeasurementMismatch(VerificationError):
    """A recorded figure does not recompute from the evidence it is derived from."""

    def __init__(self, receipt: str, field: str, *, expected: Any, actual: Any, what: str = "") -> None:
        about = f" ({what})" if what else ""
        super().__init__(f"receipt {receipt}: recorded {field} {actual!r} does not recompute{about}: "
                         f"recomputed {expected!r}", receipt=receipt, field=field, expected=expected, actual=actual)


class RecordInvalid(VerificationError):
    """A record (a receipt's measurements, a row of an outcome table) lacks a field or has one of the wrong type."""

    def __init__(self, receipt: str | None, field: str, *, expected: Any, actual: Any, what: str = "") -> None:
        where = f"receipt {receipt}: " if receipt else ""
        about = f"{what} " if what else ""
        super().__init__(f"{where}{about}{field}: expected {expected}, found {actual!r}", receipt=receipt,
                         field=field, expected=expected, actual=actual)


class StoredBodyInvalid(VerificationError):
    """A stored receipt row whose body is not a receipt: the ledger is damaged, or was written behind the library's
    back (exit 1, as verification reports it; the input of the command was fine)."""

    def __init__(self, receipt: str, detail: str) -> None:
        super().__init__(f"receipt {receipt}: stored body does not parse: {detail}", receipt=receipt, field="body",
                         expected="a canonical receipt body", actual=detail)


class ReportMismatch(VerificationError):
    """A stored report differs from the one rebuilt from the ledger; names the first differing field."""

    def __init__(self, receipt: str, field: str, *, expected: Any, actual: Any) -> None:
        super().__init__(f"receipt {receipt}: the report's {field} does not recompute from the ledger",
                         receipt=receipt, field=f"report.{field}", expected=expected, actual=actual)


class ReexecutionMismatch(VerificationError):
    """Re-executing a recorded computation (a model's outputs, a training segment) gave other results."""


class MissingDependency(LedgerError):
    """A check needs a library this installation lacks, or has in another version than the one the check's bytes
    depend on (matplotlib 3.11 to render a format-1 report page again): the check cannot run, so nothing is
    verified, and nothing is called tampered with."""

    exit_code = EXIT_FAILED


class RunFailed(LedgerError):
    """A launched group of ranks failed: which arm, which rank first, every exit code, where the logs are."""

    exit_code = EXIT_FAILED

    def __init__(self, arm: str, rank: int | None, returncodes: list[int | None], logs: str, *,
                 detail: str = "") -> None:
        what = f"rank {rank} failed" if rank is not None else "the group failed"
        more = f": {detail}" if detail else ""
        super().__init__(f"arm {arm}: {what}{more} (exit codes {returncodes}); see {logs}")
        self.arm = arm
        self.rank = rank
        self.returncodes = returncodes
        self.logs = logs
