"""Helpers for the core tests: host descriptions with fault injection, and
snapshots of everything a test compares (ledger bytes, simulated host state)."""

from __future__ import annotations

import fcntl
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from invariants import HostFacts, assert_invariants, sim_facts
from simhosts import default_host

from charly_arbiter.core.ledger import LEDGER, Ledger
from charly_arbiter.core.model import LedgerState

REPO = Path(__file__).resolve().parent.parent.parent

host_toml = default_host  # the default host, with fault lines added by name

# Every holder preemptible: lets a state machine claim both tokens exclusively.
ALL_PREEMPTIBLE = host_toml(dm_preemptible=True)


def bind_by_hand(sim_dir: Path, drivers: Mapping[str, str]) -> None:
    """What an operator does through sysfs by hand: bind functions of the simulated
    host to drivers (state.json, under the simulation's own lock, written atomically;
    each bind in its log, log.jsonl)."""
    lock = os.open(sim_dir / "state.lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)
        path = sim_dir / "state.json"
        state = json.loads(path.read_text())
        for address, driver in sorted(drivers.items()):
            state["drivers"][address] = driver
        temp = sim_dir / "state.json.by-hand"
        temp.write_text(json.dumps(state, indent=1, sort_keys=True))
        os.replace(temp, path)
        with open(sim_dir / "log.jsonl", "a", encoding="utf-8") as log:
            for address, driver in sorted(drivers.items()):
                log.write(json.dumps(f"bind {address} {driver} (by hand)") + "\n")
    finally:
        os.close(lock)


# The crash points of a ledger write, in order (core/ledger.py's `crashpoint` calls):
# a kill -9 at each must leave the previous generation or the new one, never less.
LEDGER_STEPS = (
    "ledger.open_temp",
    "ledger.write_half",
    "ledger.write_all",
    "ledger.fsync_temp",
    "ledger.backup",
    "ledger.rename",
    "ledger.fsync_dir",
)
HOLDER_REFS = ("container:llm", "systemd:ollama.service", "systemd:display-manager.service")
HOME = {"0000:0a:00.0": "nvidia", "0000:0a:00.1": "snd_hda_intel", "0000:0b:00.0": "nvidia"}
TOKEN_FUNCTIONS = {"gpu0": ("0000:0a:00.0", "0000:0a:00.1"), "gpu1": ("0000:0b:00.0",)}


def ledger_bytes(state_dir: Path) -> bytes | None:
    path = state_dir / LEDGER
    return path.read_bytes() if path.exists() else None


def read_ledger(state_dir: Path) -> LedgerState:
    """The ledger as any command would read it: parses and verifies, or raises."""
    return Ledger(state_dir).read()


def host_state(sim: Any) -> dict[str, Any]:
    """The simulated host's drivers, running holders and sleep locks (the log is left
    out)."""
    snapshot = sim.host().snapshot()
    return {
        "drivers": snapshot["drivers"],
        "running": snapshot["running"],
        "sleep_locks": snapshot.get("sleep_locks", {}),
    }


def facts(sim: Any, expected_running: tuple[str, ...] = HOLDER_REFS) -> HostFacts:
    """The default simulated host's facts, for the shared invariant checks."""
    return sim_facts(sim.host().snapshot(), TOKEN_FUNCTIONS, expected_running)


def check_invariants(sim: Any, context: object = "") -> None:
    """I1-I3 on the default simulated host and its ledger."""
    assert_invariants(read_ledger(sim.state_dir), facts(sim), context)


def assert_converged(sim: Any) -> None:
    """Nothing leased, every function on its home driver, every holder running."""
    state = read_ledger(sim.state_dir)
    assert state.leases == (), state.leases
    snapshot = sim.host().snapshot()
    assert snapshot["drivers"] == HOME
    assert not snapshot.get("sleep_locks"), snapshot["sleep_locks"]
    for ref in HOLDER_REFS:
        assert snapshot["running"][ref], f"{ref} is not running: {snapshot['running']}"
