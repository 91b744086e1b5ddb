"""deploy/grafana/maskroll-replicas.json against the replica's own metrics: a dashboard shape Grafana
imports, every metric a query names is one `maskroll serve` exports (names built from
`maskroll.server.metrics.Metrics()`, so a rename fails here), and every exported metric has a panel.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from maskroll.server.metrics import Metrics

DASHBOARD = Path(__file__).resolve().parents[2] / "deploy" / "grafana" / "maskroll-replicas.json"
# What prometheus_client puts on the wire for each family type (a Counter `x` is `x_total`).
_SUFFIXES = {
    "counter": ("_total", "_created"),
    "histogram": ("_bucket", "_sum", "_count", "_created"),
    "gauge": ("",),
}
_METRIC = re.compile(r"\bmaskroll_[a-zA-Z0-9_]+")
_SELECTOR = '{job=~"$job", namespace=~"$namespace", instance=~"$instance"}'


def exported() -> dict[str, set[str]]:
    """Family name -> the sample names it exports, whether or not it has been observed yet."""
    families = {}
    for family in Metrics().registry.collect():
        assert family.type in _SUFFIXES, f"{family.name}: no wire names known for type {family.type}"
        names = {family.name + suffix for suffix in _SUFFIXES[family.type]}
        seen = {sample.name for sample in family.samples}
        assert seen <= names, f"{family.name} exports {seen - names}, which this test does not derive"
        families[family.name] = names
    return families


@pytest.fixture(scope="module")
def dashboard() -> dict:
    return json.loads(DASHBOARD.read_text())


def panels(dashboard: dict) -> list[dict]:
    """Every panel, including those inside collapsed rows."""
    out = []
    for panel in dashboard["panels"]:
        out.append(panel)
        out.extend(panel.get("panels", []))
    return out


def queries(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    found = [
        (f"panel {p['title']!r}", t["expr"])
        for p in panels(dashboard)
        if p["type"] != "row"
        for t in p["targets"]
    ]
    for var in dashboard["templating"]["list"]:
        if var["type"] == "query":
            query = var["query"]["query"] if isinstance(var["query"], dict) else var["query"]
            found.append((f"variable {var['name']!r}", query))
    return found


def test_is_a_dashboard_grafana_imports(dashboard):
    assert dashboard["title"] and dashboard["uid"]
    assert isinstance(dashboard["schemaVersion"], int) and dashboard["schemaVersion"] >= 36
    ids = [p["id"] for p in panels(dashboard)]
    assert len(ids) == len(set(ids)), f"duplicate panel ids: {sorted(i for i in ids if ids.count(i) > 1)}"
    for panel in panels(dashboard):
        assert panel["title"] and {"h", "w", "x", "y"} <= panel["gridPos"].keys(), panel
        assert panel["gridPos"]["x"] + panel["gridPos"]["w"] <= 24, (
            f"{panel['title']!r} is wider than the grid"
        )
        if panel["type"] == "row":
            continue
        assert panel["targets"], f"panel {panel['title']!r} has no query"
        ref_ids = [t["refId"] for t in panel["targets"]]
        assert len(ref_ids) == len(set(ref_ids)), f"panel {panel['title']!r} repeats a refId"
        for target in panel["targets"]:
            assert target["expr"].strip(), f"panel {panel['title']!r} has an empty expr"


def test_queries_use_the_datasource_variable_and_the_replica_filters(dashboard):
    variables = {v["name"]: v for v in dashboard["templating"]["list"]}
    assert variables["datasource"]["type"] == "datasource"
    assert variables["datasource"]["query"] == "prometheus"
    assert {"job", "namespace", "instance"} <= variables.keys()
    ref = {"type": "prometheus", "uid": "${datasource}"}
    for panel in panels(dashboard):
        if panel["type"] == "row":
            continue
        assert panel["datasource"] == ref, f"panel {panel['title']!r} does not use ${{datasource}}"
        for target in panel["targets"]:
            assert target.get("datasource", ref) == ref, f"panel {panel['title']!r} target {target['refId']}"
            for name in _METRIC.findall(target["expr"]):
                assert f"{name}{_SELECTOR}" in target["expr"], (
                    f"panel {panel['title']!r}: {name} lacks the job/namespace/instance filters"
                )


def test_every_queried_metric_is_exported_by_the_replica(dashboard):
    known = set().union(*exported().values())
    unknown = [
        (where, name)
        for where, query in queries(dashboard)
        for name in _METRIC.findall(query)
        if name not in known
    ]
    assert not unknown, (
        f"queries name metrics `maskroll serve` does not export (server/metrics.py): {unknown}"
    )


def test_every_exported_metric_has_a_panel(dashboard):
    used = {
        name
        for p in panels(dashboard)
        if p["type"] != "row"
        for t in p["targets"]
        for name in _METRIC.findall(t["expr"])
    }
    missing = sorted(family for family, names in exported().items() if not names & used)
    assert not missing, (
        f"server/metrics.py exports {missing} but no panel of {DASHBOARD.relative_to(DASHBOARD.parents[2])} "
        "shows them: add a panel (and a row to the table in docs/deploy.md, section 7)"
    )


def test_the_checks_catch_a_renamed_metric(dashboard):
    """A typo in an expr is an unknown name, and the metric it was meant to show has no panel any more."""
    broken = json.loads(json.dumps(dashboard))
    for panel in panels(broken):
        for target in panel.get("targets", []):
            target["expr"] = target["expr"].replace(
                "maskroll_pull_jobs_active", "maskroll_pull_jobs_in_progress"
            )
    with pytest.raises(AssertionError, match="maskroll_pull_jobs_in_progress"):
        test_every_queried_metric_is_exported_by_the_replica(broken)
    with pytest.raises(AssertionError, match="add a panel"):
        test_every_exported_metric_has_a_panel(broken)
