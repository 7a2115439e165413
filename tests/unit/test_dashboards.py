"""The Grafana dashboard and the Prometheus alerts name only metrics and labels that exist.

Every PromQL expression of ``ops/grafana/ledgerbox.json`` (panel targets, template variable
queries) and ``ops/prometheus/alerts.yml`` is tokenised: string literals, durations, label
matchers and ``by/without/on/ignoring (...)`` lists are set apart, function names and
keywords dropped; every identifier left must be a sample name of the relay's or the inbox's
metrics (``_total``, ``_bucket``, ``_sum``, ``_count`` resolved by the client registry), and
every label used must be one of that metric's labels (or ``le``, ``job``, ``instance``).
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml
from prometheus_client import Counter, Gauge, Histogram
from prometheus_client.metrics import MetricWrapperBase

from ledgerbox.inbox import _metrics as inbox_metrics
from ledgerbox.relay import _metrics as relay_metrics

REPO = Path(__file__).resolve().parents[2]
DASHBOARD = REPO / "ops" / "grafana" / "ledgerbox.json"
ALERTS = REPO / "ops" / "prometheus" / "alerts.yml"

#: Labels Prometheus adds (target labels) or histograms carry.
COMMON_LABELS = {"le", "job", "instance"}
KEYWORDS = {
    "by", "without", "on", "ignoring", "group_left", "group_right",
    "and", "or", "unless", "bool", "offset", "inf", "nan",
}  # fmt: skip
GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\(([^)]*)\)")
STRING = re.compile(r'"(?:[^"\\]|\\.)*"|\'(?:[^\'\\]|\\.)*\'')
SELECTOR = re.compile(r"([a-zA-Z_:][a-zA-Z0-9_:]*)?\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)")
IDENT = re.compile(r"(?<![\w.$])([a-zA-Z_:][a-zA-Z0-9_:]*)(\s*\()?")
LABEL_VALUES = re.compile(r"^label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*(\w+)\s*\)$")


def _metric_objects() -> list[MetricWrapperBase]:
    found: list[MetricWrapperBase] = []
    for module in (relay_metrics, inbox_metrics):
        for name in module.__all__:
            value = getattr(module, name)
            if isinstance(value, Counter | Gauge | Histogram):
                found.append(value)
    return found


def _sample_names(metric: MetricWrapperBase) -> set[str]:
    base: str = metric._name
    if isinstance(metric, Counter):
        return {f"{base}_total", f"{base}_created"}
    if isinstance(metric, Histogram):
        return {f"{base}_bucket", f"{base}_sum", f"{base}_count", f"{base}_created"}
    return {base}


def known_metrics() -> dict[str, set[str]]:
    """Sample name -> its label names, for every metric of the relay and the inbox."""
    known: dict[str, set[str]] = {}
    for metric in _metric_objects():
        labels = set(metric._labelnames)
        for sample in _sample_names(metric):
            known[sample] = labels
    return known


def references(expr: str) -> tuple[set[str], set[str], list[tuple[str | None, str]]]:
    """``(metric names, grouping labels, [(metric or None, matcher label)])`` of one PromQL
    expression (a small tokenizer: enough for the rules of this repository)."""
    matched = LABEL_VALUES.match(expr.strip())
    if matched:  # Grafana's template query
        return {matched.group(1)}, set(), [(matched.group(1), matched.group(2))]
    text = STRING.sub('""', expr)
    text = re.sub(r"\[[^\]]*\]", "", text)  # ranges and subqueries: [5m], [10m:1m]
    text = text.replace("$__rate_interval", "")
    matchers: list[tuple[str | None, str]] = []
    for selector in SELECTOR.finditer(text):
        for label in MATCHER.finditer(selector.group(2)):
            matchers.append((selector.group(1), label.group(1)))
    text = SELECTOR.sub(lambda m: f" {m.group(1) or ''} ", text)
    grouping: set[str] = set()
    for group in GROUPING.finditer(text):
        grouping.update(g.strip() for g in group.group(2).split(",") if g.strip())
    text = GROUPING.sub(" ", text)
    names = set()
    for ident in IDENT.finditer(text):
        name, call = ident.group(1), ident.group(2)
        if call or name.lower() in KEYWORDS:
            continue
        names.add(name)
    return names, grouping, matchers


def dashboard_exprs() -> Iterator[tuple[str, str]]:
    board: dict[str, Any] = json.loads(DASHBOARD.read_text())
    for panel in board["panels"]:
        for target in panel.get("targets", ()):
            yield f"panel {panel['title']!r}", target["expr"]
    for variable in board["templating"]["list"]:
        if variable["type"] == "query":
            yield f"variable {variable['name']!r}", variable["query"]["query"]


def alert_exprs() -> Iterator[tuple[str, str]]:
    rules: dict[str, Any] = yaml.safe_load(ALERTS.read_text())
    for group in rules["groups"]:
        for rule in group["rules"]:
            yield f"alert {rule['alert']}", rule["expr"]


EXPRESSIONS = [*dashboard_exprs(), *alert_exprs()]


@pytest.mark.parametrize(("where", "expr"), EXPRESSIONS, ids=[w for w, _ in EXPRESSIONS])
def test_every_referenced_metric_and_label_exists(where: str, expr: str) -> None:
    known = known_metrics()
    names, grouping, matchers = references(expr)
    assert names, f"{where}: no metric found in {expr!r}"
    missing = sorted(n for n in names if n not in known)
    assert not missing, f"{where}: unknown metrics {missing} in {expr!r}"
    labels = set().union(*(known[n] for n in names)) | COMMON_LABELS
    assert grouping <= labels, f"{where}: unknown labels {sorted(grouping - labels)}"
    for metric, label in matchers:
        allowed = (known[metric] if metric else labels) | COMMON_LABELS
        assert label in allowed, f"{where}: {metric} has no label {label!r}"


def test_the_tokenizer_catches_a_wrong_name_a_wrong_label_and_sees_suffixes() -> None:
    known = known_metrics()
    names, grouping, matchers = references(
        "histogram_quantile(0.99, sum by (group, le) (rate(ledgerbox_inbox_event_latency_"
        'seconds_bucket{group=~"a|b"}[5m]))) > 30 and on(group) ledgerbx_inbox_lag_records'
    )
    assert names == {"ledgerbox_inbox_event_latency_seconds_bucket", "ledgerbx_inbox_lag_records"}
    assert "ledgerbx_inbox_lag_records" not in known
    assert grouping == {"group", "le"}
    assert matchers == [("ledgerbox_inbox_event_latency_seconds_bucket", "group")]
    assert {"ledgerbox_relay_published_total", "ledgerbox_inbox_lag_records"} <= set(known)
    assert "ledgerbox_relay_published" not in known, "a counter is scraped with _total"
    assert known["ledgerbox_inbox_lag_records"] == {"group", "topic", "partition"}


def test_the_issue_s_metrics_are_on_the_dashboard_and_alerted() -> None:
    on_board = set().union(*(references(e)[0] for _, e in dashboard_exprs()))
    alerted = set().union(*(references(e)[0] for _, e in alert_exprs()))
    for name in (
        "ledgerbox_inbox_lag_records",
        "ledgerbox_inbox_event_latency_seconds_bucket",
        "ledgerbox_inbox_lock_acquired_total",
        "ledgerbox_inbox_lock_contended_total",
        "ledgerbox_inbox_lock_expired_total",
        "ledgerbox_inbox_duplicates_total",
        "ledgerbox_inbox_dead_lettered_total",
        "ledgerbox_inbox_replayed_total",
        "ledgerbox_relay_held_events",
        "ledgerbox_relay_lease_changes_total",
        "ledgerbox_relay_owned_shards",
        "ledgerbox_relay_oldest_pending_age_seconds",
        "ledgerbox_relay_published_total",
    ):
        assert name in on_board, name
    for name in (
        "ledgerbox_relay_oldest_pending_age_seconds",
        "ledgerbox_relay_up",
        "ledgerbox_relay_owned_shards",
        "ledgerbox_inbox_lag_records",
        "ledgerbox_inbox_dead_lettered_total",
        "ledgerbox_relay_held_events",
        "ledgerbox_inbox_health",
    ):
        assert name in alerted, name


def test_the_files_are_well_formed() -> None:
    board = json.loads(DASHBOARD.read_text())
    ids = [p["id"] for p in board["panels"]]
    assert len(ids) == len(set(ids)), "panel ids are unique"
    assert board["uid"] == "ledgerbox" and board["schemaVersion"] >= 36
    for panel in board["panels"]:
        if panel["type"] != "row":
            assert panel["datasource"]["uid"] == "${datasource}", panel["title"]
            assert panel["targets"], panel["title"]
    for group in yaml.safe_load(ALERTS.read_text())["groups"]:
        for rule in group["rules"]:
            assert rule["labels"]["severity"] in ("warning", "critical"), rule["alert"]
            anchor = rule["alert"].lower()
            assert rule["annotations"]["runbook"] == f"docs/observability.md#{anchor}"
            assert rule["annotations"]["summary"]
