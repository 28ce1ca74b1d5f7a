"""The shipped Prometheus rules and Grafana dashboard (flask_idempotency/observability/rules/).

``promtool`` (Debian's ``prometheus`` package; ``.ci/run`` installs it) checks the
rules file and runs its unit tests over synthetic series
(tests/observability/rules/). Every expression of the rules and the dashboard
may name only metrics that ``PrometheusMetrics`` registers, read from a real
registry here (not from a list kept by hand), or the rules' own recorded series;
and every metric it registers is shown or alerted on somewhere.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Iterator
from importlib.resources import files
from pathlib import Path
from typing import Any

import pytest
import yaml
from flask import Flask
from prometheus_client import CollectorRegistry

from flask_idempotency.observability.prometheus import PrometheusMetrics

RULES_DIR = files("flask_idempotency.observability") / "rules"
RULES = Path(str(RULES_DIR / "flask_idempotency.rules.yml"))
DASHBOARD = Path(str(RULES_DIR / "grafana-dashboard.json"))
UNIT_TESTS = Path(__file__).parent / "rules" / "flask_idempotency.rules.test.yml"

#: Sample names each family type exposes (prometheus-client's counters drop ``_total``
#: from the family's name; ``_created`` outside multiprocess mode only).
SUFFIXES = {
    "counter": ("_total", "_created"),
    "gauge": ("",),
    "histogram": ("_bucket", "_count", "_sum", "_created"),
    "summary": ("", "_count", "_sum", "_created"),
}
#: PromQL words that are not metric names (operators, modifiers, literals).
KEYWORDS = {"and", "or", "unless", "bool", "offset", "inf", "nan", "atan2"}


@pytest.fixture(scope="module")
def promtool() -> str:
    found = shutil.which("promtool")
    if found is None:
        message = (
            "promtool is not installed: it comes with Debian's `prometheus` package "
            "(apt-get install prometheus), which .ci/run installs"
        )
        if os.environ.get("CI"):
            pytest.fail(message, pytrace=False)
        pytest.skip(message)
    return found


def run(argv: list[str], cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd=cwd, check=False)


def test_promtool_accepts_the_rules(promtool: str) -> None:
    result = run([promtool, "check", "rules", str(RULES)])
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_rules_pass_their_unit_tests(promtool: str) -> None:
    result = run([promtool, "test", "rules", UNIT_TESTS.name], cwd=UNIT_TESTS.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "SUCCESS" in result.stdout


def test_a_broken_rule_fails_its_unit_tests(promtool: str, tmp_path: Path) -> None:
    """The unit tests can fail: with one threshold moved, promtool says which alert."""
    text = RULES.read_text()
    moved = text.replace("flask_idempotency_oldest_abandoned_age_seconds) > 600", "…) > 6000")
    moved = moved.replace("…", "max by (job) (flask_idempotency_oldest_abandoned_age_seconds")
    assert moved != text
    (tmp_path / "rules").mkdir()
    (tmp_path / "rules" / RULES.name).write_text(moved)
    tests = UNIT_TESTS.read_text().replace(
        "../../../flask_idempotency/observability/rules/", "rules/"
    )
    (tmp_path / UNIT_TESTS.name).write_text(tests)
    result = run([promtool, "test", "rules", UNIT_TESTS.name], cwd=tmp_path)
    assert result.returncode != 0
    assert "FlaskIdempotencyRecoveryBehind" in result.stdout + result.stderr


def rules() -> list[dict[str, Any]]:
    loaded = yaml.safe_load(RULES.read_text())
    return [rule for group in loaded["groups"] for rule in group["rules"]]


def test_every_alert_is_tested_firing_and_silent() -> None:
    tests = yaml.safe_load(UNIT_TESTS.read_text())["tests"]
    firing: set[str] = set()
    silent: set[str] = set()
    for case in tests:
        for check in case.get("alert_rule_test", []):
            (firing if check.get("exp_alerts") else silent).add(check["alertname"])
    alerts = {rule["alert"] for rule in rules() if "alert" in rule}
    assert len(alerts) >= 15
    assert sorted(alerts - firing) == [], "alerts never shown firing"
    assert sorted(alerts - silent) == [], "alerts never shown silent"
    for rule in rules():
        if "alert" in rule:
            assert rule["labels"]["severity"] in ("page", "ticket"), rule["alert"]
            assert rule["annotations"]["summary"] and rule["annotations"]["description"]


# -- metric names --------------------------------------------------------------------


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression selects (Grafana's ``$variables`` allowed)."""
    text = re.sub(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'|`[^`]*`', '""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)  # label matchers
    text = re.sub(r"\[[^\]]*\]", " ", text)  # ranges, subqueries ($__rate_interval)
    text = re.sub(
        r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", " ", text
    )  # grouping labels
    names = set()
    for match in re.finditer(r"(?<![\w.$])[a-zA-Z_:][\w:]*", text):
        word = match.group()
        if word.lower() in KEYWORDS or re.match(r"\s*\(", text[match.end() :]):
            continue  # a keyword, or a function / aggregation
        names.add(word)
    return names


def test_metric_names_are_found_in_expressions() -> None:
    """The extraction the next test relies on: names in, labels, functions and
    literals out."""
    expr = (
        'sum by (job, le) (rate(flask_idempotency_x_bucket{job=~"$job",le!="1e3"}'
        "[$__rate_interval])) / on (job) group_left () max(flask_idempotency_y offset 5m)"
        " > bool 0.5e3 unless job:flask_idempotency_z:ratio_rate5m"
    )
    assert metric_names(expr) == {
        "flask_idempotency_x_bucket",
        "flask_idempotency_y",
        "job:flask_idempotency_z:ratio_rate5m",
    }


def dashboard_expressions() -> Iterator[tuple[str, str]]:
    dashboard = json.loads(DASHBOARD.read_text())

    def panels(items: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
        for item in items:
            yield item
            yield from panels(item.get("panels", []))

    for panel in panels(dashboard["panels"]):
        for target in panel.get("targets", []):
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in dashboard["templating"]["list"]:
        query = variable.get("definition", "")
        found = re.fullmatch(r"label_values\((\w+),\s*\w+\)", query)
        if query:
            assert found, f"variable {variable['name']}: {query!r}"
            yield f"variable {variable['name']!r}", found.group(1)


@pytest.fixture
def exported(make_app: Callable[..., Flask]) -> dict[str, set[str]]:
    """Every sample name PrometheusMetrics registers (with the table-wide figures), by
    family: read from a registry, so a metric added to the code is known here."""
    app = make_app()
    registry = CollectorRegistry()
    PrometheusMetrics(app, registry=registry, table_stats=True)
    families: dict[str, set[str]] = {}
    for family in registry.collect():
        families[family.name] = {family.name + suffix for suffix in SUFFIXES[family.type]}
    return families


def test_expressions_name_only_exported_metrics(exported: dict[str, set[str]]) -> None:
    samples = set().union(*exported.values())
    assert "flask_idempotency_requests_total" in samples
    assert "flask_idempotency_records_lease_expired" in samples  # the table-wide collector
    recorded = {rule["record"] for rule in rules() if "record" in rule}
    everywhere = [(rule.get("alert") or rule["record"], rule["expr"]) for rule in rules()]
    everywhere += list(dashboard_expressions())
    unknown = {
        (where, name)
        for where, expr in everywhere
        for name in metric_names(expr)
        if name not in samples | recorded
    }
    assert sorted(unknown) == [], "expressions naming metrics the extension does not export"
    used = set().union(*(metric_names(expr) for _, expr in everywhere))
    assert sorted(recorded - used) == [], "recorded series nothing uses"


def test_every_exported_metric_is_shown_or_alerted_on(exported: dict[str, set[str]]) -> None:
    used: set[str] = set()
    expressions = [rule["expr"] for rule in rules()] + [e for _, e in dashboard_expressions()]
    for expr in expressions:
        used |= metric_names(expr)
    missing = sorted(family for family, names in exported.items() if not names & used)
    assert missing == [], "metrics neither on the dashboard nor in a rule"


def test_dashboard_is_importable() -> None:
    """What Grafana needs to import it: unique panel ids, a Prometheus data source
    chosen by a variable, every target with a refId."""
    dashboard = json.loads(DASHBOARD.read_text())
    assert dashboard["uid"] and dashboard["title"]
    ids = [panel["id"] for panel in dashboard["panels"]]
    assert len(ids) == len(set(ids))
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    for panel in dashboard["panels"]:
        if panel["type"] == "row":
            continue
        assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
        refs = [target["refId"] for target in panel["targets"]]
        assert refs and len(refs) == len(set(refs)), panel["title"]
