"""``aalis-agent reshard DIR --shards N``: a ProcessShards directory's sessions moved to
another shard count (:mod:`aalis_agent.scale.reshard`), with progress on stderr: one line
redrawn on a terminal, otherwise (a log file, a pipe) a line every few seconds."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from aalis_agent.scale.reshard import JOURNAL, Progress, reshard

__all__ = ["run_reshard"]

_REDRAW_S = 0.5  # on a terminal
_LINE_S = 5.0  # otherwise


def run_reshard(directory: str, shards: int) -> int:
    folder = Path(directory)
    try:
        terminal = sys.stderr.isatty()
    except (AttributeError, ValueError):
        terminal = False
    every = _REDRAW_S if terminal else _LINE_S
    shown = [0.0]
    pending = [False]  # a redrawn line not yet ended

    def progress(p: Progress) -> None:
        now = time.monotonic()
        last = p.sessions == p.sessions_total
        if now - shown[0] >= every or last:
            shown[0] = now
            line = (
                f"copied {p.sessions:,}/{p.sessions_total:,} sessions, "
                f"{p.events:,}/{p.events_total:,} events"
            )
            if terminal:
                sys.stderr.write(f"\r{line}" + ("\n" if last else ""))
                pending[0] = not last
            else:
                sys.stderr.write(f"{line}\n")
            sys.stderr.flush()

    try:
        done = reshard(folder, shards, progress=progress)
    except BaseException as exc:
        if pending[0]:  # what is said next starts a line of its own
            sys.stderr.write("\n")
        if isinstance(exc, KeyboardInterrupt) and (folder / JOURNAL).exists():
            sys.stderr.write(
                f"the reshard is not finished; run `aalis-agent reshard {directory} "
                f"--shards {shards}` again to finish it (the directory is refused until then)\n"
            )
        raise
    if done.kept is None:
        sys.stdout.write(f"{directory}: already {shards} shards; nothing to do\n")
        return 0
    sys.stdout.write(
        f"{directory}: {done.old_shards} -> {done.shards} shards; {done.sessions:,} sessions "
        f"({done.events:,} events) copied and checked. The old shard files are kept in "
        f"{done.kept}: remove it once you no longer need them\n"
    )
    return 0
