"""Test hosts on one machine: network namespaces with their own addresses on a bridge, each link shaped with tc.

``up(n, rate)`` makes, for a :class:`Network` (default prefix ``ledger``, subnet ``10.231.7.0/24``):

* a switch namespace ``ledger-sw`` holding the bridge ``br0`` (address ``10.231.7.1``: the operator's seat, from
  which a load client reaches the hosts); nothing is added to the machine's own network namespace, so no route to
  the subnet exists outside the namespaces;
* per host K, a namespace ``ledger-hK`` whose one interface ``eth0`` (address ``10.231.7.(100+K)``) is a veth pair
  whose other end ``hK`` is a port of the bridge. Both ends are shaped with ``tbf`` at ``rate``, so each host has
  a full-duplex link of that rate to the switch;
* per host, ``/etc/netns/ledger-hK/hosts`` naming every host and an empty ``resolv.conf`` (``ip netns exec``
  mounts them over ``/etc``): host names resolve inside the hosts and no DNS query leaves them.

Host addresses are 100+K so that their text order is their numeric order: torchrun's c10d rendezvous ranks its
nodes by their sorted addresses, and that order makes rank K the rank on host K.

Every process is started on a host with :meth:`Host.argv`: ``ip netns exec`` into its namespace and ``unshare
--uts`` to give it the host's own hostname, both of which exec, so the process started is the program itself.

The state file (``/run/ledger-hosts/<prefix>.json``, on tmpfs like the namespaces themselves) is written before
anything is made; ``down`` also finds every namespace of the network by name, so it cleans up after a crash of
``up`` or of anything running on the hosts, and is idempotent. ``fail_host`` makes a host die mid-run (its link,
processes and namespace go at once) and ``up`` with the same settings recreates it.

A ledger server reached over the network sits at the switch (the operator's seat, where the command that starts
the ranks runs too); ``check_ledger_reach`` refuses a ledger URL that the hosts or the caller cannot reach.
"""

from __future__ import annotations

import ctypes
import dataclasses
import ipaddress
import json
import os
import re
import shutil
import signal
import subprocess
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Final, TypeVar, cast

from ledger.errors import InputError, LedgerError

STATE_DIR: Final = Path("/run/ledger-hosts")
ETC_NETNS: Final = Path("/etc/netns")
IFNAME: Final = "eth0"
BRIDGE: Final = "br0"
HOST_OFFSET: Final = 100  # host K is .100+K: three digits, so address order = host order (see the module doc)
MAX_HOSTS: Final = 100
DEFAULT_RATE: Final = "100mbit"
_RATE = re.compile(r"^(\d+(?:\.\d+)?)(bit|kbit|mbit|gbit)$")
_UNITS: Final = {"bit": 1, "kbit": 10**3, "mbit": 10**6, "gbit": 10**9}
T = TypeVar("T")


class HostsUnavailable(LedgerError):
    """Namespaces cannot be made here (not root, no ``ip``/``tc``, or the kernel refused)."""


def rate_bits(rate: str) -> int:
    """``100mbit`` -> 100_000_000 (tc's decimal units; only bit rates, since tc's ``bps`` means bytes)."""
    m = _RATE.match(rate.strip().lower())
    if m is None:
        raise InputError(f"rate {rate!r}: give a number and one of bit, kbit, mbit, gbit (e.g. 100mbit)")
    bits = int(float(m.group(1)) * _UNITS[m.group(2)])
    if bits < 10**5:
        raise InputError(f"rate {rate!r} is below 100kbit; tbf would drop full-size frames")
    return bits


def _burst_bytes(bits: int) -> int:
    """tbf's bucket: 1 ms of the line rate, at least 32 kbit. A smaller bucket caps 1gbit at about 600 Mbit/s
    here (the qdisc's timer cannot refill it fast enough); a larger one lets bursts exceed the rate."""
    return max(4000, bits // 8000)


@dataclass(frozen=True)
class Host:
    """One test host: its namespace (also its hostname), address and interface."""

    index: int
    name: str
    address: str
    ifname: str = IFNAME

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run on this host: in its network namespace, with its hostname. ``ip netns exec`` and
        ``unshare`` both exec, so the pid of the process started is the command's own."""
        return ["ip", "netns", "exec", self.name, "unshare", "--uts", "--", "sh", "-c", 'hostname "$0" && exec "$@"',
                self.name, *command]

    def pids(self) -> list[int]:
        """Every process in this host's namespace ([] if the host is gone)."""
        done = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True, check=False)
        return [int(p) for p in done.stdout.split()] if done.returncode == 0 else []

    def to_json(self) -> dict[str, Any]:
        return {"index": self.index, "name": self.name, "address": self.address, "ifname": self.ifname}


