"""The ``aalis-agent`` command: ``demo``, ``chat``, ``config``, ``replay``, ``scenario``,
``inspect`` and ``reshard``.

structlog and output are configured here, never on import. Registered secrets (API keys,
see :mod:`services.secrets`) are masked in the log, in error lines and in ``config``'s
output.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

import structlog
from aalis_agent.events import AgentError, ConfigError, ReplayError, StoreError
from aalis_agent.events.open import missing_database, open_store
from aalis_agent.events.sqlite import SqliteEventStore

if TYPE_CHECKING:
    from aalis_agent.events.postgres import PostgresEventStore
from aalis_agent.services.logging_setup import LOGGER_NAME, BoundLogger, stdlib_processors
from aalis_agent.services.secrets import redact

__all__ = ["Terminated", "build_parser", "main"]


class Terminated(KeyboardInterrupt):
    """SIGTERM (a service manager stopping the command): it leaves as at a Ctrl-C that
    leaves (a running turn stopped, the runtime shut down, every write whole), with
    status 143."""


def _on_sigterm(signum: int, frame: Any) -> None:
    raise Terminated


DEFAULT_DEMO_DB = "aalis-demo.db"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="aalis-agent",
        description="An embedded, event-sourced actor runtime for LLM chat sessions.",
    )
    parser.add_argument(
        "--version", action="version", version=f"aalis-agent {_installed_version()}"
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    demo = sub.add_parser(
        "demo",
        help="run live turns on a scripted model, then replay what they wrote",
        description=(
            "Run a conversation through the real runtime on the embedded defaults, with a "
            "scripted model in place of a real one: a human-opened turn with a tool call, a "
            "message inserted mid-turn, a queued injection run as its own turn, a malformed "
            "tool call answered with its error, and a stop whose marker the next turn reads. "
            "Then print the timeline and the state a replay rebuilds from the event log."
        ),
    )
    demo.add_argument(
        "--db",
        default=DEFAULT_DEMO_DB,
        help=f"SQLite event database or postgresql:// URL (default: {DEFAULT_DEMO_DB})",
    )
    demo.add_argument(
        "-v", "--verbose", action="store_true", help="show the scheduler's debug log lines"
    )

    chat = sub.add_parser(
        "chat",
        help="talk to a session from the terminal (or pipe lines in)",
        description=(
            "Chat with a session: each line is a message; lines typed while a turn runs "
            "join it or queue as the scheduler decides; /stop (or Ctrl-C) stops the running "
            "turn, and Ctrl-C with none running leaves; "
            "/session, /session.set KEY VALUE and /session.reset KEY show and change the "
            "session's settings; /model and /persona list what there is (keyword, -p N); "
            "/quit leaves. Reads piped input too (one message a line, UTF-8: a line that is "
            "not valid UTF-8 is reported on stderr and skipped, and the status is then 1), "
            "waits for the last "
            "turn, then exits. Models: --config FILE (providers, preferences, settings "
            "layers, personas; see docs/configuration.md), or --base-url and --model for one "
            "OpenAI-compatible server (key from --api-key-env NAME; for an https server "
            "OPENAI_API_KEY by default), or --script, else a "
            "scripted model that echoes; with --config, --base-url or --script gives the "
            "model in place of the file's. The model may call the built-in tools "
            "current_time and calculate (--no-tools: none). Started where an earlier chat "
            "of the session was killed mid-turn, it first records the cut turn (aborted, "
            "crash) and answers the lines that run took and left unanswered (this "
            "session's only), while reading new lines."
        ),
    )
    chat.add_argument("--config", metavar="FILE", help="configuration file (TOML)")
    chat.add_argument(
        "--no-tools",
        action="store_true",
        help="do not offer the built-in tools (current_time, calculate) to the model",
    )
    chat.add_argument(
        "--db",
        default="aalis-chat.db",
        help="SQLite event database or postgresql:// URL (default: aalis-chat.db)",
    )
    chat.add_argument(
        "--sync",
        choices=("normal", "full"),
        help="what a SQLite database's commits survive: normal (the default) a crash of "
        "this process; full also a crash of the machine or a power cut, at a flush to the "
        "disk per commit",
    )
    chat.add_argument("--session", default="cli:console", help="session id (default: cli:console)")
    chat.add_argument("--base-url", help="OpenAI-compatible server, e.g. http://127.0.0.1:11434/v1")
    chat.add_argument("--model", help="model id on that server")
    chat.add_argument(
        "--api-key-env",
        metavar="NAME",
        help="environment variable holding that server's API key (default for https "
        "servers: OPENAI_API_KEY or AALIS_API_KEY; http servers get none unless named)",
    )
    chat.add_argument(
        "--context-length",
        type=_limit,
        metavar="N|auto",
        help="the --base-url model's context window in tokens (default 128000); auto: as "
        "the server's model listing gives it, where it does",
    )
    chat.add_argument(
        "--max-tokens",
        type=_limit,
        metavar="N|auto",
        help="the most tokens the --base-url model may answer with (default 4096); auto: "
        "as the server's model listing gives it, where it does",
    )
    chat.add_argument("--script", help="a scripted model's replies (TOML or JSON), instead")
    chat.add_argument(
        "-v", "--verbose", action="store_true", help="show the runtime's log lines on stderr"
    )

    config = sub.add_parser(
        "config",
        help="check a configuration file and show what it gives",
        description=(
            "Load a configuration file (TOML; see docs/configuration.md) as chat --config "
            "would, and show the plugin config, the models in priority order with their "
            "thinking levels, the preferences and the model a session would use now, the "
            "settings layers and the personas. A problem stops it with a line naming the "
            "file, the key and what is wrong (exit status 2). An API-key variable that is not "
            "set here is listed, and the status is 1 (chat would refuse the file). Keys are "
            "never shown, not even in a server's error."
        ),
    )
    config.add_argument("file", metavar="FILE", help="configuration file (TOML)")

    replay = sub.add_parser(
        "replay",
        help="print a session's timeline or its state at an event, or fork a turn (--fork)",
        description=(
            "Replay session logs from an event database: the timeline of each session "
            "(turns, inputs and entry modes, model calls, tool calls with callIds, outcomes "
            "and durations, stop markers, releases), or with --at the projected state "
            "(history window, queue, pending inserts) as of that event. Rows that do not "
            "decode are reported with session and seq and skipped (and the rows after one in "
            "its group of up to 32, compressed against it); the exit status is 1 then."
        ),
    )
    replay.add_argument("db", metavar="DB", help="SQLite event database or postgresql:// URL")
    replay.add_argument("--session", metavar="ID", help="only this session (default: all)")
    replay.add_argument(
        "--at", metavar="SEQ", type=int, help="show the projected state as of this seq"
    )
    replay.add_argument("--json", action="store_true", help="print one JSON object per line")
    replay.add_argument(
        "-v",
        "--verbose",
        action="store_true",
        help="show the runtime's log lines on stderr (a --fork re-run's)",
    )
    from aalis_agent.cli.fork import add_fork_arguments

    add_fork_arguments(replay)

    scenario = sub.add_parser(
        "scenario",
        help="run a scenario file (TOML) through the real runtime, deterministically",
        description=(
            "Run a scenario file (see docs/scenarios.md): sessions, tools, scripted model "
            "replies and a timeline of inputs and stops. Prints a transcript, or with --json "
            "one JSON document: per session, every model call's messages and tools, the "
            "inputs' outcomes and the event log. The same file gives the same output."
        ),
    )
    scenario.add_argument("file", metavar="FILE", help="scenario file (TOML)")
    scenario.add_argument(
        "--db",
        metavar="PATH",
        help="write the log to this SQLite file or postgresql:// URL (default: in memory)",
    )
    scenario.add_argument("--json", action="store_true", help="print one JSON document")
    scenario.add_argument(
        "-v", "--verbose", action="store_true", help="show the runtime's log lines"
    )
    resharded = sub.add_parser(
        "reshard",
        help="move a ProcessShards directory's sessions to another shard count",
        description=(
            "Copy every session of a ProcessShards directory into new shard files for "
            "another count, check each copy against its original, then put the new files "
            "in place and record the count. The old files are kept whole in a "
            "before-reshard-* folder beside them. The directory must not be in use (its "
            "ProcessShards stopped). Cut at any point, run the same command again: it "
            "finishes (the directory is refused until then). Errors name what is wrong "
            "(exit status 2)."
        ),
    )
    resharded.add_argument("directory", metavar="DIR", help="the ProcessShards directory")
    resharded.add_argument(
        "--shards", metavar="N", type=_shard_count, required=True, help="the new shard count"
    )
    inspect = sub.add_parser(
        "inspect",
        help="serve a local read-only web page over an event database",
        description=(
            "Serve the sessions, a timeline of turns, model-call requests, the token budget "
            "over calls and the state at any event, on 127.0.0.1 (a free port unless --port)."
        ),
    )
    from aalis_agent.inspector.cli import add_arguments as add_inspect_arguments

    add_inspect_arguments(inspect)
    return parser


def _installed_version() -> str:
    """The installed distribution's version (its metadata)."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("aalis-agent")
    except PackageNotFoundError:  # pragma: no cover - a tree that is not installed
        return "0+unknown"


