"""Errors of the tamper-evidence layer (Merkle proofs, signed notes, checkpoints, DSSE envelopes, operator keys).

Kept apart from ledger/errors.py until they are merged into it. Like those, each error renders as one line and
carries what was expected and what was found (``expected`` / ``actual``; bytes are shown as lowercase hex so
``diagnostics()`` stays JSON-serialisable). A proof or signature that does not verify is a
:class:`~ledger.errors.VerificationError` (exit 1); text that cannot even be parsed is an
:class:`~ledger.errors.InputError` (exit 2).
"""

from __future__ import annotations

from typing import Any

from ledger.errors import InputError, UnsafeFile, VerificationError


def shown(value: Any) -> Any:
    """Bytes as hex (what a reader compares against other tools' output); anything else unchanged."""
    return value.hex() if isinstance(value, bytes | bytearray) else value


# ------------------------------------------------------------------------------------- verification failures


class InclusionProofInvalid(VerificationError):
    """An inclusion proof does not prove that the leaf is at ``index`` in the tree of ``size`` with that root."""

    def __init__(self, detail: str, *, index: int, size: int, expected: Any = None, actual: Any = None) -> None:
        super().__init__(f"inclusion proof of leaf {index} in tree of size {size} invalid: {detail}",
                         field="inclusion_proof", expected=shown(expected), actual=shown(actual))
        self.detail = detail
        self.index = index
        self.size = size


class ConsistencyProofInvalid(VerificationError):
    """A consistency proof does not prove that the tree of ``size1`` is a prefix of the tree of ``size2``."""

    def __init__(self, detail: str, *, size1: int, size2: int, expected: Any = None, actual: Any = None) -> None:
        super().__init__(f"consistency proof from size {size1} to size {size2} invalid: {detail}",
                         field="consistency_proof", expected=shown(expected), actual=shown(actual))
        self.detail = detail
        self.size1 = size1
        self.size2 = size2


class SignatureInvalid(VerificationError):
    """A signature by a known key does not verify (the signed bytes or the signature were changed)."""

    def __init__(self, what: str, *, key: str, expected: Any = None, actual: Any = None,
                 receipt: str | None = None) -> None:
        super().__init__(f"{what}: signature by {key} does not verify", receipt=receipt, field="signature",
                         expected=shown(expected), actual=shown(actual))
        self.what = what
        self.key = key


class UnknownKey(VerificationError):
    """Nothing was signed by enough trusted keys: every signature present is by a key the verifier does not know."""

    def __init__(self, what: str, *, expected: Any, actual: Any) -> None:
        super().__init__(f"{what}: no valid signature by a trusted key (trusted: {_names(expected)}; "
                         f"signed by: {_names(actual)})", field="signature", expected=expected, actual=actual)
        self.what = what


def _names(value: Any) -> str:
    if isinstance(value, list | tuple):
        return ", ".join(str(v) for v in value) or "none"
    return str(value)


# ------------------------------------------------------------------------------------------ malformed input


class _Malformed(InputError):
    kind = "input"

    def __init__(self, detail: str, *, expected: Any = None, actual: Any = None) -> None:
        super().__init__(f"malformed {self.kind}: {detail}")
        self.detail = detail
        self.expected = shown(expected)
        self.actual = shown(actual)


class MalformedNote(_Malformed):
    """Not a C2SP signed note (bad UTF-8, control characters, missing blank line, bad signature line...)."""

    kind = "signed note"


class MalformedCheckpoint(_Malformed):
    """A note text that is not a C2SP tlog-checkpoint body (origin, decimal size, base64 root, extensions)."""

    kind = "log checkpoint"


class MalformedEnvelope(_Malformed):
    """Not a DSSE v1 envelope, or a payload that is not the in-toto Statement v1 it claims to be."""

    kind = "DSSE envelope"


class MalformedKey(_Malformed):
    """A key string or key file that does not parse (name, key id, algorithm byte, key length, key id check)."""

    kind = "key"


class InvalidTreeRange(_Malformed):
    """A proof or root asked for outside the tree (leaf index >= size, size1 > size2, negative sizes)."""

    kind = "tree range"


class _ModeExposesKeys(UnsafeFile):
    """A key file or directory whose mode lets group or others at the keys: ``mode`` as found, ``expected`` as
    required, and the chmod that fixes it in the message."""

    def __init__(self, path: str, mode: int, detail: str, *, chmod: str, expected: str) -> None:
        super().__init__(path, f"{detail} (run `chmod {chmod} {path}`)")
        self.expected = expected
        self.actual = f"{mode:04o}"
        self.mode = mode


class KeyFileExposed(_ModeExposesKeys):
    """A private key file that group or others may access: refused, the way ssh refuses such a key."""

    def __init__(self, path: str, *, mode: int) -> None:
        super().__init__(path, mode, f"private key file has mode {mode:04o}; it must not be accessible by group or "
                                     "others", chmod="600", expected="0600")


class KeyDirectoryExposed(_ModeExposesKeys):
    """A key directory that group or others may write to: a new private key is not written there (they could
    remove or replace its keys)."""

    def __init__(self, path: str, *, mode: int) -> None:
        super().__init__(path, mode, f"key directory has mode {mode:04o}; group or others may write to it and so "
                                     "remove or replace its keys", chmod="700",
                         expected="no write access for group or others")


class LogOriginMismatch(VerificationError):
    """A checkpoint from another log than the one expected."""

    def __init__(self, *, expected: str, actual: str) -> None:
        super().__init__(f"log checkpoint origin is {actual!r}, expected {expected!r}", field="origin",
                         expected=expected, actual=actual)


class CosignatureQuorum(VerificationError):
    """Fewer valid witness cosignatures on a log checkpoint than the policy requires."""

    def __init__(self, origin: str, *, expected: int, actual: list[str]) -> None:
        super().__init__(f"log checkpoint {origin}: {len(actual)} valid witness cosignature(s), need {expected} "
                         f"({', '.join(actual) or 'none'})", field="cosignatures", expected=expected, actual=actual)
