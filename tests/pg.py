"""A throwaway PostgreSQL cluster for the tests: ``initdb`` into a temporary folder, a free
loopback port, ``pg_ctl start``, one database; stopped and removed at the end.

Nothing is mocked: the Postgres store's tests talk to a real server. The fixtures skip,
naming why, only when no server binaries can be found or the cluster does not start.
``AALIS_PG_BINDIR`` names the folder of ``initdb``/``pg_ctl`` when they are elsewhere;
``AALIS_PG_URL`` points the tests at a server already running instead (its database must
be one they may create schemas in).

As root (CI), the cluster runs as the ``postgres`` user that the Debian package creates:
PostgreSQL refuses to run as root.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pwd
import shlex
import shutil
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Mapping
from pathlib import Path
from urllib.parse import quote

import pytest

__all__ = ["Cluster", "ClusterUnavailable", "find_bindir", "pg_cluster", "pg_url", "url_with"]

SUPERUSER = "aalis"
DATABASE = "aalis_test"
FAST = {"fsync": "off", "synchronous_commit": "off", "full_page_writes": "off"}
"""Settings for a cluster whose data is thrown away: no waits on the disk."""


class ClusterUnavailable(RuntimeError):
    """No PostgreSQL server could be found or started here; the message says why."""


def find_bindir() -> Path | None:
    """The folder holding ``initdb``, ``pg_ctl`` and ``postgres``: ``AALIS_PG_BINDIR``,
    else the newest ``/usr/lib/postgresql/<version>/bin`` (Debian), else ``pg_config
    --bindir``, else where ``initdb`` is on the PATH."""
    candidates: list[Path] = []
    if env := os.environ.get("AALIS_PG_BINDIR"):
        candidates.append(Path(env))
    debian = Path("/usr/lib/postgresql")
    if debian.is_dir():
        versions = [p for p in debian.iterdir() if p.name.split(".")[0].isdigit()]
        versions.sort(key=lambda p: [int(x) for x in p.name.split(".") if x.isdigit()])
        candidates += [p / "bin" for p in reversed(versions)]
    if pg_config := shutil.which("pg_config"):
        with contextlib.suppress(OSError, subprocess.SubprocessError):
            out = subprocess.run(
                [pg_config, "--bindir"], capture_output=True, text=True, timeout=10, check=True
            )
            candidates.append(Path(out.stdout.strip()))
    if initdb := shutil.which("initdb"):
        candidates.append(Path(initdb).resolve().parent)
    for folder in candidates:
        if all((folder / name).is_file() for name in ("initdb", "pg_ctl", "postgres")):
            return folder
    return None


def free_port() -> int:
    """A TCP port free on 127.0.0.1 just now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
        return port


def url_with(
    url: str,
    *,
    database: str | None = None,
    search_path: str | None = None,
    settings: Mapping[str, str] | None = None,
) -> str:
    """``url`` naming another database, or with ``search_path`` and other ``settings`` set
    for its sessions (libpq's ``options``)."""
    if database is not None:
        base, _, query = url.partition("?")
        url = base.rsplit("/", 1)[0] + "/" + quote(database) + (f"?{query}" if query else "")
    options = dict(settings or {})
    if search_path is not None:
        options["search_path"] = search_path
    if options:
        text = " ".join(f"-c{k}={v}" for k, v in options.items())
        url += ("&" if "?" in url else "?") + f"options={quote(text)}"
    return url