def _shard_count(text: str) -> int:
    """A shard count: an integer from 1 to ``MAX_SHARDS``."""
    from aalis_agent.scale.reshard import MAX_SHARDS

    if not (text.isascii() and text.isdigit()) or len(text) > 6 or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    if int(text) > MAX_SHARDS:
        raise argparse.ArgumentTypeError(f"at most {MAX_SHARDS:,} shards, got {text}")
    return int(text)


def _limit(text: str) -> int | str:
    """A token count (a positive integer) or ``auto``."""
    if text == "auto":
        return text
    if not (text.isascii() and text.isdigit()) or len(text) > 12 or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer or auto, got {text!r}")
    return int(text)


def _open_existing(path: str) -> SqliteEventStore | PostgresEventStore:
    """The event database to read (replay only reads): a SQLite file that must exist, or
    a ``postgresql://`` URL."""
    missing = missing_database(path)
    if missing is not None:
        raise ReplayError(missing)
    return open_store(path, read_only=True)


def _cmd_replay(args: argparse.Namespace) -> int:
    from aalis_agent.cli.fork import fork_flags_given, run_fork

    if args.fork is not None:
        return run_fork(args)
    stray = fork_flags_given(args)
    if stray:
        raise ReplayError(f"{', '.join(stray)}: only with --fork SEQ")
    from aalis_agent.cli.replay import run_replay

    if args.at is not None and args.at < 1:
        raise ReplayError(f"--at must be a seq of 1 or more, got {args.at}")
    store = _open_existing(args.db)
    try:
        sessions = store.sessions()
        if args.session is not None:
            if args.session not in sessions:
                from aalis_agent.timeline import shown_name

                known = ", ".join(map(shown_name, sessions[:10])) or "none"
                raise ReplayError(f"no session {args.session!r} in {args.db!r} (sessions: {known})")
            sessions = [args.session]
        total = store.count(args.session)
        report = run_replay(store, sessions, at=args.at, as_json=args.json, total=total)
    finally:
        store.close()
    if report.corrupt:
        sys.stderr.write(
            f"{len(report.corrupt)} row(s) could not be decoded; the rest was replayed\n"
        )
        return 1
    return 0


