"""`plan` through the real CLI on the simulated host: it shows what `acquire`
would do, exits 3 on a refusal like `acquire`, and changes nothing at all."""

from __future__ import annotations

import json

from opstools import assert_golden
from simhosts import default_host, holder


def snapshot(sim) -> dict[str, bytes]:
    """Every file a claim could change: the ledger, the host's state, the history."""
    files = [
        sim.state_dir / "ledger.toml",
        sim.sim_dir / "state.json",
        sim.sim_dir / "log.jsonl",
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


# -- plan --release ------------------------------------------------------------------------


def preempted_by_a_vm(sim) -> None:
    """container:llm shares gpu0; libvirt:win11 claims it exclusively (stopping llm and
    ollama, taking llm's lease), then shuts down."""
    sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    sim.stopped("libvirt:win11")


def test_plan_release_shows_what_goes_home_and_who_comes_back_and_changes_nothing(sim):
    preempted_by_a_vm(sim)
    before = snapshot(sim)
    result = sim.cli("plan", "--release", "libvirt:win11")
    assert result.returncode == 0, result.stderr
    assert_golden("plan-release.txt", result.stdout)
    assert snapshot(sim) == before


def test_the_release_plan_is_what_release_then_does(sim):
    preempted_by_a_vm(sim)
    planned = json.loads(sim.cli("plan", "--release", "--json", "libvirt:win11").stdout)
    assert planned["lease"] == {"mode": "exclusive", "tokens": ["gpu0"], "state": "active"}
    log_before = len(sim.host().snapshot()["log"])
    sim.cli("release", "libvirt:win11", check=True)
    log = sim.host().snapshot()["log"][log_before:]
    # The holders start in the planned order (newest stop first) ...
    started = [c["holder"] for c in planned["come_back"] if c["way"] == "start"]
    assert [f"start {holder}" for holder in started] == [
        line for line in log if line.startswith("start ")
    ]
    # ... the GPU goes to the planned drivers ...
    (home,) = planned["home"]
    drivers = sim.status()["tokens"]["gpu0"]["drivers"]
    assert {s["address"]: s["to"] for s in home["switches"]} == drivers
    # ... and the shared claimant has the planned lease back.
    leases = {lease["claimant"]: lease["tokens"] for lease in sim.status()["leases"]}
    assert leases == {
        c["holder"]: c["shared_lease"] for c in planned["come_back"] if c["shared_lease"]
    }
    assert leases == {"container:llm": ["gpu0"]}


def test_plan_release_of_a_claimant_that_runs_exits_3_unless_forced(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    before = snapshot(sim)
    refused = sim.cli("plan", "--release", "libvirt:win11")
    assert refused.returncode == 3, refused.stderr
    assert "releasing libvirt:win11 would be refused: libvirt:win11 still runs" in refused.stdout
    assert "hint: stop libvirt:win11 first" in refused.stdout
    as_json = json.loads(sim.cli("plan", "--release", "--json", "libvirt:win11").stdout)
    assert as_json["refused"].startswith("libvirt:win11 still runs")
    forced = sim.cli("plan", "--release", "--force", "libvirt:win11")
    assert forced.returncode == 0, forced.stderr
    assert "send gpu0 home" in forced.stdout
    assert snapshot(sim) == before
    # `release` itself agrees: refused, exit 3.
    assert sim.cli("release", "libvirt:win11").returncode == 3


def test_plan_release_of_a_shared_lease_that_is_not_the_last(make_sim):
    # A VM with gpu0 passed through: what a shared claim cannot coexist with.
    sim = make_sim(host=default_host() + holder("libvirt", "vfio-vm", ["gpu0"], preemptible=True))
    sim.cli("acquire", "--shared", "container:a", "gpu0", check=True)
    sim.cli("acquire", "--shared", "container:b", "gpu0", check=True)
    sim.stopped("container:a")
    result = sim.cli("plan", "--release", "container:a")
    assert result.returncode == 0, result.stderr
    assert "The lease ends at once: every GPU it holds stays in use." in result.stdout
    # The first shared claim stopped the VM that had gpu0 passed through: it stays
    # stopped for b.
    assert "hand libvirt:vfio-vm to container:b" in result.stdout


def test_plan_release_without_a_lease_and_its_usage_errors(sim):
    result = sim.cli("plan", "--release", "libvirt:nobody")
    assert result.returncode == 0
    assert result.stdout == "libvirt:nobody holds no lease: releasing it changes nothing.\n"
    document = json.loads(sim.cli("plan", "--release", "--json", "libvirt:nobody").stdout)
    assert document == {"claimant": "libvirt:nobody", "holds_no_lease": True, "release": True}
    for argv in (
        ("plan", "--release", "libvirt:win11", "gpu0"),
        ("plan", "--release", "--exclusive", "libvirt:win11"),
        ("plan", "--force", "--exclusive", "libvirt:win11", "gpu0"),
    ):
        usage = sim.cli(*argv)
        assert usage.returncode == 2, (argv, usage.stderr)
