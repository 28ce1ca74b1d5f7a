"""What the pages say about the package, checked against the package: its extras,
its tables. A page that falls behind the code fails here, not in a reader's hands."""

from __future__ import annotations

import re
from importlib.metadata import metadata

from flask_idempotency.store.migrations import TABLES

from .snippets import ROOT

DOCS = ROOT / "docs"
#: Extras for working on the checkout, not for an application.
CHECKOUT_EXTRAS = {"dev", "docs", "example"}


def library_extras() -> set[str]:
    return set(metadata("flask-idempotency").get_all("Provides-Extra") or ()) - CHECKOUT_EXTRAS


def test_readme_and_quickstart_name_every_extra() -> None:
    extras = library_extras()
    assert {"sqlalchemy", "psycopg", "alembic", "celery", "redis"} <= extras, extras
    for page in (ROOT / "README.md", DOCS / "quickstart.md"):
        text = page.read_text(encoding="utf-8")
        missing = sorted(extra for extra in extras if f"`{extra}`" not in text)
        assert not missing, f"{page.name} does not name the extras {missing}"


def test_alembic_page_names_every_table_of_the_schema() -> None:
    text = (DOCS / "alembic.md").read_text(encoding="utf-8")
    intro = text.split("\n## ", 1)[0]
    named = set(re.findall(r"`(idempotency_\w+)`", intro))
    assert named == set(TABLES), (sorted(TABLES - named), sorted(named - TABLES))


def test_testing_page_quotes_the_error_of_a_url_beside_db() -> None:
    """The testing page says IDEMPOTENCY_DATABASE_URL raises with db=, quoting the error."""
    import pytest
    from flask import Flask
    from flask_sqlalchemy import SQLAlchemy

    from flask_idempotency import Idempotency

    text = (DOCS / "testing.md").read_text(encoding="utf-8")
    quoted = re.search(r'raises `ValueError` \("([^"]+)"\)', text)
    assert quoted is not None
    app = Flask(__name__)
    app.config["SQLALCHEMY_DATABASE_URI"] = "postgresql://localhost/unused"
    app.config["IDEMPOTENCY_DATABASE_URL"] = "postgresql://localhost/unused"
    db = SQLAlchemy(app)
    with pytest.raises(ValueError, match=re.escape(" ".join(quoted.group(1).split()))):
        Idempotency(app, db=db)
