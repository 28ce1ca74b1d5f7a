"""Sphinx helpers for this site, so that the docs have one source of truth.

- The CLI and configuration references are plain Markdown that ``reference.py``
  writes into ``cli.md`` and ``configuration.md`` from the code; the build fails
  (a warning, an error under ``-W``) when the committed text is stale.
- Each ``### `IDEMPOTENCY_...``` heading of the configuration page is a ``confval``
  target, so ``{confval}`IDEMPOTENCY_TTL``` links to it; a key removed from
  ``settings.py`` breaks every reference to it (the build is nitpicky).
- ``{repo}`path``` links to a file of this repository on GitHub, and warns (an
  error under ``-W``) when the path does not exist in the checkout: the link
  check for links that leave the site but stay in the project.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import reference
from docutils import nodes
from sphinx.application import Sphinx
from sphinx.util import logging

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
#: Where ``{repo}`` links point; the files are checked in this checkout.
REPO_URL = "https://github.com/flask-idempotency/flask-idempotency/blob/main/"
_CONFIG_KEY = re.compile(r"IDEMPOTENCY_[A-Z0-9_]+")


def check_reference(app: Sphinx) -> None:
    """Fail the build when a generated reference page is not what the code says now."""
    for name in reference.stale_pages():
        log.warning("%s is stale: run `make reference` (python docs/_ext/reference.py)", name)


def note_config_keys(app: Sphinx, doctree: nodes.document) -> None:
    """Each setting's section of the configuration page is the ``confval`` of its key."""
    if app.env.docname != "configuration":
        return
    std: Any = app.env.get_domain("std")
    for section in doctree.findall(nodes.section):
        title = section[0].astext() if section.children else ""
        if _CONFIG_KEY.fullmatch(title) and section["ids"]:
            std.note_object("confval", title, section["ids"][0], location=section)


#: What a page must not show once built: a directive nobody expanded (``.. option::``),
#: an option whose ``--`` became a dash, an uppercase HTML tag (a ``<SECONDS>`` the
#: browser swallowed). Code blocks are exempt from the first.
_RAW_DIRECTIVE = re.compile(r"(?:^|>)\s*(\.\. [a-z][\w:-]*::)", re.M)
_DASHED_OPTION = re.compile(r"[\u2013\u2014][a-z]")
_RAW_TAG = re.compile(r"</?[A-Z][A-Z0-9_]*>")
_PRE = re.compile(r"<pre>.*?</pre>", re.S)


def html_problems(html: str) -> list[str]:
    """What is wrong in one built page (see above)."""
    outside_code = _PRE.sub("", html)
    problems = [f"raw directive {m.group(1)!r}" for m in _RAW_DIRECTIVE.finditer(outside_code)]
    problems += [
        f"dash for hyphens: {html[max(m.start() - 20, 0) : m.end() + 20]!r}"
        for m in _DASHED_OPTION.finditer(html)
    ]
    problems += [f"raw tag {m.group(0)!r}" for m in _RAW_TAG.finditer(html)]
    return problems


def check_html(app: Sphinx, exception: Exception | None) -> None:
    if exception is not None or app.builder.format != "html":
        return
    for page in sorted(Path(app.outdir).glob("*.html")):
        for problem in html_problems(page.read_text(encoding="utf-8")):
            log.warning("%s: %s", page.name, problem)


def repo_role(
    name: str,
    rawtext: str,
    text: str,
    lineno: int,
    inliner: Any,
    options: dict[str, Any] | None = None,
    content: list[str] | None = None,
) -> tuple[list[nodes.Node], list[nodes.system_message]]:
    """``{repo}`benchmarks/results/latest.md``` or ``{repo}`the results <benchmarks/results/>```."""
    match = re.fullmatch(r"(.*?)\s*<(.+)>", text, re.S)
    title, path = (match.group(1), match.group(2)) if match else (text, text)
    if not (ROOT / path.split("#", 1)[0]).exists():
        message = inliner.reporter.warning(f"{{repo}} link to a missing file: {path}", line=lineno)
        return [nodes.literal(rawtext, title)], [message]
    node = nodes.reference(rawtext, "", refuri=REPO_URL + path)
    node += nodes.literal(title, title) if not match else nodes.Text(title)
    return [node], []


def setup(app: Sphinx) -> dict[str, Any]:
    app.connect("builder-inited", check_reference)
    app.connect("doctree-read", note_config_keys)
    app.connect("build-finished", check_html)
    app.add_role("repo", repo_role)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
