"""The package uses its dependencies through their front door.

It lives inside other people's applications, next to their SQLAlchemy, redis-py
and Celery, and must survive those libraries' next releases: nothing in it
replaces a method or function that another package defines (a patched dialect
breaks every application on that engine the day SQLAlchemy renames one of its
internals). This test reads the package's source, so a change that brings such
an assignment back fails here before any review.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "flask_idempotency"

#: The names an object of our own is written through: its own attributes are ours.
OWN = {"self", "cls"}


def _functions(tree: ast.AST) -> set[str]:
    return {
        node.name
        for node in ast.walk(tree)
        if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef)
    }


def _callables_put_on_other_objects(path: Path) -> list[str]:
    """``obj.attr = <a function or lambda>`` where ``obj`` is not ours (``self``)."""
    source = path.read_text(encoding="utf-8")
    tree = ast.parse(source)
    functions = _functions(tree)
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assign):
            continue
        value = node.value
        is_callable = isinstance(value, ast.Lambda) or (
            isinstance(value, ast.Name) and value.id in functions
        )
        if not is_callable:
            continue
        for target in node.targets:
            if isinstance(target, ast.Attribute):
                owner = target.value
                if not (isinstance(owner, ast.Name) and owner.id in OWN):
                    found.append(f"{path.name}:{node.lineno}: {ast.unparse(target)} = ...")
    for number, line in enumerate(source.splitlines(), start=1):
        if "method-assign" in line:
            found.append(f"{path.name}:{number}: {line.strip()}")
    return found


def test_nothing_replaces_a_callable_of_another_package() -> None:
    found = [
        hit
        for path in sorted(PACKAGE.rglob("*.py"))
        for hit in _callables_put_on_other_objects(path)
    ]
    assert found == [], "use the dependency's documented API (an event, an option):\n" + "\n".join(
        found
    )


def test_the_check_sees_a_patched_dialect() -> None:
    """The rule catches what the package once did to SQLAlchemy's dialect."""
    patched = """
def divert(dialect):
    execute = dialect.do_execute

    def do_execute(cursor, statement, parameters, context=None):
        execute(cursor, statement, parameters, context)

    dialect.do_execute = do_execute  # type: ignore[method-assign]
    dialect.connect = lambda *a, **k: None
"""
    probe = PACKAGE.parent / "tests" / "structure" / "_patched_probe.txt"
    try:
        probe.write_text(patched, encoding="utf-8")
        hits = _callables_put_on_other_objects(probe)
    finally:
        probe.unlink()
    assert len(hits) == 3, hits
