"""The project's exceptions, under one root.

    AgentError
    ├── ConfigError (ValueError)        bad configuration or settings values
    ├── InvalidInput (ValueError)       an input the log could not hold (wrong type, ...)
    ├── StoreError
    │   ├── ConcurrencyConflict         an append's expected_seq did not match the log
    │   ├── InvalidBatch (ValueError)   a batch that cannot be appended as given
    │   ├── CorruptEvent                a stored row that does not decode
    │   ├── StoreInUse                  another process writes this database
    │   └── SessionFailed               a session stopped after a failed write, or
    │                                   quarantined because its log does not decode
    └── ReplayError                     a log that cannot be replayed as asked

Developer misuse (a wrong argument) raises the builtin-flavoured subclasses; failures of
a run (a conflict, a corrupt row) raise the others.
"""

from __future__ import annotations

__all__ = [
    "AgentError",
    "ConcurrencyConflict",
    "ConfigError",
    "CorruptEvent",
    "InvalidBatch",
    "InvalidInput",
    "ReplayError",
    "SessionFailed",
    "StoreError",
    "StoreInUse",
]


class AgentError(Exception):
    """Root of every error this project raises on purpose."""


class ConfigError(AgentError, ValueError):
    """A configuration or settings value that is refused; the message names the key."""


class InvalidInput(AgentError, ValueError):
    """An input refused at the API boundary: a field of the wrong type, or a value the
    log cannot hold. The message names the field (``$.content``); nothing was written."""


class StoreError(AgentError):
    """An event store could not do what was asked."""


class ConcurrencyConflict(StoreError):
    """Another writer appended first: the log's last seq is not the one expected."""

    def __init__(self, session_id: str, expected_seq: int, actual_seq: int) -> None:
        super().__init__(
            f"session {session_id!r}: expected last seq {expected_seq}, "
            f"but the log is at seq {actual_seq}"
        )
        self.session_id = session_id
        self.expected_seq = expected_seq
        self.actual_seq = actual_seq


class InvalidBatch(StoreError, ValueError):
    """A batch whose events do not belong to the session or do not follow expected_seq."""


class CorruptEvent(StoreError):
    """A stored row that cannot be decoded into a known event."""

    def __init__(self, session_id: str, seq: int, reason: str) -> None:
        super().__init__(f"session {session_id!r} seq {seq}: cannot decode event: {reason}")
        self.session_id = session_id
        self.seq = seq
        self.reason = reason


class StoreInUse(StoreError):
    """Another process has this event database open for writing: one process runs its
    sessions at a time. Readers (``read_only``, as ``replay``) are not refused."""

    def __init__(self, database: str, holder: str) -> None:
        super().__init__(
            f"event database {database!r} is open for writing by another process "
            f"(pid {holder}); one process runs its sessions at a time. Stop that process, "
            "or read the database without writing (aalis-agent replay)"
        )
        self.database = database
        self.holder = holder


class SessionFailed(StoreError):
    """A session stopped because a write to its log failed (persist, then act: nothing
    more happens in it), or it is quarantined because its log does not decode.

    Everything the log accepted before the failure is kept: a stopped session restarts
    from its log at its next use; a quarantined one stays refused until repaired."""

    def __init__(self, session_id: str, reason: str, *, quarantined: bool = False) -> None:
        if quarantined:
            text = f"session {session_id!r} is quarantined: {reason}"
        else:
            text = (
                f"session {session_id!r} stopped: a write to its log failed ({reason}); "
                "what the log accepted before is kept, and the session restarts from it "
                "at its next use"
            )
        super().__init__(text)
        self.session_id = session_id
        self.reason = reason
        self.quarantined = quarantined


class ReplayError(AgentError):
    """A replay request that cannot be served (no such session, bad --at)."""
