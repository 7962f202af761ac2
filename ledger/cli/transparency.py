"""`ledger keys`, `log-head`, `witness add-head`, `export --in-toto`, and `ledger verify` with signatures, heads and
attestations (docs/transparency.md). Fast: nothing here imports torch, and the library only inside each command.

`ledger verify` is registered here in place of the plain one of verifying.py: it runs that same verification of a
receipt's ancestry (verify/receipts.py) and then the tamper-evidence checks, and prints both in one result.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ledger.cli import verifying
from ledger.cli.common import ArtifactsOpt, DbOpt, JsonOpt, artifact_store, emit_json, make_typer, open_store, out
from ledger.errors import InputError

KeyDirOpt = Annotated[
    Path | None,
    typer.Option("--dir", help="Key directory. Default $LEDGER_KEYS or ~/.config/training-ledger/keys."),
]
SignKeyOpt = Annotated[str, typer.Option("--key", help="Name of the signing key in the key directory.")]
LogKeyOpt = Annotated[
    list[str] | None,
    typer.Option("--log-key", help="A trusted log (operator) public key: the key string or a file holding it. "
                 "Repeatable. Default: the keys the ledger registers."),
]


def register(app: typer.Typer) -> None:
    keys_app = make_typer("Operator and witness keys: private halves in 0600 files, public halves in the ledger.")
    keys_app.command("new")(keys_new)
    keys_app.command("list")(keys_list)
    keys_app.command("export")(keys_export)
    keys_app.command("register")(keys_register)
    app.add_typer(keys_app, name="keys")
    witness_app = make_typer("A witness: cosigns a log's checkpoints that extend the last one it saw.")
    witness_app.command("add-head")(witness_add_head)
    app.add_typer(witness_app, name="witness")
    app.command("log-head")(log_head)
    app.command("export")(export)
    # Replace verifying.py's `verify`, in its place, by the one below: the same verification of a receipt's ancestry
    # plus signatures, heads and attestations.
    app.command("verify")(verify)
    mine = app.registered_commands.pop()
    plain = [i for i, c in enumerate(app.registered_commands) if c.callback is verifying.verify]
    if plain:
        app.registered_commands[plain[0]] = mine
    else:
        app.registered_commands.append(mine)


# ----------------------------------------------------------------------------------------------------- keys


def keys_new(
    name: Annotated[str, typer.Argument(help="Key name (A-Z a-z 0-9 . _ -): the file <dir>/<NAME>.key.")],
    directory: KeyDirOpt = None,
    witness: Annotated[bool, typer.Option("--witness", help="A witness key (cosignature/v1), not an operator key.")]
    = False,
    json_out: JsonOpt = False,
) -> None:
    """Create a key pair: the private key in a new 0600 file (never overwritten), the public key printed."""
    from ledger.transparency import create_key

    try:
        signer, path = create_key(name, directory, witness=witness)
    except FileExistsError as exc:
        raise InputError(f"key file {exc.filename} exists: a key is never overwritten") from None
    value = {"name": name, "path": str(path), "public_key": signer.verifier.key(), "witness": witness}
    if json_out:
        emit_json(value)
    else:
        out.print(f"{signer.verifier.key()}\n{'witness' if witness else 'operator'} key {name} written to {path} "
                  f"(mode 0600)")


def keys_list(directory: KeyDirOpt = None, db: DbOpt = None, json_out: JsonOpt = False) -> None:
    """List the keys of the key directory; with --db, also whether and where the ledger registers each."""
    from ledger.transparency import keys_dir, list_keys, registered_keys

    found = list_keys(directory)
    registered: dict[str, Any] = {}
    if db is not None:
        with open_store(db) as store:
            registered = registered_keys(store)
    rows = [{"name": k.name, "path": str(k.path), "public_key": k.verifier.key(), "witness": k.witness,
             "registered": (registered[k.verifier.label].receipt if k.verifier.label in registered else None)}
            for k in found]
    if json_out:
        emit_json({"dir": str(keys_dir(directory)), "keys": rows})
        return
    if not rows:
        out.print(f"no keys in {keys_dir(directory)}")
    for row in rows:
        where = f"  registered by {row['registered']}" if row["registered"] else ("  not registered" if db else "")
        out.print(f"{row['name']:<20} {'witness ' if row['witness'] else 'operator'} {row['public_key']}{where}")


def keys_export(name: Annotated[str, typer.Argument(help="Key name.")], directory: KeyDirOpt = None,
                json_out: JsonOpt = False) -> None:
    """Print a key's public half (the verifier key string auditors and witnesses are given)."""
    from ledger.transparency import load_key

    verifier = load_key(name, directory).verifier
    if json_out:
        emit_json({"name": name, "public_key": verifier.key(), "label": verifier.label})
    else:
        sys.stdout.write(verifier.key() + "\n")


