"""The shipped Grafana dashboard (etc/grafana/charly-arbiter.json) is one Grafana
can load and whose queries work: valid JSON with the fields Grafana needs, panels
that do not overlap, every query valid PromQL for Debian's real promtool (which
cannot run a query offline, but checks an expression given as a recording rule),
and every metric it reads one the real `charly-arbiter metrics` exports.

`problems` is the checker; the last test plants each kind of defect in a copy
and sees the checker find it.
"""

from __future__ import annotations

import copy
import itertools
import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import yaml
from promseries import exported_names
from promtool import REPO, metric_names, promtool

DASHBOARD = REPO / "etc" / "grafana" / "charly-arbiter.json"
PANEL_TYPES = {"stat", "timeseries", "table", "state-timeline"}
# Grafana's own variables, with values of the kind it puts in their place.
BUILTINS = {"__rate_interval": "4m", "__interval": "1m", "__range": "6h"}
_VARIABLE = re.compile(r"\$(?:\{(\w+)\}|(\w+))")
_LABEL_VALUES = re.compile(r"label_values\(\s*([a-zA-Z_:][a-zA-Z0-9_:]*)\s*,\s*(\w+)\s*\)")
GRID_WIDTH = 24


def problems(dashboard: dict[str, Any], exported: set[str], directory: Path) -> list[str]:
    """Everything that would stop Grafana from showing this dashboard's data."""
    found = []
    uid = dashboard.get("uid")
    if not isinstance(uid, str) or not re.fullmatch(r"[A-Za-z0-9_-]{1,40}", uid):
        found.append(f"uid {uid!r}: Grafana wants 1 to 40 letters, digits, - or _")
    for key, kind in (("title", str), ("schemaVersion", int), ("panels", list)):
        if not isinstance(dashboard.get(key), kind) or not dashboard[key]:
            found.append(f"no {key}")
    variables = {var["name"]: var for var in dashboard.get("templating", {}).get("list", [])}
    source = variables.get("datasource", {})
    if (source.get("type"), source.get("query")) != ("datasource", "prometheus"):
        found.append("no Prometheus data source variable `datasource`")
    for name, var in variables.items():
        if var.get("type") == "query":
            match = _LABEL_VALUES.fullmatch(var.get("definition", ""))
            if match is None or match.group(1) not in exported:
                found.append(f"variable {name}: {var.get('definition')!r} reads no exported metric")
    panels = dashboard.get("panels") or []
    ids = [panel.get("id") for panel in panels]
    if len(set(ids)) != len(ids) or not all(isinstance(i, int) for i in ids):
        found.append(f"panel ids are not unique integers: {ids}")
    for panel in panels:
        found += [f"panel {panel.get('id')}: {what}" for what in _panel_problems(panel)]
    for one, other in itertools.combinations(panels, 2):
        if _overlap(one.get("gridPos", {}), other.get("gridPos", {})):
            found.append(f"panels {one.get('id')} and {other.get('id')} overlap")
    rules = []
    for panel in panels:
        for target in panel.get("targets", []):
            expr = target.get("expr", "")
            where = f"panel {panel.get('id')} {target.get('refId')}"
            used = {a or b for a, b in _VARIABLE.findall(expr)}
            if used - set(variables) - set(BUILTINS):
                found.append(f"{where}: undefined variables {sorted(used - set(variables))}")
                continue
            values = {**BUILTINS, **{name: "gpuhost1:9100" for name in variables}}
            query = _VARIABLE.sub(lambda m: values[m.group(1) or m.group(2)], expr)
            unknown = metric_names(query) - exported
            if unknown:
                found.append(
                    f"{where}: reads {sorted(unknown)}, which charly-arbiter does not export"
                )
            record = f"dashboard:panel{panel.get('id')}_{target.get('refId')}"
            rules.append({"record": record, "expr": query})
    path = directory / "dashboard-queries.rules.yml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "dashboard", "rules": rules}]}))
    checked = promtool("check", "rules", str(path))
    if checked.returncode != 0:
        found.append(f"promtool check rules on the queries:\n{checked.stdout}{checked.stderr}")
    return found


