"""Shared test setup: hypothesis profiles (derandomised in CI)."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pykka
import pytest
import structlog
from aalis_agent.actors.runtime import Runtime
from aalis_agent.services import logging_setup
from hypothesis import HealthCheck, settings

settings.register_profile(
    "ci", derandomize=True, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
settings.register_profile("dev", deadline=None)
settings.load_profile("ci" if os.environ.get("CI") else "dev")


@pytest.fixture(autouse=True)
def _reset_structlog() -> Iterator[None]:
    """A test that runs the CLI configures structlog; later tests start from defaults."""
    yield
    structlog.reset_defaults()
    logging_setup.install()  # the library's own default: quiet unless logging is configured


@pytest.fixture
def runtimes() -> Iterator[list[Runtime]]:
    """Runtimes a test makes (it appends them), shut down after it."""
    made: list[Runtime] = []
    yield made
    for rt in made:
        rt.shutdown(timeout=10)
    pykka.ActorRegistry.stop_all()
