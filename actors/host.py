"""What a session actor needs from whatever hosts it: a narrow protocol, so the actor
never reaches into the :class:`~aalis_agent.actors.runtime.Runtime` (which implements it)
and the two modules do not import each other."""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from aalis_agent.actors.budget import BudgetLog
    from aalis_agent.actors.hooks import Hooks
    from aalis_agent.actors.turn import TurnRunner
    from aalis_agent.actors.workers import Workers

__all__ = ["SessionHost"]


class SessionHost(Protocol):
    """The host of session actors (the runtime): its hooks, budget log and turn threads,
    and the events
    an actor reports about itself and its turn runners."""

    @property
    def hooks(self) -> Hooks: ...

    @property
    def budget_log(self) -> BudgetLog: ...

    @property
    def workers(self) -> Workers:
        """The threads its sessions' turns run on."""
        ...

    def runner_started(self, runner: TurnRunner) -> None:
        """A turn runner of one of its sessions started."""

    def runner_exited(self, runner: TurnRunner) -> None:
        """A turn runner finished (its thread is about to end)."""

    def archive_missed(self) -> None:
        """A write found no message archive (ARC1): warn, once per activation."""

    def unregister_if_idle(self, session_id: str, actor: Any) -> bool:
        """The actor is passivating: forget it unless a message is on its way to it."""

    def session_failed(self, session_id: str, actor: Any, runner: Any = None) -> None:
        """The actor was fenced after a failed write: forget it, so the next use of the
        session rebuilds it from its log; its turn ``runner``, if one is still running,
        keeps the session until it ends."""

    @property
    def confirm_ownership(self) -> Callable[[str], bool] | None:
        """Whether a session is still held here, asked before a turn acts (None: no
        ownership to ask)."""
        ...

    def wait_outliving(self, runner: TurnRunner) -> None:
        """Before ``runner`` acts: wait while a turn of its session cut by a failed write
        still runs."""
