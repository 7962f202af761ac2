"""Key revocation: a ``key`` receipt of format ``ledger-key-revocation/1`` withdraws a registered key from a place in
the log on (docs/transparency.md §2).

    kind "key", parents [the key receipt registering the key], run/rank/step/prepared/selection null,
    measurements {"format": "ledger-key-revocation/1", "key": "<the revoked key's verifier key string>"}

Semantics, as in TUF and Sigstore, with the log's order as the clock: a signature by the key on a receipt whose leaf
comes after the revocation's leaf fails verification; receipts logged before it keep their signatures. Revocation
is final: registering the key again does not undo it (register a new key instead).

A revocation cites the registration of the key it revokes, and its chain rule (ledger/rules.py) holds both key
strings equal, so a key no receipt registers cannot be revoked: the store refuses the receipt (MissingParents, or
ChainBroken when it cites another receipt) and verification refuses it again.

Who may revoke: a revocation must be signed, and every signature on it must be by a registered key not revoked
before it (verify/transparency.py checks this; :func:`revoke_key` refuses to append a revocation that would fail
there). The revoked key may sign its own revocation, as an OpenPGP key signs its revocation certificate: revoking
only takes power away, so a thief holding the key gains nothing by it, and an operator whose only key leaked can
revoke it at once, before registering a new one. A lost key (no private half left) is revoked by another key.
"""

from __future__ import annotations

from dataclasses import dataclass

from ledger import chain, tlog
from ledger.errors import LookupFailed, VerificationError
from ledger.note import Signer
from ledger.reads import scalar
from ledger.receipts import Kind, Receipt, make_receipt
from ledger.rules import KEY_REVOCATION_FORMAT
from ledger.signing import load_public_key, operator_key
from ledger.store import Store, Stored
from ledger.tlog import LeafSignature
from ledger.transparency import RegisteredKey, logged_key_receipts, registered_keys


class KeyNotRegistered(LookupFailed):
    """No registered key matches the name, label, key id or key string given (exit 3): nothing to revoke."""

    def __init__(self, ref: str, registered: list[str]) -> None:
        super().__init__(f"no key {ref!r} is registered in this ledger (registered: {', '.join(registered) or 'none'})"
                         f": nothing to revoke")
        self.ref = ref
        self.expected = registered
        self.actual = ref


class AmbiguousKey(LookupFailed):
    """A key name that several registered keys share (exit 3): give the label or the key id."""

    def __init__(self, ref: str, candidates: list[str]) -> None:
        super().__init__(f"key {ref!r} matches {len(candidates)} registered keys ({', '.join(candidates)}); give "
                         f"the label NAME+<8 hex> or the key id")
        self.ref = ref
        self.expected = "one key"
        self.actual = candidates


class RevocationRefused(VerificationError):
    """A revocation that verification would reject: its signer is not registered, or was revoked (exit 1)."""

    def __init__(self, label: str, detail: str, *, expected: object, actual: object) -> None:
        super().__init__(f"cannot revoke {label}: {detail}", field="signature", expected=expected, actual=actual)


@dataclass(frozen=True)
class Revocation:
    """A key revoked in the ledger: its label, the revocation receipt and its leaf (signatures by the key on receipts
    at later leaves fail), the registration it cites, and the signatures stored with it."""

    label: str
    receipt: str
    leaf_index: int
    registration: str
    signatures: tuple[LeafSignature, ...]
    seq: int


def revocation_receipt(registration: Receipt) -> Receipt:
    """The receipt revoking the key that ``registration`` (a key receipt) registers. The same registration gives
    the same receipt: revoking twice appends nothing."""
    return make_receipt(Kind.KEY, parents=[registration],
                        measurements={"format": KEY_REVOCATION_FORMAT, "key": registration.measurements["key"]})


def revocations(store: Store) -> dict[str, Revocation]:
    """Every revoked key by label, at its first revocation in log order (see :func:`all_revocations`)."""
    out: dict[str, Revocation] = {}
    for r in all_revocations(store):
        out.setdefault(r.label, r)
    return out


