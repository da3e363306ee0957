"""Pure folds over a session's log: history, turns, queue, and all of them together.

No I/O, no clock, no logging, no threads. Imports ``events`` only.
"""

from aalis_agent.projections import history, queue, turns
from aalis_agent.projections.chain import Chain
from aalis_agent.projections.session import SessionView, evolve, project

__all__ = ["Chain", "SessionView", "evolve", "history", "project", "queue", "turns"]