def _cmd_chat(args: argparse.Namespace) -> int:
    from aalis_agent.cli.chat import run_chat
    from aalis_agent.services import ChatModel, ScriptedModel

    services = None
    mcp_servers: tuple[Any, ...] = ()
    if args.config:
        from aalis_agent.services.config_file import load_config

        config = load_config(args.config)
        services = config.services()
        mcp_servers = config.mcp
    model: ChatModel | None = None
    if args.base_url or args.model:
        if not (args.base_url and args.model):
            raise ConfigError("--base-url and --model go together")
        if args.script:
            raise ConfigError(
                "--script and --base-url do not go together: the chat's model is the "
                "script's or the server's"
            )
        from aalis_agent.services.openai_compat import OpenAICompatibleModel

        api_key = None
        if args.api_key_env:
            api_key = os.environ.get(args.api_key_env)
            if not api_key:
                name = args.api_key_env
                raise ConfigError(f"--api-key-env: the environment variable {name} is not set")
        model = OpenAICompatibleModel(
            base_url=args.base_url,
            model=args.model,
            api_key=api_key,
            env_key=not args.api_key_env,
            **_server_limits(args, api_key),
        )
    elif args.api_key_env:
        raise ConfigError("--api-key-env goes with --base-url and --model")
    elif args.context_length is not None or args.max_tokens is not None:
        raise ConfigError("--context-length and --max-tokens go with --base-url and --model")
    elif args.script:
        model = ScriptedModel.from_file(args.script)

    def chat() -> int:
        return run_chat(
            args.db,
            args.session,
            model,
            services=services,
            tools=not args.no_tools,
            sync=args.sync,
        )

    if not mcp_servers:
        return chat()
    # The configuration's MCP servers ([mcp.<name>]) join the tools, beside the built-in
    # ones (unless --no-tools); one that does not start, or offers a tool name taken
    # already, is an McpError naming it (one line, exit 2).
    from aalis_agent.services.builtin_tools import builtin_tools
    from aalis_agent.services.mcp import McpClient

    assert services is not None
    client = McpClient(mcp_servers)
    try:
        client.start()
        if not args.no_tools:
            for tool in builtin_tools(tz=services.tz, texts=services.texts_for("cli")):
                services.tools.register(tool)
        client.register(services.tools)
        return chat()
    finally:
        client.close()


