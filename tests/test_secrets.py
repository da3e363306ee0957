"""Secrets are never stored or logged: a provider that echoes the API key in its errors
(a real loopback server) leaves no trace of it in the event database, in ``replay
--json``, in chat's output and log, or in ``aalis-agent config``'s output."""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler
from pathlib import Path
from typing import Any

import pykka
import pytest
import structlog
from aalis_agent.actors.runtime import Runtime
from aalis_agent.cli.main import configure_logging
from aalis_agent.events import Input, ModelCallEnded, SqliteEventStore
from aalis_agent.services import AbortSignal, ChatRequest, Services
from aalis_agent.services.openai_compat import (
    OpenAICompatibleModel,
    ProviderError,
    list_server_models,
)
from aalis_agent.services.secrets import MASK, redact, redact_processor, register_secret

from tests.harness import LoopbackServer, run_cli

KEY = "sk-test-SECRET-123456"
ENV = {"PATH": "/usr/bin:/bin", "ECHO_TEST_KEY": KEY}


class EchoServer(LoopbackServer):
    """A loopback OpenAI-compatible server whose errors echo the key it was sent, as some
    providers' "Incorrect API key provided: ..." errors do.

    Each POST takes the next of ``posts``: ``"401"`` (the default), ``"400"`` (a refusal
    of ``stream_options`` that names the key: the model retries without them) or
    ``"sse"`` (a reply that starts, then an error event in the stream). ``GET /models``
    answers 401 unless ``listing`` is set (ids; ``{key}`` becomes the key received)."""

    def __init__(self) -> None:
        self.posts: list[str] = []
        self.listing: list[str] | None = None
        self.keys: list[str] = []  # the keys received, in order
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args: Any) -> None:
                pass

            def _key(self) -> str:
                key = (self.headers["Authorization"] or "").removeprefix("Bearer ")
                outer.keys.append(key)
                return key

            def _json(self, status: int, obj: Any) -> None:
                body = json.dumps(obj).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def _refuse(self, key: str, status: int = 401, what: str = "") -> None:
                message = f"{what}Incorrect API key provided: {key}. Auth: Bearer {key}"
                error = {"message": message, "type": "invalid_request_error", "key": key}
                self._json(status, {"error": error})

            def do_GET(self) -> None:
                key = self._key()
                if outer.listing is None:
                    self._refuse(key)
                    return
                ids = [m.replace("{key}", key) for m in outer.listing]
                self._json(200, {"object": "list", "data": [{"id": m} for m in ids]})

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                key = self._key()
                mode = outer.posts.pop(0) if outer.posts else "401"
                if mode == "400":
                    self._refuse(key, 400, "Unrecognized request argument: stream_options. ")
                    return
                if mode == "401":
                    self._refuse(key)
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/event-stream")
                self.end_headers()
                delta = {"choices": [{"index": 0, "delta": {"content": "好"}}]}
                chunk = {"id": "c", "object": "chat.completion.chunk", "created": 0, "model": "m"}
                self.wfile.write(f"data: {json.dumps({**chunk, **delta})}\n\n".encode())
                error = {"error": {"message": f"stream broke for key {key}", "key": key}}
                self.wfile.write(f"data: {json.dumps(error)}\n\n".encode())
                self.wfile.flush()

        self.serve(Handler)


@pytest.fixture
def echo() -> Iterator[EchoServer]:
    s = EchoServer()
    yield s
    s.close()


def _db_bytes(db: Path) -> bytes:
    """The database's files as they are on disk: the main file, its WAL and journal."""
    return b"".join(p.read_bytes() for p in sorted(db.parent.glob(db.name + "*")))


# --- the registry and the log processor ------------------------------------------------