def all_revocations(store: Store) -> list[Revocation]:
    """Every revocation receipt of the ledger, in log order. Each one's id recomputes from its body (else
    DigestMismatch), it is in the log (else NotInLog; both as :func:`ledger.transparency.logged_key_receipts`
    checks every key receipt), and its chain rule holds against the key receipt it cites (else ChainBroken: it
    revokes a key no receipt registers). Its signatures are verify's to check."""
    logged = logged_key_receipts(store)
    # parents are found by the id their body hashes to (logged_key_receipts checked it), never the stored column
    by_id = {k.receipt.id: k.receipt for k in logged}
    found = [k for k in logged if k.receipt.measurements.get("format") == KEY_REVOCATION_FORMAT]
    with store.reading() as reads:
        sigs = tlog.signatures_by_seq(reads, [k.seq for k in found])
        for k in found:  # a cited receipt of another kind: its rule names what it cites instead
            for p in set(k.receipt.parents) - by_id.keys():
                cited = scalar(reads, "SELECT body FROM receipts WHERE id = ?", (p,))
                if cited is not None and (parent := Receipt.from_bytes(bytes(cited))).id == p:
                    by_id[p] = parent
    out: list[Revocation] = []
    for k in found:
        chain.check_receipt(k.receipt, by_id)
        label = load_public_key(k.receipt.measurements["key"]).label
        out.append(Revocation(label, k.receipt.id, k.leaf_index, k.receipt.parents[0], sigs.get(k.seq, ()), k.seq))
    return out


def find_key(keys: dict[str, RegisteredKey], ref: str) -> RegisteredKey:
    """The registered key ``ref`` names: its verifier key string, its label ``NAME+<8 hex>``, its key id (8 hex) or
    its name (which must then be unique among the registered keys)."""
    ref = ref.strip()
    matches = [k for k in keys.values()
               if ref in (k.verifier.key(), k.verifier.label, f"{k.verifier.key_id:08x}", k.verifier.name)]
    if not matches:
        raise KeyNotRegistered(ref, sorted(keys))
    if len(matches) > 1:
        raise AmbiguousKey(ref, sorted(k.verifier.label for k in matches))
    return matches[0]


def revoke_key(store: Store, signer: Signer, ref: str) -> tuple[Stored, Revocation | None]:
    """Append the revocation of the registered key ``ref`` (see :func:`find_key`), signed by ``signer``; returns the
    stored revocation and, when the key was revoked already, that earlier revocation (nothing is appended then).

    Refused before anything is written: a key the ledger does not register (KeyNotRegistered, AmbiguousKey), a
    witness key as signer (InputError), a signer the ledger does not register or has revoked (RevocationRefused).
    The ledger's revocations are taken as stored; whether each is validly signed is verify's to say (the CLI runs
    verify.transparency.checked_revocations first)."""
    keys = registered_keys(store)
    target = find_key(keys, ref)
    revoked = revocations(store)
    earlier = revoked.get(target.verifier.label)
    if earlier is not None:
        return store.get(earlier.receipt), earlier
    check_revoker(signer, target.verifier.label, keys, revoked)
    registration = store.get(target.receipt).receipt  # registered_keys recomputed its id from its body
    return store.append(revocation_receipt(registration), signer=signer), None


def check_revoker(signer: Signer | None, label: str, keys: dict[str, RegisteredKey],
                  revoked: dict[str, Revocation]) -> None:
    """Refuse (RevocationRefused) to append a revocation of key ``label`` that verification would reject: unsigned,
    or signed by a key the ledger does not register or has revoked; a witness key is InputError. Once logged, such
    a revocation would fail every later verification of the ledger, and the log cannot drop it."""
    if signer is None:
        raise RevocationRefused(label, "a revocation must be signed by a registered key: set LEDGER_SIGNING_KEY to "
                                "one (or use `ledger keys revoke`)", expected=sorted(keys), actual=None)
    operator_key(signer, "revocations")
    me = signer.verifier
    mine = keys.get(me.label)
    if mine is None or mine.verifier != me:
        raise RevocationRefused(label, f"the signing key {me.label} is not registered in this ledger "
                                f"(register it first, or sign with a registered key)", expected=sorted(keys),
                                actual=me.label)
    if me.label in revoked:
        was = revoked[me.label]
        raise RevocationRefused(label, f"the signing key {me.label} was revoked at leaf {was.leaf_index} by "
                                f"{was.receipt}", expected="a key not revoked", actual=was.receipt)
