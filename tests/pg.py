"""A throw-away PostgreSQL cluster per test session, and the fixtures that run one test on SQLite and PostgreSQL.

The cluster is Debian's PostgreSQL (``scripts/install-system-packages.sh`` installs it): ``initdb`` into a temporary
directory, the server listening only on a unix socket in that directory (no TCP port, so parallel sessions and a
system server never clash), run as the ``postgres`` user when the tests run as root (PostgreSQL refuses root), and
stopped and deleted when the session ends, also after a failure or Ctrl-C. Each test gets databases of its own.

``backend`` is parametrized (``sqlite``, ``postgresql``); ``db_url`` is an empty database on it, ``ledger_url`` a
ledger at the schema head. Where PostgreSQL cannot run, its cases skip saying why, and fail when ``CI=true``: CI
installs it, so a skip there would hide a broken setup.

tests/conftest.py imports the fixtures; benchmarks/ledger_bench.py uses :func:`throwaway_cluster` directly.
"""

from __future__ import annotations

import itertools
import os
import pwd
import re
import secrets
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from glob import glob
from pathlib import Path
from typing import Any

import pytest

BACKENDS = ("sqlite", "postgresql")
SERVER_USER = "postgres"  # the OS user that runs the server when we are root, and the database superuser
_NAME_RE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


class PostgresUnavailable(Exception):
    """PostgreSQL cannot run here (no server binaries, no driver, no user to run it as); the message says which."""


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("true", "1")


def _find_bin(name: str) -> str | None:
    """A server binary: on PATH, else Debian's newest /usr/lib/postgresql/<major>/bin (not on PATH there)."""
    found = shutil.which(name)
    if found:
        return found
    candidates = sorted(glob(f"/usr/lib/postgresql/*/bin/{name}"), key=lambda p: int(Path(p).parts[-3]))
    return candidates[-1] if candidates else None


@dataclass(frozen=True)
class Cluster:
    """A running server reached through the unix socket in ``socket_dir`` (trusted), and through TCP at
    ``host:port`` with ``password`` when it was started listening; the database superuser is ``user``."""

    socket_dir: Path
    user: str = SERVER_USER
    host: str | None = None
    port: int | None = None
    password: str | None = None

    @property
    def log(self) -> Path:
        """The server's log file."""
        return self.socket_dir / "server.log"

    def socket_url(self, database: str = "postgres") -> str:
        """The database's URL through the unix socket (trusted; reachable from any network namespace)."""
        return f"postgresql+psycopg://{self.user}@/{database}?host={self.socket_dir}&port={self.port or 5432}"

    def url(self, database: str = "postgres") -> str:
        """The database's URL: over TCP when the server listens on an address, else through its socket."""
        if self.host is not None:
            return f"postgresql+psycopg://{self.user}:{self.password}@{self.host}:{self.port}/{database}"
        return f"postgresql+psycopg://{self.user}@/{database}?host={self.socket_dir}"

    def execute(self, sql: str) -> None:
        """Run one statement outside a transaction (CREATE and DROP DATABASE refuse to run inside one)."""
        import psycopg

        with psycopg.connect(host=str(self.socket_dir), port=self.port or 5432, user=self.user, dbname="postgres",
                             autocommit=True) as conn:
            conn.execute(sql)  # names were checked against _NAME_RE: no quoting needed

    def create_database(self, name: str, template: str = "template0") -> str:
        """A new database (a copy of ``template``); returns its URL."""
        for n in (name, template):
            if not _NAME_RE.fullmatch(n):
                raise ValueError(f"not a plain database name: {n!r}")
        self.execute(f"CREATE DATABASE {name} TEMPLATE {template}")
        return self.url(name)

    def drop_database(self, name: str) -> None:
        if not _NAME_RE.fullmatch(name):
            raise ValueError(f"not a plain database name: {name!r}")
        self.execute(f"DROP DATABASE IF EXISTS {name} WITH (FORCE)")  # FORCE: a test may leave a connection open


def _server_command() -> tuple[str, str, list[str], int | None]:
    """initdb, pg_ctl, the prefix that runs them as the server user, and that user's uid (None: ourselves)."""
    try:
        import psycopg  # noqa: F401
    except ImportError as exc:
        raise PostgresUnavailable("the psycopg driver is missing: pip install 'psycopg[binary]' (in the test "
                                  "extra)") from exc
    initdb = _find_bin("initdb")
    if initdb is None:
        raise PostgresUnavailable("the PostgreSQL server binaries (initdb, pg_ctl) are not installed: run "
                                  "scripts/install-system-packages.sh as root (Debian package postgresql)")
    pg_ctl = str(Path(initdb).with_name("pg_ctl"))
    if os.geteuid() != 0:
        return initdb, pg_ctl, [], None
    try:
        uid = pwd.getpwnam(SERVER_USER).pw_uid
    except KeyError as exc:
        raise PostgresUnavailable(f"running as root and there is no {SERVER_USER!r} user to run the server as "
                                  "(PostgreSQL refuses root)") from exc
    if shutil.which("runuser") is None:
        raise PostgresUnavailable("running as root and `runuser` is missing (util-linux)")
    return initdb, pg_ctl, ["runuser", "-u", SERVER_USER, "--"], uid


