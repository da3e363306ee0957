"""``open_store``: the event store a target names, a SQLite file or a PostgreSQL URL."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from aalis_agent.events.errors import StoreError
from aalis_agent.events.sqlite import SqliteEventStore

if TYPE_CHECKING:
    from aalis_agent.events.postgres import PostgresEventStore

__all__ = ["SHARDS_MANIFEST", "is_postgres_url", "missing_database", "open_store"]

_SCHEMES = ("postgresql://", "postgres://")
SHARDS_MANIFEST = "shards.json"
"""What a directory of process shards records its shard count in
(:class:`~aalis_agent.scale.processes.ProcessShards`)."""


def is_postgres_url(target: str | Path) -> bool:
    """Whether ``target`` is a PostgreSQL URL (``postgresql://`` or ``postgres://``)."""
    return isinstance(target, str) and target.lower().startswith(_SCHEMES)


def missing_database(target: str | Path) -> str | None:
    """Why there is no event database to read at ``target`` (a SQLite file that must
    exist), or None: there is one, or it is a PostgreSQL URL (its server says)."""
    if is_postgres_url(target):
        return None
    path = Path(target)
    if path.is_file():
        return None
    if path.is_dir():
        if (path / SHARDS_MANIFEST).is_file():
            shards = ", ".join(sorted(p.name for p in path.glob("shard-*.db"))[:4])
            return (
                f"{str(target)!r} is a directory of process shards, not an event database: "
                f"open one of its shard files ({shards or 'none written yet'})"
            )
        return f"{str(target)!r} is a directory, not an event database"
    return f"no event database at {str(target)!r}"


def open_store(
    target: str | Path, *, read_only: bool = False, sync: str | None = None
) -> SqliteEventStore | PostgresEventStore:
    """The event store at ``target``: a :class:`PostgresEventStore` for a
    ``postgresql://`` URL, else a :class:`SqliteEventStore` for a file path (or
    ``":memory:"``). ``read_only`` opens it for reading only (as ``replay`` does): nothing
    is created and writes are refused.

    The PostgreSQL store needs psycopg (``pip install 'aalis-agent[postgres]'``); without
    it a URL is refused with :class:`StoreError`.

    ``sync`` (``"normal"`` or ``"full"``) is the SQLite store's (see
    :class:`SqliteEventStore`); a PostgreSQL server syncs its commits itself, so it is
    refused for a URL.
    """
    if is_postgres_url(target):
        if sync is not None:
            raise StoreError(
                "sync applies to a SQLite file; a PostgreSQL server makes its commits "
                "durable itself (its synchronous_commit setting)"
            )
        try:
            from aalis_agent.events.postgres import PostgresEventStore
        except ImportError as exc:
            raise StoreError(
                f"a PostgreSQL event database needs psycopg and psycopg_pool "
                f"(pip install 'aalis-agent[postgres]'): {exc}"
            ) from None
        return PostgresEventStore(str(target), read_only=read_only)
    return SqliteEventStore(target, read_only=read_only, sync=sync or "normal")
