"""Concurrency through the real CLI (issue 9): many claimants in 6 to 13 worker
processes claim and release one or two of four GPUs, exclusive or shared,
while a lock-free reader checks every ledger generation it can see.

The host: four GPUs (gpu0 and gpu2 with an HDMI audio function in their IOMMU
group), a preemptible holder or two on each, one of them spanning two GPUs.
Each worker owns its claimants (a VM that mostly claims exclusively, one or
two containers that mostly share) and repeats: make the claimant run (it
starts), `acquire --exclusive|--shared CLAIMANT TOKEN [TOKEN]`, hold it a few
ms, `release --force CLAIMANT`.  The worker plays the claimant saying that it
is done, and the simulated host counts a claimant it was not told about as
running, hence `--force`.

Preemption: an exclusive claim stops the shared claimants on its GPUs and takes
their leases into its own; its release starts them again and gives them their
shared leases back.  So a worker may legitimately find, for its claimant:
- `release` answering "holds no lease": an exclusive claim preempted it after
  its claim, and has not released yet;
- `acquire` answering "already holds" (same claim) or refusing because it
  "already holds a shared lease" (another claim, which the worker then
  releases): its lease was reinstated after it had been preempted.
Each of these must be explained by an exclusive win that names the claimant
among those it stopped, at a time that fits.

Checked while it runs:
- the reader, lock free: I1 (and I3's one-record rule) on the ledger alone for
  every generation it sees; I1-I3 on (ledger, host state) pairs at consistent
  instants.  The pair is read ledger, host, ledger: when both ledger reads show
  the same generation, nothing was written in between, so the host state read
  meanwhile is the one that went with that generation.  The arbiter records an
  intent before it acts and drops a lease only after undoing it, so I1-I3 hold
  at every instant, not only between commands;
- no deadlock (every worker finishes within its budget), no exit but 0 and 3,
  every refusal for a reason the rules give, no lost update (every claim still
  there for its release, unless a preemption explains it), never two exclusive
  winners on one token at once.

The end state, once every worker has finished: I1-I3 hold; the only leases
left are active shared leases reinstated for preempted claimants, which the
host says run.  Those claimants are then marked gone (`sim stop`) and
`restore --stranded` runs until no lease is left; then I5: nothing leased,
every function home, every holder running, and a second restore changes
neither the ledger's bytes nor the host's state.
"""

from __future__ import annotations

import itertools
import json
import multiprocessing
import random
import subprocess
import sys
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import simhosts
from coretools import REPO, ledger_bytes, read_ledger
from invariants import HostFacts, assert_converged, sim_facts, violations
from simhosts import audio, gpu, host

from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Lease, LeaseState, LedgerState, Mode
from charly_arbiter.host.sim import SimHost
from tests.conftest import sim_config

TOKENS = ("gpu0", "gpu1", "gpu2", "gpu3")
TOKEN_FUNCTIONS = {
    "gpu0": ("0000:0a:00.0", "0000:0a:00.1"),
    "gpu1": ("0000:0b:00.0",),
    "gpu2": ("0000:41:00.0", "0000:41:00.1"),
    "gpu3": ("0000:42:00.0",),
}
HOMES = {
    "0000:0a:00.0": "nvidia",
    "0000:0a:00.1": "snd_hda_intel",
    "0000:0b:00.0": "nvidia",
    "0000:41:00.0": "amdgpu",
    "0000:41:00.1": "snd_hda_intel",
    "0000:42:00.0": "nvidia",
}
HOLDERS = (
    "container:llm",
    "systemd:ollama.service",
    "systemd:display-manager.service",
    "container:render",
    "systemd:train.service",
    "container:jupyter",
)
HOST = host(
    gpu("0000:0a:00.0", group=12),
    audio("0000:0a:00.1", group=12),
    gpu("0000:0b:00.0", group=13, model="2204"),
    gpu("0000:41:00.0", group=20, model="744c", driver="amdgpu", vendor="1002"),
    audio("0000:41:00.1", group=20, model="ab30", vendor="1002"),
    gpu("0000:42:00.0", group=21, model="2704"),
    simhosts.holder("container", "llm", ["gpu0"], preemptible=True),
    simhosts.holder("systemd", "ollama.service", ["gpu0", "gpu1"], preemptible=True),
    simhosts.holder("systemd", "display-manager.service", ["gpu1"], preemptible=True),
    # Named by its audio function's address: a holder of the whole token all the same.
    simhosts.holder("container", "render", ["0000:41:00.1"], preemptible=True),
    simhosts.holder("systemd", "train.service", ["gpu2", "gpu3"], preemptible=True),
    simhosts.holder("container", "jupyter", ["gpu3"], preemptible=True),
)
CONFIG = sim_config(
    gpu0="0000:0a:00.0", gpu1="0000:0b:00.0", gpu2="0000:41:00.0", gpu3="0000:42:00.0"
)

