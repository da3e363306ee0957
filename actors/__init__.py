"""Concurrency and effects: the runtime, session actors, turns, and the command line."""

__all__: list[str] = []
