"""runners.hosts and the ranks across namespace hosts.

The namespace tests need root, ``ip``, ``tc`` and ``unshare``. Where namespaces cannot be made they skip with the
reason, except with ``CI=true``, where they fail: CI must run them. Their names carry this process's pid (``lt<pid>``
and so on), so neither a developer's ``ledger hosts up`` nor a concurrent test run is ever touched; each set is
alone on its own bridge, so subnets may repeat. They always tear down.

The multi-process tests (marked slow) train the tiny experiment's 4-rank arms across 4 hosts, one rank per host,
and show that the receipts verify, the digests equal loopback's (the session's tiny experiment), each host's own
interface counters carry the ring all-reduce of the exact collective bytes, and recovery survives a killed rank and a
dead host.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ledger.cli.app import app
from ledger.errors import InputError
from runners import hosts
from runners.distributed import host_command
from runners.hosts import HostSet, HostsUnavailable, Network
from tests.conftest import TinyExperiment

PID = os.getpid() % 10**6
NET = Network(f"lt{PID}", "10.231.9.0/24")
TRAIN_NET = Network(f"lr{PID}", "10.231.12.0/24")  # the arms' hosts, apart from the tests that tear hosts down
CRASH_NET = Network(f"lc{PID}", "10.231.10.0/24")
CLI_NET = Network(f"li{PID}", "10.231.11.0/24")
REPO = Path(__file__).resolve().parents[2]
runner = CliRunner()


def hosts_or_skip() -> None:
    """Skip (fail under CI=true) with the reason when namespaces cannot be made here."""
    try:
        hosts.check_available()
        probe = f"{NET.prefix}-probe"  # not a name any Network owns
        made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, check=False)
        if made.returncode != 0:
            raise HostsUnavailable(f"ip netns add: {made.stderr.strip()}")
        subprocess.run(["ip", "netns", "del", probe], check=False)
    except HostsUnavailable as exc:
        if os.environ.get("CI") == "true":
            pytest.fail(f"CI=true and namespace hosts cannot be made: {exc}")
        pytest.skip(f"namespace hosts cannot be made here: {exc}")


def leftovers(network: Network = NET) -> list[str]:
    return [ns for ns in hosts.namespaces() if network.owns(ns)]


def on_host(host: hosts.Host, code: str, *args: str, timeout: float = 30.0) -> subprocess.Popen[str]:
    return subprocess.Popen(host.argv([sys.executable, "-c", textwrap.dedent(code), *args]), stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)


def finish(p: subprocess.Popen[str], timeout: float = 30.0) -> str:
    try:
        out, err = p.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        p.kill()
        out, err = p.communicate()
    assert p.returncode == 0, err[-2000:]
    return out


# ---------------------------------------------------------------------------------------------- pure parts


def test_rates_parse_in_tc_units() -> None:
    assert hosts.rate_bits("100mbit") == 100_000_000
    assert hosts.rate_bits("1gbit") == 10**9
    assert hosts.rate_bits("2.5mbit") == 2_500_000
    for bad in ("100mbps", "fast", "10kbit", "", "1 gbit"):
        with pytest.raises(InputError):
            hosts.rate_bits(bad)


def test_network_names_and_addresses() -> None:
    net = Network()
    assert (net.switch, net.switch_address) == ("ledger-sw", "10.231.7.1")
    h = net.host(3)
    assert (h.name, h.address, h.ifname) == ("ledger-h3", "10.231.7.103", "eth0")
    # c10d ranks nodes by their sorted addresses: text order must be host order.
    addrs = [net.host(k).address for k in range(hosts.MAX_HOSTS)]
    assert sorted(addrs) == addrs
    assert net.owns("ledger-h12") and net.owns("ledger-sw")
    assert not net.owns("ledger-hx") and not net.owns("other-h1") and not net.owns("ledger-h1-x")
    for bad in (("ledger", "8.8.8.0/24"), ("ledger", "10.0.0.0/16"), ("Bad-Name", "10.231.7.0/24")):
        with pytest.raises(InputError):
            Network(*bad)
    # not a network at all (ipaddress's ValueError was a traceback from `ledger hosts up --subnet`), host bits set
    for subnet in ("999.1.2.0/24", "abc", "", "10.231.7.5/24", "fd00::/120"):
        with pytest.raises(InputError, match="give a private IPv4 /24"):
            Network("ledger", subnet)


def test_host_commands_put_rank_k_on_host_k() -> None:
    hs = HostSet(NET, "100mbit", tuple(NET.host(k) for k in range(4)))
    argv, env = host_command("runners.train", ["--arm", "ddp-four"], 4, hs, 2, 29999)
    assert argv[:4] == ["ip", "netns", "exec", f"{NET.prefix}-h2"] and "unshare" in argv
    torchrun = argv[argv.index(sys.executable):]
    assert torchrun[1:3] == ["-m", "torch.distributed.run"]
    assert torchrun[torchrun.index("--rdzv-endpoint") + 1] == "10.231.9.100:29999"
    assert torchrun[torchrun.index("--local-addr") + 1] == "10.231.9.102"
    assert "is_host=false" in torchrun[torchrun.index("--rdzv-conf") + 1]
    assert torchrun[-3:] == ["runners.train", "--arm", "ddp-four"]
    assert env == {"GLOO_SOCKET_IFNAME": "eth0"}
    argv, env = host_command("runners.train", [], 4, replace(hs, launcher="env"), 0, 29999, "env")
    assert argv[-2:] == ["-m", "runners.train"]
    assert env == {"GLOO_SOCKET_IFNAME": "eth0", "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "4",
                   "MASTER_ADDR": "10.231.9.100", "MASTER_PORT": "29999"}


def test_the_ledger_must_be_reachable_from_the_hosts() -> None:
    hs = HostSet(NET, "100mbit", tuple(NET.host(k) for k in range(4)))
    for fine in ("ledger.db", "sqlite:////tmp/x.db", "postgresql+psycopg://u@/ledger?host=/tmp/sock"):
        hosts.check_ledger_reach(fine, hs)  # through the shared file system
    for outside in ("127.0.0.1", "localhost", "10.231.7.1", "db.example.com"):
        with pytest.raises(InputError, match="the test hosts cannot reach the ledger at .* listening on 10.231.9.1"):
            hosts.check_ledger_reach(f"postgresql+psycopg://u:p@{outside}:5432/ledger", hs)
    # The switch's address (or name) is where the hosts reach a server; this process, in the machine's own
    # namespace, has no route there.
    for inside in (NET.switch_address, NET.switch, hs[2].address):
        with pytest.raises(InputError, match=f"operator's seat: ip netns exec {NET.switch} ledger"):
            hosts.check_ledger_reach(f"postgresql+psycopg://u:p@{inside}:5432/ledger", hs)


# ------------------------------------------------------------------------------------------------ namespaces


@pytest.fixture(scope="module")
def four() -> Iterator[HostSet]:
    hosts_or_skip()
    hosts.down(NET)
    try:
        yield hosts.up(4, "100mbit", NET)
    finally:
        hosts.down(NET)
        assert leftovers() == []


ECHO_SERVER = """
    import socket, sys
    s = socket.create_server((sys.argv[1], 5001), backlog=8)
    print("listening", flush=True)
    for _ in range(3):
        c, peer = s.accept()
        data = c.recv(64)
        c.sendall(socket.gethostname().encode() + b" " + data)
        c.close()
