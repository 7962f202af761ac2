"""`ledger keys`, `log-head`, `witness add-head` and `export --in-toto` (docs/transparency.md). Fast: nothing here
imports torch, and the library only inside each command. Verifying signatures, heads and attestations is part of
`ledger verify` (verifying.py), which renders every verification in one place.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Any

import typer

from ledger.cli.common import (
    ArtifactsOpt,
    DbOpt,
    JsonOpt,
    artifact_store,
    emit_json,
    make_typer,
    open_store,
    out,
    read_input,
)
from ledger.cli.verifying import verifier_key
from ledger.errors import InputError

KeyDirOpt = Annotated[
    Path | None,
    typer.Option("--dir", help="Key directory. Default $LEDGER_KEYS or ~/.config/training-ledger/keys."),
]
SignKeyOpt = Annotated[str, typer.Option("--key", help="Name of the signing key in the key directory.")]


def register(app: typer.Typer) -> None:
    keys_app = make_typer("Operator and witness keys: private halves in 0600 files, public halves in the ledger.")
    keys_app.command("new")(keys_new)
    keys_app.command("list")(keys_list)
    keys_app.command("export")(keys_export)
    keys_app.command("register")(keys_register)
    keys_app.command("revoke")(keys_revoke)
    app.add_typer(keys_app, name="keys")
    witness_app = make_typer("A witness: cosigns a log's checkpoints that extend the last one it saw.")
    witness_app.command("add-head")(witness_add_head)
    app.add_typer(witness_app, name="witness")
    app.command("log-head")(log_head)
    app.command("export")(export)


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
    """List the keys of the key directory; with --db, also whether and where the ledger registers and revokes each.
    A key file that does not load is listed with what is wrong with it, and the command then fails with the first
    one's error (exit 2)."""
    from ledger.revocation import revocations
    from ledger.transparency import keys_dir, list_keys, registered_keys

    found, unusable = list_keys(directory)
    registered: dict[str, Any] = {}
    revoked: dict[str, Any] = {}
    if db is not None:
        with open_store(db) as store:
            registered, revoked = registered_keys(store), revocations(store)
    rows = [{"name": k.name, "path": str(k.path), "public_key": k.verifier.key(), "witness": k.witness,
             "registered": (registered[k.verifier.label].receipt if k.verifier.label in registered else None),
             "revoked": (revoked[k.verifier.label].receipt if k.verifier.label in revoked else None)}
            for k in found]
    if json_out:
        emit_json({"dir": str(keys_dir(directory)), "keys": rows,
                   "unusable": [{"name": u.name, "path": str(u.path), "problem": u.problem} for u in unusable]})
    else:
        if not rows and not unusable:
            out.print(f"no keys in {keys_dir(directory)}")
        for row in rows:
            where = f"  registered by {row['registered']}" if row["registered"] else ("  not registered" if db else "")
            if row["revoked"]:
                where += f", revoked by {row['revoked']}"
            out.print(f"{row['name']:<20} {'witness ' if row['witness'] else 'operator'} {row['public_key']}{where}")
        for u in unusable:
            out.print(f"{u.name:<20} unusable: {u.problem}")
    if unusable:
        raise unusable[0].error


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


def keys_revoke(
    key: Annotated[str, typer.Argument(help="The registered key to revoke: its name, its label NAME+<8 hex>, its "
                                       "key id (8 hex) or its public key string.")],
    signing_key: Annotated[str, typer.Option("--key", help="Name of the registered key in the key directory that "
                                             "signs the revocation (the revoked key itself may).")] = "operator",
    directory: KeyDirOpt = None,
    db: DbOpt = None,
    json_out: JsonOpt = False,
) -> None:
    """Revoke a registered key by a `key` revocation receipt signed by a registered, non-revoked key: its signatures
    on receipts appended after the revocation fail verification; those before it stay valid."""
    from ledger.revocation import revoke_key
    from ledger.signing import load_public_key
    from ledger.transparency import load_key
    from verify.transparency import checked_revocations

    signer = load_key(signing_key, directory)
    with open_store(db) as store:
        # The ledger's revocations as verify judges them: an invalid one is not a key revoked already (exit 1).
        checked_revocations(store)
        stored, earlier = revoke_key(store, signer, key)
    revoked = load_public_key(stored.receipt.measurements["key"]).label
    signed_by = [signer.verifier.label] if earlier is None else [s.key for s in earlier.signatures]
    value = {"receipt": stored.receipt.id, "new": earlier is None and stored.new, "label": revoked,
             "signed_by": signed_by}
    if json_out:
        emit_json(value)
    elif value["new"]:
        out.print(f"revoked {revoked}: {stored.receipt.id} (signed by {signed_by[0]}); its signatures on "
                  f"receipts appended from now on fail verification")
    else:
        out.print(f"already revoked {revoked}: {stored.receipt.id}")


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
    from ledger.note import MAX_NOTE_BYTES
    from ledger.transparency import load_key
    from verify.transparency import witness_add_head as add

    witness = load_key(key, directory)
    verifier = verifier_key(log_key) if log_key else None
    checkpoint = read_input(head, MAX_NOTE_BYTES)
    if db is not None:
        with open_store(db) as store:
            result = add(state, checkpoint, witness, log_key=verifier, store=store)
    else:
        result = add(state, checkpoint, witness, log_key=verifier)
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