class Cluster:
    """One PostgreSQL cluster in its own folder, on a free loopback port.

    ``start()`` runs ``initdb`` (trust authentication, superuser ``aalis``, UTF-8) and
    ``pg_ctl start``, then creates ``database``; ``stop()`` stops the server and removes
    the folder. ``settings`` are passed to the server (``-c name=value``).
    """

    def __init__(
        self,
        *,
        bindir: Path | None = None,
        settings: Mapping[str, str] | None = None,
        database: str = DATABASE,
        base: str | None = None,
    ) -> None:
        found = bindir or find_bindir()
        if found is None:
            raise ClusterUnavailable(
                "no PostgreSQL server binaries (initdb, pg_ctl, postgres) found: install "
                "them (Debian: apt-get install -y postgresql) or set AALIS_PG_BINDIR"
            )
        self.bindir = found
        self.settings = dict(settings or {})
        self.database = database
        self._base = base
        self.folder: Path | None = None
        self.port = 0
        self._user: pwd.struct_passwd | None = None

    @property
    def data(self) -> Path:
        assert self.folder is not None
        return self.folder / "data"

    @property
    def url(self) -> str:
        return f"postgresql://{SUPERUSER}@127.0.0.1:{self.port}/{quote(self.database)}"

    def _as_server_user(self, argv: list[str]) -> list[str]:
        if self._user is None:
            return argv
        return ["setpriv", f"--reuid={self._user.pw_uid}", f"--regid={self._user.pw_gid}",
                "--clear-groups", "--", *argv]  # fmt: skip

    def _run(self, argv: list[str], *, timeout: float = 120) -> subprocess.CompletedProcess[str]:
        env = {**os.environ, "LC_ALL": "C.UTF-8", "LANG": "C.UTF-8"}
        env.pop("PGDATA", None)
        return subprocess.run(
            self._as_server_user(argv),
            capture_output=True,
            text=True,
            timeout=timeout,
            env=env,
            cwd=self.folder,
        )

    def start(self) -> str:
        """Create and start the cluster; its URL."""
        if os.geteuid() == 0:
            try:
                self._user = pwd.getpwnam("postgres")
            except KeyError:
                raise ClusterUnavailable(
                    "running as root and there is no 'postgres' user to run the server as "
                    "(PostgreSQL refuses to run as root)"
                ) from None
            if shutil.which("setpriv") is None:
                raise ClusterUnavailable("running as root and setpriv is missing")
        self.folder = Path(tempfile.mkdtemp(prefix="aalis-pg-", dir=self._base))
        if self._user is not None:
            os.chown(self.folder, self._user.pw_uid, self._user.pw_gid)
        try:
            self._init_and_start()
        except BaseException:
            self.stop()
            raise
        return self.url

    def _init_and_start(self) -> None:
        init = self._run(
            [str(self.bindir / "initdb"), "-D", str(self.data), "-U", SUPERUSER,
             "--auth=trust", "--encoding=UTF8", "--locale=C", "--no-sync"]
        )  # fmt: skip
        if init.returncode != 0:
            raise ClusterUnavailable(f"initdb failed: {init.stderr.strip() or init.stdout}")
        settings = {
            "listen_addresses": "127.0.0.1",
            "unix_socket_directories": "",
            "max_connections": "100",
            **self.settings,
        }
        log = self.folder / "server.log"  # type: ignore[operator]
        last = ""
        for _ in range(5):  # another process may take the free port before the server
            self.port = free_port()
            all_settings = {**settings, "port": str(self.port)}
            options = " ".join(f"-c {k}={shlex.quote(v)}" for k, v in all_settings.items())
            started = self._run(
                [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-l", str(log), "-w",
                 "-t", "60", "-o", options, "start"]
            )  # fmt: skip
            if started.returncode == 0:
                break
            last = started.stderr.strip() or started.stdout.strip()
            with contextlib.suppress(OSError):
                last += "\n" + log.read_text()[-2000:]
        else:
            raise ClusterUnavailable(f"pg_ctl start failed: {last}")
        self._create_database()

    def _create_database(self) -> None:
        import psycopg

        with psycopg.connect(url_with(self.url, database="postgres"), autocommit=True) as conn:
            conn.execute(f'CREATE DATABASE "{self.database}"')

    def stop(self) -> None:
        """Stop the server (fast shutdown) and remove its folder."""
        if self.folder is None:
            return
        if (self.data / "postmaster.pid").exists():
            self._run(
                [str(self.bindir / "pg_ctl"), "-D", str(self.data), "-m", "fast", "-w", "stop"]
            )
        shutil.rmtree(self.folder, ignore_errors=True)
        self.folder = None

    def __enter__(self) -> Cluster:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()


@pytest.fixture(scope="session")
def pg_cluster() -> Iterator[str]:
    """The URL of a database on a PostgreSQL server for this test session: a throwaway
    cluster (or the server ``AALIS_PG_URL`` names)."""
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e .[postgres])")
    if url := os.environ.get("AALIS_PG_URL"):
        yield url
        return
    try:
        cluster = Cluster(settings=FAST)
        cluster.start()
    except ClusterUnavailable as exc:
        pytest.skip(f"no PostgreSQL server for the tests: {exc}")
    try:
        yield cluster.url
    finally:
        cluster.stop()


_schemas = itertools.count(1)


@pytest.fixture
def pg_url(pg_cluster: str) -> str:
    """A URL whose sessions work in a new, empty schema of the test database: each test
    sees a store of its own."""
    import psycopg

    name = f"t{os.getpid()}_{next(_schemas)}"
    with psycopg.connect(pg_cluster, autocommit=True) as conn:
        conn.execute(f"CREATE SCHEMA {name}")
    return url_with(pg_cluster, search_path=name)
