"""The --json outputs a program reads (Cockpit's GPUs page among them), through the
real CLI on the simulated host: stranded reasons and poison times in `status`,
`restore --dry-run --json` as the plan of a restore, `poison --json`, the
sentence of each `history` event, and `status --json --follow`."""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import time
from pathlib import Path

from simhosts import default_host

POISONING_HOST = default_host(gpu1="fail_switch = true", dm_preemptible=True)


def test_status_says_why_a_lease_is_stranded_and_since_when_a_token_is_poisoned(make_sim):
    sim = make_sim(host=POISONING_HOST)
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    assert sim.cli("acquire", "--exclusive", "libvirt:lab", "gpu1").returncode == 1
    document = sim.status()
    assert document["leases"][0]["stranded_why"] == ""
    poisoned = document["tokens"]["gpu1"]
    assert poisoned["poisoned"] and poisoned["since"]
    assert poisoned["since"] == json.loads(sim.cli("poison", "list", "--json").stdout)[0]["since"]
    assert document["tokens"]["gpu0"]["since"] == ""
    sim.stopped("libvirt:win11")
    document = sim.status()
    assert document["stranded"] == ["libvirt:win11"]
    assert document["leases"][0]["stranded_why"] == "libvirt:win11 is not running any more"
    sim.cli("sim", "reboot", check=True)
    why = sim.status()["leases"][0]["stranded_why"]
    assert why == "it was made before the last reboot"
    explained = sim.cli("explain", "libvirt:win11", check=True).stdout
    assert f"is stranded: {why}." in explained  # the same words as `explain`


def test_restore_dry_run_json_is_the_plan_and_changes_nothing(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    sim.stopped("libvirt:win11")
    before = sim.status()
    plan = json.loads(sim.cli("restore", "--dry-run", "--json", check=True).stdout)
    assert plan["dry_run"] is True
    (item,) = plan["claimants"]
    assert item["claimant"] == "libvirt:win11"
    assert item["mode"] == "exclusive" and item["tokens"] == ["gpu0"]
    assert sorted(item["start_again"]) == ["container:llm", "systemd:ollama.service"]
    assert sim.status() == before
    done = json.loads(sim.cli("restore", "--json", "libvirt:win11", check=True).stdout)
    assert done["dry_run"] is False
    assert [entry["claimant"] for entry in done["claimants"]] == ["libvirt:win11"]
    assert sim.status()["leases"] == []
    nothing = json.loads(sim.cli("restore", "--json", check=True).stdout)
    assert nothing == {"claimants": [], "dry_run": False}


def test_a_refused_restore_prints_no_json_and_the_reason_on_stderr(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    refused = sim.cli("restore", "--json", "libvirt:win11")
    assert refused.returncode == 3
    assert refused.stdout == ""
    assert "libvirt:win11 still runs" in refused.stderr


def test_poison_json(make_sim):
    sim = make_sim(host=POISONING_HOST)
    assert json.loads(sim.cli("poison", "list", "--json").stdout) == []
    sim.cli("acquire", "--exclusive", "libvirt:lab", "gpu1")
    (entry,) = json.loads(sim.cli("poison", "list", "--json").stdout)
    assert entry["token"] == "gpu1" and "simulated failure" in entry["reason"]
    cleared = sim.cli("poison", "clear", "--json", "gpu1", check=True)
    assert json.loads(cleared.stdout) == {"cleared": True, "token": "gpu1"}
    again = sim.cli("poison", "clear", "--json", "gpu1", check=True)
    assert json.loads(again.stdout) == {"cleared": False, "token": "gpu1"}


def test_history_json_carries_the_sentence_the_text_shows(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu1")
    documents = json.loads(sim.cli("history", "--json", check=True).stdout)
    lines = sim.cli("history", check=True).stdout.strip().splitlines()
    assert len(documents) == len(lines) >= 1
    for document, line in zip(documents, lines, strict=True):
        assert line.split(None, 3)[3].endswith(document["message"]), (line, document)
    assert documents[-1]["event"] == "refused"


def _line(process: subprocess.Popen[str], timeout: float = 15) -> dict:
    ready, _, _ = select.select([process.stdout], [], [], timeout)
    assert ready, f"no line within {timeout} s"
    line = process.stdout.readline()
    assert line.endswith("\n"), line
    return json.loads(line)


def test_follow_prints_a_line_per_change_and_ends_with_its_reader(sim):
    follower = subprocess.Popen(
        [sys.executable, "-m", "charly_arbiter", "status", "--json", "--follow"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=sim.env(),
    )
    try:
        first = _line(follower)
        assert first == sim.status()
        assert not sim.state_dir.exists()  # nothing to watch yet: it looks once a second
        sim.cli("acquire", "--shared", "container:llm", "gpu0", check=True)
        claimed = _line(follower)
        assert claimed["generation"] > first["generation"]
        assert claimed["tokens"]["gpu0"]["mode"] == "shared"
        # Now there is a state directory: it waits on the kernel's word (inotify).
        descriptors = Path(f"/proc/{follower.pid}/fd")
        _wait_for(lambda: "anon_inode:inotify" in _links(descriptors), "an inotify descriptor")
        # A refusal writes only the history: a line all the same, for the timeline.
        assert sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu1").returncode == 3
        refused = _line(follower)
        assert refused["generation"] == claimed["generation"]
        # Nothing changes: nothing is printed.
        ready, _, _ = select.select([follower.stdout], [], [], 2.5)
        assert not ready, follower.stdout.readline()
        follower.stdout.close()  # the reader goes away
        follower.wait(timeout=10)
        assert follower.returncode == 0, follower.stderr.read()
    finally:
        if follower.poll() is None:
            follower.kill()
            follower.wait()


def test_follow_needs_json(sim):
    result = sim.cli("status", "--follow")
    assert result.returncode == 2 and "--follow needs --json" in result.stderr


def _links(directory: Path) -> list[str]:
    found = []
    for entry in directory.iterdir():
        try:
            found.append(os.readlink(entry))
        except OSError:
            continue
    return found


def _wait_for(condition, what: str, timeout: float = 15) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"no {what} within {timeout} s"
        time.sleep(0.05)