def keys_register(
    name: Annotated[str, typer.Argument(help="Key name.")],
    directory: KeyDirOpt = None,
    db: DbOpt = None,
    rank: Annotated[int | None, typer.Option("--rank", min=0, help="The rank this key signs for (a rank's key).")]
    = None,
    json_out: JsonOpt = False,
) -> None:
    """Register a key in the ledger by a `key` receipt signed by the key itself; it may sign receipts from there on."""
    from ledger.transparency import load_key, register_key

    signer = load_key(name, directory)
    with open_store(db) as store:
        stored = register_key(store, signer, rank=rank)
    value = {"receipt": stored.receipt.id, "new": stored.new, "label": signer.verifier.label}
    if json_out:
        emit_json(value)
    else:
        out.print(f"{'registered' if stored.new else 'already registered'} {signer.verifier.label}: "
                  f"{stored.receipt.id}")


# ----------------------------------------------------------------------------------------------------- heads


def log_head(
    db: DbOpt = None,
    out_path: Annotated[Path | None, typer.Option("--out", help="Write the signed head here (default: stdout).")]
    = None,
    key: SignKeyOpt = "operator",
    directory: KeyDirOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Sign the log's current head (a C2SP checkpoint: origin, size, root) with the operator key and print it, or
    write it to --out. Publish it somewhere the database's holder cannot rewrite."""
    from ledger import note
    from ledger.artifacts import atomic_write
    from ledger.transparency import load_key, sign_head

    signer = load_key(key, directory)
    with open_store(db) as store:
        signed = sign_head(store, signer)
    cp = note.parse_checkpoint(note.parse_note(signed).text)
    if out_path is not None:
        out_path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(out_path, signed)
    if json_out:
        emit_json({"origin": cp.origin, "size": cp.size, "root": cp.root.hex(), "signed_by": signer.verifier.label,
                   "note": signed.decode(), "path": str(out_path) if out_path else None})
    elif out_path is None:
        sys.stdout.write(signed.decode())
    else:
        out.print(f"head {cp.origin} size {cp.size} root {cp.root.hex()} written to {out_path}")


def witness_add_head(
    head: Annotated[Path, typer.Argument(help="A signed checkpoint (from `ledger log-head`).")],
    state: Annotated[Path | None, typer.Option("--state", help="Witness state directory. Default $LEDGER_WITNESS "
                                               "or ~/.config/training-ledger/witness.")] = None,
    key: SignKeyOpt = "witness",
    directory: KeyDirOpt = None,
    db: Annotated[str | None, typer.Option("--db", help="The log's ledger, from which the witness computes the "
                                           "consistency proof from the last checkpoint it saw.")] = None,
    log_key: Annotated[str | None, typer.Option("--log-key", help="The log's public key (key string or file); "
                                                "pinned the first time.")] = None,
    out_path: Annotated[Path | None, typer.Option("--out", help="Write the cosigned checkpoint here (default: "
                                                  "stdout).")] = None,
    json_out: JsonOpt = False,
) -> None:
    """Cosign a checkpoint if it extends the last one this witness accepted for its log (consistency proof computed
    from --db and verified against both roots); refuse it otherwise (exit 1)."""
    from ledger.artifacts import atomic_write
    from ledger.transparency import load_key
    from verify.transparency import witness_add_head as add

    witness = load_key(key, directory)
    verifier = _verifier(log_key) if log_key else None
    if db is not None:
        with open_store(db) as store:
            result = add(state, head.read_bytes(), witness, log_key=verifier, store=store)
    else:
        result = add(state, head.read_bytes(), witness, log_key=verifier)
    if out_path is not None:
        atomic_write(out_path, result.cosigned)
    if json_out:
        emit_json({**result.to_json(), "witness": witness.verifier.label, "note": result.cosigned.decode()})
    elif out_path is None:
        sys.stdout.write(result.cosigned.decode())
    else:
        seen = "first checkpoint seen" if result.previous is None else f"extends size {result.previous}"
        out.print(f"cosigned {result.checkpoint.origin} size {result.checkpoint.size} ({seen}) as "
                  f"{witness.verifier.label}: {out_path}")


def _verifier(value: str) -> Any:
    """A verifier key given as the key string or as a file holding it."""
    from ledger import note

    text = value
    if "+" not in value or Path(value).is_file():
        text = Path(value).read_text(encoding="utf-8").strip()
    return note.Verifier.from_key(text)


# --------------------------------------------------------------------------------------------------- export


def export(
    in_toto: Annotated[str, typer.Option("--in-toto", help="The receipt (id or unique prefix) to attest.")],
    out_path: Annotated[Path | None, typer.Option("--out", help="Write the envelope here (default: stdout).")]
    = None,
    key: SignKeyOpt = "operator",
    directory: KeyDirOpt = None,
    db: DbOpt = None,
    artifacts: ArtifactsOpt = None,
) -> None:
    """Write an in-toto Statement v1 attesting a receipt (its artifacts as subjects with sha256 and blake3, the
    receipt and its inclusion proof against a checkpoint signed now) in a DSSE envelope signed by the operator."""
    from ledger.artifacts import atomic_write
    from ledger.transparency import export_attestation, load_key

    signer = load_key(key, directory)
    with open_store(db) as store:
        envelope = export_attestation(store, artifact_store(store.url, artifacts), in_toto, signer)
    data = envelope.to_json() + b"\n"
    if out_path is None:
        sys.stdout.write(data.decode())
    else:
        atomic_write(out_path, data)
        out.print(f"attestation of {in_toto} written to {out_path}")


# --------------------------------------------------------------------------------------------------- verify


def verify(
    ref: Annotated[str | None, typer.Argument(help="Receipt id or unique hex prefix (optional with --head).")] = None,
    db: DbOpt = None,
    artifacts: ArtifactsOpt = None,
    require_artifacts: Annotated[
        bool, typer.Option("--require-artifacts", help="Fail (exit 3) when an artifact's bytes are missing.")
    ] = False,
    rescore: Annotated[
        int, typer.Option("--rescore", min=0, help="Also re-score N random documents of each eval from its checkpoint.")
    ] = 0,
    head: Annotated[Path | None, typer.Option("--head", help="A signed checkpoint published earlier: prove the "
                                              "ledger extends it and includes what is verified.")] = None,
    in_toto: Annotated[Path | None, typer.Option("--in-toto", help="Verify an attestation (DSSE envelope) "
                                                 "instead of a receipt.")] = None,
    log_key: LogKeyOpt = None,
    witness_key: Annotated[list[str] | None, typer.Option("--witness-key", help="Require the head to be cosigned "
                                                          "by this witness (key string or file). Repeatable.")]
    = None,
    require_signatures: Annotated[bool, typer.Option("--require-signatures", help="Fail on an unsigned receipt.")]
    = False,
    json_out: JsonOpt = False,
) -> None:
    """Recompute a receipt's id and every ancestor's, check parent links, chain rules, artifact digests and who signed
    each receipt; with --head, that the ledger extends that head and includes them (without an id: every receipt of
    the ledger); with --in-toto, an exported attestation."""
    from ledger.errors import VerificationError

    trusted = [_verifier(k) for k in log_key] if log_key else None
    try:
        if in_toto is not None:
            _verify_attestation(in_toto, db, artifacts, trusted, json_out)
            return
        if ref is None and head is None:
            raise InputError("give a receipt id, --head FILE or --in-toto FILE")
        _verify_ledger(ref, db, artifacts, require_artifacts, rescore, head, trusted,
                       [_verifier(k) for k in witness_key or ()], require_signatures, json_out)
    except VerificationError as exc:
        if json_out:  # scripts get the structured failure on stdout as well as the one line on stderr
            emit_json({"ok": False, **exc.diagnostics()})
        raise


def _verify_ledger(ref: str | None, db: str | None, artifacts: Path | None, require_artifacts: bool, rescore: int,
                   head: Path | None, trusted: list[Any] | None, witnesses: list[Any], require_signatures: bool,
                   json_out: bool) -> None:
    from verify.receipts import verify_receipt
    from verify.transparency import check_signatures, verify_head

    store = open_store(db)
    report = None
    closure: list[str] | None = None
    if ref is not None:
        report = verify_receipt(store, ref, artifacts=artifact_store(store.url, artifacts),
                                require_artifacts=require_artifacts, rescore=rescore,
                                runner=verifying._model_runner(rescore))
        closure = [s.receipt.id for s in store.ancestors(report.receipt)]
    signatures = check_signatures(store, closure, require=require_signatures)
    head_report = None
    if head is not None:
        head_report = verify_head(store, head.read_bytes(), trusted=trusted, witnesses=witnesses, receipts=closure)
    if json_out:
        value: dict[str, Any] = report.to_json() if report is not None else {"ok": True}
        value["signatures"] = signatures.to_json()
        if head_report is not None:
            value["log"] = head_report.to_json()
        emit_json(value)
        return
    if report is not None:
        _print_receipt_report(report)
    else:
        out.print(f"OK ledger: {signatures.checked} receipt(s) re-hashed, logged and signature-checked")
    for line in signatures.lines() + (head_report.lines() if head_report is not None else []):
        out.print(f"  {line}")


def _print_receipt_report(report: Any) -> None:
    """The text of a receipt's verification, as verifying.py's `verify` prints it."""
    verified = {a.digest for a in report.artifacts if a.status == "verified"}
    missing: dict[str, list[str]] = {}
    for a in report.missing:
        missing.setdefault(a.digest, []).append(a.name)
    out.print(f"OK {report.receipt}: {report.receipts_checked} receipt(s) recomputed and chained, "
              f"{len(verified)} distinct artifact(s) re-hashed, {len(missing)} missing")
    for digest, names in list(missing.items())[:10]:
        out.print(f"  missing: {digest} ({', '.join(sorted(set(names)))}, cited {len(names)}x)")
    if len(missing) > 10:
        out.print(f"  ... and {len(missing) - 10} more missing (see --json)")
    for line in report.checks:
        out.print(f"  {line}")


def _verify_attestation(path: Path, db: str | None, artifacts: Path | None, trusted: list[Any] | None,
                        json_out: bool) -> None:
    """Trust the keys given, else the keys the ledger given by --db registers; with --db the ledger must also
    extend the attested checkpoint and include the receipt."""
    from ledger.transparency import registered_keys
    from verify.transparency import verify_attestation

    store = open_store(db) if db is not None else None
    if trusted is None:
        if store is None:
            raise InputError("no trusted key: give --log-key KEY, or --db with a ledger that registers the key")
        trusted = [k.verifier for k in registered_keys(store).values()]
    arts = artifact_store(store.url, artifacts) if store is not None else (
        artifact_store("", artifacts) if artifacts is not None else None)
    result = verify_attestation(path.read_bytes(), trusted, artifacts=arts, store=store)
    if json_out:
        emit_json(result.to_json())
    else:
        for line in result.lines():
            out.print(line)