# The worker plays the claimant saying it is done; the host would call it running.
RELEASE = ("release", "--force")
LEANING = 0.8  # how often a VM claims exclusively, and a container shares
TWO_TOKENS = 0.4  # how often a claim names two GPUs
HOLD = 0.05  # longest time a worker holds a claim, in seconds
BUDGET = 180  # seconds a worker may need past the deadline before it counts as stuck
# Why a claim may be refused, as the rules word it.
REFUSALS = {
    "exclusive": "is held exclusively by",
    "in progress": "the shared lease of",
    "stranded": "it holds a stranded lease of",
    "reinstated": "it already holds a shared lease in state active",
}


@dataclass(frozen=True)
class Size:
    workers: int
    claimants_per_worker: int
    seconds: float
    min_wins: int  # of each mode: less means the run exercised too little


# A smoke run: on two busy cores it makes about ten claims, too few to demand
# wins of both modes every time.
FAST = Size(workers=6, claimants_per_worker=2, seconds=4, min_wins=0)
LONG = Size(workers=13, claimants_per_worker=3, seconds=75, min_wins=10)


def test_claimants_in_concurrent_processes(make_sim, tmp_path):
    stress(make_sim, tmp_path, FAST)


@pytest.mark.slow
def test_claimants_in_concurrent_processes_long(make_sim, tmp_path):
    """39 claimants in 13 processes for 75 s (the size issue 9 asked for)."""
    stress(make_sim, tmp_path, LONG)


# -- the processes ------------------------------------------------------------------


def cli(env: dict[str, str], *args: str) -> dict[str, Any]:
    """Run the real CLI; what it answered, and when (this machine's clock)."""
    start = time.time()
    result = subprocess.run(
        [sys.executable, "-m", "charly_arbiter", *args],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=BUDGET,
    )
    return {
        "rc": result.returncode,
        "out": result.stdout.strip(),
        "err": result.stderr[-500:],
        "start": start,
        "end": time.time(),
    }


def worker(
    claimants: list[str], seed: int, deadline: float, sim_dir: Path, env: dict[str, str], log: Path
) -> None:
    rng = random.Random(seed)
    host = SimHost(sim_dir)
    with log.open("w") as out:
        while time.time() < deadline:
            claimant = rng.choice(claimants)
            vm = claimant.startswith("libvirt:")
            mode = "exclusive" if (rng.random() < LEANING) == vm else "shared"
            tokens = rng.sample(TOKENS, 2 if rng.random() < TWO_TOKENS else 1)
            if not host.is_running(claimant):
                host.set_running(claimant, True)  # preempted earlier; it starts again
            record: dict[str, Any] = {"claimant": claimant, "mode": mode, "tokens": tokens}
            record["acquire"] = got = cli(env, "acquire", f"--{mode}", claimant, *tokens)
            if got["rc"] == 0 or REFUSALS["reinstated"] in got["err"]:
                time.sleep(rng.uniform(0, HOLD))
                record["release"] = cli(env, *RELEASE, claimant)
            out.write(json.dumps(record) + "\n")
            out.flush()


def reader(state_dir: Path, sim_dir: Path, stop: Path, result: Path) -> None:
    """Read the ledger without its lock until `stop` exists, checking what it sees."""
    ledger = Ledger(state_dir)
    ledger_alone = HostFacts(drivers={}, token_functions=TOKEN_FUNCTIONS, running={})
    seen: set[int] = set()
    paired: set[int] = set()
    found: dict[str, dict[str, Any]] = {}

    def note(state: LedgerState, problems: list[str], drivers: object = None) -> None:
        for problem in problems:
            entry = found.setdefault(problem, {"generation": state.generation, "count": 0})
            entry["count"] += 1
            entry.setdefault("leases", [describe(lease) for lease in state.leases])
            if drivers is not None:
                entry.setdefault("drivers", drivers)

    before = ledger.read()
    while not stop.exists():
        if before.generation not in seen:
            seen.add(before.generation)
            note(before, violations(before, ledger_alone))
        try:
            host = json.loads((sim_dir / "state.json").read_text())
        except FileNotFoundError:  # no command has run yet
            host = None
        after = ledger.read()
        if host is not None and after.generation == before.generation:
            paired.add(before.generation)
            facts = sim_facts(host, TOKEN_FUNCTIONS, HOLDERS)
            note(before, violations(before, facts), host["drivers"])
        before = after
    result.write_text(json.dumps({"seen": len(seen), "paired": len(paired), "found": found}))


