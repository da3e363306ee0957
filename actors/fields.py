"""``fields()``: a session's settings as the settings UI shows them (SET1-SET4).

Each field carries its effective value, the layer it comes from and the text the UI
writes. The model field reports the model actually in use; the thinking-level field
offers the levels of that model and says when the set level is not one of them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from aalis_agent.events.errors import ConfigError
from aalis_agent.events.schema import ModelRef
from aalis_agent.request.texts import ZH, Texts
from aalis_agent.services import Services
from aalis_agent.services.models import ModelChoice, model_name, think_default, think_levels
from aalis_agent.services.settings import SETTING_FIELDS, SettingsLayers

__all__ = ["LAYER_TEXT", "FieldView", "session_fields"]

LAYER_TEXT = {
    kind: ZH(f"setting.layer.{kind}")
    for kind in ("plugin config", "platform profile", "platform-type profile", "venue", "session")
}
"""How the UI names each settings layer (``zh``; a locale's: ``setting.layer.<kind>``)."""


@dataclass(frozen=True, slots=True)
class FieldView:
    """One setting as shown: ``value`` is what applies (for ``llm`` the entry id of the
    model in use), ``layer`` where it is set (None: unset), ``text`` what the UI writes,
    ``options`` the choices as ``(id, name)`` (the thinking levels of the model)."""

    key: str
    label: str
    owner_only: bool
    value: Any
    layer: str | None
    text: str
    options: tuple[tuple[str, str], ...] = ()

    def line(self, texts: Texts = ZH) -> str:
        """The field as ``/session`` shows it, in ``texts``' language."""
        where = ""
        if self.layer is not None and self.layer not in ("session", "plugin config"):
            kind = self.layer.split(" '", 1)[0]
            key = f"setting.layer.{kind}"
            where = texts("setting.line.layer", layer=texts(key) if kind in LAYER_TEXT else kind)
        return texts("setting.line", label=self.label, key=self.key, text=self.text, where=where)


def _effective(
    services: Services,
    session_id: str,
    platform: str | None,
    venue: str | None,
    layer: Mapping[str, Any],
) -> dict[str, tuple[Any, str]]:
    resolver = services.resolver
    if isinstance(resolver, SettingsLayers):
        return resolver.effective(platform, layer, venue)
    # Another resolver: what it gives a turn, attributed to the session when set there.
    s = resolver.for_turn(session_id, platform, layer, venue)
    given = {
        "llm": {"provider": s.model.provider, "model": s.model.model} if s.model else None,
        "think": s.think,
        "maxToolIterations": s.max_tool_iterations,
        "historyLimit": s.history_limit,
        "persona": s.persona,
        "enabledToolGroups": list(s.tool_groups) if s.tool_groups is not None else None,
    }
    return {
        k: (v, "session" if k in layer else "settings") for k, v in given.items() if v is not None
    }


def session_fields(
    services: Services,
    session_id: str,
    layer: Mapping[str, Any],
    *,
    platform: str | None = None,
    venue: str | None = None,
) -> list[FieldView]:
    """Every field of :data:`SETTING_FIELDS` for ``session_id``, whose own layer is
    ``layer``, read for ``platform`` and ``venue``, in their locale."""
    texts = services.texts_for(platform, venue)
    eff = _effective(services, session_id, platform, venue, layer)
    out: list[FieldView] = []
    choice: ModelChoice | None = None
    llm = eff.get("llm", (None, None))[0]
    try:
        ref = ModelRef(provider=llm["provider"], model=llm["model"]) if llm else None
        choice = services.models.resolve(ref, warn=False)
    except ConfigError:  # no model at all: the fields still show
        choice = None
    for key, spec in SETTING_FIELDS.items():
        value, where = eff.get(key, (None, None))
        text = texts(f"setting.{key}.unset")
        options: tuple[tuple[str, str], ...] = ()
        if key == "llm":
            text, value = _model_text(choice, value, texts)
        elif key == "think":
            text, options = _think_text(services, choice, value, texts)
        elif key == "maxToolIterations":
            text = texts("setting.unlimited") if value is None else str(value)
        elif key == "historyLimit":
            value = 0 if value is None else value
            text = str(value)
        elif key == "persona":
            names = dict(services.persona.list()) if services.persona is not None else {}
            if value is not None:
                if value in names:
                    text = texts("setting.remark", text=names[value], remark=value)
                else:
                    text = str(value)
            else:
                default = getattr(services.persona, "default", None)
                if default in names:
                    text = texts("setting.remark", text=text, remark=names[default])
        elif key == "enabledToolGroups" and value is not None:
            if "*" in value:
                text = texts("setting.all")
            else:
                text = (
                    texts("setting.list_separator").join(value) if value else texts("setting.none")
                )
        label = texts(f"setting.{key}")
        out.append(FieldView(key, label, spec.owner_only, value, where, text, options))
    return out


def _model_text(choice: ModelChoice | None, value: Any, texts: Texts) -> tuple[str, Any]:
    if choice is None:
        return (texts("setting.no_model"), None)
    name = model_name(choice.model)
    if value is None:
        return texts.follow_preference(name), choice.entry_id
    wanted = f"{value['provider']}/{value['model']}"
    if choice.source != "setting":  # set, but not there: the fallback is in use (SET5)
        return texts("setting.model_missing", wanted=wanted, model=name), choice.entry_id
    return wanted, choice.entry_id


def _think_text(
    services: Services, choice: ModelChoice | None, value: Any, texts: Texts
) -> tuple[str, tuple[tuple[str, str], ...]]:
    if choice is None:
        return (texts("setting.think_not_tunable"), ())
    levels = think_levels(choice.model)
    options = tuple((lv.id, lv.label) for lv in levels)
    default = think_default(choice.model)
    if default is None:
        return texts("setting.think_not_tunable"), options
    if value is None:
        return texts("setting.think_default", default=default.label), options
    mine = next((lv for lv in levels if lv.id == value), None)
    if mine is not None:
        return mine.label, options
    # The level's name from whichever model declares it; else its id.
    known = (lv for m in services.models.models() for lv in think_levels(m) if lv.id == value)
    name = next((lv.label for lv in known), str(value))
    return texts(
        "setting.remark", text=name, remark=texts.think_not_in_model(default.label)
    ), options
