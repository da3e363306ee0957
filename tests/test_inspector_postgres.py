"""The inspector over a PostgreSQL log (a real server, tests/pg.py): the same answers as
over the SQLite file the same turns wrote, and the URL's password kept off the screen."""

from __future__ import annotations

import io
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("psycopg", reason="psycopg is not installed (pip install -e .[postgres])")

from aalis_agent.cli.demo import DEMO_SESSION, run_demo
from aalis_agent.inspector.server import make_server

from tests.harness import ROOT
from tests.pg import pg_cluster, pg_url  # noqa: F401 -- the fixtures
from tests.test_inspector import api, get


def test_the_inspector_reads_a_postgresql_log_as_it_reads_a_sqlite_file(
    pg_url: str,  # noqa: F811
    tmp_path: Path,
) -> None:
    run_demo(pg_url, out=io.StringIO())
    run_demo(str(tmp_path / "demo.db"), out=io.StringIO())
    answers = []
    for db in (pg_url, str(tmp_path / "demo.db")):
        srv = make_server(db)
        srv.start()
        try:
            status, sessions = get(srv, "/api/sessions")
            assert status == 200
            answers.append((sessions, api(srv, "timeline"), api(srv, "usage")))
        finally:
            srv.stop()
    on_pg, on_file = answers
    assert [s["session_id"] for s in on_pg[0]["sessions"]] == [DEMO_SESSION]
    assert on_pg[1]["turns_total"] == 4
    assert _timeless(on_pg) == _timeless(on_file)  # the two runs' clocks differ


def _timeless(value: Any) -> Any:
    """``value`` without its times (``*_at``, ``duration_ms``)."""
    if isinstance(value, dict):
        return {
            k: _timeless(v)
            for k, v in value.items()
            if not (k.endswith("_at") or k == "duration_ms")
        }
    if isinstance(value, (list, tuple)):
        return [_timeless(v) for v in value]
    return value


def test_inspect_takes_a_postgresql_url_and_shows_it_without_its_password(
    pg_url: str,  # noqa: F811
) -> None:
    run_demo(pg_url, out=io.StringIO())
    with_password = pg_url.replace("postgresql://aalis@", "postgresql://aalis:s3cret@", 1)
    assert with_password != pg_url  # the test cluster trusts loopback: any password does
    with subprocess.Popen(
        [sys.executable, "-m", "aalis_agent.cli", "inspect", with_password],
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
        text=True,
        cwd=ROOT,
    ) as proc:
        try:
            assert proc.stdout is not None
            line = proc.stdout.readline()
            assert line.startswith("Inspecting postgresql://aalis:***@"), line
            assert "s3cret" not in line
        finally:
            proc.terminate()
