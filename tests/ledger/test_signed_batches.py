"""A signed batched append stores, for every receipt, the signature sign_receipt makes (tlog.sign_ids works the
key's label out once per batch, not the message); and opening a Store, `ledger show` and `ledger --help` never
import cryptography (it is imported when a key is made or loaded or a signature made or checked)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from ledger.receipts import make_receipt
from ledger.signing import generate_key, sign_receipt
from ledger.store import Store


def test_a_signed_batched_append_stores_the_same_signatures(tmp_path: Path) -> None:
    signer = generate_key("bench-operator")
    with Store.open(tmp_path / "ledger.db", create=True, signer=signer) as store:
        for b in range(3):
            store.append_many([make_receipt("note", measurements={"b": b, "i": i}) for i in range(300)])
        with store.engine.connect() as conn:
            rows = conn.exec_driver_sql("SELECT r.id, s.key, s.signature FROM receipts r JOIN receipt_signatures s "
                                        "ON s.receipt_seq = r.seq").all()
    assert len(rows) == 900
    assert all((key, bytes(sig)) == (signer.verifier.label, sign_receipt(signer, rid).signature)
               for rid, key, sig in rows)


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