@dataclass(frozen=True)
class Network:
    """Names and addresses of one set of test hosts. Tests use their own prefix and subnet, so they never touch
    the hosts a developer brought up."""

    prefix: str = "ledger"
    subnet: str = "10.231.7.0/24"

    def __post_init__(self) -> None:
        try:
            net = ipaddress.ip_network(self.subnet)
        except ValueError:  # not a network, or host bits set (10.231.7.5/24)
            net = None
        if net is None or net.version != 4 or net.prefixlen != 24 or not net.is_private:
            raise InputError(f"subnet {self.subnet}: give a private IPv4 /24 (e.g. 10.231.7.0/24)")
        if not re.fullmatch(r"[a-z][a-z0-9]{0,9}", self.prefix):
            raise InputError(f"prefix {self.prefix!r}: 1-10 lowercase letters and digits, starting with a letter")

    @property
    def switch(self) -> str:
        return f"{self.prefix}-sw"

    @property
    def switch_address(self) -> str:
        return str(ipaddress.ip_network(self.subnet)[1])

    @property
    def state_path(self) -> Path:
        return STATE_DIR / f"{self.prefix}.json"

    def host(self, k: int) -> Host:
        return Host(k, f"{self.prefix}-h{k}", str(ipaddress.ip_network(self.subnet)[HOST_OFFSET + k]))

    def owns(self, namespace: str) -> bool:
        return namespace == self.switch or re.fullmatch(rf"{re.escape(self.prefix)}-h\d+", namespace) is not None


@dataclass(frozen=True)
class HostSet:
    """Hosts that ``up`` made (or found), their link rate, and how ranks are started on them: ``torchrun`` (an
    agent per host, multi-node c10d rendezvous) or ``env`` (each rank directly, env:// to host 0); see
    :func:`runners.distributed.host_command`."""

    network: Network
    rate: str
    hosts: tuple[Host, ...] = field(default_factory=tuple)
    launcher: str = "torchrun"

    @property
    def rate_bits(self) -> int:
        return rate_bits(self.rate)

    def __len__(self) -> int:
        return len(self.hosts)

    def __getitem__(self, k: int) -> Host:
        return self.hosts[k]

    def to_json(self) -> dict[str, Any]:
        return {"prefix": self.network.prefix, "subnet": self.network.subnet, "rate": self.rate,
                "switch": {"name": self.network.switch, "address": self.network.switch_address},
                "hosts": [h.to_json() for h in self.hosts]}


# ------------------------------------------------------------------------------------------------ commands


def _run(*argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=30)
    if check and done.returncode != 0:
        raise HostsUnavailable(f"{' '.join(argv)}: {(done.stderr or done.stdout).strip() or 'failed'}")
    return done


def namespaces() -> list[str]:
    """Every named network namespace on this machine."""
    if shutil.which("ip") is None:
        return []
    done = _run("ip", "netns", "list", check=False)
    return [line.split()[0] for line in done.stdout.splitlines() if line.strip()]


def check_available() -> None:
    """Raise :class:`HostsUnavailable` with the reason if namespaces cannot be made here."""
    if os.geteuid() != 0:
        raise HostsUnavailable("test hosts need root (network namespaces, veth pairs, tc)")
    for tool in ("ip", "tc", "unshare"):
        if shutil.which(tool) is None:
            raise HostsUnavailable(f"test hosts need {tool!r} (iproute2, util-linux) on PATH")


def _write_etc(network: Network, hosts: Sequence[Host]) -> None:
    names = "".join(f"{h.address} {h.name}\n::ffff:{h.address} {h.name}\n" for h in hosts)
    # The v4-mapped lines: TCPStore listens dual-stack and names its peers from their mapped addresses.
    for h in hosts:
        d = ETC_NETNS / h.name
        d.mkdir(parents=True, exist_ok=True)
        (d / "hosts").write_text(f"127.0.0.1 localhost\n::1 localhost\n{network.switch_address} {network.switch}\n"
                                 + names)
        (d / "resolv.conf").write_text("# ledger test host: no DNS\n")


