"""Sphinx configuration: `make docs` builds this site with -W and nitpicky references."""

from __future__ import annotations

import sys
from pathlib import Path

import flask_idempotency

sys.path.insert(0, str(Path(__file__).parent / "_ext"))

project = "flask-idempotency"
copyright = "flask-idempotency contributors"
release = flask_idempotency.__version__
version = ".".join(release.split(".")[:2])

extensions = [
    "myst_parser",
    "sphinx.ext.autodoc",
    "pallets_sphinx_themes",
    "idempotency_docs",
]
source_suffix = {".md": "markdown"}
exclude_patterns = ["_build"]
# `--dry-run` stays two hyphens and quotes stay straight: what a reader copies from
# prose must work in a shell (docutils' "smart" punctuation would make `--` a dash).
smartquotes = False
# Markdown pages: ``{confval}`` and ``{doc}`` roles, ``:::`` fences for notes, and
# anchors for headings so pages can link to each other's sections.
myst_enable_extensions = ["colon_fence", "deflist"]
myst_heading_anchors = 3

html_theme = "flask"
html_title = f"flask-idempotency ({version})"
html_theme_options = {"index_sidebar_logo": False}
html_context = {"project_links": []}

autodoc_member_order = "bysource"
autodoc_typehints = "description"
autodoc_typehints_format = "short"
autodoc_preserve_defaults = True

# Every reference must resolve (make docs runs with -n), except to what lives in
# other projects' docs: this build fetches no intersphinx inventory (it must work
# offline in CI), so names from the standard library, Flask, Werkzeug, psycopg2,
# kombu, redis-py, prometheus-client, OpenTelemetry, requests and httpx stay plain text.
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(typing|collections|datetime|threading|logging|enum|pathlib|types|os)\..*"),
    (r"py:.*", r"(flask|werkzeug|click|psycopg2|psycopg|kombu|redis|prometheus_client)(\..*)?"),
    (r"py:.*", r"(opentelemetry|pytest|pytest_postgresql|collections\.abc)(\..*)?"),
    (r"py:.*", r"(requests|httpx)(\..*)?"),
    (
        r"py:class",
        r"(Any|Callable|Iterator|Iterable|Mapping|Sequence|Counter|Flask|Request"
        r"|Response|Path|timedelta|datetime|Event|Enum|P|R|T|View|TracebackType"
        r"|int|str|bytes|float|bool|None|dict|list|tuple|set|frozenset|object|type"
        r"|Exception|BaseException|Logger)",
    ),
    # Internal helper types that appear in public signatures; not part of the API.
    (r"py:class", r"(.*\.)?(_\w+|T|Handler|KeyFunc|ConsumerOptions|EventPublisher|Backoff)"),
    (r"py:class", r"(CollectorRegistry|TracerProvider|ConsumerGuard)"),
    # The store's record types, shown in signatures; the store is not public API.
    (r"py:class", r"flask_idempotency\.store\..*"),
    # EmbeddedEvents.run's docstring says :meth:`stop`; Sphinx does not resolve it from
    # the re-exported class (flask_idempotency.events.EmbeddedEvents).
    (r"py:meth", r"stop"),
]

# linkcheck (make docs): internal links only. Links to other sites are not
# fetched (CI runs offline and must not fail on someone else's outage); links
# into this repository are ``{repo}`` roles, checked against the checkout by
# _ext/idempotency_docs.py during every build.
linkcheck_ignore = [r"https?://.*", r"urn:.*"]
