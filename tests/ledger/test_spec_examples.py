"""The worked examples of docs/receipts.md, checked against the library, so the spec cannot drift from the code.

Every fenced block labelled ``example-...`` in the page is parsed (format: records separated by blank lines, each
line ``key: value``, repeated ``hex:`` lines concatenated; see section 8 of the page) and each claim in it is
recomputed: canonical bytes, digests, float texts, receipt ids, prepared/selection digests, chain rules, error
messages. docs/cli.md is checked for a section per CLI command and for the exit-code table.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from typing import Any

import pytest
import typer

from ledger import chain, digests, errors
from ledger.artifacts import ArtifactStore
from ledger.cli import app
from ledger.errors import LedgerError
from ledger.receipts import KINDS, Receipt, make_receipt, parse_receipt
from ledger.store import Store
from verify.receipts import verify_receipt

DOCS = Path(__file__).resolve().parents[2] / "docs"
SPEC = (DOCS / "receipts.md").read_text(encoding="utf-8")
CLI_DOC = (DOCS / "cli.md").read_text(encoding="utf-8")

Record = dict[str, str]


def example_blocks(text: str) -> list[tuple[str, list[Record]]]:
    """(label, records) for every fenced ```example-<label> block, in page order."""
    out: list[tuple[str, list[Record]]] = []
    for label, body in re.findall(r"^```example-([a-z-]+)\n(.*?)^```$", text, flags=re.S | re.M):
        if label == "floats":  # one vector per line, parsed by float_vectors()
            out.append((label, []))
            continue
        records: list[Record] = []
        current: Record = {}
        for raw in body.split("\n"):
            line = raw.rstrip()
            if not line:
                if current:
                    records.append(current)
                current = {}
                continue
            key, sep, value = line.partition(": ")
            assert sep, f"example-{label}: line without 'key: value': {line!r}"
            if key == "hex":
                current["hex"] = current.get("hex", "") + value
            else:
                assert key not in current, f"example-{label}: repeated key {key!r}"
                current[key] = value
        if current:
            records.append(current)
        out.append((label, records))
    return out


BLOCKS = example_blocks(SPEC)


def records(label: str) -> list[Record]:
    return [r for lab, recs in BLOCKS if lab == label for r in recs]


def record_bytes(rec: Record) -> bytes:
    if "bytes" in rec:
        data = rec["bytes"].encode("utf-8")
        if "hex" in rec:
            assert bytes.fromhex(rec["hex"]) == data
        return data
    return bytes.fromhex(rec["hex"])


def test_page_has_the_examples_it_promises() -> None:
    labels = [label for label, _ in BLOCKS]
    assert set(labels) == {"canonical", "domains", "floats", "receipt", "noncanonical"}, labels
    assert len(records("canonical")) >= 2
    assert len(records("receipt")) >= 3
    assert len(records("noncanonical")) >= 10
    assert "## State digests (checkpoints)" in SPEC


@pytest.mark.parametrize("rec", records("canonical"), ids=lambda r: r["text"][:24])
def test_canonical_examples(rec: Record) -> None:
    value = ast.literal_eval(rec["input"])
    body = digests.canonical_bytes(value)
    assert body.decode("utf-8") == rec["text"]
    assert body.hex() == rec["hex"]
    assert len(body) == int(rec["length"])
    if "blake3" in rec:
        assert digests.raw_digest(body) == rec["blake3"]
    domains = [k.removeprefix("digest ") for k in rec if k.startswith("digest ")]
    assert len(domains) >= 2
    for domain in domains:
        assert digests.digest_bytes(domain, body) == rec[f"digest {domain}"]
        assert digests.digest_json(domain, value) == rec[f"digest {domain}"]
    assert digests.canonical_bytes(digests.parse_canonical(body)) == body


def test_domain_vectors_cover_every_domain() -> None:
    (rec,) = records("domains")
    assert set(rec) == set(digests.DOMAINS) | {"raw"}, "a new digest domain needs a vector in docs/receipts.md"
    for domain in digests.DOMAINS:
        assert digests.digest_bytes(domain, b"") == rec[domain]
    assert digests.raw_digest(b"") == rec["raw"]


def float_vectors() -> list[tuple[str, str]]:
    body = re.search(r"^```example-floats\n(.*?)^```$", SPEC, flags=re.S | re.M)
    assert body is not None
    pairs = [line.split() for line in body.group(1).splitlines() if line.strip()]
    return [(p[0], p[1]) for p in pairs]


def test_float_vectors() -> None:
    vectors = float_vectors()
    assert len(vectors) >= 20
    for hexfloat, text in vectors:
        x = float.fromhex(hexfloat)
        assert digests.canonical_bytes(x) == text.encode(), hexfloat
        back = digests.parse_canonical(text.encode())
        assert isinstance(back, float) and back.hex() == x.hex()


def _receipts_in_page() -> list[tuple[Record, Receipt]]:
    return [(rec, parse_receipt(rec["body"].encode("utf-8"))) for rec in records("receipt")]


def test_receipt_examples() -> None:
    seen: dict[str, Receipt] = {}
    for rec, receipt in _receipts_in_page():
        body = rec["body"].encode("utf-8")
        assert receipt.body == body
        assert receipt.kind == rec["name"]
        assert receipt.id == rec["id"] == digests.receipt_id(body)
        if "hex" in rec:
            assert body.hex() == rec["hex"]
        # The body is what make_receipt writes for these fields (the writers' path, not only the parser's).
        doc = receipt.to_document()
        rebuilt = make_receipt(doc["kind"], run=doc["run"], rank=doc["rank"], step=doc["step"],
                               prepared=doc["prepared"], selection=doc["selection"], parents=doc["parents"],
                               artifacts=doc["artifacts"], measurements=doc["measurements"])
        assert rebuilt.body == body
        files = {k.removeprefix("file "): ast.literal_eval(v) for k, v in rec.items() if k.startswith("file ")}
        for name, content in files.items():
            assert digests.raw_digest(content.encode("utf-8")) == receipt.artifacts[name]
        if "prepared" in rec:
            assert digests.prepared_digest(receipt.artifacts) == rec["prepared"] == receipt.prepared
        if "selection" in rec:
            assert digests.selection_digest(receipt.artifacts) == rec["selection"] == receipt.selection
        chain.check_receipt(receipt, seen)  # parents are the earlier examples; the rules of the page hold
        seen[receipt.id] = receipt
    assert [r.kind for r in seen.values()][:1] == ["prepare"]
    assert any(len(r.parents) >= 2 for r in seen.values())


def test_receipt_examples_verify_in_a_real_ledger(tmp_path: Path) -> None:
    """Append the page's receipts to an SQLite ledger with their artifact files and verify the last one."""
    pairs = _receipts_in_page()
    arts = ArtifactStore(tmp_path / "artifacts")
    for rec, receipt in pairs:
        for key, value in rec.items():
            if key.startswith("file "):
                assert arts.put_bytes(ast.literal_eval(value).encode("utf-8")) == receipt.artifacts[key[5:]]
    with Store.open(tmp_path / "ledger.db", create=True) as store:
        store.append_many([r for _, r in pairs])
        report = verify_receipt(store, pairs[-1][1].id, artifacts=arts)
    assert report.receipts_checked == len(pairs)
    file_count = sum(k.startswith("file ") for rec, _ in pairs for k in rec)
    assert sum(a.status == "verified" for a in report.artifacts) == file_count


@pytest.mark.parametrize("rec", records("noncanonical"), ids=lambda r: (r.get("bytes") or r["hex"])[:30])
def test_noncanonical_examples(rec: Record) -> None:
    data = record_bytes(rec)
    with pytest.raises(LedgerError) as caught:
        if rec.get("as", "json") == "receipt":
            parse_receipt(data)
        else:
            digests.parse_canonical(data)
    assert isinstance(caught.value, errors.InputError)
    message = str(caught.value)
    if "error" in rec:
        assert message == rec["error"]
    else:
        assert message.startswith(rec["error prefix"])


def test_kinds_table_lists_every_kind() -> None:
    section = SPEC.split("### 3.3 Kinds", 1)[1].split("\n### ", 1)[0]
    listed = set(re.findall(r"^\| `([a-z-]+)` \|", section, flags=re.M))
    assert listed == set(KINDS), "docs/receipts.md section 3.3 must list exactly the kinds of ledger.receipts"
    rules = SPEC.split("### 4.2 Rules per kind", 1)[1].split("\n### ", 1)[0]
    for kind in KINDS:
        assert f"`{kind}`" in rules, f"no chain rule documented for {kind}"


def test_context_string_in_page() -> None:
    assert f'"{digests._CONTEXT_BASE}" + d' in SPEC


# ------------------------------------------------------------------------------------------- docs/cli.md


# Commands whose authors append their own docs/cli.md sections (issue 3); remove a name once its section exists.
PENDING_SECTIONS: frozenset[str] = frozenset()


def _command_paths(group: Any, prefix: str = "") -> list[str]:
    paths: list[str] = []
    for name, cmd in group.commands.items():
        path = f"{prefix}{name}"
        if hasattr(cmd, "commands"):  # a sub-group (typer vendors its own click, so no isinstance check)
            paths.extend(_command_paths(cmd, path + " "))
        else:
            paths.append(path)
    return paths


def test_cli_doc_has_a_section_per_command() -> None:
    commands = set(_command_paths(typer.main.get_command(app)))
    assert {"init", "append", "show", "log", "verify", "db upgrade", "db current", "db downgrade"} <= commands
    headings = set(re.findall(r"^### `ledger ([a-z -]+?)`", CLI_DOC, flags=re.M))
    missing = sorted(commands - headings - PENDING_SECTIONS)
    assert not missing, f"docs/cli.md has no '### `ledger <command>`' section for {missing}"
    stale = sorted(headings - commands)
    assert not stale, f"docs/cli.md documents commands that do not exist: {stale}"


def test_cli_doc_exit_codes() -> None:
    table: dict[int, Any] = {int(code): text for code, text in re.findall(r"^\| (\d) \| (.+) \|$", CLI_DOC, re.M)}
    assert set(table) == {errors.EXIT_OK, errors.EXIT_FAILED, errors.EXIT_USAGE, errors.EXIT_LOOKUP,
                          errors.EXIT_DATABASE}
    for cls, code in ((errors.VerificationError, 1), (errors.InputError, 2), (errors.LookupFailed, 3),
                      (errors.DatabaseError, 4)):
        assert cls.exit_code == code
        assert cls.__name__ in table[code], f"docs/cli.md exit code {code} should name {cls.__name__}"
