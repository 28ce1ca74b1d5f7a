"""The CLI and configuration references: committed Markdown that matches the code,
and a built site that shows them as a reader should see them (no raw directive, no
dash for ``--``, no swallowed ``<SECONDS>``)."""

from __future__ import annotations

import html
import importlib.util
import re
import subprocess
import sys
from pathlib import Path
from types import ModuleType

import pytest

from .snippets import ROOT

EXT = ROOT / "docs" / "_ext"


def _load(name: str) -> ModuleType:
    """A module of docs/_ext (Sphinx finds them on its own path, not the package's)."""
    if str(EXT) not in sys.path:
        sys.path.insert(0, str(EXT))  # idempotency_docs imports reference
    spec = importlib.util.spec_from_file_location(name, EXT / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


reference = _load("reference")
idempotency_docs = _load("idempotency_docs")


def test_committed_references_match_the_code() -> None:
    """docs/cli.md and docs/configuration.md are what `make reference` writes now."""
    assert reference.stale_pages() == [], "run `make reference` and commit the pages"


def test_cli_reference_has_every_command_and_option() -> None:
    import click

    from flask_idempotency.cli import group

    text = (ROOT / "docs" / "cli.md").read_text(encoding="utf-8")
    ctx = click.Context(group, info_name="flask idempotency")
    for name in group.list_commands(ctx):
        command = group.get_command(ctx, name)
        assert command is not None
        assert f"## `flask idempotency {name}`" in text
        for param in command.params:
            if isinstance(param, click.Option):
                for opt in param.opts:
                    assert f"`{opt}" in text or f", {opt}" in text, (name, opt)


def test_configuration_reference_has_every_key() -> None:
    import dataclasses

    from flask_idempotency.config_keys import GROUPED, config_key
    from flask_idempotency.settings import Settings

    text = (ROOT / "docs" / "configuration.md").read_text(encoding="utf-8")
    for field in dataclasses.fields(Settings):
        group, option = GROUPED.get(field.name, (None, None))
        if group is None:
            assert f"### `{config_key(field.name)}`" in text, field.name
        else:
            assert f"### `IDEMPOTENCY_{group.upper()}`" in text, field.name
            if option is not None:
                assert f"| `{option}` |" in text, field.name


def test_prose_keeps_options_tags_and_stars_literal() -> None:
    assert reference.prose("asks (--yes to skip), renewal < lease < TTL") == (
        "asks (`--yes` to skip), renewal < lease < TTL"
    )
    assert reference.prose("a <SECONDS> value, 0 3 * * *") == "a \\<SECONDS> value, 0 3 \\* \\* \\*"
    assert reference.prose("set GUNICORN_CMD_ARGS, not ``--x``") == (
        "set `GUNICORN_CMD_ARGS`, not `--x`"
    )
    assert reference.prose("a | b `c|d`", in_table=True) == "a \\| b `c\\|d`"


def test_html_check_finds_what_sphinx_click_used_to_leave() -> None:
    """The old cli.html, as the issue found it: each defect is reported."""
    old = (
        "<p>.. program:: flask idempotency doctor</p>\n"
        "<p>.. option:: \u2013processor-timeout <SECONDS></p>\n"
        "<pre>.. code-block:: shell</pre>"
    )
    problems = idempotency_docs.html_problems(old)
    assert any("raw directive '.. program::'" in p for p in problems), problems
    assert any("raw directive '.. option::'" in p for p in problems), problems
    assert any("dash for hyphens" in p for p in problems), problems
    assert any("raw tag '<SECONDS>'" in p for p in problems), problems
    assert not any("code-block" in p for p in problems), problems  # code is exempt
    assert idempotency_docs.html_problems("<p><code>--yes</code> &lt;SECONDS&gt;</p>") == []


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The site as `make docs` builds it (-W -n: any warning fails)."""
    out = tmp_path_factory.mktemp("html")
    done = subprocess.run(
        [sys.executable, "-m", "sphinx", "-W", "--keep-going", "-n", "-q", "-b", "html"]
        + ["-d", str(out / ".doctrees"), str(ROOT / "docs"), str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    return out


def _text(page: Path) -> str:
    body = page.read_text(encoding="utf-8")
    return html.unescape(re.sub(r"<[^>]+>", "", body))


def test_built_cli_page_reads_as_help_does(site: Path) -> None:
    page = site / "cli.html"
    raw = page.read_text(encoding="utf-8")
    assert idempotency_docs.html_problems(raw) == []
    text = _text(page)
    assert "--processor-timeout SECONDS" in text
    assert "--progress-interval SECONDS" in text
    assert "flask idempotency purge [OPTIONS]" in text
    assert "\u2013" not in text  # not one en dash: every `--` stays two hyphens
    # The metavar is text, escaped in the source, never a tag the browser drops.
    assert "<SECONDS>" not in raw


def test_built_configuration_page_links_every_key(site: Path) -> None:
    raw = (site / "configuration.html").read_text(encoding="utf-8")
    assert idempotency_docs.html_problems(raw) == []
    assert 'id="idempotency-ttl"' in raw
    # {confval} and Markdown links from other pages reach the key's section.
    assert 'href="configuration.html#idempotency-scope-func"' in (
        site / "quickstart.html"
    ).read_text(encoding="utf-8")