def _make_switch(network: Network) -> None:
    sw = network.switch
    if sw not in namespaces():
        _run("ip", "netns", "add", sw)
    links = _run("ip", "-n", sw, "-o", "link", "show").stdout
    if f" {BRIDGE}:" not in links:
        _run("ip", "-n", sw, "link", "add", BRIDGE, "type", "bridge")
        _no_ipv6(sw, BRIDGE)
        _run("ip", "-n", sw, "addr", "add", f"{network.switch_address}/24", "dev", BRIDGE)
    _run("ip", "-n", sw, "link", "set", "lo", "up")
    _run("ip", "-n", sw, "link", "set", BRIDGE, "up")


def _shape(namespace: str, dev: str, rate: str) -> None:
    burst = _burst_bytes(rate_bits(rate))
    _run("tc", "-n", namespace, "qdisc", "replace", "dev", dev, "root", "tbf", "rate", rate, "burst", str(burst),
         "latency", "50ms")


def _host_ok(network: Network, host: Host) -> bool:
    if host.name not in namespaces():
        return False
    inner = _run("ip", "-n", host.name, "-o", "addr", "show", "dev", host.ifname, check=False).stdout
    port = _run("ip", "-n", network.switch, "-o", "link", "show", f"h{host.index}", check=False).stdout
    return f" {host.address}/24 " in inner and f"master {BRIDGE}" in port


def _no_ipv6(namespace: str, dev: str) -> None:
    """No IPv6 on the links (loopback keeps it): link-local autoconfiguration and router solicitations would add
    traffic of their own to the interface counters the ranks record."""
    _run("ip", "netns", "exec", namespace, "sysctl", "-q", "-w", f"net.ipv6.conf.{dev}.disable_ipv6=1")


def _make_host(network: Network, host: Host, rate: str) -> None:
    """Create ``host`` from nothing (any remains of an earlier one are removed first)."""
    _remove_host(network, host)
    port = f"h{host.index}"
    _run("ip", "netns", "add", host.name)
    # Both ends are born in their namespaces: the machine's own namespace never holds an interface of ours.
    _run("ip", "link", "add", host.ifname, "netns", host.name, "type", "veth", "peer", "name", port,
         "netns", network.switch)
    _no_ipv6(network.switch, port)
    _no_ipv6(host.name, host.ifname)
    _run("ip", "-n", network.switch, "link", "set", port, "master", BRIDGE)
    _run("ip", "-n", network.switch, "link", "set", port, "up")
    _run("ip", "-n", host.name, "addr", "add", f"{host.address}/24", "dev", host.ifname)
    _run("ip", "-n", host.name, "link", "set", "lo", "up")
    _run("ip", "-n", host.name, "link", "set", host.ifname, "up")
    _shape(host.name, host.ifname, rate)  # the host's uplink
    _shape(network.switch, port, rate)  # and its downlink


def _kill_all(host: Host) -> None:
    for pid in host.pids():
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def _remove_host(network: Network, host: Host) -> None:
    # The switch side first: deleting one end of a veth pair deletes both, at once, even while processes still
    # hold the host's namespace; then the processes; then the namespace.
    if network.switch in namespaces():
        _run("ip", "-n", network.switch, "link", "del", f"h{host.index}", check=False)
    if host.name in namespaces():
        _kill_all(host)
        _run("ip", "netns", "del", host.name, check=False)
    shutil.rmtree(ETC_NETNS / host.name, ignore_errors=True)


def _save(hs: HostSet) -> None:
    STATE_DIR.mkdir(parents=True, exist_ok=True)
    pending = hs.network.state_path.with_suffix(".tmp")
    pending.write_text(json.dumps(hs.to_json(), indent=2, sort_keys=True) + "\n")
    os.replace(pending, hs.network.state_path)


def load(network: Network = Network()) -> HostSet | None:
    """The host set ``up`` recorded for ``network``, or None."""
    try:
        state = json.loads(network.state_path.read_text())
    except (OSError, ValueError):
        return None
    return HostSet(network, str(state["rate"]), tuple(network.host(h["index"]) for h in state["hosts"]))


def up(n: int, rate: str = DEFAULT_RATE, network: Network = Network()) -> HostSet:
    """Bring up ``n`` hosts at ``rate`` (idempotent: an existing set with the same settings is repaired, e.g. a
    host that :func:`fail_host` removed is recreated; one with other settings is taken down first)."""
    if not 1 <= n <= MAX_HOSTS:
        raise InputError(f"{n} hosts: give 1 to {MAX_HOSTS}")
    rate_bits(rate)
    check_available()
    existing = load(network)
    if existing is not None and (len(existing) != n or existing.rate != rate):
        down(network)
    hs = HostSet(network, rate, tuple(network.host(k) for k in range(n)))
    _save(hs)  # first, so that `down` after a crash here knows what to remove
    try:
        _make_switch(network)
        _write_etc(network, hs.hosts)
        for host in hs.hosts:
            if _host_ok(network, host):
                _shape(host.name, host.ifname, rate)
                _shape(network.switch, f"h{host.index}", rate)
            else:
                _make_host(network, host, rate)
    except BaseException:
        down(network)
        raise
    return hs


