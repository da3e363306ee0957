"""``aalis-agent reshard DIR --shards N``: a ProcessShards directory's sessions moved to
another shard count (:mod:`aalis_agent.scale.reshard`), with progress on stderr."""

from __future__ import annotations

import sys
import time
from pathlib import Path

from aalis_agent.scale.reshard import JOURNAL, Progress, reshard

__all__ = ["run_reshard"]


def run_reshard(directory: str, shards: int) -> int:
    shown = [0.0]
    folder = Path(directory)

    def progress(p: Progress) -> None:
        now = time.monotonic()
        if now - shown[0] >= 0.5 or p.sessions == p.sessions_total:
            shown[0] = now
            sys.stderr.write(
                f"\rcopied {p.sessions:,}/{p.sessions_total:,} sessions, "
                f"{p.events:,}/{p.events_total:,} events"
            )
            if p.sessions == p.sessions_total:
                sys.stderr.write("\n")
            sys.stderr.flush()

    try:
        done = reshard(folder, shards, progress=progress)
    except KeyboardInterrupt:
        if (folder / JOURNAL).exists():
            sys.stderr.write(
                f"\nthe reshard is not finished; run `aalis-agent reshard {directory} "
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