def check_available() -> None:
    """Raise :class:`PostgresUnavailable` saying why when a throw-away cluster cannot run here: a caller that must
    make other things first (benchmarks/ledger_bench.py's namespace hosts) asks before making them."""
    _server_command()


def _scratch_parent(durable: bool, *, as_root: bool) -> str | None:
    """Where the cluster's directory goes. Not pytest's tmp_path: under root that is a 0700 directory the postgres
    user cannot traverse. A test cluster goes to /dev/shm (memory) where there is one: CREATE DATABASE copies
    about 8 MB, which took 20-50 ms there and 0.1-1.2 s on this machine's shared disk. A durable one stays on disk."""
    if not durable and os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK | os.X_OK):
        return "/dev/shm"
    return "/tmp" if as_root else None


def _free_port(host: str) -> int:
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:
        probe.bind((host, 0))
        return int(probe.getsockname()[1])


@contextmanager
def throwaway_cluster(*, durable: bool = False, listen: str | None = None,
                      options: Sequence[str] = (), netns: str | None = None, port: int | None = None,
                      clients: Sequence[str] = ()) -> Iterator[Cluster]:
    """Start a new cluster in a temporary directory; stop it and delete everything on exit.

    ``durable=False`` (tests) turns fsync off: nothing here outlives the process. A benchmark comparing against
    SQLite with ``synchronous=FULL`` passes ``durable=True`` so that every commit reaches the disk on both.
    ``listen`` (an address, e.g. ``127.0.0.1``) also opens a TCP port there (``port``, default a free one), with a
    random password (SCRAM), for clients that reach the server over the network; the socket alone is trusted.
    ``clients`` are the networks (CIDR) allowed in besides loopback, e.g. the namespace hosts' subnet.
    ``netns`` runs the server in that named network namespace (``ip netns exec``, root only): the namespace hosts'
    switch, to listen on the bridge address, which exists only there; its unix socket stays reachable from here
    (a socket file is found through the file system, not the network), and ``port`` defaults to 5432 there,
    since only our processes run in it. ``options`` are extra ``-c name=value`` server settings. Raises
    :class:`PostgresUnavailable` when the server cannot run here, and ``RuntimeError`` (with the server's log)
    when it fails to start.
    """
    if netns is not None and listen is None:
        raise ValueError("netns: a server in a network namespace is there to listen on one of its addresses")
    initdb, pg_ctl, as_user, uid = _server_command()
    in_netns = [] if netns is None else ["ip", "netns", "exec", netns]
    base = Path(tempfile.mkdtemp(prefix="ledger-pg-", dir=_scratch_parent(durable, as_root=uid is not None)))
    if uid is not None:
        os.chown(base, uid, -1)
    data, log = base / "data", base / "server.log"
    # Not durable: no fsync, and the WAL kept small (in memory when the cluster lives in /dev/shm).
    fast = ["fsync=off", "full_page_writes=off", "synchronous_commit=off", "max_wal_size=256MB"]
    settings = [f"listen_addresses='{listen or ''}'", *([] if durable else fast), *options]
    auth = ["--auth=trust"]
    password = None
    if listen is not None:
        port, password = port or (5432 if netns is not None else _free_port(listen)), secrets.token_hex(16)
        pwfile = base / "password"
        pwfile.write_text(password + "\n")
        if uid is not None:
            os.chown(pwfile, uid, -1)
        auth = ["--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"]
        settings.append(f"port={port}")
    started = False
    try:
        made = subprocess.run([*as_user, initdb, "-D", str(data), "-U", SERVER_USER, *auth, "-E", "UTF8",
                               "--locale=C", "--no-sync"], capture_output=True, text=True, timeout=120)
        if made.returncode != 0:
            raise RuntimeError(f"initdb failed: {made.stderr.strip()}")
        if clients:  # initdb allows loopback only; the file stays the server user's (appending keeps its owner)
            with open(data / "pg_hba.conf", "a") as hba:
                hba.writelines(f"host all all {c} scram-sha-256\n" for c in clients)
        server_options = " ".join([f"-k {base}", *(f"-c {s}" for s in settings)])
        start = subprocess.run([*in_netns, *as_user, pg_ctl, "-D", str(data), "-l", str(log), "-w", "-t", "60",
                                "-o", server_options, "start"], capture_output=True, text=True, timeout=120)
        if start.returncode != 0:
            server_log = log.read_text(errors="replace") if log.exists() else ""
            raise RuntimeError(f"PostgreSQL did not start: {start.stderr.strip()}\n{server_log}")
        started = True
        yield Cluster(base, host=listen, port=port, password=password)
    finally:
        if started:  # immediate: the data directory is deleted next, nothing needs a clean shutdown
            subprocess.run([*as_user, pg_ctl, "-D", str(data), "-m", "immediate", "-w", "stop"],
                           capture_output=True, timeout=120)
        shutil.rmtree(base, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ fixtures


@pytest.fixture(scope="session")
def postgres_cluster() -> Iterator[Cluster]:
    """The session's PostgreSQL cluster (started on first use). Skips where it cannot run; fails when CI=true."""
    try:
        with throwaway_cluster() as cluster:
            yield cluster
            return
    except PostgresUnavailable as exc:
        reason = str(exc)
    if in_ci():  # outside the except block: the reason alone, not a chained traceback
        pytest.fail(f"CI=true but PostgreSQL cannot run: {reason}", pytrace=False)
    pytest.skip(f"PostgreSQL cannot run here: {reason}")


_names = itertools.count()


@pytest.fixture(scope="session")
def postgres_template(postgres_cluster: Cluster) -> str:
    """A database holding an empty ledger at the schema head, made once by ``Store.open(create=True)``; tests get
    copies of it (copying files instead of running every migration again: about a quarter of the time). Copies share
    its log origin, as copies of one ledger do; a test about independent ledgers creates its own from ``db_url``."""
    from ledger.store import Store

    url = postgres_cluster.create_database("ledger_template")
    Store.open(url, create=True).close()  # closes its connections: a template must have none
    return "ledger_template"


@pytest.fixture(params=BACKENDS)
def backend(request: pytest.FixtureRequest) -> str:
    """The database engine this case runs on: ``sqlite`` or ``postgresql``."""
    return str(request.param)


MakeDbUrl = Callable[..., str]  # (name[, template]) -> the URL of a new database


@pytest.fixture
def make_db_url(backend: str, tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MakeDbUrl]:
    """A factory of new empty databases on this case's backend: ``name -> URL`` (SQLite: an empty file
    ``<name>.db`` under tmp_path; PostgreSQL: a new database, a copy of ``template``, dropped after the test)."""
    if backend == "sqlite":
        from ledger.database import resolve_url

        def sqlite_file(name: str, template: str | None = None) -> str:
            path = tmp_path / f"{name}.db"
            if path.exists():
                raise ValueError(f"{path} exists already: give each database its own name")
            path.touch()  # a zero-byte file is an empty SQLite database, as a new PostgreSQL database is empty
            return resolve_url(path)

        yield sqlite_file
        return
    cluster: Cluster = request.getfixturevalue("postgres_cluster")
    made: list[str] = []

    def database(name: str, template: str = "template0") -> str:
        db = f"t{next(_names)}_{re.sub(r'[^a-z0-9_]', '_', name.lower())}"[:63]
        url = cluster.create_database(db, template)
        made.append(db)
        return url

    yield database
    for db in made:
        cluster.drop_database(db)


@pytest.fixture
def db_url(make_db_url: MakeDbUrl) -> str:
    """An empty database on this case's backend (no schema)."""
    return make_db_url("db")


@pytest.fixture
def ledger_url(backend: str, make_db_url: MakeDbUrl, request: pytest.FixtureRequest) -> str:
    """A ledger at the schema head on this case's backend, holding no receipt."""
    if backend == "sqlite":
        from ledger.store import Store

        url = make_db_url("ledger")
        Store.open(url, create=True).close()
        return url
    return make_db_url("ledger", request.getfixturevalue("postgres_template"))


# ----------------------------------------------------------------------------- raw SQL on either backend


def raw_rows(url: str, sql: str, params: dict[str, Any] | None = None) -> list[tuple[Any, ...]]:
    """Rows of one query through a plain SQLAlchemy engine (none of the ledger's code in the way)."""
    from sqlalchemy import create_engine, text

    engine = create_engine(url)
    try:
        with engine.begin() as conn:
            result = conn.execute(text(sql), params or {})
            return [tuple(row) for row in result] if result.returns_rows else []
    finally:
        engine.dispose()


def raw_count(url: str, table: str = "receipts") -> int:
    return int(raw_rows(url, f"SELECT count(*) FROM {table}")[0][0])
