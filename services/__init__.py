"""Ports (Protocols) and their default adapters: llm, tools, persona, settings, authority,
gateway, session manager. Services never import ``actors``.
"""

__all__: list[str] = []
