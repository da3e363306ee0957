"""A turn's reply (FLOW14-FLOW15, SAVE2, SAVE5, OUT1): ``agent:reply:before`` with
format retries, the reply saved with the turn's record and durable before it is sent
(a stop that came first refuses it), then ``agent:turn:after``."""

from __future__ import annotations

from typing import Any

import structlog
from aalis_agent.actors.hooks import (
    ReplyBefore,
    TurnAfter,
)
from aalis_agent.actors.messages import Settled
from aalis_agent.actors.turn_base import TurnBase, _Call, deliver
from aalis_agent.events import (
    ChatMessage,
    MessageMeta,
    TurnOutcome,
    TurnRecord,
)
from aalis_agent.events.codec import clean_text
from aalis_agent.request.prompt import (
    TurnPrompt,
)
from aalis_agent.request.textnorm import strip_leaked_special_tokens

__all__ = ["ReplyStep"]

log = structlog.get_logger("aalis.turn")


class ReplyStep(TurnBase):
    """The reply of a turn's runner (a part of :class:`TurnRunner`)."""

    def _model_call(
        self, prompt: TurnPrompt, tool_defs: list[dict[str, Any]], *, retry: bool = False
    ) -> _Call:
        raise NotImplementedError  # the runner's (actors/turn.py)

    def _reply(self, prompt: TurnPrompt, call: _Call) -> tuple[TurnOutcome, str | None]:
        """FLOW14 and saving: ``agent:reply:before`` (with format retries), then the reply
        saved with the turn record (SAVE2, SAVE5) and sent (OUT1); empty replies are not
        saved (SAVE4)."""
        content = strip_leaked_special_tokens(call.text)
        attempt = 0
        # With no middleware on the hook, its payload would leave the chain as built: the
        # reply is the call's text, archived as sent, with no retry (no payload built).
        hooked = self.hooks.has_middleware("agent:reply:before")
        archive: str | None = None
        while hooked:
            ctx = ReplyBefore(
                content=content,
                session_id=self.session_id,
                platform=self.opened.platform,
                user_id=self._user_id(),
                trigger_type=self._trigger(),
                attempt=attempt,
            )
            self.hooks.run("agent:reply:before", ctx, lambda c: c)
            if not ctx.retry_requested or attempt >= ctx.max_retries:
                content, archive = ctx.content, ctx.archive_content
                break
            attempt += 1
            # A format retry: feedback, then the model again without tools; no inserts.
            prompt.tail.append(
                ChatMessage(
                    id=self.ids.new("msg"),
                    role="assistant",
                    content=content,
                )
            )
            prompt.tail.append(
                ChatMessage(
                    id=self.ids.new("msg"),
                    role="system",
                    content=ctx.retry_feedback or self.texts("prompt.format_retry"),
                )
            )
            retry = self._model_call(prompt, [], retry=True)
            if retry.aborted:
                return "aborted", self.abort.reason
            content = strip_leaked_special_tokens(retry.text)
        final = _hook_text(content, "content")
        outcome: TurnOutcome = "replied" if final.strip() else "silent"
        if outcome == "replied":
            stored = final if archive is None else _hook_text(archive, "archive_content")
            self._archive(
                ChatMessage(
                    id=self.ids.new("msg"),
                    role="assistant",
                    content=stored,
                    reasoning=call.reasoning,
                    meta=MessageMeta(
                        turn_id=self.turn_id,
                        visible_content=final if stored != final else None,
                        turn_record=TurnRecord(
                            turn_id=self.turn_id, outcome="replied", source=self.opened.source
                        ),
                    ),
                )
            )
            if self.hooks.has_middleware("agent:turn:after"):
                self._flush(final=True)  # refused when a stop came first (NotRecorded)
                deliver(self.services, self._outbound(final))
            else:
                # Nothing runs after the reply: the turn ends in the commit that saves
                # it, and the actor sends it once durable (one commit fewer per turn).
                duration = max(self.clock.now_ms() - self._started_ms, 0)
                ended = Settled(self.turn_id, "replied", None, duration, (), self._outbound(final))
                self._flush(final=True, settle=ended)
        if not self.hooks.has_middleware("agent:turn:after"):
            return outcome, None  # nothing to run: no payload built
        after = TurnAfter(
            message=list(self.inputs),
            reply=final if outcome == "replied" else None,
            outcome=outcome,
            session_id=self.session_id,
        )
        if outcome != "replied":
            self.hooks.run("agent:turn:after", after, lambda c: c)
            return outcome, None
        try:
            self.hooks.run("agent:turn:after", after, lambda c: c)
        except Exception:
            # The reply is durable and sent, the turn's record saved with it: the turn
            # replied, and is not recorded again (as an error) after the fact.
            log.exception(
                "agent:turn:after failed after the reply was saved",
                session=self.session_id,
                turn=self.turn_id,
            )
        return outcome, None


def _hook_text(value: object, name: str) -> str:
    """A text an ``agent:reply:before`` middleware may have set, as the log stores it
    (a ``str`` subclass as plain text, lone surrogates replaced), or a clear error naming
    the field when it is not text at all (the turn then fails, saving nothing)."""
    if not isinstance(value, str):
        raise TypeError(f"agent:reply:before left {name} as {type(value).__name__}, not text")
    return clean_text(value)