"""
ECHO_CLIENT = """
    import json, socket, sys
    out = {}
    for addr in sys.argv[1:]:
        with socket.create_connection((addr, 5001), timeout=10) as c:
            c.sendall(socket.gethostname().encode())
            out[addr] = c.recv(128).decode()
    print(json.dumps(out))
"""


def test_every_host_talks_tcp_to_every_other(four: HostSet) -> None:
    servers = [on_host(h, ECHO_SERVER, h.address) for h in four.hosts]
    try:
        for s in servers:
            assert s.stdout is not None and s.stdout.readline().strip() == "listening"
        clients = [on_host(h, ECHO_CLIENT, *[o.address for o in four.hosts if o != h]) for h in four.hosts]
        for h, c in zip(four.hosts, clients, strict=True):
            answers = json.loads(finish(c))
            # Each peer answered with its own hostname and what this host sent: a real connection per pair.
            assert answers == {o.address: f"{o.name} {h.name}" for o in four.hosts if o != h}
        for s in servers:
            finish(s)
    finally:
        for s in servers:
            s.kill()


SINK = """
    import socket, sys, time
    s = socket.create_server((sys.argv[1], 5002))
    print("listening", flush=True)
    c, _ = s.accept()
    n, t0 = 0, None
    while b := c.recv(1 << 20):
        t0 = t0 or time.perf_counter()
        n += len(b)
    print(n, time.perf_counter() - t0)
