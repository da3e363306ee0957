"""Moving a :class:`~aalis_agent.scale.processes.ProcessShards` directory's sessions to
another shard count (``aalis-agent reshard DIR --shards N``).

A session lives in the shard file its id hashes to among the directory's count
(``shards.json``), so a directory opened with another count would look for its sessions
in the wrong files; ``ProcessShards`` refuses that. :func:`reshard` copies every session's
log, event by event and seq by seq, into new shard files for the new count, checks each
copy against its original, and only then puts the new files in place of the old ones and
records the new count. Nothing is deleted: the old files are kept in a folder beside them
(``before-reshard-<old count>-<time>``), whole, for the user to remove.

Cut at any point (a kill, a full disk, a bad row), it leaves the directory as it was or
says how to finish: every step is recorded first in ``reshard.json``, which
``ProcessShards`` refuses to open past, and running the same reshard again finishes it
(a copy cut half-way is made again from the start; files cut half-way through being
moved are moved on). A reshard cut while still copying can instead be given up by
running it with the old count. An error while copying (a row of an old shard that does
not decode, a full disk) gives the reshard up at once: nothing was moved, and the error
names what failed (a bad row by its session and seq; ``aalis-agent replay`` shows what
else that file holds). The directory is held the whole time, as ``ProcessShards`` holds
it while its workers run: either one refuses while the other has it
(:class:`StoreInUse`), in this process too.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

from aalis_agent.events.errors import StoreError, StoreInUse, UsageError
from aalis_agent.events.ownership import acquire_writer, release_writer
from aalis_agent.events.sqlite import SqliteEventStore
from aalis_agent.scale.ownership import shard_of

__all__ = [
    "JOURNAL",
    "MANIFEST",
    "MAX_SHARDS",
    "Progress",
    "ReshardDone",
    "held_directory",
    "hold_directory",
    "refuse_if_resharding",
    "release_directory",
    "reshard",
    "write_json_atomically",
]

MANIFEST = "shards.json"
# A worker process a shard: more than this on one machine is a typo, not a plan.
MAX_SHARDS = 4096
JOURNAL = "reshard.json"
_HOLD = "shards"  # the directory's hold: ``shards.lock`` (events/ownership.py's lock)
_CHUNK = 4096  # events read at a time: a long session is not read whole
_ROW = 32  # events a commit (a turn's are ~4): short rows, as reads decode a row whole
_SUFFIXES = ("", "-wal", "-shm")  # a SQLite database's files
_SHARD_FILES = re.compile(r"(shard-.*?\.db)(-wal|-shm|-journal|\.lock)?")  # and a shard's


@dataclass(frozen=True)
class Progress:
    """How far the copy is: sessions and events copied of each total."""

    sessions: int
    sessions_total: int
    events: int
    events_total: int


@dataclass(frozen=True)
class ReshardDone:
    """What :func:`reshard` did: the count before and after, the sessions and events
    copied, and the folder keeping the old files (None when there was nothing to do)."""

    old_shards: int
    shards: int
    sessions: int
    events: int
    kept: Path | None


def _shard_file(directory: Path, index: int) -> Path:
    return directory / f"shard-{index}.db"


_guard = threading.Lock()
_holds: dict[str, int] = {}  # a held directory's key -> its holders here (-1: a reshard)


def hold_directory(directory: Path, *, alone: bool = False) -> str:
    """Hold ``directory`` as its one user (``ProcessShards`` or a reshard) until
    :func:`release_directory`; :class:`StoreInUse` when another process holds it (the
    kernel lets go of a process that dies), or ``alone`` (a reshard) when this process
    holds it too, or when a reshard in this process holds it. Returns the key to
    release it with."""
    key = os.path.realpath(directory / _HOLD)  # as acquire_writer names it
    with _guard:
        held = _holds.get(key, 0)
        if held < 0 or (alone and held > 0):
            refused = StoreInUse(str(directory), str(os.getpid()))
            refused.args = (
                f"shard directory {str(directory)!r} is in use by this process (pid "
                f"{os.getpid()}): its ProcessShards or a reshard; stop it first",
            )
            raise refused
        try:
            acquire_writer(str(directory / _HOLD))
        except StoreInUse as exc:
            refused = StoreInUse(str(directory), exc.holder)
            refused.args = (
                f"shard directory {str(directory)!r} is in use by another process (pid "
                f"{exc.holder}): its ProcessShards or a reshard; stop it first",
            )
            raise refused from None
        _holds[key] = -1 if alone else held + 1
    return key


def release_directory(key: str) -> None:
    with _guard:
        held = _holds.pop(key, 0)
        if held > 1:
            _holds[key] = held - 1
        release_writer(key)


@contextlib.contextmanager
def held_directory(directory: Path, *, alone: bool = False) -> Iterator[None]:
    """:func:`hold_directory` for the length of a block."""
    key = hold_directory(directory, alone=alone)
    try:
        yield
    finally:
        release_directory(key)


def refuse_if_resharding(directory: Path) -> None:
    """Refuse a directory whose reshard was begun and not finished: its files are not
    where its count says, and running the reshard again finishes it."""
    journal = _read_journal(directory)
    if journal is not None:
        raise UsageError(
            f"{str(directory)!r}: a reshard to {journal.to} shards was begun and not finished "
            f"({JOURNAL}); run `aalis-agent reshard {directory} --shards {journal.to}` to "
            "finish it"
            + (
                f" (or with --shards {journal.old} to give it up: it was still copying)"
                if journal.state == "copying"
                else ""
            )
        )


@dataclass(frozen=True)
class _Journal:
    old: int  # the count the files were made for
    to: int  # the count they are being moved to
    state: str  # "copying", "moving-old", "moving-new"
    kept: str  # the folder (name) the old files go to


_STATES = ("copying", "moving-old", "moving-new")


def _read_journal(directory: Path) -> _Journal | None:
    path = directory / JOURNAL
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        return None
    try:
        data = json.loads(text)
        journal = _Journal(data["from"], data["to"], data["state"], data["kept"])
    except (ValueError, KeyError, TypeError):
        raise UsageError(f"{str(path)!r} is not a reshard record: {text[:80]!r}") from None
    if (
        journal.state not in _STATES
        or not _count(journal.old)
        or not _count(journal.to)
        or not isinstance(journal.kept, str)
        or not journal.kept.startswith("before-reshard-")
        or "/" in journal.kept
    ):
        raise UsageError(f"{str(path)!r} is not a reshard record: {text[:80]!r}")
    return journal


def _count(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def write_json_atomically(path: Path, data: dict[str, object]) -> None:
    """Write ``path`` whole or not at all, durably (the file and its folder flushed)."""
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        f.write(json.dumps(data) + "\n")
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _sync_folder(path.parent)


def _sync_folder(folder: Path) -> None:
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _record(directory: Path, journal: _Journal) -> None:
    write_json_atomically(
        directory / JOURNAL,
        {"from": journal.old, "to": journal.to, "state": journal.state, "kept": journal.kept},
    )


def _recorded_count(directory: Path) -> int:
    path = directory / MANIFEST
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise UsageError(
            f"{str(directory)!r} is not a ProcessShards directory: it has no {MANIFEST}"
        ) from None
    try:
        count = json.loads(text)["shards"]
    except (ValueError, KeyError, TypeError):
        count = None
    if not _count(count):
        raise UsageError(f"{str(path)!r} is not a shard manifest: {text[:80]!r}")
    return count  # type: ignore[no-any-return]


def reshard(
    directory: str | os.PathLike[str],
    shards: int,
    *,
    progress: Callable[[Progress], None] | None = None,
) -> ReshardDone:
    """Move the sessions of the ``ProcessShards`` directory to ``shards`` shard files; see
    the module docstring. ``progress`` is called as the copy goes (after each session).
    A reshard begun and cut is finished by calling this again with the same count; one
    cut while still copying is given up by calling it with the old count instead. An
    error while copying (a row that does not decode, a full disk) gives it up itself:
    nothing was moved, the directory is as it was."""
    if not _count(shards) or shards > MAX_SHARDS:
        raise UsageError(
            f"reshard: shards must be an integer from 1 to {MAX_SHARDS:,}, not {shards!r}"
        )
    folder = Path(directory)
    if not folder.is_dir():
        raise UsageError(f"{str(folder)!r} is not a directory")
    with held_directory(folder, alone=True):  # (ProcessShards of this process too)
        journal = _read_journal(folder)
        if journal is None:
            old = _recorded_count(folder)
            if old == shards:
                return ReshardDone(old, shards, 0, 0, None)
            missing = [p.name for p in map(lambda i: _shard_file(folder, i), range(old))]
            missing = [name for name in missing if not (folder / name).is_file()]
            if missing:
                raise UsageError(
                    f"{str(folder)!r} records {old} shards but {', '.join(missing[:3])} "
                    "is missing: nothing was changed"
                )
            # A shard file the count does not name, or a WAL, shared-memory or lock file
            # of one: in the way of a new file, or (a WAL) read by SQLite as the new
            # file's own, whosever it is.
            expected = {f"shard-{i}.db" for i in range(old)}
            stray = sorted(
                p.name
                for p in folder.glob("shard-*.db*")
                if (match := _SHARD_FILES.fullmatch(p.name)) and match[1] not in expected
            )
            if stray:
                raise UsageError(
                    f"{str(folder)!r} records {old} shards but also holds "
                    f"{', '.join(stray[:3])}: move it away first (nothing was changed)"
                )
            stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime())
            kept = f"before-reshard-{old}-{stamp}"
            n = 1
            while (folder / kept).exists():  # never mixed with the files kept before
                n += 1
                kept = f"before-reshard-{old}-{stamp}-{n}"
            journal = _Journal(old, shards, "copying", kept)
            _record(folder, journal)
        elif journal.state == "copying" and shards == journal.old:
            _abandon(folder, journal)  # back to the count the files hold: nothing moved
            return ReshardDone(journal.old, shards, 0, 0, None)
        elif journal.to != shards:
            raise UsageError(
                f"{str(folder)!r}: a reshard to {journal.to} shards was begun and not "
                f"finished ({JOURNAL}); finish it first: --shards {journal.to}"
            )
        sessions = events = 0
        if journal.state == "copying":
            # The old files' writer locks are held from before the copy until they are
            # moved aside: no other process (``chat --db`` on a shard file) writes one
            # after its sessions were copied.
            held: list[str] = []
            try:
                try:
                    _enough_files(journal.old)
                    for i in range(journal.old):
                        held.append(acquire_writer(str(_shard_file(folder, i))))
                    sessions, events = _copy(folder, journal, progress)
                except Exception:
                    _abandon(folder, journal)  # nothing was moved: as it was
                    raise
                journal = _Journal(journal.old, journal.to, "moving-old", journal.kept)
                _record(folder, journal)
                _move_old(folder, journal)
                journal = _Journal(journal.old, journal.to, "moving-new", journal.kept)
                _record(folder, journal)
            finally:
                for key in held:
                    release_writer(key)
        if journal.state == "moving-old":
            _move_old(folder, journal)
            journal = _Journal(journal.old, journal.to, "moving-new", journal.kept)
            _record(folder, journal)
        _move_new(folder, journal)
        write_json_atomically(folder / MANIFEST, {"format": 1, "shards": journal.to})
        (folder / JOURNAL).unlink()
        _sync_folder(folder)
        return ReshardDone(journal.old, journal.to, sessions, events, folder / journal.kept)


# Open files the copy needs: the old shard files are open together (a store holds its
# database, WAL, shared memory and writer lock, and the copy holds each writer lock once
# more), with one new file and a margin besides.
_FILES_PER_OLD = 5
_FILES_MORE = 32


def _enough_files(old: int) -> None:
    """Raise this process's limit of open files (its soft limit, up to the hard one) to
    what a copy from ``old`` shard files needs, or refuse naming the limit."""
    need = _FILES_PER_OLD * old + _FILES_MORE
    try:
        import resource
    except ImportError:  # pragma: no cover - not a POSIX system
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY or soft >= need:
        return
    if hard != resource.RLIM_INFINITY and hard < need:
        raise UsageError(
            f"reshard: copying from {old} shard files needs about {need} open files, and "
            f"this process may open {hard} at most (ulimit -Hn): raise that limit, or "
            "reshard in steps (nothing was changed)"
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (need, hard))


def _abandon(directory: Path, journal: _Journal) -> None:
    """Give up a reshard still copying: its new files and its record go; the old files
    were never touched."""
    shutil.rmtree(_staging(directory, journal), ignore_errors=True)
    (directory / JOURNAL).unlink(missing_ok=True)
    _sync_folder(directory)


def _staging(directory: Path, journal: _Journal) -> Path:
    return directory / f"reshard-{journal.to}"


def _copy(
    directory: Path, journal: _Journal, progress: Callable[[Progress], None] | None
) -> tuple[int, int]:
    """Copy every session of the old files into new ones in the staging folder (made
    anew: a copy cut before is started again), each checked against its original. The
    old files are open together; the new ones one at a time, each written whole, then
    closed (checkpointed: the file holds every event) and flushed to the disk."""
    staging = _staging(directory, journal)
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir()
    olds: list[SqliteEventStore] = []
    try:
        for i in range(journal.old):  # held for writing: no other process writes them
            olds.append(SqliteEventStore(_shard_file(directory, i), background_checkpoint=False))
        plan: list[list[tuple[SqliteEventStore, str]]] = [[] for _ in range(journal.to)]
        found: dict[str, SqliteEventStore] = {}
        for store in olds:
            for sid in store.sessions():
                if (before := found.setdefault(sid, store)) is not store:
                    raise StoreError(
                        f"reshard: session {sid!r} is in both {Path(before.path).name} and "
                        f"{Path(store.path).name}: nothing was moved (see `aalis-agent "
                        "replay` of each; move one away by hand)"
                    )
                plan[shard_of(sid, journal.to)].append((store, sid))
        sessions = sum(map(len, plan))
        open_work = {id(store): set(store.open_sessions()) for store in olds}
        held = {id(store): store.count() for store in olds}
        total = sum(held.values())
        copied = done = 0
        for i, moving in enumerate(plan):
            new = SqliteEventStore(_shard_file(staging, i), background_checkpoint=False)
            try:
                for store, sid in moving:
                    n = _copy_session(store, new, sid, sid in open_work[id(store)])
                    copied += n
                    held[id(store)] -= n
                    done += 1
                    if progress is not None:
                        progress(Progress(done, sessions, copied, total))
            finally:
                new.close()
            for suffix in _SUFFIXES:
                _sync_file(Path(f"{_shard_file(staging, i)}{suffix}"))
        for store in olds:
            if held[id(store)]:  # rows of a session number no name is given (a hand edit)
                raise StoreError(
                    f"reshard: {store.path!r} holds {held[id(store)]} events in no session "
                    "it lists (rows of a session number its sessions table does not name): "
                    "they would be left behind; nothing was moved"
                )
        _sync_folder(staging)
        return sessions, copied
    finally:
        for store in olds:
            store.close()


def _sync_file(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except FileNotFoundError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _copy_session(old: SqliteEventStore, new: SqliteEventStore, sid: str, open_work: bool) -> int:
    """Copy one session's events (``_ROW`` a commit, the last with the session's
    open-work mark) and check the copy: the same events, seq by seq. Returns how many."""
    last = old.last_seq(sid)
    seq = 0
    while seq < last:
        chunk = old.read_range(sid, seq, seq + _CHUNK)
        if not chunk:
            break
        for at in range(0, len(chunk), _ROW):
            part = chunk[at : at + _ROW]
            end = part[-1].seq
            new.append(sid, part, seq, open_work=open_work if end >= last else True)
            seq = end
    if new.last_seq(sid) != last:
        raise StoreError(
            f"reshard: session {sid!r}: copied up to seq {new.last_seq(sid)} of {last}"
        )
    seq = 0
    while seq < last:  # read back as a runtime would read it
        want = old.read_range(sid, seq, seq + _CHUNK)
        got = new.read_range(sid, seq, seq + _CHUNK)
        if got != want:
            raise StoreError(f"reshard: session {sid!r}: the copy differs after seq {seq}")
        seq = want[-1].seq
    return last


_move = os.replace  # (a file moved whole, or not at all)


def _move_old(directory: Path, journal: _Journal) -> None:
    """Move the old shard files (and their lock files) into the kept folder."""
    kept = directory / journal.kept
    kept.mkdir(exist_ok=True)
    for i in range(journal.old):
        base = _shard_file(directory, i)
        for suffix in (*_SUFFIXES, ".lock"):
            src = Path(f"{base}{suffix}")
            if src.exists():
                _move(src, kept / src.name)
    _sync_folder(kept)
    _sync_folder(directory)


def _move_new(directory: Path, journal: _Journal) -> None:
    """Move the new shard files from the staging folder into the directory."""
    staging = _staging(directory, journal)
    for i in range(journal.to):
        base = _shard_file(staging, i)
        for suffix in (*_SUFFIXES, ".lock"):
            src = Path(f"{base}{suffix}")
            dst = directory / src.name
            if not src.exists():
                continue
            if dst.exists():
                raise UsageError(
                    f"{str(directory)!r}: {dst.name} is in the way of the new shard file "
                    f"({src}); move it away and run the reshard again"
                )
            _move(src, dst)
    _sync_folder(directory)
    with contextlib.suppress(OSError):
        staging.rmdir()
