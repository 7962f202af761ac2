"""A signed batched append stores one batch signature per 1,024 receipts (ledger/signing.py), each receipt of a
batch the same bytes, and a receipt appended alone sign_receipt's; and opening a Store, `ledger show` and
`ledger --help` never import cryptography (it is imported when a key is made or loaded or a signature made or
checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ledger.receipts import make_receipt
from ledger.signing import MAX_BATCH, generate_key, sign_batch, sign_receipt
from ledger.store import Store


def test_a_signed_batched_append_stores_one_signature_per_batch(tmp_path: Path) -> None:
    signer = generate_key("bench-operator")
    n = 2 * MAX_BATCH + 452
    with Store.open(tmp_path / "ledger.db", create=True, signer=signer) as store:
        stored = store.append_many([make_receipt("note", measurements={"i": i}) for i in range(n)])
        alone = store.append(make_receipt("note", measurements={"alone": True})).receipt.id
        with store.engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT r.id, s.key, s.signature FROM receipts r JOIN receipt_signatures s "
                                        "ON s.receipt_seq = r.seq ORDER BY r.seq").all()
    assert len(rows) == n + 1 and {key for _, key, _ in rows} == {signer.verifier.label}
    ids = [s.receipt.id for s in sorted(stored, key=lambda s: s.seq)]
    want = sign_batch(signer, ids)
    assert [len(chunk) for chunk, _ in want] == [MAX_BATCH, MAX_BATCH, 452]
    assert [(rid, bytes(sig)) for rid, _, sig in rows[:n]] == [(rid, sig) for chunk, sig in want for rid in chunk]
    assert (rows[n][0], bytes(rows[n][2])) == (alone, sign_receipt(signer, alone).signature)


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, check=True, cwd=Path(__file__).resolve().parents[2])
    return set(out.stdout.split())


def test_opening_a_store_and_show_do_not_import_cryptography(ledger_db: Path) -> None:
    with Store.open(ledger_db) as store:
        rid = store.append(make_receipt("note", measurements={"x": 1})).receipt.id
    loaded = _loaded_after(f"from ledger.store import Store\nStore.open({str(ledger_db)!r}).get({rid!r})")
    assert "ledger.store" in loaded and not {m for m in loaded if m.startswith("cryptography")}
    for args in (["show", rid, "--db", str(ledger_db)], ["--help"]):
        loaded = _loaded_after(f"import sys\nfrom ledger.cli import main\nsys.argv = ['ledger', *{args!r}]\n"
                               "try:\n    main()\nexcept SystemExit:\n    pass")
        assert not {m for m in loaded if m.startswith("cryptography")}, args
    loaded = _loaded_after("from ledger.signing import generate_key\ngenerate_key('a')")
    assert "cryptography" in loaded  # and it is there once a key is made
