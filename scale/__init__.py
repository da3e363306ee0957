"""Past one core and one machine: worker processes on this machine (``processes``), session
ownership across processes, and placement of runtime shards on Ray."""

from __future__ import annotations

import uuid

import msgspec
from aalis_agent.events.schema import Input

__all__ = ["with_input_id"]


def with_input_id(inp: Input) -> Input:
    """``inp`` with an id: one it has, else a new random one (``in-`` and 16 hex digits,
    as a runtime gives), so that sending it again to a restarted shard is sending the
    same input, which its session answers instead of running it twice."""
    if inp.id:
        return inp
    return msgspec.structs.replace(inp, id=f"in-{uuid.uuid4().hex[:16]}")