"""
SOURCE = """
    import socket, sys
    with socket.create_connection((sys.argv[1], 5002), timeout=10) as s:
        buf = b"x" * (1 << 20)
        for _ in range(int(sys.argv[2])):
            s.sendall(buf)
"""


def test_transfer_rate_is_the_shaped_rate(four: HostSet) -> None:
    sink = on_host(four[1], SINK, four[1].address)
    assert sink.stdout is not None and sink.stdout.readline().strip() == "listening"
    finish(on_host(four[0], SOURCE, four[1].address, "15"))  # 15 MiB: about 1.3 s at 100 Mbit/s
    n, seconds = finish(sink).split()
    goodput = int(n) * 8 / float(seconds)
    # tbf counts whole frames: 1448 payload bytes ride in 1514 (Ethernet 14, IP 20, TCP 32 with timestamps).
    wire = goodput * 1514 / 1448
    assert int(n) == 15 << 20
    assert 0.85 * four.rate_bits < wire < 1.05 * four.rate_bits, f"{wire / 1e6:.1f} Mbit/s on the wire"


def test_up_is_idempotent_and_recreates_a_dead_host(four: HostSet) -> None:
    again = hosts.up(4, "100mbit", NET)
    assert again == four
    hosts.fail_host(NET, four[2])
    st = hosts.status(NET)
    assert [h["up"] for h in st["hosts"]] == [True, True, False, True]
    assert four[2].name not in hosts.namespaces()
    with pytest.raises(InputError, match=f"{NET.prefix}-h2"):
        hosts.require(4, NET)
    hosts.ensure(four)
    st = hosts.status(NET)
    assert all(h["up"] for h in st["hosts"]) and st["stray"] == []
    assert "rate 100Mbit" in st["hosts"][2]["qdisc"]
    assert hosts.require(4, NET) == four


def test_down_removes_everything_also_after_a_crash(tmp_path: Path) -> None:
    hosts_or_skip()
    net = CRASH_NET
    names = [f"{net.prefix}-{n}" for n in ("h0", "h1", "h7", "sw")]
    try:
        hosts.up(2, "1gbit", net)
        assert sorted(leftovers(net)) == [names[0], names[1], names[3]]
        # A crash: the state file is lost, a process still runs on a host, and a stray host exists.
        sleeper = subprocess.Popen(net.host(0).argv(["sleep", "60"]))
        deadline = time.monotonic() + 10
        while sleeper.pid not in net.host(0).pids() and time.monotonic() < deadline:
            time.sleep(0.05)
        net.state_path.unlink()
        subprocess.run(["ip", "netns", "add", names[2]], check=True)
        assert hosts.status(net)["stray"] == names
        assert sorted(hosts.down(net)) == names
        assert sleeper.wait(timeout=10) == -9  # what ran on a host died with it
        assert leftovers(net) == [] and not (hosts.ETC_NETNS / names[0]).exists()
        assert hosts.down(net) == []  # down twice is fine
    finally:
        hosts.down(net)
    assert leftovers(net) == []


def test_cli_up_status_down(tmp_path: Path) -> None:
    hosts_or_skip()
    opts = ["--prefix", CLI_NET.prefix, "--subnet", CLI_NET.subnet]
    try:
        up = runner.invoke(app, ["hosts", "up", "2", "--rate", "1gbit", *opts, "--json"])
        assert up.exit_code == 0, up.output
        assert [h["address"] for h in json.loads(up.stdout)["hosts"]] == ["10.231.11.100", "10.231.11.101"]
        st = runner.invoke(app, ["hosts", "status", *opts, "--json"])
        assert st.exit_code == 0 and all(h["up"] for h in json.loads(st.stdout)["hosts"])
        assert "rate 1gbit" in runner.invoke(app, ["hosts", "status", *opts]).stdout
        bad = runner.invoke(app, ["hosts", "up", "2", "--rate", "fast", *opts])
        assert bad.exit_code == 2 and bad.stderr.startswith("ledger: error: rate 'fast'")
    finally:
        down = runner.invoke(app, ["hosts", "down", *opts])
        assert down.exit_code == 0, down.output
    assert runner.invoke(app, ["hosts", "down", *opts]).stdout.strip() == "no test hosts were up"
    assert leftovers(CLI_NET) == []


# ----------------------------------------------------------------------------------- the arms across hosts

TINY = (REPO / "examples" / "tiny.toml").read_text()
ARMS4 = ("ddp-four", "diloco-four")


@dataclass
class Cluster:
    workdir: Path
    db: Path
    prepared: str
    hosts: HostSet
    params: int
    runs: dict[str, dict[int, Any]] = field(default_factory=dict)  # run -> rank -> train-end receipt


def _ends(db: Path, run: str) -> dict[int, Any]:
    from ledger.store import Store

    with Store.open(db) as store:
        return {s.receipt.rank or 0: s.receipt for s in store.find(kind="train-end", run=run)}


def train(c: Cluster, arm: str, run: str) -> dict[int, Any]:
    """Train ``arm`` as ``run`` across the cluster's hosts, one rank per host."""
    from ledger.errors import RunFailed
    from ledger.store import Store
    from runners.train import summarize_arm, train_arm

    t0 = time.perf_counter()
    try:
        train_arm(c.workdir, str(c.db), arm, run=run, prepared=c.prepared, timeout=60.0,
                  hosts=c.hosts)
    except RunFailed as failed:
        pytest.fail(f"{failed}\n" + "\n".join(p.read_text()[-2000:] for p in sorted(Path(failed.logs).glob("*"))))
    with Store.open(c.db) as store:
        summarize_arm(store, c.prepared, arm, run)
    c.runs[run] = _ends(c.db, run)
    print(f"{run}: {time.perf_counter() - t0:.1f} s")
    return c.runs[run]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    """The tiny experiment prepared, and 4 hosts at 1 Gbit/s (the arms' runs are made by the tests that need them,
    each well under a minute here)."""
    import tomllib

    from ledger.artifacts import ArtifactStore, workdir_root
    from ledger.experiment.config import config_from_dict
    from ledger.store import Store
    from runners.model import build_model
    from runners.prepare import load_prepared, pinned_threads, prepare

    hosts_or_skip()
    root = tmp_path_factory.mktemp("hosts")
    config = config_from_dict(tomllib.loads(TINY))
    db = root / "ledger.db"
    with Store.open(db, create=True) as store, pinned_threads(1):
        prepared = prepare(config, root, store).prepared
        vocab = load_prepared(store, ArtifactStore(workdir_root(root)), prepared).tokenizer.vocab_size
    params = sum(p.numel() for p in build_model(config.model, vocab, config.seed).parameters())
    hosts.down(TRAIN_NET)
    try:
        yield Cluster(root, db, prepared, hosts.up(4, "1gbit", TRAIN_NET), params)
    finally:
        hosts.down(TRAIN_NET)
        assert leftovers(TRAIN_NET) == []


