"""The llm service: model providers, their chat models, and which model a turn uses.

A provider is an instance (``openai``, ``local``…) holding chat models; a model's entry
id is ``<provider instance id>/<model id>``, the form ``/session.set llm`` takes (SET1).

Which model a turn uses (SET1): the ``llm`` setting when one of the settings layers has
it; otherwise the service preference — this plugin's preference, else the global
preference, else the provider with the highest priority, else the first registered.
When the setting or the preference names a model that is not there (deleted, its provider
reloading or failed), the turn uses what the service falls back to and one warning is
logged per (wanted, actual) pair, saying which preference it was (SET5).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Literal

import structlog
from aalis_agent.events.errors import ConfigError
from aalis_agent.events.schema import ModelRef
from aalis_agent.services.llm import ChatModel, ThinkLevel

__all__ = [
    "LlmService",
    "ModelChoice",
    "Provider",
    "entry_id",
    "model_name",
    "parse_model_ref",
    "think_default",
    "think_levels",
]

log = structlog.get_logger("aalis.llm")

Source = Literal["setting", "plugin-preference", "global-preference", "provider-priority"]


def entry_id(model: ChatModel) -> str:
    """``<provider>/<model>``: the id listed by ``/model`` and taken by ``/session.set llm``."""
    return f"{model.provider_id}/{model.id}"


def model_name(model: ChatModel) -> str:
    """The name shown for a model: its declared ``name``, else its id."""
    name = getattr(model, "name", None)
    return name if isinstance(name, str) and name else model.id


def think_levels(model: ChatModel) -> tuple[ThinkLevel, ...]:
    """The thinking levels ``model`` declares (SET2); empty when it cannot be tuned."""
    return tuple(getattr(model, "think_levels", ()) or ())


def think_default(model: ChatModel) -> ThinkLevel | None:
    """The model's default level: the one named ``default_think``, else the first."""
    levels = think_levels(model)
    if not levels:
        return None
    wanted = getattr(model, "default_think", None)
    return next((lv for lv in levels if lv.id == wanted), levels[0])


def parse_model_ref(
    value: object, *, where: str, shown: Callable[[object], str] = repr
) -> ModelRef:
    """A ``ModelRef`` from ``"<provider>/<model>"`` or ``{provider, model}``; both parts
    must be non-empty strings, else a ConfigError naming ``where`` and the value (shown
    by ``shown``: as Python spells it unless told otherwise)."""
    provider = model = None
    if isinstance(value, str) and "/" in value:
        provider, model = value.split("/", 1)
    elif isinstance(value, dict):
        provider, model = value.get("provider"), value.get("model")
    elif isinstance(value, ModelRef):
        provider, model = value.provider, value.model
    if not (isinstance(provider, str) and provider and isinstance(model, str) and model):
        raise ConfigError(f"{where}: expected <provider>/<model>, got {shown(value)}")
    return ModelRef(provider=provider, model=model)


@dataclass(eq=False)
class Provider:
    """A provider instance and its chat models. Higher ``priority`` is preferred when no
    preference says otherwise; equal priorities keep registration order."""

    id: str
    models: list[ChatModel] = field(default_factory=list)
    priority: int = 0

    def __post_init__(self) -> None:
        if not self.id or "/" in self.id:
            raise ConfigError(f"provider id must be non-empty without '/', got {self.id!r}")
        for m in self.models:
            if m.provider_id != self.id:
                raise ConfigError(
                    f"provider {self.id!r}: model {m.id!r} says its provider is {m.provider_id!r}"
                )

    def find(self, model_id: str) -> ChatModel | None:
        return next((m for m in self.models if m.id == model_id), None)


@dataclass(frozen=True, slots=True)
class ModelChoice:
    """The model a turn uses and why: from a ``setting`` or a preference, and what was
    wanted when it fell back (SET5)."""

    model: ChatModel
    source: Source
    wanted: ModelRef | None = None
    wanted_source: Source | None = None

    @property
    def entry_id(self) -> str:
        return entry_id(self.model)

    @property
    def fell_back(self) -> bool:
        return self.wanted is not None


