"""Sphinx helpers for this site, so that the docs have one source of truth.

- ``.. idempotency-settings::`` writes one ``confval`` entry per key of
  :class:`flask_idempotency.settings.Settings`, from the ``#:`` comment above the field in
  ``flask_idempotency/settings.py`` and the field's default; a group of options is
  one key, its options in a table. A key added there
  appears on the configuration page; one removed breaks every ``{confval}``
  reference to it (the build is nitpicky).
- ``{repo}`path``` links to a file of this repository on GitHub, and warns (an
  error under ``-W``) when the path does not exist in the checkout: the link
  check for links that leave the site but stay in the project.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Any

from docutils import nodes
from docutils.parsers.rst import Directive
from docutils.statemachine import StringList
from sphinx.application import Sphinx
from sphinx.pycode import ModuleAnalyzer
from sphinx.util import logging
from sphinx.util.nodes import nested_parse_with_titles

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[2]
#: Where ``{repo}`` links point; the files are checked in this checkout.
REPO_URL = "https://github.com/flask-idempotency/flask-idempotency/blob/main/"
_KEY_PREFIX = re.compile(r'^``(IDEMPOTENCY_[A-Z0-9_]+(?:\["[a-z_]+"\])?)``:\s*')


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not dataclasses.MISSING:
        value = field.default
    elif field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:  # pragma: no cover - every setting has a default
        return "required"
    if value is None:
        return "unset"
    if callable(value):
        module = value.__module__
        public = "flask_idempotency" if module.startswith("flask_idempotency.") else module
        return f"``{public}.{value.__qualname__}``"
    return f"``{value!r}``"


#: What each option group is for, above the table of its options (the database
#: group's own ``#:`` comment, on ``connect_kwargs``, says it for that one).
GROUP_INTROS = {
    "redis_options": "The Redis cache's options, beside ``IDEMPOTENCY_REDIS_URL``:",
    "broker_options": "The event relay's options, beside ``IDEMPOTENCY_BROKER_URL``:",
}


class SettingsDirective(Directive):
    """Every ``IDEMPOTENCY_*`` key, in the order ``settings.py`` defines them.

    A group of options (``IDEMPOTENCY_DATABASE_OPTIONS``...) is one key, listed where
    its first option is defined, with its options in a table under it: as
    Flask-Limiter documents ``RATELIMIT_STORAGE_OPTIONS``.
    """

    has_content = False

    def run(self) -> list[nodes.Node]:
        from flask_idempotency.config_keys import GROUPED, OPTION_GROUPS, config_key
        from flask_idempotency.settings import Settings

        analyzer = ModuleAnalyzer.for_module("flask_idempotency.settings")
        docs = analyzer.find_attr_docs()
        fields = {field.name: field for field in dataclasses.fields(Settings)}
        lines: list[str] = []
        listed_groups: set[str] = set()
        #: The field that holds a group's other options (the database's libpq
        #: parameters), whose comment introduces the group.
        holders = {g: name for name, (g, option) in GROUPED.items() if option is None}
        for field in fields.values():
            group, option = GROUPED.get(field.name, (None, None))
            if group is not None:
                if group not in listed_groups:
                    listed_groups.add(group)
                    lines += self._group(group, OPTION_GROUPS[group], holders, fields, docs)
                continue
            key = config_key(field.name)
            comment = self._comment(docs, field.name, key)
            lines += [
                f".. confval:: {key}",
                f"   :type: ``{field.type}``",
                f"   :default: {_default(field)}",
                "",
            ]
            lines += [f"   {line}" if line else "" for line in comment]
            lines.append("")
        node = nodes.section()
        node.document = self.state.document
        nested_parse_with_titles(self.state, StringList(lines, source="settings.py"), node)
        return node.children

    @staticmethod
    def _comment(docs: dict[tuple[str, str], list[str]], name: str, key: str) -> list[str]:
        """The field's ``#:`` comment without its leading key, which must be ``key``."""
        comment = list(docs.get(("Settings", name), []))
        if not comment:
            log.warning("flask_idempotency/settings.py: %s has no #: comment", name)
            return [""]
        match = _KEY_PREFIX.match(comment[0])
        if match is None or match.group(1) != key:
            log.warning(
                "flask_idempotency/settings.py: the #: comment of %s should start with ``%s``:",
                name,
                key,
            )
        else:
            comment[0] = comment[0][match.end() :]
        return comment

    def _group(
        self,
        group: str,
        options: dict[str, str],
        holders: dict[str, str],
        fields: dict[str, dataclasses.Field[Any]],
        docs: dict[tuple[str, str], list[str]],
    ) -> list[str]:
        """One ``confval`` for the group, its options in a list table under it."""
        key = f"IDEMPOTENCY_{group.upper()}"
        holder = holders.get(group)
        intro = self._comment(docs, holder, key) if holder else [GROUP_INTROS[group]]
        lines = [f".. confval:: {key}", "   :type: ``Mapping[str, Any]``", "   :default: ``{}``"]
        lines.append("")
        lines += [f"   {line}" if line else "" for line in intro]
        lines += [
            "",
            "   .. list-table::",
            "      :header-rows: 1",
            "      :widths: 20 15 65",
            "",
            "      * - option",
            "        - default",
            "        - what it sets",
        ]
        for option, name in options.items():
            comment = self._comment(docs, name, f'{key}["{option}"]')
            lines += [
                f"      * - ``{option}``",
                f"        - {_default(fields[name])}",
                f"        - {comment[0]}",
            ]
            lines += [f"          {line}" if line else "" for line in comment[1:]]
        lines.append("")
        return lines


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
    app.add_directive("idempotency-settings", SettingsDirective)
    app.add_role("repo", repo_role)
    return {"parallel_read_safe": True, "parallel_write_safe": True}
