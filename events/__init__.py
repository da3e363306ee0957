"""The session log: its event vocabulary, codec, errors and stores.

This package imports nothing else of the project's.
"""

from aalis_agent.events.batch import Batch
from aalis_agent.events.clock import (
    Clock,
    FixedClock,
    IdSource,
    SequentialIds,
    SystemClock,
    UuidIds,
)
from aalis_agent.events.codec import (
    decode,
    decode_json,
    encode,
    encode_json,
    event_tag,
    restamp,
    to_builtins,
)
from aalis_agent.events.errors import (
    Aborted,
    AgentError,
    ConcurrencyConflict,
    ConfigError,
    CorruptEvent,
    InvalidBatch,
    InvalidInput,
    ProviderError,
    ReplayError,
    RunError,
    RuntimeClosed,
    ScenarioError,
    SessionFailed,
    StoreError,
    StoreInUse,
    ToolError,
    UsageError,
)
from aalis_agent.events.schema import *  # noqa: F403 -- the vocabulary is re-exported whole
from aalis_agent.events.schema import __all__ as _schema_all
from aalis_agent.events.sqlite import SqliteEventStore
from aalis_agent.events.store import EventStore, InMemoryEventStore, Recorded, check_batch

__all__ = [
    *_schema_all,
    "Aborted",
    "AgentError",
    "Batch",
    "Clock",
    "ConcurrencyConflict",
    "ConfigError",
    "CorruptEvent",
    "EventStore",
    "FixedClock",
    "IdSource",
    "InMemoryEventStore",
    "InvalidBatch",
    "InvalidInput",
    "Recorded",
    "ProviderError",
    "ReplayError",
    "RunError",
    "RuntimeClosed",
    "ScenarioError",
    "SessionFailed",
    "SequentialIds",
    "SqliteEventStore",
    "StoreError",
    "StoreInUse",
    "ToolError",
    "UsageError",
    "SystemClock",
    "UuidIds",
    "check_batch",
    "decode",
    "decode_json",
    "encode",
    "encode_json",
    "event_tag",
    "restamp",
    "to_builtins",
]
