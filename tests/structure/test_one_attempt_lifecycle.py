"""Every attempt goes through one lifecycle: ``engine.Attempt``.

A view, a recovered record, a consumed message and a Celery task each claim,
run, settle and close an attempt. When each caller begins the store's request
handle itself, each orders the claim, the session, the settlement and the
close its own way, and one of them gets it wrong. This test reads the package's
source: outside the store and ``engine.py``, nothing begins a store handle.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[2] / "flask_idempotency"


def _handles_begun(source: str) -> list[int]:
    """The lines of ``<...>.store.begin()`` and ``store.begin()`` calls in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
            continue
        receiver = node.func.value
        name = receiver.attr if isinstance(receiver, ast.Attribute) else getattr(receiver, "id", "")
        if node.func.attr == "begin" and name == "store":
            found.append(node.lineno)
    return found


def test_only_the_attempt_begins_a_store_handle() -> None:
    outside = [
        path
        for path in sorted(PACKAGE.rglob("*.py"))
        if path.relative_to(PACKAGE).parts[0] != "store" and path.name != "engine.py"
    ]
    assert len(outside) > 20, "no source found"
    found = [
        f"{path.relative_to(PACKAGE.parent)}:{line}"
        for path in outside
        for line in _handles_begun(path.read_text(encoding="utf-8"))
    ]
    assert found == [], f"a store handle begun outside engine.Attempt: {found}"


def test_the_check_sees_a_handle_begun() -> None:
    """The check itself, on the shapes the callers had before the attempt existed."""
    source = "ctx.tx = ctx.state.store.begin()\ntx = store.begin()\nconn.begin()\n"
    assert _handles_begun(source) == [1, 2]
