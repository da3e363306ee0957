"""``aalis-agent inspect DB [--port N]``: serve the inspector page until interrupted."""

from __future__ import annotations

import argparse
import sys

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``inspect`` subcommand's arguments."""
    parser.add_argument(
        "db",
        metavar="DB",
        help="event database: a SQLite file or a postgresql:// URL (opened read-only)",
    )
    parser.add_argument(
        "--port",
        type=int,
        default=0,
        help="port on 127.0.0.1 to serve on (default: a free one, printed)",
    )
    parser.add_argument("-v", "--verbose", action="store_true", help="log each request on stderr")


def run(args: argparse.Namespace) -> int:
    """Serve the page for ``args.db`` on the loopback address until Ctrl-C (status 0);
    a SIGTERM is raised on to the command (:class:`~aalis_agent.cli.main.Terminated`,
    status 143), the server closed first."""
    from aalis_agent.events.open import is_postgres_url
    from aalis_agent.inspector.server import make_server

    if not 0 <= args.port <= 65535:
        sys.stderr.write(f"aalis-agent inspect: error: --port must be 0-65535, got {args.port}\n")
        return 2

    def to_stderr(line: str) -> None:
        sys.stderr.write(line + "\n")

    log = to_stderr if args.verbose else None
    try:
        server = make_server(args.db, args.port, log=log)
    except OSError as exc:
        sys.stderr.write(f"aalis-agent inspect: error: cannot listen: {exc}\n")
        return 2
    shown = args.db
    if is_postgres_url(shown):  # opened already: psycopg is there
        from aalis_agent.events.postgres import redact_url

        shown = redact_url(shown)  # no password on the screen
    sys.stdout.write(f"Inspecting {shown} (read-only) at {server.url}\nCtrl-C stops it.\n")
    sys.stdout.flush()
    try:
        server.serve_forever()
    except KeyboardInterrupt as exc:
        from aalis_agent.cli.main import Terminated

        if isinstance(exc, Terminated):
            raise  # a SIGTERM: the command leaves with 143, as every command does
        # Ctrl-C: how the page is stopped by hand (status 0)
    finally:
        server.server_close()
        server.store.close()
    return 0