# -- the test -------------------------------------------------------------------------


def stress(make_sim: Any, tmp_path: Path, size: Size) -> None:
    sim = make_sim(HOST, CONFIG)
    env = sim.env()
    fork = multiprocessing.get_context("fork")
    # Each worker's own claimants: a VM, then one or two containers.
    owned = [
        [f"libvirt:vm{index}", f"container:c{index}a", f"container:c{index}b"][
            : size.claimants_per_worker
        ]
        for index in range(size.workers)
    ]
    claimants = {claimant for group in owned for claimant in group}
    stop, result = tmp_path / "stop", tmp_path / "reader.json"
    reading = fork.Process(target=reader, args=(sim.state_dir, sim.sim_dir, stop, result))
    reading.start()
    deadline = time.time() + size.seconds
    workers = []
    for index, group in enumerate(owned):
        log = tmp_path / f"worker{index}.jsonl"
        process = fork.Process(target=worker, args=(group, index, deadline, sim.sim_dir, env, log))
        process.start()
        workers.append((process, log))
    for process, _ in workers:
        process.join(timeout=max(1.0, deadline + BUDGET - time.time()))
    stuck = [process.pid for process, _ in workers if process.exitcode is None]
    for process, _ in workers:
        if process.exitcode is None:
            process.kill()
    stop.touch()
    reading.join(timeout=60)
    if reading.exitcode is None:
        reading.kill()
    assert stuck == [], f"workers {stuck} did not finish within {BUDGET} s of the deadline"
    assert [process.exitcode for process, _ in workers] == [0] * size.workers
    assert reading.exitcode == 0
    seen = json.loads(result.read_text())

    records = [json.loads(line) for _, log in workers for line in log.read_text().splitlines()]
    outcome = Outcome(records)
    # Quiescent: no worker runs; the ledger and the host can be read as one.
    quiet_state = read_ledger(sim.state_dir)
    quiet_facts = sim_facts(sim.host().snapshot(), TOKEN_FUNCTIONS, HOLDERS)
    quiet_problems = violations(quiet_state, quiet_facts)
    print(
        f"\n{len(records)} claims by {len(claimants)} claimants in {size.workers} processes: "
        f"{len(outcome.wins('exclusive'))} exclusive and {len(outcome.wins('shared'))} shared "
        f"wins, {outcome.rejoined} reinstated leases found by their claimant, "
        f"{sum(outcome.refusals.values())} refusals {dict(outcome.refusals)}, "
        f"{outcome.preemption_count} preemptions ({outcome.found_preempted} releases found "
        f"their lease taken); the reader checked {seen['seen']} of "
        f"{quiet_state.generation} generations, {seen['paired']} with the host's state; "
        f"{len(quiet_state.leases)} leases left"
    )
    print("\n".join(["left:", *map(describe, quiet_state.leases), *quiet_problems]))

    assert outcome.errors == [], "\n".join(map(brief, outcome.errors[:5]))
    assert outcome.lost == [], "\n".join(map(brief, outcome.lost[:5]))
    assert outcome.unexplained == [], "\n".join(map(brief, outcome.unexplained[:5]))
    assert outcome.overlaps == [], outcome.overlaps[:3]
    found = sorted(seen["found"].items(), key=lambda item: item[1]["generation"])
    assert found == [], f"{len(found)} distinct violations, the first: " + json.dumps(
        found[:3], indent=1
    )
    assert len(outcome.wins("exclusive")) >= size.min_wins, "too little contention"
    assert len(outcome.wins("shared")) >= size.min_wins, "too little contention"
    assert seen["seen"] > 0 and seen["paired"] > 0

    assert quiet_problems == [], [describe(lease) for lease in quiet_state.leases]
    running = quiet_facts.running
    unexpected = [
        lease
        for lease in quiet_state.leases
        if lease.mode is not Mode.SHARED
        or lease.state is not LeaseState.ACTIVE
        or lease.claimant not in outcome.preempted
        or not running.get(lease.claimant, True)
    ]
    assert unexpected == [], unexpected

    # Every claimant gone; restoring a lease may reinstate the leases it had taken.
    for _ in range(len(claimants)):
        left = read_ledger(sim.state_dir).leases
        if not left:
            break
        for lease in left:
            sim.cli("sim", "stop", lease.claimant, check=True)
        sim.cli("restore", "--stranded", check=True)
    state = read_ledger(sim.state_dir)
    assert_converged(
        state, sim_facts(sim.host().snapshot(), TOKEN_FUNCTIONS, HOLDERS), HOMES, HOLDERS
    )
    before = (ledger_bytes(sim.state_dir), (sim.sim_dir / "state.json").read_text())
    again = sim.cli("restore", "--stranded", check=True)
    assert again.stdout.strip() == "nothing to restore"
    assert (ledger_bytes(sim.state_dir), (sim.sim_dir / "state.json").read_text()) == before


