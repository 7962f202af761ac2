"""`ledger hosts up N [--rate R] | down | status`: test hosts as network namespaces on a shaped bridge
(runners/hosts.py; docs/hosts.md). Needs root. Imports no torch."""

from __future__ import annotations

from typing import Annotated, Any

import typer

from ledger.cli.common import JsonOpt, emit, make_typer

hosts_app = make_typer("Test hosts on this machine: network namespaces with shaped links (root only).")


PrefixOpt = Annotated[str, typer.Option("--prefix", help="Names: <prefix>-h0 .. and the switch <prefix>-sw.")]
SubnetOpt = Annotated[str, typer.Option("--subnet", help="A private /24: the switch .1, host K .100+K.")]


def register(app: typer.Typer) -> None:
    app.add_typer(hosts_app, name="hosts")


def _network(prefix: str, subnet: str) -> Any:
    from runners.hosts import Network

    return Network(prefix, subnet)


@hosts_app.command("up")
def up_cmd(
    n: Annotated[int, typer.Argument(min=1, help="How many hosts (ledger-h0 .. ledger-h<N-1>).")],
    rate: Annotated[str, typer.Option("--rate", help="Each link's rate, both ways (tc units: 100mbit, 1gbit).")]
    = "100mbit",
    prefix: PrefixOpt = "ledger",
    subnet: SubnetOpt = "10.231.7.0/24",
    json_out: JsonOpt = False,
) -> None:
    """Bring up N hosts on a bridge, each link shaped with tbf. Idempotent: repairs a set with the same
    settings (a host that died is recreated), replaces one with other settings."""
    from runners import hosts

    hs = hosts.up(n, rate, _network(prefix, subnet))
    emit(hs.to_json(), json_out, f"{len(hs)} hosts up at {hs.rate} on {hs.network.subnet} "
         f"(switch {hs.network.switch} {hs.network.switch_address})\n"
         + "\n".join(f"  {h.name}  {h.address}  {h.ifname}" for h in hs.hosts))


@hosts_app.command("down")
def down_cmd(prefix: PrefixOpt = "ledger", subnet: SubnetOpt = "10.231.7.0/24", json_out: JsonOpt = False) -> None:
    """Remove every host and the switch, and kill what still runs on them. Idempotent, also after a crash."""
    from runners import hosts

    removed = sorted(hosts.down(_network(prefix, subnet)))
    emit({"removed": removed}, json_out, f"removed {', '.join(removed)}" if removed else "no test hosts were up")


@hosts_app.command("status")
def status_cmd(prefix: PrefixOpt = "ledger", subnet: SubnetOpt = "10.231.7.0/24", json_out: JsonOpt = False) -> None:
    """The hosts that are up: address, qdisc, interface byte counters, processes; and any leftovers."""
    from runners import hosts

    st = hosts.status(_network(prefix, subnet))
    emit(st, json_out, _status_text(st))


def _status_text(st: dict[str, Any]) -> str:
    if not st["hosts"] and not st["stray"]:
        return "no test hosts are up"
    lines = [f"rate {st['rate']}  subnet {st['subnet']}  switch {st['switch']['name']} "
             f"{st['switch']['address']} {'up' if st['switch']['up'] else 'DOWN'}"]
    for h in st["hosts"]:
        c = h["counters"] or {}
        lines.append(f"  {h['name']:<12} {h['address']:<15} {'up' if h['up'] else 'DOWN':<5} "
                     f"rx {c.get('rx', 0):>14,} B  tx {c.get('tx', 0):>14,} B  processes {h['processes']}")
    if st["stray"]:
        lines.append(f"  leftovers (removed by `ledger hosts down`): {', '.join(st['stray'])}")
    return "\n".join(lines)
