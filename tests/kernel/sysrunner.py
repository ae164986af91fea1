"""Runs INSIDE the systemd guest (sysguest.py), as a unit once the boot is done.

Reads the plan from the share (/charly/share/spec.json: a module of
tests/kernel and, per boot, the names of its scenarios), waits until systemd
says the boot is over, and calls `scenario_NAME(scenario)` for each name of
this boot (of the spec's module, or of tests/kernel/STEM.py for `STEM:NAME`:
one boot may run the scenarios of two test files).  A scenario records facts
into `scenario.out` (command results, and `scenario.step(LABEL)` snapshots:
drivers, the ledger, the invariants I1-I3, the units it watches); nothing here
asserts, so one failure does not hide the others.  A scenario that raises (or
runs past its time) is recorded with its traceback and its evidence: the state
and journal of the units it watched, the failed units, the journal's last
lines.  After each scenario the boot's record is written to
/charly/share/results-N.json.  The last boot powers the guest off; an earlier
one reboots it, unless a scenario crashed it first.

Usage: sysrunner.py (no arguments: all of it comes from the share)
"""

from __future__ import annotations

import importlib.util
import json
import os
import signal
import sys
import time
import traceback
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import sysfacts

HERE = Path(__file__).resolve().parent
UNIT_KINDS = ("systemd", "display-manager")  # holder kinds whose name is a system unit
SHARE = Path("/charly/share")
# One scenario's limit (they take seconds); a module may give some of its scenarios
# more with a dict SCENARIO_SECONDS of its own (name -> seconds).
SCENARIO_SECONDS = 300


class ScenarioTimeout(Exception):
    pass


class Scenario:
    """What one scenario records, and the facts it is judged by."""

    def __init__(self, name: str, boot: int, save: Any) -> None:
        self.name = name
        self.boot = boot
        self.out: dict[str, Any] = {}
        self.watched: list[str] = []
        # holder ref -> whether it runs unless the arbiter stopped it (I3)
        self.expected: dict[str, bool] = {}
        self._save = save

    def watch(self, *units: str) -> None:
        """Units whose state every step records, and whose journal a failure shows."""
        self.watched += [unit for unit in units if unit not in self.watched]

    def expect(self, ref: str, running: bool = True) -> None:
        """`ref` (systemd:UNIT, display-manager:UNIT) runs unless the arbiter stopped
        it: I3 checks it."""
        self.expected[ref] = running
        kind, _, unit = ref.partition(":")
        if kind in UNIT_KINDS:
            self.watch(unit)

    def facts(self) -> dict[str, Any]:
        shown = sysfacts.units(self.watched)
        running = {
            ref: shown[ref.partition(":")[2]]["ActiveState"] == "active" for ref in self.expected
        }
        return {
            "uptime": sysfacts.uptime(),
            "drivers": sysfacts.drivers(),
            "vfio": sysfacts.vfio_nodes(),
            "card0": sysfacts.card_holders(),
            "ledger": sysfacts.ledger(),
            "violations": sysfacts.invariant_violations(
                running, {ref for ref, expected in self.expected.items() if expected}
            ),
            "units": shown,
        }

    def step(self, label: str, **extra: Any) -> dict[str, Any]:
        """A snapshot of the facts (and `extra`), recorded as steps[label]."""
        record = {**self.facts(), **extra}
        self.out.setdefault("steps", {})[label] = record
        return record

    def evidence(self) -> dict[str, Any]:
        return {
            "units": sysfacts.units(self.watched),
            "journals": {unit: sysfacts.journal(unit) for unit in self.watched},
            "failed": sysfacts.failed_units(),
            "journal": sysfacts.journal(None, 60),
        }

    def crash(self) -> None:
        """End this boot as a power cut would (sysrq `b`: no unmount, no sync), after
        saving what was recorded."""
        self.out["crashed_at"] = sysfacts.uptime()
        self._save()
        sysfacts.say(f"boot {self.boot}: {self.name} crashes the guest")
        with open("/proc/sysrq-trigger", "w") as trigger:
            trigger.write("b")
        time.sleep(60)  # the reset comes first


def load(path: str) -> ModuleType:
    spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _timeout(signum: int, frame: FrameType | None) -> None:
    raise ScenarioTimeout("the scenario ran past its time (SCENARIO_SECONDS)")


def main() -> None:
    plan = json.loads((SHARE / "spec.json").read_text())
    boot = int((SHARE / "boots").read_text())
    names: list[str] = plan["boots"][boot - 1]
    out: dict[str, Any] = {
        "boot": boot,
        "scenarios": {},
        "errors": {},
        "evidence": {},
        "seconds": {},
    }
    results = SHARE / f"results-{boot}.json"

    def save() -> None:
        results.write_text(json.dumps(out, indent=1, default=str))

    sysfacts.say(f"boot {boot}: runner started, waiting for the boot to finish")
    out["system"] = sysfacts.boot_facts(SHARE / f"switch-root-{boot}")
    save()
    sysfacts.say(f"boot {boot}: {out['system']['state']} {out['system']['reached']}")
    modules: dict[str, ModuleType] = {}
    signal.signal(signal.SIGALRM, _timeout)
    for qualified in names:
        # "NAME" is a scenario of the spec's module, "STEM:NAME" one of tests/kernel/STEM.py
        stem, _, name = qualified.rpartition(":")
        path = f"{HERE}/{stem}.py" if stem else plan["module"]
        if path not in modules:
            modules[path] = load(path)
        module = modules[path]
        scenario = Scenario(name, boot, save)
        out["scenarios"][name] = scenario.out
        began = time.monotonic()
        signal.alarm(getattr(module, "SCENARIO_SECONDS", {}).get(name, SCENARIO_SECONDS))
        try:
            getattr(module, f"scenario_{name}")(scenario)
        except BaseException:
            out["errors"][name] = traceback.format_exc()
            signal.alarm(0)
            try:
                out["evidence"][name] = scenario.evidence()
            except Exception:
                out["evidence"][name] = traceback.format_exc()
        finally:
            signal.alarm(0)
        out["seconds"][name] = round(time.monotonic() - began, 2)
        sysfacts.say(
            f"boot {boot}: {name} {'FAILED' if name in out['errors'] else 'ok'} "
            f"in {out['seconds'][name]} s"
        )
        save()
    out["runner_done_at"] = sysfacts.uptime()
    save()
    last = boot >= len(plan["boots"])
    sysfacts.say(f"boot {boot}: done, {'powering off' if last else 'rebooting'}")
    os.sync()
    sysfacts.run([sysfacts.SYSTEMCTL, "poweroff" if last else "reboot", "--no-block"])


if __name__ == "__main__":
    main()