def _on_hosts(c: Cluster, arm: str) -> dict[int, Any]:
    """The arm's ``train/<arm>`` run across the hosts (the recovery tests' uninterrupted run), trained once."""
    return c.runs.get(f"train/{arm}") or train(c, arm, f"train/{arm}")


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("arm", ARMS4)
def test_arm_across_hosts_one_rank_per_host_verifies(cluster: Cluster, arm: str) -> None:
    from ledger.artifacts import ArtifactStore, workdir_root
    from ledger.store import Store
    from verify.receipts import verify_receipt

    across = _on_hosts(cluster, arm)
    for rank in range(4):
        assert across[rank].measurements["binding"]["host"] == f"{TRAIN_NET.prefix}-h{rank}"  # rank K on host K
        assert across[rank].measurements["binding"]["backend"] == "gloo"
    with Store.open(cluster.db) as store:
        summary = store.find(kind="arm-summary", run=f"train/{arm}")[-1].receipt
        report = verify_receipt(store, summary.id, artifacts=ArtifactStore(workdir_root(cluster.workdir)),
                                require_artifacts=True)
    assert report.missing == []


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("arm", ARMS4)
def test_arm_across_hosts_equals_loopback(cluster: Cluster, arm: str, tiny_experiment: TinyExperiment) -> None:
    """Determinism does not depend on the network: every rank's state, model, optimizer, outer and RNG digests
    and its exact sent bytes are loopback's (the session's tiny experiment, `ledger run experiment` on the same
    examples/tiny.toml, trained the arm on loopback: the same prepared digest, another ledger)."""
    across = _on_hosts(cluster, arm)
    from ledger.store import Store

    with Store.open(tiny_experiment.db) as store:
        assert store.latest_prepared(None) == cluster.prepared
    loop = _ends(tiny_experiment.db, f"train/{arm}")
    assert sorted(loop) == [0, 1, 2, 3]
    for rank in range(4):
        assert across[rank].artifacts == loop[rank].artifacts, rank
        assert across[rank].measurements["sent_bytes"] == loop[rank].measurements["sent_bytes"]


