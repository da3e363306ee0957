"""One writing process per event database: an advisory lock beside the file.

Two processes running sessions over one database would both append to the same logs:
the sequence check turns that into conflicts, handles that never resolve and live turns
recorded as cut by the other process. So a store opened for writing takes an exclusive
``flock`` on ``<database>.lock`` (its holder's pid written in it) and keeps it until
closed; the kernel drops it when the process dies, SIGKILL included, so a crashed owner
never blocks its successor. A second process gets :class:`StoreInUse` at once, naming
the holder. Readers (``read_only=True``, as ``replay`` opens) take no lock.

Within one process, stores opened on the same file share the lock (reference counted):
the lock keeps other processes out, not this one's own connections.
"""

from __future__ import annotations

import os
import threading

from aalis_agent.events.errors import StoreError, StoreInUse

try:
    import fcntl
except ImportError:  # pragma: no cover - not a POSIX system: no advisory locks
    fcntl = None  # type: ignore[assignment]

__all__ = ["acquire_writer", "release_writer"]

_guard = threading.Lock()
_held: dict[str, tuple[int, int]] = {}  # database realpath -> (lock fd, references)


def acquire_writer(database: str) -> str:
    """Take (or share, within this process) the writer lock of ``database``; returns the
    key to give :func:`release_writer`. Raises :class:`StoreInUse` when another process
    holds it."""
    key = os.path.realpath(database)
    with _guard:
        held = _held.get(key)
        if held is not None:
            _held[key] = (held[0], held[1] + 1)
            return key
        if fcntl is None:  # pragma: no cover
            _held[key] = (-1, 1)
            return key
        try:
            fd = os.open(f"{key}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            # Its lock file is the first thing made: name the folder that is missing, not
            # the lock file the user never asked for.
            missing = isinstance(exc, FileNotFoundError) and not os.path.isdir(os.path.dirname(key))
            folder = os.path.dirname(os.fspath(database)) or "."
            why = f"its folder {folder!r} does not exist" if missing else str(exc)
            raise StoreError(f"cannot open event database {database!r}: {why}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.read(fd, 64).decode("ascii", "replace").strip() or "?"
            os.close(fd)
            raise StoreInUse(database, holder) from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        _held[key] = (fd, 1)
        return key


def release_writer(key: str) -> None:
    """Drop one reference to the lock; the last one releases it."""
    with _guard:
        held = _held.get(key)
        if held is None:
            return
        fd, refs = held
        if refs > 1:
            _held[key] = (fd, refs - 1)
            return
        del _held[key]
        if fd >= 0 and fcntl is not None:
            fcntl.flock(fd, fcntl.LOCK_UN)
            os.close(fd)
