"""`plan` through the real CLI on the simulated host: it shows what `acquire`
would do, exits 3 on a refusal like `acquire`, and changes nothing at all."""

from __future__ import annotations

import json

from opstools import assert_golden


def snapshot(sim) -> dict[str, bytes]:
    """Every file a claim could change: the ledger, the host's state, the history."""
    files = [
        sim.state_dir / "ledger.toml",
        sim.sim_dir / "state.json",
        sim.state_dir / "history.jsonl",
    ]
    return {path.name: path.read_bytes() for path in files if path.exists()}


def test_plan_shows_the_stops_and_switches_and_changes_nothing(sim):
    # A refusal leaves a history file and the host's state file, but no ledger.
    assert sim.cli("acquire", "--exclusive", "libvirt:other", "gpu1").returncode == 3
    before = snapshot(sim)
    assert set(before) == {"state.json", "history.jsonl"}
    result = sim.cli("plan", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 0, result.stderr
    assert_golden("plan-exclusive.txt", result.stdout)
    assert snapshot(sim) == before


def test_plan_with_a_ledger_in_place_changes_no_byte_of_it(sim):
    sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
    before = snapshot(sim)
    assert "ledger.toml" in before
    result = sim.cli("plan", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 0, result.stderr
    assert "container:llm (stop, whose shared lease on gpu0 it takes over)" in result.stdout
    assert snapshot(sim) == before


def test_a_refused_plan_exits_3_and_names_the_holder(sim):
    sim.cli("status", check=True)
    before = snapshot(sim)
    result = sim.cli("plan", "--exclusive", "libvirt:win11", "gpu1")
    assert result.returncode == 3
    assert "libvirt:win11 would be refused" in result.stdout
    assert "systemd:display-manager.service, which is not preemptible" in result.stdout
    assert "hint: stop systemd:display-manager.service first" in result.stdout
    assert snapshot(sim) == before


def test_the_plan_is_what_acquire_then_does(sim):
    planned = json.loads(sim.cli("plan", "--json", "--exclusive", "libvirt:win11", "gpu0").stdout)
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    log = sim.host().snapshot()["log"]
    assert [f"stop {step['holder']}" for step in planned["stops"]] == [
        line for line in log if line.startswith("stop ")
    ]
    drivers = sim.status()["tokens"]["gpu0"]["drivers"]
    assert {s["address"]: s["to"] for s in planned["switches"]} == drivers
    assert {s["from"] for s in planned["switches"]} == {"nvidia", "snd_hda_intel"}


def test_plan_of_a_held_claim_says_there_is_nothing_to_do(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    result = sim.cli("plan", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 0
    assert result.stdout.strip() == "libvirt:win11 already holds gpu0 (exclusive): nothing to do"


def test_plan_needs_a_mode(sim):
    result = sim.cli("plan", "libvirt:win11", "gpu0")
    assert result.returncode == 2
    assert "say --exclusive or --shared" in result.stderr