@pytest.mark.slow
@pytest.mark.distributed
def test_env_launcher_gives_torchruns_digests(cluster: Cluster) -> None:
    """Each rank started directly (env:// to host 0) instead of by a torchrun agent: the same ranks on the same
    hosts, the same bits."""
    across = _on_hosts(cluster, "ddp-four")
    direct = replace(cluster, hosts=replace(cluster.hosts, launcher="env"))
    env = train(direct, "ddp-four", "env/ddp-four")
    for rank in range(4):
        assert env[rank].artifacts == across[rank].artifacts, rank
        assert env[rank].measurements["binding"]["host"] == f"{TRAIN_NET.prefix}-h{rank}"


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize("arm", ARMS4)
def test_each_host_counts_its_own_wire_bytes(cluster: Cluster, arm: str) -> None:
    """Each rank read /proc/net/dev inside its own namespace: its eth0 carries the ring all-reduce, 2(w-1)/w
    times the exact payload, plus TCP/IP/Ethernet headers, ACKs and the rendezvous (docs/hosts.md)."""
    ends = _on_hosts(cluster, arm)
    steps, h = 8, 2
    calls = steps if arm == "ddp-four" else steps // h
    for rank, end in ends.items():
        m = end.measurements
        assert m["sent_bytes"] == calls * cluster.params * 4
        wire = m["interface_bytes"]
        assert set(wire) == {"lo", "eth0"}  # the host's own interfaces, not the machine's
        ring = m["sent_bytes"] * 2 * 3 / 4
        for way in ("tx", "rx"):
            assert ring < wire["eth0"][way] < ring * 1.12 + 20_000, (rank, way, wire, ring)


def _recover(cluster: Cluster, kill_host: bool) -> Any:
    from runners.recover import run_recover

    _on_hosts(cluster, "diloco-four")  # the uninterrupted run: on the hosts too, or the bindings' hosts differ
    t0 = time.perf_counter()
    result = run_recover(cluster.workdir, str(cluster.db), arm="diloco-four", kill_rank=1, kill_after_step=5,
                         prepared=cluster.prepared, hosts=cluster.hosts, kill_host=kill_host, timeout=15.0)
    print(f"recovery (kill_host={kill_host}): {time.perf_counter() - t0:.1f} s")
    return result


def _assert_recovered(cluster: Cluster, result: Any) -> None:
    m = result.summary.measurements
    assert result.passed and m["all_rank_state_and_trajectory_comparisons_passed"]
    assert m["uninterrupted_run"] == "train/diloco-four" and m["restore_step"] == 4
    for c in result.comparisons:
        assert c.measurements["contents_exactly_equal"] and c.measurements["binding_equal"], c.measurements
    ends = _ends(cluster.db, m["recovered_run"])
    assert [ends[r].measurements["binding"]["host"] for r in range(4)] == [f"{TRAIN_NET.prefix}-h{r}" for r in range(4)]