def ensure(hs: HostSet) -> HostSet:
    """``hs`` up as it was made: recreate any host that died."""
    return dataclasses.replace(up(len(hs), hs.rate, hs.network), launcher=hs.launcher)


def require(n: int, network: Network = Network()) -> HostSet:
    """The live host set for a run on ``n`` hosts, or an error saying how to make one."""
    hs = load(network)
    if hs is None:
        raise InputError(f"no test hosts are up: run `ledger hosts up {n}` first")
    if len(hs) < n:
        raise InputError(f"{len(hs)} test hosts are up, {n} needed: run `ledger hosts up {n}`")
    missing = [h.name for h in hs.hosts if not _host_ok(network, h)]
    if missing:
        raise InputError(f"test hosts {', '.join(missing)} are down: run `ledger hosts up {len(hs)}` to repair")
    return hs


def fail_host(network: Network, host: Host) -> None:
    """The host dies mid-run: its link goes first (peers see no reset, as with a machine losing power), then every
    process on it (SIGKILL), then its namespace."""
    _remove_host(network, host)


def down(network: Network = Network()) -> list[str]:
    """Remove every host and the switch of ``network`` (found by name, so this works after any crash); every
    process left on them is SIGKILLed. Idempotent; returns the namespaces removed."""
    owned = [ns for ns in namespaces() if network.owns(ns)]
    hosts = [ns for ns in owned if ns != network.switch]
    for ns in hosts:
        _remove_host(network, network.host(int(ns.rsplit("h", 1)[1])))
    if network.switch in owned:
        _kill_all(Host(-1, network.switch, network.switch_address))
        _run("ip", "netns", "del", network.switch, check=False)
    for d in ETC_NETNS.glob(f"{network.prefix}-h*") if ETC_NETNS.is_dir() else ():
        if network.owns(d.name):
            shutil.rmtree(d, ignore_errors=True)
    network.state_path.unlink(missing_ok=True)
    for d in (STATE_DIR, ETC_NETNS):  # only if empty: another set, or another tool, may keep files there
        try:
            d.rmdir()
        except OSError:
            pass
    _wait_gone(owned)
    return owned


