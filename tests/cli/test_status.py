"""`status` (cli/status.py): its JSON alone on stdout, what runs on each token of a
fresh host, and its table with names as long and as wide as claimants may have: the
columns stay aligned by display width (a CJK character takes two columns), and a
cell too wide for its column gets a line of its own instead of pushing the rest."""

from __future__ import annotations

import json
import unicodedata
from collections.abc import Callable

import pytest

from charly_arbiter.cli.status import MAX_CELL, width
from tests.conftest import DEFAULT_CONFIG, SimEnv


@pytest.fixture
def hostile_sim(make_sim: Callable[..., SimEnv]) -> SimEnv:
    return make_sim(config=DEFAULT_CONFIG + "\n")


@pytest.mark.parametrize("name", ["x" * 200, "虚拟机" * 30, "虚拟机", "a b"])
def test_long_and_wide_names_keep_the_status_columns(hostile_sim: SimEnv, name: str) -> None:
    sim = hostile_sim
    sim.cli("acquire", "--shared", "--", f"libvirt:{name}", "gpu0", check=True)
    sim.cli("acquire", "--shared", "container:short", "gpu0", check=True)
    table = sim.cli("status").stdout.split("\n\n")[0].splitlines()
    head = next(i for i, line in enumerate(table) if line.lstrip().startswith("HOLDER"))
    header = table[head]
    mode_column = display_width(header[: header.index("MODE")])
    for line in table[head + 1 :]:
        if line.lstrip().startswith("used by "):
            break  # after the table: a holder that runs without a lease (container:llm)
        if "shared" not in line:
            assert line.lstrip().startswith("libvirt:"), line  # a wide cell on its own line
            continue
        assert display_width(line[: line.index("shared")]) == mode_column, (line, header)


def display_width(text: str) -> int:
    return sum(2 if unicodedata.east_asian_width(c) in ("W", "F") else 1 for c in text)


def test_display_width_counts_wide_characters_twice_and_marks_not_at_all() -> None:
    assert width("gpu0") == 4
    assert width("虚拟机") == 6
    assert width("e\u0301") == 1  # e and a combining acute accent
    assert MAX_CELL < 200


def test_status_json_is_the_only_thing_on_stdout(sim):
    sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
    result = sim.cli("status", "--json")
    assert result.returncode == 0 and result.stderr == ""
    document = json.loads(result.stdout)
    assert document["leases"][0]["claimant"] == "container:llm"
    human = sim.cli("status")
    assert human.returncode == 0 and human.stderr == ""
    assert "container:llm" in human.stdout and "gpu0" in human.stdout


def test_status_of_a_fresh_host_says_what_runs_on_each_token(sim):
    """gpu0's holders may be stopped for a claim: idle.  gpu1's display manager may not:
    in use (a token whose holder is not preemptible is not idle)."""
    document = sim.status()
    assert document["leases"] == [] and document["stranded"] == []
    assert {name: token["mode"] for name, token in document["tokens"].items()} == {
        "gpu0": "idle",
        "gpu1": "in-use",
    }
    human = sim.cli("status", check=True).stdout
    assert (
        "used by systemd:display-manager.service without a lease "
        "(not preemptible: exclusive claims are refused)"
    ) in human
    assert "used by container:llm without a lease (preemptible: an exclusive claim stops it)" in (
        human
    )
