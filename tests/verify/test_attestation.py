"""In-toto attestations of a receipt (ledger/transparency.py exports, verify/transparency.py checks): the export/verify
round trip through the CLI, what the statement holds, interop with securesystemslib, and each way a tampered
attestation fails: a bad signature even when the subjects match, a payload changed under its signature, an
untrusted key, a subject's bytes changed on disk, and an operator-signed envelope whose proof does not include it."""

from __future__ import annotations

import base64
import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey
from typer.testing import CliRunner

from ledger import digests, dsse
from ledger import transparency as tp
from ledger.artifacts import ArtifactStore, default_root
from ledger.cli import app
from ledger.errors import DigestMismatch
from ledger.receipts import Receipt, make_receipt
from ledger.store import Store
from ledger.transparency_errors import SignatureInvalid, UnknownKey
from tests.ledger.test_dsse import securesystemslib
from verify import transparency as vt


def cli(*args: str) -> tuple[int, str, str]:
    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stdout, r.stderr


class Attested:
    def __init__(self, tmp_path: Path) -> None:
        self.keys = tmp_path / "keys"
        self.db = tmp_path / "ledger.db"
        assert cli("keys", "new", "operator", "--dir", str(self.keys))[0] == 0
        self.signer = tp.load_key("operator", self.keys)
        with Store.open(self.db, create=True, signer=self.signer) as store:
            tp.register_key(store, self.signer)
            self.arts = ArtifactStore(default_root(store.url))
            self.data = b"outcome,1\noutcome,0\n"
            self.config = b'{"lr":0.001}'
            files = {"outcomes": self.arts.put_bytes(self.data), "config": self.arts.put_bytes(self.config)}
            missing = digests.raw_digest(b"bytes nobody kept")
            self.receipt: Receipt = make_receipt("note", artifacts={**files, "model": missing},
                                                 measurements={"accuracy": 0.5})
            store.append(self.receipt)
            store.append(make_receipt("note", measurements={"after": 1}))
        self.envelope = tmp_path / "attestation.json"
        code, _, stderr = cli("export", "--in-toto", self.receipt.id[7:19], "--out", str(self.envelope), "--db",
                              str(self.db), "--dir", str(self.keys))
        assert code == 0, stderr

    def payload(self) -> dict[str, Any]:
        return json.loads(base64.b64decode(json.loads(self.envelope.read_text())["payload"]))

    def verify(self, *extra: str) -> tuple[int, str, str]:
        return cli("verify", "--in-toto", str(self.envelope), "--db", str(self.db), *extra)


@pytest.fixture
def att(tmp_path: Path) -> Attested:
    return Attested(tmp_path)


def test_export_and_verify_round_trip(att: Attested) -> None:
    code, stdout, stderr = att.verify()
    assert code == 0, stderr
    assert f"OK attestation of note receipt {att.receipt.id}" in stdout and "2 re-hashed" in stdout
    # without the ledger, with the operator's public key given
    code, stdout, stderr = cli("verify", "--in-toto", str(att.envelope), "--log-key", att.signer.verifier.key())
    assert code == 0, stderr
    code, stdout, _ = att.verify("--json")
    assert json.loads(stdout)["leaf_index"] == 1 and json.loads(stdout)["tree_size"] == 3


def test_the_statement_holds_the_receipt_its_subjects_and_its_proof(att: Attested) -> None:
    stmt = att.payload()
    assert stmt["_type"] == "https://in-toto.io/Statement/v1" and stmt["predicateType"] == tp.PREDICATE_TYPE
    subjects = {s["name"]: s["digest"] for s in stmt["subject"]}
    assert subjects[att.receipt.id] == {"sha256": hashlib.sha256(att.receipt.body).hexdigest(),
                                        "blake3": digests.raw_digest(att.receipt.body)[7:]}
    assert subjects["outcomes"] == {"sha256": hashlib.sha256(att.data).hexdigest(),
                                    "blake3": att.receipt.artifacts["outcomes"][7:]}
    assert "model" not in subjects and "model" in stmt["predicate"]["not_subjects"]  # no bytes: not a subject
    pred = stmt["predicate"]
    assert digests.canonical_bytes(pred["receipt"]) == att.receipt.body and pred["receipt_id"] == att.receipt.id
    assert pred["signatures"][0]["key"] == att.signer.verifier.label
    assert pred["log"]["checkpoint"].startswith("training-ledger/") and pred["log"]["leaf_index"] == 1
    assert json.loads(att.envelope.read_text())["payloadType"] == dsse.PAYLOAD_TYPE_IN_TOTO