def _wait_gone(names: Sequence[str], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while any(n in namespaces() for n in names) and time.monotonic() < deadline:
        time.sleep(0.05)


def _counters(namespace: str) -> dict[str, dict[str, int]]:
    done = _run("ip", "netns", "exec", namespace, "cat", "/proc/net/dev", check=False)
    out: dict[str, dict[str, int]] = {}
    for line in done.stdout.splitlines()[2:]:
        name, _, rest = line.partition(":")
        cols = rest.split()
        if len(cols) >= 9:
            out[name.strip()] = {"rx": int(cols[0]), "tx": int(cols[8])}
    return out


def _qdisc(namespace: str, dev: str) -> str:
    return _run("tc", "-n", namespace, "qdisc", "show", "dev", dev, check=False).stdout.strip()


def status(network: Network = Network()) -> dict[str, Any]:
    """What is up: the recorded set, each host's namespace, address, qdisc and interface counters, and any
    namespace of this network that the state file does not name (a crash's leftovers, which ``down`` removes)."""
    hs = load(network)
    present = [ns for ns in namespaces() if network.owns(ns)]
    hosts = []
    for h in hs.hosts if hs is not None else ():
        up_ = _host_ok(network, h)
        hosts.append({**h.to_json(), "up": up_, "qdisc": _qdisc(h.name, h.ifname) if up_ else None,
                      "counters": _counters(h.name).get(h.ifname) if up_ else None, "processes": len(h.pids())})
    named = {h.name for h in hs.hosts} | {network.switch} if hs is not None else set()
    return {"prefix": network.prefix, "subnet": network.subnet, "rate": hs.rate if hs else None,
            "switch": {"name": network.switch, "address": network.switch_address,
                       "up": network.switch in present},
            "hosts": hosts, "stray": sorted(set(present) - named)}


# ------------------------------------------------------------------------------------------------ processes

_CLONE_NEWNET: Final = 0x40000000


def in_namespace(namespace: str, fn: Callable[[], T]) -> T:
    """``fn()`` on a thread of this process that has entered ``namespace``'s network namespace (the switch's, to
    reach the hosts as their operator would), and its result or exception. Only that thread moves: setns(2) of a
    network namespace is per thread; sockets it opens, threads and processes it starts are in the namespace."""
    libc = ctypes.CDLL(None, use_errno=True)
    result: dict[str, Any] = {}

    def target() -> None:
        try:
            fd = os.open(f"/run/netns/{namespace}", os.O_RDONLY)
            try:
                if libc.setns(fd, _CLONE_NEWNET) != 0:
                    err = ctypes.get_errno()
                    raise HostsUnavailable(f"setns into {namespace}: {os.strerror(err)}")
            finally:
                os.close(fd)
            result["value"] = fn()
        except BaseException as exc:  # re-raised in the caller's thread
            result["error"] = exc

    thread = threading.Thread(target=target, name=f"netns-{namespace}")
    thread.start()
    thread.join()
    if "error" in result:
        raise result["error"]
    return cast(T, result["value"])


def is_current_namespace(namespace: str) -> bool:
    """Whether the calling thread is in the named network namespace (``ip netns exec``, or :func:`in_namespace`)."""
    try:
        here, there = os.stat("/proc/thread-self/ns/net"), os.stat(f"/run/netns/{namespace}")
    except OSError:
        return False
    return (here.st_dev, here.st_ino) == (there.st_dev, there.st_ino)


def check_ledger_reach(url: str, hs: HostSet) -> None:
    """Raise InputError unless both the ranks on ``hs`` and this process can reach the ledger ``url``.

    An SQLite file or a PostgreSQL unix socket is found through the shared file system. A server over TCP must be
    inside the hosts' subnet (they have one link, no default route and no DNS; the switch's address, where a server
    sits as on a cluster's database machine, or a host's), and this process must be at the switch or on a host:
    the machine's own namespace has no route to the subnet (docs/hosts.md)."""
    if "://" not in url or url.startswith("sqlite"):
        return
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError

    try:
        parsed = make_url(url)
    except ArgumentError as exc:
        raise InputError(f"ledger URL: {exc}") from exc
    host = parsed.host or parsed.query.get("host")
    if not isinstance(host, str) or not host or host.startswith("/"):
        return  # a unix socket (or several hosts, which the driver resolves): nothing to say here
    net = hs.network
    names = {net.switch: net.switch_address, **{h.name: h.address for h in hs.hosts}}
    address = names.get(host, host)
    subnet = ipaddress.ip_network(net.subnet)
    try:
        inside = ipaddress.ip_address(address) in subnet
    except ValueError:
        inside = False  # a name the hosts cannot resolve: /etc/netns names only the switch and the hosts
    if not inside:
        raise InputError(f"the test hosts cannot reach the ledger at {host}: their one link is to {net.subnet}; "
                         f"run the database server at the switch, listening on {net.switch_address} "
                         f"(docs/hosts.md)")
    if not any(is_current_namespace(ns) for ns in (net.switch, *(h.name for h in hs.hosts))):
        raise InputError(f"this process cannot reach the ledger at {host}: the machine's own network namespace "
                         f"has no route to {net.subnet}; run the command at the operator's seat: "
                         f"ip netns exec {net.switch} ledger ...")


def descendants(pid: int) -> list[int]:
    """Every live descendant of ``pid`` (from /proc's parent links), children before grandchildren."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        ppid = int(text.rsplit(")", 1)[1].split()[1])  # the comm field may hold spaces and parentheses
        children.setdefault(ppid, []).append(int(stat.parent.name))
    out: list[int] = []
    frontier = [pid]
    while frontier:
        nxt = [c for p in frontier for c in children.get(p, [])]
        out.extend(nxt)
        frontier = nxt
    return out


def kill_tree(pid: int, *, include_root: bool = True) -> None:
    """SIGKILL ``pid``'s descendants (and ``pid``): a torchrun agent's worker dies with its agent."""
    targets = descendants(pid) + ([pid] if include_root else [])
    for p in targets:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


__all__ = ["DEFAULT_RATE", "Host", "HostSet", "HostsUnavailable", "Network", "check_available", "check_ledger_reach",
           "descendants", "down", "ensure", "fail_host", "in_namespace", "is_current_namespace", "kill_tree", "load",
           "namespaces", "rate_bits", "require", "status", "up"]