def test_registered_secrets_are_masked_and_short_values_ignored() -> None:
    register_secret("sk-unit-AAAA-0001")
    register_secret("")
    register_secret(None)
    register_secret("abc")  # too short to be a key: masking it would garble ordinary text
    text = "key sk-unit-AAAA-0001, again sk-unit-AAAA-0001; abc stays"
    assert redact(text) == f"key {MASK}, again {MASK}; abc stays"
    plain = "nothing secret here"
    assert redact(plain) is plain  # no copy when there is nothing to mask


def test_overlapping_and_nested_secrets_leave_no_piece_behind() -> None:
    register_secret("sk-overlap-111122223333")
    register_secret("33334444-overlap-tail")  # starts inside the first
    register_secret("sk-overlap-1111")  # a prefix of the first
    text = "x sk-overlap-1111222233334444-overlap-tail y, z sk-overlap-1111 w"
    assert redact(text) == f"x {MASK} y, z {MASK} w"


def test_many_secrets_are_masked_quickly() -> None:
    keys = [f"sk-many-{i:05d}-{i * 7919 % 100_000:05d}" for i in range(3000)]
    for k in keys:
        register_secret(k)
    text = " | ".join(keys[::97]) + " plain text " * 2000
    t0 = time.perf_counter()
    masked = redact(text)
    assert time.perf_counter() - t0 < 2.0  # one pass over the text, not one per key
    assert not any(k in masked for k in keys)
    assert masked.count(MASK) == len(keys[::97])


def test_the_processor_masks_every_value_and_the_traceback() -> None:
    register_secret(KEY)
    try:
        raise RuntimeError(f"server said {KEY}")
    except RuntimeError:
        event = redact_processor(
            None,
            "error",
            {
                "event": f"failed with {KEY}",
                "detail": {"auth": f"Bearer {KEY}"},
                "exc_info": True,
                "n": 3,
            },
        )
    assert KEY not in repr(event)
    assert event["event"] == f"failed with {MASK}" and event["n"] == 3
    assert "RuntimeError: server said " + MASK in event["exception"]  # formatted, masked


def test_the_cli_log_masks_secrets_in_messages_and_tracebacks(
    capsys: pytest.CaptureFixture[str],
) -> None:
    register_secret(KEY)
    configure_logging()
    log = structlog.get_logger("test")
    try:
        raise RuntimeError(f"Incorrect API key provided: {KEY}")
    except RuntimeError:
        log.exception("call failed", auth=f"Bearer {KEY}", body={"key": KEY})
    log.warning(f"plain {KEY}")
    err = capsys.readouterr().err
    assert "call failed" in err and "RuntimeError: Incorrect API key provided: ***" in err
    assert KEY not in err


# --- the provider's errors -------------------------------------------------------------


def test_every_provider_error_is_masked_and_unchained(echo: EchoServer) -> None:
    model = OpenAICompatibleModel(base_url=echo.url, model="m", api_key=KEY)
    request = ChatRequest(messages=(), session_id="s")
    echo.posts += ["400", "401", "sse"]
    for expected in ("AuthenticationError", "APIError"):  # after a retry; in the stream
        with pytest.raises(ProviderError) as caught:
            list(model.chat_stream(request, AbortSignal()))
        err = caught.value
        assert str(err).startswith(expected + ": ") and MASK in str(err)
        assert err.__cause__ is None and err.__context__ is None and err.__suppress_context__
        assert KEY not in repr(vars(err)) + repr(err.args)
    with pytest.raises(ProviderError) as listing:
        list_server_models(echo.url, "sk-test-LISTING-654321")
    assert listing.value.status_code == 401 and listing.value.__context__ is None
    assert "sk-test-LISTING-654321" not in str(listing.value)
    assert echo.keys == [KEY, KEY, KEY, "sk-test-LISTING-654321"]  # each was sent, and echoed


# --- end to end ------------------------------------------------------------------------


