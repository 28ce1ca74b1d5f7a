"""SQL on the records is written in one place, where the store's rules apply."""

from __future__ import annotations

import re
from pathlib import Path

import flask_idempotency

PACKAGE = Path(flask_idempotency.__file__).parent
#: A statement that reads or writes the records (not a mention in prose).
STATEMENT = re.compile(r"\b(FROM|INTO|UPDATE|JOIN|TABLE)\s+idempotency_records\b", re.IGNORECASE)


def test_records_sql_only_under_store() -> None:
    """Only ``store/`` (and read-only checks in ``testing/``) runs SQL on the records:
    elsewhere a statement would escape the store's timeouts and its tests."""
    offenders = []
    for path in sorted(PACKAGE.rglob("*.py")):
        relative = path.relative_to(PACKAGE)
        if relative.parts[0] in ("store", "testing"):
            continue
        for number, line in enumerate(path.read_text("utf-8").splitlines(), start=1):
            if STATEMENT.search(line):
                offenders.append(f"{relative}:{number}: {line.strip()}")
    assert offenders == []


def test_testing_only_reads_the_records() -> None:
    for path in sorted((PACKAGE / "testing").rglob("*.py")):
        text = path.read_text("utf-8")
        for verb in (
            "INSERT INTO idempotency_records",
            "UPDATE idempotency_records",
            "DELETE FROM idempotency_records",
        ):
            assert verb not in text, f"{path.name} writes the records"
