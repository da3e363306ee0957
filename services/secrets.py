"""Secrets (API keys) that must never be stored or logged: the registry and its masking
live in :mod:`aalis_agent.events.secrets` (the error tree needs them); this is the name
services and applications use."""

from aalis_agent.events.secrets import MASK, MIN_LENGTH, redact, redact_processor, register_secret

__all__ = ["MASK", "MIN_LENGTH", "redact", "redact_processor", "register_secret"]