def test_a_turn_stores_no_key_and_replay_shows_none(
    echo: EchoServer, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A real runtime turn on SQLite against the echoing server: a refused first request
    (retried), then a stream that breaks. The errors are recorded, masked; the database's
    bytes, ``replay --json`` and the log hold no key."""
    configure_logging()
    echo.posts += ["400", "401", "sse"]
    db = tmp_path / "secrets.db"
    store = SqliteEventStore(str(db))
    model = OpenAICompatibleModel(base_url=echo.url, model="m", api_key=KEY)
    runtime = Runtime(store, Services(llm=model), janitor=False)
    try:
        for text in ("你好", "再来"):
            outcome = runtime.submit("t:1", Input(id="", content=text)).result(timeout=30)
            assert outcome.outcome == "error"
        errors = [e.error or "" for e in store.read("t:1") if isinstance(e, ModelCallEnded)]
        assert len(errors) == 2 and all(MASK in e for e in errors), errors
        assert KEY.encode() not in _db_bytes(db)  # with its WAL, before closing
    finally:
        runtime.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()
        store.close()
    assert echo.keys == [KEY] * 3
    assert KEY.encode() not in _db_bytes(db)
    assert KEY not in capsys.readouterr().err
    replay = run_cli("replay", str(db), "--json", env=ENV)
    assert replay.returncode == 0, replay.stderr
    assert MASK in replay.stdout and "AuthenticationError" in replay.stdout
    assert KEY not in replay.stdout + replay.stderr


def test_chat_with_the_key_in_the_environment_shows_and_stores_none(
    echo: EchoServer, tmp_path: Path
) -> None:
    db = tmp_path / "chat.db"
    args = ("chat", "--db", str(db), "--base-url", echo.url, "--model", "m")
    result = run_cli(*args, "--api-key-env", "ECHO_TEST_KEY", stdin="你好\n", env=ENV)
    assert result.returncode == 1, result.stderr  # a turn the server failed: one line, exit 1
    assert echo.keys == [KEY]  # the server got it (and echoed it)
    assert "turn failed" in result.stderr and "AuthenticationError" in result.stderr
    assert KEY not in result.stdout + result.stderr
    assert KEY.encode() not in _db_bytes(db)


def test_config_listing_from_the_server_shows_no_key(echo: EchoServer, tmp_path: Path) -> None:
    path = tmp_path / "aalis.toml"
    path.write_text(
        f'[providers.echo]\nbaseUrl = "{echo.url}"\napiKeyEnv = "ECHO_TEST_KEY"\n'
        "listModels = true\n",
        encoding="utf-8",
    )
    refused = run_cli("config", str(path), env=ENV)  # the listing fails, echoing the key
    assert refused.returncode == 2
    assert "providers.echo.listModels: listing the server's models failed" in refused.stderr
    assert MASK in refused.stderr
    assert KEY not in refused.stdout + refused.stderr
    echo.listing = ["qwen", "leak-{key}"]  # a listing that names the key
    listed = run_cli("config", str(path), env=ENV)
    assert listed.returncode == 0, listed.stderr
    assert "echo/qwen" in listed.stdout and f"echo/leak-{MASK}" in listed.stdout
    assert KEY not in listed.stdout + listed.stderr
    assert echo.keys == [KEY, KEY]


def test_a_key_from_a_configuration_file_is_registered(tmp_path: Path) -> None:
    from aalis_agent.services.config_file import load_config

    path = tmp_path / "aalis.toml"
    path.write_text(
        '[providers.a]\nbaseUrl = "http://127.0.0.1:9/v1"\napiKey = "sk-file-REGISTERED-1"\n'
        '[[providers.a.models]]\nid = "m"\n'
        '[providers.b]\nbaseUrl = "http://127.0.0.1:9/v1"\napiKeyEnv = "B_KEY"\n'
        '[[providers.b.models]]\nid = "m"\n',
        encoding="utf-8",
    )
    load_config(path, env={"B_KEY": "sk-env-REGISTERED-2"})
    assert redact("sk-file-REGISTERED-1 sk-env-REGISTERED-2") == f"{MASK} {MASK}"
