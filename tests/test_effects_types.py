"""``SessionActor._effects`` skips events whose type is not in ``_WITH_EFFECTS``: every
type its ``match`` names (or it tests ``kind is`` before the match) must be there, or its
case would never run."""

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
        elif (
            isinstance(node, ast.Compare)
            and isinstance(node.left, ast.Name)
            and node.left.id == "kind"
            and isinstance(node.ops[0], ast.Is)
            and isinstance(node.comparators[0], ast.Name)
        ):
            named.add(node.comparators[0].id)
    assert named, "no match cases found"
    assert named == {t.__name__ for t in session._WITH_EFFECTS}
