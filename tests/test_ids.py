"""``UuidIds``: random ids, unique within a process and across a fork."""

from __future__ import annotations

import os
import re
import threading

import pytest
from aalis_agent.events.clock import UuidIds


def test_ids_have_the_prefix_and_16_hex_digits() -> None:
    ids = UuidIds()
    made = {ids.new("msg") for _ in range(50_000)}
    assert len(made) == 50_000
    assert all(re.fullmatch(r"msg-[0-9a-f]{16}", i) for i in made)


def test_ids_from_many_threads_do_not_repeat() -> None:
    ids = UuidIds()
    out: list[list[str]] = [[] for _ in range(4)]

    def make(k: int) -> None:
        out[k].extend(ids.new("turn") for _ in range(5_000))

    threads = [threading.Thread(target=make, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    every = [i for part in out for i in part]
    assert len(every) == len(set(every)) == 20_000


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs fork")
def test_a_forked_child_does_not_repeat_its_parents_ids() -> None:
    ids = UuidIds()
    ids.new("warm")
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, then out
        try:
            os.write(write, " ".join(ids.new("x") for _ in range(20)).encode())
        finally:
            os._exit(0)
    os.close(write)
    os.waitpid(pid, 0)
    with os.fdopen(read) as f:
        child = f.read().split()
    parent = [ids.new("x") for _ in range(20)]
    assert len(child) == 20
    assert not set(child) & set(parent)