@pytest.mark.slow
@pytest.mark.distributed
def test_recovery_after_the_rank_on_one_host_is_killed(cluster: Cluster) -> None:
    result = _recover(cluster, kill_host=False)
    _assert_recovered(cluster, result)
    from ledger.store import Store

    with Store.open(cluster.db) as store:
        fault = store.get(next(p for p in result.summary.parents if store.get(p).receipt.kind == "fault")).receipt
    assert "host_removed" not in fault.measurements


@pytest.mark.slow
@pytest.mark.distributed
def test_recovery_after_a_host_dies(cluster: Cluster) -> None:
    """The killed rank's host loses its link, processes and namespace at once; the survivors' collectives time
    out (no reset comes from a dead host); the restarted group runs on the host made anew."""
    from ledger.store import Store

    result = _recover(cluster, kill_host=True)
    _assert_recovered(cluster, result)
    with Store.open(cluster.db) as store:
        fault = next(store.get(p).receipt for p in result.summary.parents if store.get(p).receipt.kind == "fault")
    assert fault.measurements["host_removed"] == f"{TRAIN_NET.prefix}-h1"
    assert all(h["up"] for h in hosts.status(TRAIN_NET)["hosts"])  # recreated for the restart, and still up


# ------------------------------------------------------------------------ a PostgreSQL ledger over the hosts' network

# Who appended each receipt, as the server saw it: inet_client_addr() is the client's address over TCP, NULL
# through the unix socket. A side table of the test's own, filled by a trigger on the ledger's receipts table.
ORIGIN_SQL = (
    "CREATE SCHEMA origin",
    "CREATE TABLE origin.receipts (id text PRIMARY KEY, client inet)",
    "CREATE FUNCTION origin.note() RETURNS trigger LANGUAGE plpgsql AS "
    "$$BEGIN INSERT INTO origin.receipts VALUES (NEW.id, inet_client_addr()); RETURN NEW; END$$",
    "CREATE TRIGGER origin AFTER INSERT ON public.receipts FOR EACH ROW EXECUTE FUNCTION origin.note()",
)


@pytest.fixture
def ledger_server(cluster: Cluster) -> Iterator[Any]:
    """A throw-away PostgreSQL server at the hosts' switch (the operator's seat): it listens on the bridge address
    only and lets the hosts' subnet in with a password. Skips where PostgreSQL cannot run; fails when CI=true."""
    from tests.pg import PostgresUnavailable, in_ci, throwaway_cluster

    net = cluster.hosts.network
    try:
        with throwaway_cluster(listen=net.switch_address, netns=net.switch, clients=[net.subnet]) as server:
            yield server
            return
    except PostgresUnavailable as exc:
        reason = str(exc)
    if in_ci():
        pytest.fail(f"CI=true but PostgreSQL cannot run: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL cannot run here: {reason}")


