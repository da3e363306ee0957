"""Commands and settings from careless callers and racing users: who stopped, odd ids,
the locale of the room, a setting changed while its session is being deleted."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pykka
import pytest
from aalis_agent.actors.commands import handle_command
from aalis_agent.actors.messages import SetSetting, Submit
from aalis_agent.actors.runtime import Runtime
from aalis_agent.actors.session import SessionActor
from aalis_agent.events import (
    InMemoryEventStore,
    Input,
    InvalidInput,
    Sender,
    SettingsChanged,
    StopMarkerSaved,
    StopRequested,
    ToolCall,
    TurnRecorded,
)
from aalis_agent.projections import project
from aalis_agent.request.texts import texts_for
from aalis_agent.services import (
    ScriptedModel,
    ScriptedReply,
    Services,
    SessionInfo,
    SettingsLayers,
    StaticAuthority,
    StaticSessions,
    Tool,
    ToolRegistry,
)

SID = "qq:group:7"


class Rig:
    """A runtime whose first turn waits in its tool until released."""

    def __init__(self, services: dict[str, Any] | None = None) -> None:
        self.entered = threading.Event()
        self.gate = threading.Event()

        def slow(args: Any, ctx: Any) -> str:
            self.entered.set()
            self.gate.wait(30)
            return "ok"

        model = ScriptedModel(
            [
                ScriptedReply(tool_calls=(ToolCall(id="c1", name="slow", arguments="{}"),)),
                ScriptedReply(text="done"),
            ]
        )
        self.store = InMemoryEventStore()
        self.runtime = Runtime(
            self.store,
            Services(
                llm=model,
                tools=ToolRegistry([Tool("slow", slow)]),
                authority=StaticAuthority([("qq", "boss")]),
                **(services or {}),
            ),
            janitor=False,
        )

    def start_turn(self, user: str = "u1", **kw: Any) -> Any:
        handle = self.runtime.submit(
            SID, Input(id="", content="hi", platform="qq", sender=Sender(user_id=user), **kw)
        )
        assert self.entered.wait(10)
        return handle


@pytest.fixture
def rig() -> Iterator[Rig]:
    r = Rig()
    yield r
    r.gate.set()
    r.runtime.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()


@pytest.mark.parametrize("how", ["stop", "stop_all", "stop_command"])
def test_a_stop_by_an_id_with_a_lone_surrogate_is_recorded_cleaned(rig: Rig, how: str) -> None:
    # The account of a client that sent half an emoji: the input's sender is cleaned as
    # it enters, and so is the same account stopping the turn (it used to fail the write
    # of the stop and stop the session, its turn's handle raising SessionFailed).
    handle = rig.start_turn(user="a\ud83d")
    if how == "stop_command":
        assert rig.runtime.stop_command(SID, "qq", "a\ud83d") is None  # a participant
    else:
        getattr(rig.runtime, how)(SID, platform="qq", user_id="a\ud83d")
    rig.gate.set()
    outcome = handle.result(10)
    assert (outcome.outcome, outcome.reason) == (
        "aborted",
        "stop" if how != "stop_all" else "stop-all",
    )
    events = rig.store.read(SID)
    assert [e.by for e in events if isinstance(e, StopRequested)] == ["a\ufffd"]
    marker = next(e for e in events if isinstance(e, StopMarkerSaved))
    assert "a\ufffd" in marker.message.content
    assert rig.runtime.submit(SID, Input(id="", content="again")).result(10).outcome == "replied"


@pytest.mark.parametrize("field", ["platform", "user_id"])
def test_a_stop_naming_who_with_a_wrong_type_is_refused_and_the_turn_runs_on(
    rig: Rig, field: str
) -> None:
    handle = rig.start_turn()
    who: dict[str, Any] = {"platform": "qq", "user_id": "boss", field: 123}
    with pytest.raises(InvalidInput, match=field):
        rig.runtime.stop(SID, **who)
    rig.gate.set()
    assert handle.result(10).outcome == "replied"
    assert not [e for e in rig.store.read(SID) if isinstance(e, StopRequested)]


def test_a_stop_or_setting_naming_a_huge_id_is_refused_and_nothing_written(rig: Rig) -> None:
    """Who stops or sets is recorded with the stop or the setting: an id of 100,000
    characters (an input's ids may take 64 KiB) is refused naming its length, the turn
    runs on, nothing is written."""
    huge = "u" * 100_000
    handle = rig.start_turn()
    for ask in (
        lambda: rig.runtime.stop(SID, platform="qq", user_id=huge),
        lambda: rig.runtime.stop_all(SID, platform=huge, user_id="boss"),
        lambda: rig.runtime.stop_command(SID, "qq", huge),
        lambda: rig.runtime.set_setting(SID, "think", "low", by=huge),
    ):
        with pytest.raises(InvalidInput, match="100,000 characters long, over 16,384"):
            ask()
    rig.gate.set()
    assert handle.result(10).outcome == "replied"
    kinds = {type(e) for e in rig.store.read(SID)}
    assert StopRequested not in kinds and SettingsChanged not in kinds


def test_a_setting_by_an_id_with_a_lone_surrogate_is_recorded_cleaned(rig: Rig) -> None:
    reply = handle_command(
        rig.runtime, SID, "/session.set think high", platform="qq", user_id="x\udc00"
    )
    assert reply is not None and reply.startswith("已设置深度思考（think）= high")
    changed = [e for e in rig.store.read(SID) if isinstance(e, SettingsChanged)]
    assert [(e.key, e.value, e.by) for e in changed] == [("think", "high", "x\ufffd")]
    with pytest.raises(InvalidInput, match="by"):
        rig.runtime.set_setting(SID, "think", "low", by=5)  # type: ignore[arg-type]
    assert len([e for e in rig.store.read(SID) if isinstance(e, SettingsChanged)]) == 1
    assert [e.outcome for e in rig.store.read(SID) if isinstance(e, TurnRecorded)] == []
    assert project(rig.store.read(SID)).settings == {"think": "high"}


def test_a_setting_changed_while_its_session_is_deleted_outlives_the_deletion(
    rig: Rig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # DEL1-DEL2: an input that arrives while a deletion winds down is handed on after it,
    # into the new generation. A setting changed in that window was acknowledged, then
    # written before the deletion and wiped by it: the user was told "set", and it was not.
    handled = threading.Event()
    handler = SessionActor._HANDLERS[SetSetting]

    def noted(actor: SessionActor, msg: SetSetting) -> Any:
        try:
            return handler(actor, msg)
        finally:
            handled.set()

    monkeypatch.setitem(SessionActor._HANDLERS, SetSetting, noted)
    handle = rig.start_turn()
    deleted = rig.runtime._begin_delete(SID)
    answers: list[str | None] = []
    setter = threading.Thread(
        target=lambda: answers.append(
            handle_command(
                rig.runtime, SID, "/session.set historyLimit 7", platform="qq", user_id="boss"
            )
        )
    )
    setter.start()
    assert handled.wait(10)  # the session has the change, its deletion still winding down
    assert not deleted.done()
    rig.gate.set()  # the tool returns, the turn winds down, the deletion is written
    assert deleted.result(10) == 1
    setter.join(10)
    assert answers == ["已设置历史条数上限（historyLimit）= 7"]
    assert handle.result(10).outcome == "aborted"
    assert rig.runtime.view(SID).settings == {"historyLimit": 7}
    assert project(rig.store.read(SID)).settings == {"historyLimit": 7}


def test_commands_answer_in_the_locale_of_the_sessions_room() -> None:
    # A venue layer picks en for its room. /stop answered in zh there, with or without the
    # venue given; other commands given no venue mixed zh labels with en values.
    room = "qq:g1"
    r = Rig(
        {
            "settings": SettingsLayers(venues={room: {"locale": "en"}}),
            "sessions": StaticSessions({SID: SessionInfo(SID, origin_platform="qq", venue=room)}),
        }
    )
    en = texts_for("en")
    rt = r.runtime
    try:
        for venue in (None, room):

            def cmd(text: str, venue: str | None = venue) -> str | None:
                return handle_command(rt, SID, text, platform="qq", user_id="u2", venue=venue)

            assert cmd("/stop") == en("stop.no_running_turn")
            assert cmd("/help") == en("command.help")
            shown = cmd("/session")
            assert shown is not None and shown.startswith("Model (llm): follows")
            assert cmd("/session.set historyLimit 3") == en(
                "command.owner_only", label=en("setting.historyLimit"), key="historyLimit"
            )
            assert cmd("/model -p x") == "/model: the page must be a positive integer, not 'x'"
        handle = r.start_turn(user="u1", group_id="g1")
        assert rt.stop_command(SID, "qq", "u2") == en("stop.denied")
        assert handle_command(rt, SID, "/stop", platform="qq", user_id="u2") == en("stop.denied")
        assert handle_command(rt, SID, "/stop", platform="qq", user_id="u1") is None
        r.gate.set()
        assert handle.result(10).outcome == "aborted"
    finally:
        r.gate.set()
        rt.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()


def test_an_input_sent_after_a_deletion_was_asked_is_not_dropped_as_stale(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # DEL2 drops inputs of a generation before the deletion. delete() raises the
    # generation at once and tells the session; an input submitted right after, handled
    # before the session took the deletion from its mailbox, carries the new generation
    # and was dropped as stale (released, never run).
    mailbox = threading.Event()
    start = SessionActor._start_mailbox

    def held_mailbox(actor: SessionActor) -> None:  # the deletion waits in the mailbox
        threading.Thread(target=lambda: (mailbox.wait(30), start(actor))).start()

    handled = threading.Event()
    submit = SessionActor._HANDLERS[Submit]

    def noted(actor: SessionActor, msg: Submit) -> Any:
        try:
            return submit(actor, msg)
        finally:
            handled.set()

    monkeypatch.setattr(SessionActor, "_start_mailbox", held_mailbox)
    rt = Runtime(InMemoryEventStore(), Services(llm=ScriptedModel()), janitor=False)
    try:
        rt.submit(SID, Input(id="", content="before")).result(10)
        monkeypatch.setitem(SessionActor._HANDLERS, Submit, noted)
        deleted = rt._begin_delete(SID)
        handles: list[Any] = []
        sender = threading.Thread(
            target=lambda: handles.append(rt.submit(SID, Input(id="", content="after")))
        )
        sender.start()
        assert handled.wait(10)  # the session has the input, not yet the deletion
        mailbox.set()
        assert deleted.result(10) == 1
        sender.join(10)
        outcome = handles[0].result(10)
        assert (handles[0].where, outcome.outcome) == ("opened", "replied")
        assert [m.content for m in rt.view(SID).history.messages if m.role == "user"] == ["after"]
    finally:
        mailbox.set()
        rt.shutdown(timeout=10)
        pykka.ActorRegistry.stop_all()
