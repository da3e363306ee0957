"""The project's exceptions: one tree, one root.

    AgentError
    ├── UsageError                      a mistake of the caller: nothing was done
    │   ├── ConfigError (ValueError)    bad configuration or settings values
    │   ├── InvalidInput (ValueError)   an input the log could not hold (wrong type, ...)
    │   ├── ReplayError                 a log that cannot be replayed as asked
    │   ├── ScenarioError               a scenario file that is wrong (scenarios/)
    │   └── RuntimeClosed (RuntimeError) the runtime was shut down (actors/runtime)
    └── RunError                        a failure while running
        ├── StoreError
        │   ├── ConcurrencyConflict     an append's expected_seq did not match the log
        │   ├── InvalidBatch (ValueError) a batch that cannot be appended as given
        │   ├── CorruptEvent            a stored row that does not decode
        │   ├── StoreInUse              another process writes this database
        │   └── SessionFailed           a session stopped after a failed write, or
        │                               quarantined because its log does not decode
        ├── ProviderError               a call to a model server failed (keys masked)
        ├── ToolError                   a tool refused or failed; the model sees the text
        └── Aborted                     code that gave up because its turn was stopped

As pydantic-ai splits ``UserError`` from ``AgentRunError``: catch :class:`UsageError` to
tell a caller what to fix, :class:`RunError` for what went wrong at run time. Each class
lives here, whatever raises it, so there is one place to read them all.
"""

from __future__ import annotations

from aalis_agent.events.secrets import redact

__all__ = [
    "Aborted",
    "AgentError",
    "ConcurrencyConflict",
    "ConfigError",
    "CorruptEvent",
    "InvalidBatch",
    "InvalidInput",
    "ProviderError",
    "ReplayError",
    "RunError",
    "RuntimeClosed",
    "ScenarioError",
    "SessionFailed",
    "StoreError",
    "StoreInUse",
    "ToolError",
    "UsageError",
]


class AgentError(Exception):
    """Root of every error this project raises on purpose."""


class UsageError(AgentError):
    """A mistake of the caller (bad configuration, bad input, misuse): nothing was done;
    the message says what to fix."""


class RunError(AgentError):
    """A failure while running: the store, a model server, a tool, a stop."""


class ConfigError(UsageError, ValueError):
    """A configuration or settings value that is refused; the message names the key."""


class InvalidInput(UsageError, ValueError):
    """An input refused at the API boundary: a field of the wrong type, or a value the
    log cannot hold. The message names the field (``$.content``); nothing was written."""


class StoreError(RunError):
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


class ReplayError(UsageError):
    """A replay request that cannot be served (no such session, bad --at)."""


class ScenarioError(UsageError):
    """A scenario file that is wrong, or a run that cannot go on as the file says.

    The message names the file, the place (a step, a tool, a reply) and what is wrong.
    """

    def __init__(self, reason: str, *, file: str = "<scenario>", where: str | None = None):
        self.file = file
        self.where = where
        self.reason = reason
        super().__init__(f"{file}: {where}: {reason}" if where else f"{file}: {reason}")


class RuntimeClosed(UsageError, RuntimeError):
    """The runtime was shut down: it takes no more inputs."""


def _one_line(text: str) -> str:
    """``text`` with its control and formatting characters escaped (``\\n``, ``\\x1b``,
    ``\\u202e``): a server's message printed to a terminal or a log cannot break lines,
    move the cursor or reverse the text after it."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


class ProviderError(RunError):
    """A call to a model server failed. The message is ``<kind>: <what the client said>``
    with every registered secret masked; ``kind`` names the client's error
    (``AuthenticationError``, ``APITimeoutError``…), ``status_code`` the HTTP status when
    the server answered. Raised ``from None``, without the client's exception."""

    def __init__(self, message: str, *, kind: str = "", status_code: int | None = None) -> None:
        super().__init__(_one_line(redact(message)))
        self.kind = kind
        self.status_code = status_code

    @classmethod
    def of(cls, exc: BaseException) -> ProviderError:
        """The masked stand-in for an exception the client raised."""
        status = getattr(exc, "status_code", None)
        kind = type(exc).__name__
        return cls(
            f"{kind}: {exc}", kind=kind, status_code=status if isinstance(status, int) else None
        )


class ToolError(RunError):
    """A tool's refusal or failure; the model sees ``ToolError: <text>`` as the call's
    result (raised by the built-in tools and by scenario tools scripted to fail)."""


class Aborted(RunError):
    """Raised by code that gives up because its turn was stopped."""
