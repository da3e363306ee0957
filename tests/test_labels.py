"""Time and sender labels (the open formats of UPSTREAM-FACTS)."""

from __future__ import annotations

from datetime import UTC, timedelta, timezone

from aalis_agent.request.labels import sender_label, time_label

CST = timezone(timedelta(hours=8))
NOW = 1_767_225_600_000  # 2026-01-01 00:00 UTC = 08:00 in UTC+8


def test_time_label_in_the_current_year_has_no_year_and_pads_only_the_clock() -> None:
    assert time_label(NOW, NOW, CST) == "1/1 08:00"
    assert time_label(NOW + 9 * 3_600_000 + 5 * 60_000, NOW, CST) == "1/1 17:05"


def test_time_label_in_another_year_has_the_year() -> None:
    assert time_label(NOW - 86_400_000, NOW, UTC) == "2025/12/31 00:00"


def test_time_label_never_depends_on_how_long_ago() -> None:
    # The same message keeps the same label however late it is read (prefix caches).
    later = NOW + 30 * 86_400_000
    assert time_label(NOW, NOW, CST) == time_label(NOW, later, CST)


def test_sender_label_forms() -> None:
    assert sender_label("qq", "10001", "Alice") == "[Alice(10001)]: "
    assert sender_label("qq", "10001", None) == "[10001]: "
    assert sender_label("qq", None, "Alice") == "[Alice]: "
    assert sender_label("cli", "console", "me") == ""
    assert sender_label("webui", "console", None) == ""


def test_rendering_never_mixes_up_messages_that_share_an_id() -> None:
    # Ids can repeat across restarts of an id source; the render cache must not care.
    from aalis_agent.events import ChatMessage, MessageMeta, Sender
    from aalis_agent.request.prompt import render_history

    a = ChatMessage(
        id="msg-1",
        role="user",
        content="hi",
        meta=MessageMeta(input_id="in-a", sender=Sender(user_id="a"), platform="qq"),
    )
    b = ChatMessage(
        id="msg-1",
        role="user",
        content="hi",
        meta=MessageMeta(input_id="in-b", sender=Sender(user_id="b"), platform="qq"),
    )
    first = render_history([a], NOW, CST)[0]
    second = render_history([b], NOW, CST)[0]
    assert (first.meta.input_id, second.meta.input_id) == ("in-a", "in-b")
    assert first.content.endswith("[a]: hi") and second.content.endswith("[b]: hi")
