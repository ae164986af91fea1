"""The simulated host's own files: its log kept apart from the state every call reads,
and no descriptor held between calls (tests make thousands of hosts and close none)."""

from __future__ import annotations

import json
import os

from tests.conftest import SimEnv

HOLDER = "container:x"


def test_the_log_is_appended_apart_and_the_state_stays_small(sim: SimEnv):
    host = sim.host()
    for _ in range(50):
        host.stop(HOLDER)
        host.start(HOLDER)
    state = json.loads((sim.sim_dir / "state.json").read_text())
    assert "log" not in state
    lines = (sim.sim_dir / "log.jsonl").read_text().splitlines()
    assert len(lines) == 100
    assert host.log() == host.snapshot()["log"] == [json.loads(line) for line in lines]
    assert host.log()[-2:] == [f"stop {HOLDER}", f"start {HOLDER}"]


def test_a_state_of_an_earlier_version_has_its_log_moved_out(sim: SimEnv):
    host = sim.host()
    host.boot_id()  # state.json made
    path = sim.sim_dir / "state.json"
    old = json.loads(path.read_text())
    path.write_text(json.dumps({**old, "log": ["stop container:llm", "reboot"]}))
    host.stop(HOLDER)
    assert "log" not in json.loads(path.read_text())
    assert host.log() == ["stop container:llm", "reboot", f"stop {HOLDER}"]


def test_no_descriptor_is_held_between_calls(sim: SimEnv):
    before = len(os.listdir("/proc/self/fd"))
    for _ in range(200):
        host = sim.host()
        host.boot_id()
        host.stop(HOLDER)
    assert len(os.listdir("/proc/self/fd")) == before
