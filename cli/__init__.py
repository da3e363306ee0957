"""The ``aalis-agent`` command: demo, chat, config, replay and scenario
(:func:`aalis_agent.cli.main.main`), thin applications over the runtime."""

from aalis_agent.cli.main import main

__all__ = ["main"]