def _server_limits(args: argparse.Namespace, api_key: str | None) -> dict[str, Any]:
    """``context_length`` and ``max_output_tokens`` for the --base-url model: as given,
    or for ``auto`` as the server's model listing says (else the model's defaults)."""
    limits: dict[str, Any] = {}
    wanted = {"context_length": args.context_length, "max_output_tokens": args.max_tokens}
    if "auto" in wanted.values():
        from aalis_agent.cli.chat import listed_limits

        if api_key is None and not args.api_key_env and args.base_url.startswith("https://"):
            api_key = os.environ.get("OPENAI_API_KEY") or os.environ.get("AALIS_API_KEY")
        listed = dict(zip(wanted, listed_limits(args.base_url, api_key, args.model), strict=True))
        for key, value in wanted.items():
            if value == "auto":
                if listed[key] is None:
                    option = "--context-length" if key == "context_length" else "--max-tokens"
                    sys.stderr.write(
                        f"aalis-agent chat: {option} auto: the server's model listing gives "
                        "none; using the default\n"
                    )
                else:
                    wanted[key] = listed[key]
    for key, value in wanted.items():
        if isinstance(value, int):
            limits[key] = value
    return limits


def _cmd_config(args: argparse.Namespace) -> int:
    from aalis_agent.services.config_file import describe, load_config

    fc = load_config(args.file, require_keys=False)
    sys.stdout.write(redact(describe(fc)))  # a listed model id could echo the key
    return 1 if fc.missing else 0


def _cmd_demo(args: argparse.Namespace) -> int:
    from aalis_agent.cli.demo import run_demo

    return run_demo(args.db)


class _Stderr(logging.StreamHandler):  # type: ignore[type-arg]
    """A handler writing to the ``sys.stderr`` of the moment, so that a replaced one
    (tests, pipes) is honoured."""

    @property
    def stream(self) -> TextIO:
        return sys.stderr

    @stream.setter
    def stream(self, value: object) -> None:
        pass


def configure_logging(
    verbose: bool = False, quiet: bool = False, *, level: int | None = None
) -> None:
    """Route the log to stderr: the library's (structlog through :mod:`logging`, loggers
    ``aalis.*``) at INFO, DEBUG with ``verbose``, WARNING with ``quiet``, or ``level``;
    other loggers at WARNING. Registered secrets are masked in every value, tracebacks
    included. Calling it again replaces the handler it installed."""
    if level is None:
        level = logging.DEBUG if verbose else logging.WARNING if quiet else logging.INFO
    structlog.configure(
        processors=stdlib_processors(console=True),
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=BoundLogger,
        cache_logger_on_first_use=False,
    )
    root = logging.getLogger()
    for old in [h for h in root.handlers if isinstance(h, _Stderr)]:
        root.removeHandler(old)
    handler = _Stderr()
    handler.setFormatter(logging.Formatter("%(message)s"))
    root.addHandler(handler)
    logging.getLogger(LOGGER_NAME).setLevel(level)


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``aalis-agent`` console script."""
    parser = build_parser()
    args = parser.parse_args(argv)
    verbose = getattr(args, "verbose", False)
    # The demo prints its own transcript, the chat its own one-line errors, replay its
    # report (a fork's turn that failed says how): the log joins them only when asked (-v).
    silent = args.command in ("chat", "replay") and not verbose
    configure_logging(
        verbose, quiet=args.command == "demo", level=logging.CRITICAL if silent else None
    )
    previous = None
    if threading.current_thread() is threading.main_thread():
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    try:
        return _run(parser, args)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _run(parser: argparse.ArgumentParser, args: argparse.Namespace) -> int:
    try:
        if args.command == "replay":
            return _cmd_replay(args)
        if args.command == "demo":
            return _cmd_demo(args)
        if args.command == "chat":
            return _cmd_chat(args)
        if args.command == "config":
            return _cmd_config(args)
        if args.command == "reshard":
            from aalis_agent.cli.reshard import run_reshard

            return run_reshard(args.directory, args.shards)
        if args.command == "inspect":
            from aalis_agent.inspector.cli import run as run_inspect

            return run_inspect(args)
        if args.command == "scenario":
            from aalis_agent.scenarios import run_cli

            configure_logging(args.verbose, quiet=not args.verbose)
            return run_cli(args.file, db=args.db, as_json=args.json)
    except (AgentError, StoreError) as exc:
        sys.stderr.write(f"aalis-agent {args.command}: error: {redact(str(exc))}\n")
        return 2
    except KeyboardInterrupt as exc:  # Ctrl-C or SIGTERM: every write the log took is whole
        how = "terminated" if isinstance(exc, Terminated) else "interrupted"
        with contextlib.suppress(OSError):
            sys.stderr.write(f"\naalis-agent {args.command}: {how}\n")
        return 143 if isinstance(exc, Terminated) else 130
    except BrokenPipeError:  # e.g. `aalis-agent replay db | head`
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as exc:  # output that cannot be written (a full disk), a file gone
        with contextlib.suppress(OSError):
            sys.stderr.write(f"aalis-agent {args.command}: error: {exc}\n")
        with contextlib.suppress(OSError):  # nothing more to flush at exit
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 1
    parser.error(f"unknown command {args.command!r}")
    return 2


if __name__ == "__main__":
    raise SystemExit(main())