def describe(lease: Lease) -> str:
    """A lease on one line: who, how, what it stopped (and whose shared lease it took)."""
    stopped = [
        f"{record.holder}{list(record.shared_tokens) if record.shared_tokens else ''}"
        + (" restored" if record.restored else "")
        for record in lease.stopped
    ]
    return f"{lease.claimant} {lease.mode} {','.join(lease.tokens)} {lease.state}" + (
        f", stopped {'; '.join(stopped)}" if stopped else ""
    )


def brief(record: dict[str, Any]) -> str:
    """A worker's claim on one line: what it asked, each command's exit and last words."""
    said = [
        f"{step} {record[step]['rc']}: "
        + (record[step]["err"].strip().splitlines() or [""])[-1]
        + f" / {record[step]['out']}"
        for step in ("acquire", "release")
        if step in record
    ]
    return f"{record['claimant']} {record['mode']} {','.join(record['tokens'])}: " + "; ".join(said)


class Outcome:
    """What the workers' records say, checked against the rules."""

    def __init__(self, records: list[dict[str, Any]]) -> None:
        self.records = records
        self.errors: list[dict[str, Any]] = []
        self.refusals: Counter[str] = Counter()
        # claimant -> (start, end) of each exclusive acquire that stopped it
        self.preempted: dict[str, list[tuple[float, float]]] = {}
        for record in records:
            got = record["acquire"]
            if got["rc"] not in (0, 3) or record.get("release", {"rc": 0})["rc"] != 0:
                self.errors.append(record)
            if got["rc"] == 3:
                reason = next((k for k, v in REFUSALS.items() if v in got["err"]), None)
                if reason is None:
                    self.errors.append(record)
                self.refusals[reason or "other"] += 1
            if got["rc"] == 0 and record["mode"] == "exclusive" and "; stopped " in got["out"]:
                for ref in got["out"].partition("; stopped ")[2].split(", "):
                    self.preempted.setdefault(ref, []).append((got["start"], got["end"]))
        for holder in HOLDERS:
            self.preempted.pop(holder, None)
        self.preemption_count = sum(len(times) for times in self.preempted.values())

        # No lost update: every lease is still there for its release, unless a
        # preemption took it meanwhile (only a shared lease can be taken).
        self.lost: list[dict[str, Any]] = []
        self.found_preempted = 0
        for record in records:
            if "release" not in record:
                continue
            answer = record["release"]["out"]
            if answer == f"released {record['claimant']}":
                continue
            shared = record["mode"] == "shared" or record["acquire"]["rc"] == 3
            if (
                shared
                and answer == f"{record['claimant']} holds no lease"
                and self.taken(record, record["acquire"]["start"], record["release"]["end"])
            ):
                self.found_preempted += 1
                continue
            self.lost.append(record)

        # A claimant meets a lease it did not take only after it was preempted.
        rejoining = [
            record
            for record in records
            if record["acquire"]["rc"] == 0 and " already holds " in record["acquire"]["out"]
        ] + [record for record in records if REFUSALS["reinstated"] in record["acquire"]["err"]]
        self.rejoined = len(rejoining)
        self.unexplained = [
            record
            for record in rejoining
            if not self.taken(record, 0, record["acquire"]["end"])
            or (record["acquire"]["rc"] == 0 and record["mode"] != "shared")
        ]

        # Never two exclusive winners at once: the spans from a claim's success to
        # its release (each inside its lease's lifetime) never overlap on a token.
        self.overlaps = []
        for token in TOKENS:
            spans = sorted(
                (record["acquire"]["end"], record["release"]["start"], record["claimant"])
                for record in self.wins("exclusive")
                if token in record["tokens"]
            )
            for first, second in itertools.pairwise(spans):
                if first[1] > second[0]:
                    self.overlaps.append((token, first, second))

    def wins(self, mode: str) -> list[dict[str, Any]]:
        """Claims that took a new lease."""
        return [
            record
            for record in self.records
            if record["mode"] == mode
            and record["acquire"]["rc"] == 0
            and " already holds " not in record["acquire"]["out"]
        ]

    def taken(self, record: dict[str, Any], start: float, end: float) -> bool:
        """Whether an exclusive claim stopped this record's claimant between start and end."""
        return any(
            stop_end >= start and stop_start <= end
            for stop_start, stop_end in self.preempted.get(record["claimant"], [])
        )
