"""Debian's real promtool over the shipped alerting rules: `check rules`, and
`test rules` with series from promseries and the alerts each minute should show.

`verify` runs a scenario's checks against the shipped rules and then against
broken copies of one alert (its expression or its `for` changed), each of which
must still be valid rules and must make the same checks fail: a check that a
broken alert passes would not guard anything.
"""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
import yaml

REPO = Path(__file__).resolve().parents[3]
RULES = REPO / "etc" / "prometheus" / "charly-arbiter.rules.yml"
PROMTOOL = Path("/usr/bin/promtool")
# The labels Prometheus gives every sample it scrapes from one host's node_exporter.
TARGET = {"instance": "gpuhost1:9100", "job": "node"}

_LABEL = re.compile(r"\{\{ \$labels\.([a-zA-Z_][a-zA-Z0-9_]*) \}\}")
_STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
_GROUPING = re.compile(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)")
_WORD = re.compile(r"(?<![\w.])[a-zA-Z_:][a-zA-Z0-9_:]*")
_KEYWORDS = frozenset(
    "by without on ignoring group_left group_right bool and or unless offset inf nan".split()
)


def promtool(*args: str, cwd: Path | None = None) -> subprocess.CompletedProcess[str]:
    if not PROMTOOL.exists():
        pytest.fail(f"{PROMTOOL} is missing: Debian's `prometheus` package (scripts/setup)")
    return subprocess.run(
        [str(PROMTOOL), *args], capture_output=True, text=True, timeout=120, cwd=cwd, check=False
    )


def metric_names(expr: str) -> set[str]:
    """The metric names a PromQL expression reads: the words left once strings,
    label matchers, ranges, grouping label lists, calls and keywords are out."""
    text = _STRING.sub('""', expr)
    text = re.sub(r"\{[^}]*\}", " ", text)
    text = re.sub(r"\[[^\]]*\]", " ", text)
    text = _GROUPING.sub(" ", text)
    names = set()
    for match in _WORD.finditer(text):
        called = text[match.end() :].lstrip().startswith("(")
        if not called and match.group().lower() not in _KEYWORDS:
            names.add(match.group())
    return names


def alerting_rules(path: Path = RULES) -> dict[str, dict[str, Any]]:
    """alert name -> its rule, as written in the file."""
    document = yaml.safe_load(path.read_text())
    return {
        rule["alert"]: rule
        for group in document["groups"]
        for rule in group["rules"]
        if "alert" in rule
    }


def rendered(rule: Mapping[str, Any], labels: Mapping[str, str]) -> dict[str, str]:
    """The rule's annotations as Prometheus renders them for an alert with `labels`.
    They may use `{{ $labels.NAME }}` and nothing else of Go's templates, so this
    is all the rendering there is to do; promtool compares it with its own."""
    annotations = {}
    for name, template in rule.get("annotations", {}).items():
        text = _LABEL.sub(lambda match: labels[match.group(1)], template)
        assert "{{" not in text, f"{rule['alert']}'s {name} uses more than $labels: {template}"
        annotations[name] = text
    return annotations


def firing(alert: str, minute: int, *series_labels: Mapping[str, str]) -> dict[str, Any]:
    """At `minute`, `alert` fires once for each of these label sets (the labels of
    the series it fires for, beside the host's), and for nothing else."""
    rule = alerting_rules()[alert]
    expected = []
    for labels in series_labels:
        full = {**TARGET, **labels, **rule.get("labels", {})}
        expected.append(
            {"exp_labels": full, "exp_annotations": rendered(rule, {**TARGET, **labels})}
        )
    return {"eval_time": f"{minute}m", "alertname": alert, "exp_alerts": expected}


def quiet(alert: str, minute: int) -> dict[str, Any]:
    """At `minute`, `alert` does not fire (pending is not firing)."""
    return firing(alert, minute)


def run_tests(
    directory: Path,
    series: Sequence[Mapping[str, str]],
    checks: Sequence[Mapping[str, Any]],
    rules: Path,
) -> subprocess.CompletedProcess[str]:
    test = {
        "rule_files": [str(rules)],
        "evaluation_interval": "1m",
        "tests": [
            {"interval": "1m", "input_series": list(series), "alert_rule_test": list(checks)}
        ],
    }
    path = directory / f"{rules.stem}.test.yml"
    path.write_text(json.dumps(test, indent=1))  # JSON is YAML
    return promtool("test", "rules", str(path))


def broken(directory: Path, alert: str, change: Mapping[str, str]) -> Path:
    """A copy of the shipped rules with one alert's `expr` or `for` changed; still
    valid rules (promtool check rules says so)."""
    document = yaml.safe_load(RULES.read_text())
    rules = [rule for group in document["groups"] for rule in group["rules"]]
    (rule,) = [rule for rule in rules if rule.get("alert") == alert]
    assert set(change) <= {"expr", "for"}, change
    assert any(rule.get(key) != text for key, text in change.items()), "nothing changes"
    rule.update(change)
    path = directory / f"broken-{len(list(directory.glob('broken-*.rules.yml')))}.rules.yml"
    path.write_text(yaml.safe_dump(document, sort_keys=False))
    checked = promtool("check", "rules", str(path))
    assert checked.returncode == 0, (
        f"{change} is not even valid rules:\n{checked.stdout}{checked.stderr}"
    )
    return path


def verify(
    directory: Path,
    series: Sequence[Mapping[str, str]],
    checks: Sequence[Mapping[str, Any]],
    alert: str,
    breakages: Sequence[Mapping[str, str]],
) -> None:
    """The checks pass on the shipped rules, and fail on each breakage of `alert`."""
    assert {check["alertname"] for check in checks} == {alert}
    result = run_tests(directory, series, checks, RULES)
    assert result.returncode == 0, f"promtool test rules:\n{result.stdout}{result.stderr}"
    assert breakages, "a check must be shown to catch a broken alert"
    for change in breakages:
        result = run_tests(directory, series, checks, broken(directory, alert, change))
        assert result.returncode != 0, (
            f"the checks of {alert} pass with {change}: they guard nothing"
        )
        assert alert in result.stdout + result.stderr, result.stdout + result.stderr