def _panel_problems(panel: dict[str, Any]) -> list[str]:
    found = []
    if panel.get("type") not in PANEL_TYPES:
        found.append(f"type {panel.get('type')!r} is not one of {sorted(PANEL_TYPES)}")
    if not panel.get("title"):
        found.append("no title")
    grid = panel.get("gridPos", {})
    if not all(isinstance(grid.get(key), int) for key in "xywh"):
        found.append(f"gridPos {grid} needs integers x, y, w, h")
    elif not (grid["x"] >= 0 and grid["y"] >= 0 and grid["w"] > 0 and grid["h"] > 0):
        found.append(f"gridPos {grid} is empty or outside the grid")
    elif grid["x"] + grid["w"] > GRID_WIDTH:
        found.append(f"gridPos {grid} is wider than the grid's {GRID_WIDTH} columns")
    if panel.get("datasource", {}).get("uid") != "${datasource}":
        found.append("does not read from the chosen data source")
    targets = panel.get("targets") or []
    if not targets:
        found.append("no targets")
    refs = [target.get("refId") for target in targets]
    if len(set(refs)) != len(refs) or not all(refs):
        found.append(f"refIds {refs} are not unique")
    if not all(isinstance(target.get("expr"), str) and target["expr"] for target in targets):
        found.append("a target without an expr")
    return found


def _overlap(one: dict[str, int], other: dict[str, int]) -> bool:
    try:
        return (
            one["x"] < other["x"] + other["w"]
            and other["x"] < one["x"] + one["w"]
            and one["y"] < other["y"] + other["h"]
            and other["y"] < one["y"] + one["h"]
        )
    except (KeyError, TypeError):
        return False  # reported as a gridPos problem


def dashboard() -> dict[str, Any]:
    document: dict[str, Any] = json.loads(DASHBOARD.read_text())
    return document


@pytest.fixture(scope="module")
def exported(tmp_path_factory: pytest.TempPathFactory) -> set[str]:
    """What the real `metrics` exports, on the example host `sim init` writes."""
    directory = tmp_path_factory.mktemp("example")
    run = [sys.executable, "-m", "charly_arbiter"]
    subprocess.run([*run, "sim", "init", str(directory)], check=True, capture_output=True)
    env = {**os.environ, "CHARLY_ARBITER_CONFIG": str(directory / "arbiter.toml")}
    metrics = subprocess.run(
        [*run, "metrics"], check=True, capture_output=True, text=True, env=env, cwd=REPO
    )
    return exported_names(metrics.stdout)


def test_the_shipped_dashboard_loads_and_every_query_works(exported, tmp_path):
    assert problems(dashboard(), exported, tmp_path) == []


def test_the_dashboard_shows_every_metric_the_arbiter_exports(exported):
    shown = set()
    for panel in dashboard()["panels"]:
        for target in panel["targets"]:
            shown |= metric_names(target["expr"])
    assert exported - shown == set()


def test_metric_names_finds_what_an_expression_reads():
    expr = (
        'sum by (instance, token) (increase(charly_arbiter_refusals_total{instance=~"$i"}[5m]))'
        " unless on (instance) up offset 5m > 1e3 or vector(0) * time()"
    )
    assert metric_names(expr) == {"charly_arbiter_refusals_total", "up"}
    assert metric_names('x{a="b}c"} / ignoring (a) group_left y') == {"x", "y"}


def _expr(panel_index: int, change: Callable[[str], str]) -> Callable[[dict[str, Any]], None]:
    def plant(board: dict[str, Any]) -> None:
        target = board["panels"][panel_index]["targets"][0]
        target["expr"] = change(target["expr"])

    return plant


DEFECTS: dict[str, tuple[Callable[[dict[str, Any]], None], str]] = {
    "an expression that does not parse": (_expr(0, lambda e: e + ")"), "promtool check rules"),
    "a metric the arbiter does not export": (
        _expr(0, lambda e: e.replace("poisoned", "poisond")),
        "does not export",
    ),
    "an undefined variable": (_expr(1, lambda e: e.replace("$instance", "$host")), "undefined"),
    "two panels with one id": (lambda b: b["panels"][1].update(id=b["panels"][0]["id"]), "ids"),
    "two panels in one place": (
        lambda b: b["panels"][1].update(gridPos=dict(b["panels"][0]["gridPos"])),
        "overlap",
    ),
    "a panel out of the grid": (lambda b: b["panels"][2]["gridPos"].update(x=23), "wider"),
    "a panel without a query": (lambda b: b["panels"][3].update(targets=[]), "no targets"),
    "no uid": (lambda b: b.pop("uid"), "uid"),
    "a host list from no metric": (
        lambda b: b["templating"]["list"][1].update(definition="label_values(up, instance)"),
        "reads no exported metric",
    ),
}


@pytest.mark.parametrize("defect", DEFECTS)
def test_the_checker_finds_a_planted_defect(exported, tmp_path, defect):
    plant, said = DEFECTS[defect]
    board = copy.deepcopy(dashboard())
    plant(board)
    found = problems(board, exported, tmp_path)
    assert any(said in problem for problem in found), found
