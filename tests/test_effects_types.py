"""``SessionActor._effects`` skips events whose type is not in ``_WITH_EFFECTS``: every
type its ``match`` names must be there, or its case would never run."""

from __future__ import annotations

import ast
import inspect
import textwrap

from aalis_agent.actors import session


def test_every_type_the_effects_match_names_is_in_with_effects() -> None:
    source = textwrap.dedent(inspect.getsource(session.SessionActor._effects))
    named: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.match_case):
            for sub in ast.walk(node.pattern):
                if isinstance(sub, ast.MatchClass) and isinstance(sub.cls, ast.Name):
                    named.add(sub.cls.id)
    assert named, "no match cases found"
    assert named == {t.__name__ for t in session._WITH_EFFECTS}
