"""``Chain``: an append-only sequence that is cheap to extend and safe to share.

A fold that appends one item per event must not copy the whole list each time, yet each
state it returns must stay unchanged afterwards. A ``Chain`` is a view of the first ``n``
items of a shared list: appending to the newest view extends the list in place (O(1));
appending to an older view copies first. Older views never see later items.

One fold at a time may extend a given chain (projections are folded by one actor).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from typing import Generic, TypeVar, overload

__all__ = ["Chain"]

T = TypeVar("T")

_new = object.__new__


class Chain(Sequence[T], Generic[T]):
    """An immutable view of a prefix of a shared, append-only list."""

    __slots__ = ("_items", "_n")

    def __init__(self, items: list[T] | None = None, n: int | None = None) -> None:
        self._items: list[T] = items if items is not None else []
        self._n: int = len(self._items) if n is None else n

    @classmethod
    def of(cls, items: Sequence[T]) -> Chain[T]:
        """A chain holding a copy of ``items``."""
        return cls(list(items))

    def append(self, item: T) -> Chain[T]:
        """A chain one item longer; this one is unchanged."""
        items = self._items
        n = self._n
        if len(items) != n:
            items = items[:n]
        items.append(item)
        chain: Chain[T] = _new(Chain)  # as Chain(items, n + 1), without calling __init__
        chain._items = items
        chain._n = n + 1
        return chain

    def list_to_extend(self) -> list[T]:
        """The list to append this chain's successors to: the shared list itself when this
        is its newest view (appending then leaves every existing view as it was), else a
        new copy of this chain's items. ``Chain(list)`` then views the result whole."""
        items = self._items
        return items if len(items) == self._n else items[: self._n]

    def views_whole(self, items: list[T]) -> bool:
        """Whether this chain is the view of all of ``items`` (that very list), as
        ``Chain(items)`` would be: a fold that extended nothing can keep this chain."""
        return self._items is items and self._n == len(items)

    def __len__(self) -> int:
        return self._n

    @overload
    def __getitem__(self, index: int) -> T: ...

    @overload
    def __getitem__(self, index: slice) -> list[T]: ...

    def __getitem__(self, index: int | slice) -> T | list[T]:
        if isinstance(index, slice):
            start, stop, step = index.indices(self._n)
            if step == 1:
                return self._items[start:stop]
            items = self._items
            return [items[i] for i in range(start, stop, step)]
        if index < 0:
            index += self._n
        if not 0 <= index < self._n:
            raise IndexError("Chain index out of range")
        return self._items[index]

    def __iter__(self) -> Iterator[T]:
        # In C, and stopping at this view's end even if the shared list grows meanwhile.
        return itertools.islice(self._items, self._n)

    def extends(self, other: Chain[T]) -> bool:
        """Whether ``other`` is a prefix of this chain (one shared list, no longer than
        this view): then ``self[len(other):]`` is exactly what was appended since."""
        return self._items is other._items and other._n <= self._n

    def to_list(self) -> list[T]:
        """A new list of the items."""
        return self._items[: self._n]

    def __eq__(self, other: object) -> bool:
        if isinstance(other, Chain):
            return self._n == other._n and (
                (self._items is other._items) or self.to_list() == other.to_list()
            )
        # A view's sequences (its queue, history, turns) were tuples: one still compares
        # equal to a tuple or list of the same items (``view.queue.queued == ()``).
        if isinstance(other, tuple | list):
            return self._n == len(other) and self.to_list() == list(other)
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self))  # as the tuple it equals

    def __repr__(self) -> str:
        return f"Chain({self.to_list()!r})"
