"""One document, two renderings: ``name: value`` lines for people, JSON for ``jq``.

``show`` and ``stats`` build a flat mapping once and hand it here, so the
prose and ``--json`` can never list different fields. JSON follows the
``kubectl -o json`` / ``gh --json`` convention: one document on standard
output and nothing else there (warnings go to standard error); ``null`` where
the prose says ``-``.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any

import click

json_option = click.option(
    "--json",
    "as_json",
    is_flag=True,
    help="Print one JSON document with the same fields instead of prose.",
)


def _prose(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, list):
        return json.dumps(value)
    return str(value)


def echo_document(fields: Mapping[str, Any], *, as_json: bool) -> None:
    if as_json:
        click.echo(json.dumps(fields, indent=2))
        return
    for name, value in fields.items():
        click.echo(f"{name}: {_prose(value)}")
