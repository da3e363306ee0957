"""The authority port: who is the owner (``isOwner``) and the owner's accounts."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Protocol

__all__ = ["CONSOLE_IDENTITIES", "Authority", "StaticAuthority"]

CONSOLE_IDENTITIES: frozenset[tuple[str, str]] = frozenset(
    {("cli", "console"), ("webui", "console")}
)
"""The local console identities: always the owner."""


class Authority(Protocol):
    def is_owner(self, platform: str | None, user_id: str | None) -> bool: ...

    def owner_account(self, platform: str | None) -> str | None:
        """The owner's account registered on ``platform``, if any."""
        ...


class StaticAuthority:
    """Owners given as ``(platform, user_id)`` pairs; the console identities included."""

    def __init__(self, owners: Iterable[tuple[str, str]] = ()) -> None:
        self._owners = frozenset(owners) | CONSOLE_IDENTITIES

    def is_owner(self, platform: str | None, user_id: str | None) -> bool:
        if platform is None or user_id is None:
            return False
        return (platform, user_id) in self._owners

    def owner_account(self, platform: str | None) -> str | None:
        for owner_platform, user_id in sorted(self._owners):
            if owner_platform == platform:
                return user_id
        return None