def test_our_attestation_verifies_with_securesystemslib(att: Attested) -> None:
    ssl = securesystemslib()
    label = att.signer.verifier.label
    public = ssl.signer.SSlibKey.from_crypto(
        Ed25519PublicKey.from_public_bytes(att.signer.verifier.public_key), keyid=label)
    theirs = ssl.dsse.Envelope.from_dict(json.loads(att.envelope.read_text()))
    assert list(theirs.verify([public], 1)) == [label]


def _sig_flipped(att: Attested) -> None:
    env = json.loads(att.envelope.read_text())
    sig = bytearray(base64.b64decode(env["signatures"][0]["sig"]))
    sig[5] ^= 0x01
    env["signatures"][0]["sig"] = base64.b64encode(bytes(sig)).decode()
    att.envelope.write_text(json.dumps(env))


def test_a_bad_signature_is_rejected_even_when_the_subjects_match(att: Attested) -> None:
    subjects = att.payload()["subject"]
    _sig_flipped(att)
    assert att.payload()["subject"] == subjects  # everything the envelope says is unchanged
    code, stdout, stderr = att.verify()
    assert code == 1 and stdout == "" and len(stderr.splitlines()) == 1 and "does not verify" in stderr
    with pytest.raises(SignatureInvalid):
        vt.verify_attestation(att.envelope.read_bytes(), [att.signer.verifier])


def test_a_payload_changed_under_its_signature_is_rejected(att: Attested) -> None:
    env = json.loads(att.envelope.read_text())
    stmt = att.payload()
    stmt["predicate"]["receipt"]["measurements"]["accuracy"] = 0.9
    env["payload"] = base64.b64encode(dsse.statement_bytes(stmt)).decode()
    att.envelope.write_text(json.dumps(env))
    code, _, stderr = att.verify()
    assert code == 1 and "does not verify" in stderr


def test_an_untrusted_key_is_rejected(att: Attested, tmp_path: Path) -> None:
    other = tp.create_key("other", tmp_path / "other-keys")[0]
    code, _, stderr = cli("verify", "--in-toto", str(att.envelope), "--log-key", other.verifier.key())
    assert code == 1 and "no valid signature by a trusted key" in stderr
    with pytest.raises(UnknownKey):
        vt.verify_attestation(att.envelope.read_bytes(), [other.verifier])


def test_a_subjects_bytes_changed_on_disk_fail(att: Attested) -> None:
    path = att.arts.path_for(att.receipt.artifacts["config"])
    path.chmod(0o644)
    path.write_bytes(b'{"lr":0.1}')
    with Store.open(att.db) as store, pytest.raises(DigestMismatch, match="config"):
        vt.verify_attestation(att.envelope.read_bytes(), [att.signer.verifier], artifacts=att.arts, store=store)
    with Store.open(att.db) as store, pytest.raises(DigestMismatch):  # and the export refuses to attest them
        tp.export_attestation(store, att.arts, att.receipt.id, att.signer)


def test_an_operator_signed_attestation_the_checkpoint_does_not_include_fails(att: Attested) -> None:
    """The operator holds the key: it can sign anything, but not make a proof include a receipt it does not."""
    stmt = att.payload()
    proof = stmt["predicate"]["log"]["inclusion_proof"]
    proof[0] = base64.b64encode(bytes(32)).decode()
    env = dsse.sign_statement(stmt, {att.signer.verifier.label: att.signer.private_key})
    with pytest.raises(vt.AttestationMismatch, match="not included"):
        vt.verify_attestation(env.to_json(), [att.signer.verifier])
    stmt = att.payload()
    stmt["subject"][1]["digest"]["blake3"] = "0" * 64  # a subject that is not the receipt's artifact
    env = dsse.sign_statement(stmt, {att.signer.verifier.label: att.signer.private_key})
    with pytest.raises(vt.AttestationMismatch, match="not an artifact of the receipt"):
        vt.verify_attestation(env.to_json(), [att.signer.verifier])