@pytest.mark.slow
@pytest.mark.distributed
def test_every_host_appends_to_postgresql_over_the_network(cluster: Cluster, ledger_server: Any, tmp_path: Path,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """The ranks, one per host, append their own receipts to a PostgreSQL server at the switch over TCP, and the
    operator (prepare, the arm summary, the audit) works at the switch too, as `ip netns exec <switch> ledger ...`
    does (docs/hosts.md). The server says who appended what; the audit verifies the ledger and its report says the
    ranks ran on separate hosts; the digests are those of the SQLite ledger's run."""
    import tomllib

    import psycopg

    from ledger.errors import RunFailed
    from ledger.experiment.config import config_from_dict
    from ledger.store import Store
    from runners.prepare import pinned_threads, prepare
    from runners.train import summarize_arm, train_arm
    from tests.pg import raw_rows

    net, run, work = cluster.hosts.network, "train/ddp-four", tmp_path / "postgres"
    hs = replace(cluster.hosts, launcher="env")  # the workers alone: four fewer processes, the same bits
    tcp = ledger_server.create_database("hosts_ledger")  # postgresql+psycopg://postgres:...@<switch address>/...
    admin = ledger_server.socket_url("hosts_ledger")  # the test's own view, through the socket
    Store.open(admin, create=True).close()
    with psycopg.connect(admin.replace("postgresql+psycopg", "postgresql"), autocommit=True) as conn:
        for statement in ORIGIN_SQL:
            conn.execute(statement)
    with pytest.raises(InputError, match="operator's seat"):
        hosts.check_ledger_reach(tcp, hs)  # not from here: the machine's namespace has no route to the subnet
    # The runners keep the artifacts in <work>/artifacts; the audit and verify below, given only a URL, are told here.
    monkeypatch.setenv("LEDGER_ARTIFACTS", str(work / "artifacts"))

    def train_at_the_switch() -> str:
        hosts.check_ledger_reach(tcp, hs)
        with Store.open(tcp) as store, pinned_threads(1):
            prepared = prepare(config_from_dict(tomllib.loads(TINY)), work, store).prepared
        t0 = time.perf_counter()
        try:
            train_arm(work, tcp, "ddp-four", run=run, prepared=prepared, timeout=60.0, hosts=hs)
        except RunFailed as failed:
            pytest.fail(f"{failed}\n" + "\n".join(p.read_text()[-2000:] for p in sorted(Path(failed.logs).glob("*"))))
        print(f"{run} on PostgreSQL: {time.perf_counter() - t0:.1f} s")
        with Store.open(tcp) as store:
            summarize_arm(store, prepared, "ddp-four", run)
        return prepared

    def audit_at_the_switch() -> dict[str, Any]:
        audited = runner.invoke(app, ["audit", "--db", tcp, "--json"])
        assert audited.exit_code == 0, audited.output
        value = json.loads(audited.stdout)
        verified = runner.invoke(app, ["verify", "--db", tcp, "--require-artifacts", value["audit"]])
        assert verified.exit_code == 0, verified.output  # the report rebuilt from the ledger, every field equal
        return dict(value["report"])

    assert hosts.in_namespace(net.switch, train_at_the_switch) == cluster.prepared  # the same experiment

    rows = raw_rows(admin, "SELECT r.kind, r.rank, host(o.client) FROM receipts r JOIN origin.receipts o USING (id) "
                           "WHERE r.run = :run", {"run": run})
    by_rank: dict[int, set[str]] = {}
    for kind, rank, client in rows:
        if kind == "arm-summary":
            assert client == net.switch_address  # the operator's own append
        else:  # each rank's receipts came from its own host's address, over TCP (NULL would be the socket)
            assert client == hs[rank].address, (kind, rank, client)
            by_rank.setdefault(rank, set()).add(kind)
    assert by_rank == {k: {"train-start", "checkpoint", "train-end"} for k in range(4)}
    clients = {c for (c,) in raw_rows(admin, "SELECT DISTINCT host(client) FROM origin.receipts")}
    assert clients == {net.switch_address, *(h.address for h in hs.hosts)}  # everything came over the network
    assert raw_rows(admin, "SHOW listen_addresses") == [(net.switch_address,)]  # the bridge's address only

    report = hosts.in_namespace(net.switch, audit_at_the_switch)
    scope = report["training"]["network_scope"]
    assert "ddp-four ran one per host, on 4 separate hosts" in scope and f"{net.prefix}-h3" in scope
    with Store.open(admin) as store:
        ends = {s.receipt.rank or 0: s.receipt for s in store.find(kind="train-end", run=run)}
    on_sqlite = _on_hosts(cluster, "ddp-four")
    for rank in range(4):
        assert ends[rank].measurements["binding"]["host"] == f"{net.prefix}-h{rank}"
        assert ends[rank].artifacts == on_sqlite[rank].artifacts, rank  # the ledger's engine changes no bit
        pg, lite = (e.measurements["interface_bytes"]["eth0"] for e in (ends[rank], on_sqlite[rank]))
        print(f"host {rank} eth0 over the loop, PostgreSQL ledger - SQLite: tx {pg['tx'] - lite['tx']:+,} B, "
              f"rx {pg['rx'] - lite['rx']:+,} B")
