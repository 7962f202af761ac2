"""verify.report.network_scope: the report's network scope says where the ranks ran, from their recorded hosts."""

from __future__ import annotations

from verify.report import NETWORK_SCOPE, network_scope

FOUR = [f"ledger-h{k}" for k in range(4)]


def test_ranks_on_one_host_keep_the_one_host_text() -> None:
    # The text of every report made on one host before the scope was derived: their audits still rebuild.
    assert network_scope({"ddp-four": ["box"] * 4, "diloco-four": ["box"] * 4}) == NETWORK_SCOPE
    assert network_scope({}) == NETWORK_SCOPE  # no multi-rank arm summarized yet
    assert network_scope({"ddp-four": ["ledger-h0", None, "ledger-h2", "ledger-h3"]}) == NETWORK_SCOPE
    assert "share one host" in NETWORK_SCOPE


def test_one_rank_per_host_says_so_and_names_the_hosts() -> None:
    scope = network_scope({"ddp-four": FOUR, "diloco-four": FOUR})
    assert scope.startswith("sent_bytes: payload bytes each rank contributed")
    assert "ddp-four and diloco-four ran one per host, on 4 separate hosts" in scope
    assert "(ledger-h0, ledger-h1, ledger-h2, ledger-h3, as their bindings record)" in scope
    assert "share one host" not in scope
    assert scope == network_scope({"ddp-four": list(FOUR), "diloco-four": tuple(FOUR)})  # a function of the hosts


def test_mixed_placements_list_each_arm() -> None:
    scope = network_scope({"ddp-four": ["a", "a", "b", "b"], "diloco-four": FOUR})
    assert scope.endswith("as their bindings record: ddp-four: 4 ranks on a, b; diloco-four: 4 ranks on "
                          "ledger-h0, ledger-h1, ledger-h2, ledger-h3")
    # Each arm one per host, but not on the same hosts: listed too, not called one set of hosts.
    other = network_scope({"ddp-four": FOUR, "diloco-four": ["n0", "n1", "n2", "n3"]})
    assert "ddp-four: 4 ranks on ledger-h0" in other and "diloco-four: 4 ranks on n0, n1, n2, n3" in other