class LlmService:
    """Providers in registration order, the two preferences, and model resolution.

    Thread-safe: turns of many sessions resolve at once while providers come and go.
    """

    def __init__(
        self,
        providers: Iterable[Provider] = (),
        *,
        plugin_preference: ModelRef | None = None,
        global_preference: ModelRef | None = None,
    ) -> None:
        self._lock = threading.Lock()
        self._providers: list[Provider] = []
        self.plugin_preference = plugin_preference
        self.global_preference = global_preference
        self._warned: set[tuple[str, str, str]] = set()
        for p in providers:
            self.register(p)

    @classmethod
    def single(cls, model: ChatModel) -> LlmService:
        """A service with one provider holding ``model``."""
        return cls([Provider(model.provider_id, [model])])

    # --- providers -------------------------------------------------------------------

    def register(self, provider: Provider) -> None:
        with self._lock:
            if any(p.id == provider.id for p in self._providers):
                raise ConfigError(f"provider {provider.id!r} is registered twice")
            self._providers.append(provider)

    def unregister(self, provider_id: str) -> None:
        """Take a provider away (reloading, failed); its models are missing until it is back."""
        with self._lock:
            self._providers = [p for p in self._providers if p.id != provider_id]

    @property
    def providers(self) -> tuple[Provider, ...]:
        with self._lock:
            return tuple(self._providers)

    def models(self) -> list[ChatModel]:
        """Every chat model: providers by priority (highest first), then registration order."""
        ranked = sorted(enumerate(self.providers), key=lambda ip: (-ip[1].priority, ip[0]))
        return [m for _, p in ranked for m in p.models]

    def find(self, ref: ModelRef) -> ChatModel | None:
        for p in self.providers:
            if p.id == ref.provider:
                return p.find(ref.model)
        return None

    # --- resolution (SET1, SET5) -----------------------------------------------------

    def preferred(self) -> ChatModel:
        """The model the service picks for this plugin right now (no setting)."""
        return self.resolve(None, warn=False).model

    def resolve(self, setting: ModelRef | None, *, warn: bool = True) -> ModelChoice:
        """The model for a turn whose ``llm`` setting is ``setting`` (None: unset).

        Raises ConfigError when no provider has any model.
        """
        wanted: list[tuple[ModelRef, Source]] = []
        if setting is not None:
            wanted.append((setting, "setting"))
        if self.plugin_preference is not None:
            wanted.append((self.plugin_preference, "plugin-preference"))
        if self.global_preference is not None:
            wanted.append((self.global_preference, "global-preference"))
        missing: tuple[ModelRef, Source] | None = None
        for ref, source in wanted:
            model = self.find(ref)
            if model is not None:
                choice = ModelChoice(model, source, *(missing or (None, None)))
                break
            if missing is None:
                missing = (ref, source)  # the effective one: what was asked for
        else:
            models = self.models()
            if not models:
                raise ConfigError("no chat model: configure a provider with at least one model")
            choice = ModelChoice(models[0], "provider-priority", *(missing or (None, None)))
        if warn and choice.wanted is not None:
            self._warn_fallback(choice)
        return choice

    def _warn_fallback(self, choice: ModelChoice) -> None:
        assert choice.wanted is not None and choice.wanted_source is not None
        key = (str(choice.wanted), choice.wanted_source, choice.entry_id)
        with self._lock:
            if key in self._warned:
                return
            self._warned.add(key)
        log.warning(
            "preferred model missing; using the fallback",
            wanted=str(choice.wanted),
            actual=choice.entry_id,
            wanted_from=choice.wanted_source,
            plugin_preference=choice.wanted_source == "plugin-preference",
        )

    # --- thinking levels (SET2) ------------------------------------------------------

    @staticmethod
    def think_for(model: ChatModel, level: str | None) -> str | None:
        """The level to send: ``level`` only when ``model`` declares it; else None, and
        the provider uses the model's default."""
        if level is None:
            return None
        return level if any(lv.id == level for lv in think_levels(model)) else None
