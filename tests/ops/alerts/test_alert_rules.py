"""The shipped alerting rules (etc/prometheus/charly-arbiter.rules.yml) under
Debian's real `promtool test rules`, against series made from the real
`charly-arbiter metrics` of a simulated host driven into each condition and out
of it again.  Each test checks the minutes an alert must not fire yet, fires,
and has resolved, then breaks that alert's expression or `for` and sees the
same checks fail (promtool.verify).  What is real: the CLI, the arbiter, its
ledger and history files, the metrics text, promtool.  What stands in: the
clock (promtool's, a scrape a minute; see promseries) and, for the reconcile
unit, systemd and node_exporter's systemd collector (ReconcileUnit below).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from promseries import STAMP_KEY, Samples, Scrapes, exported_names, parse, value
from promtool import (
    REPO,
    RULES,
    TARGET,
    alerting_rules,
    firing,
    metric_names,
    promtool,
    quiet,
    rendered,
    verify,
)
from simhosts import default_host

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import load_config
from charly_arbiter.core.events import Events
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Mode
from charly_arbiter.errors import ClaimRefused
from charly_arbiter.ops.history import HistoryLog


def scrapes_of(sim, tmp_path: Path, *also) -> Scrapes:
    return Scrapes(sim, tmp_path / "charly-arbiter.prom", *also)


def test_promtool_checks_the_shipped_rules() -> None:
    result = promtool("check", "rules", str(RULES))
    assert result.returncode == 0, result.stdout + result.stderr
    assert f"SUCCESS: {len(alerting_rules())} rules found" in result.stdout


def test_the_rules_read_what_the_arbiter_exports_and_nothing_else_but_the_unit_state(sim):
    exported = exported_names(sim.cli("metrics", check=True).stdout)
    read = {alert: metric_names(rule["expr"]) for alert, rule in alerting_rules().items()}
    assert all(read.values()), read
    others = {name for names in read.values() for name in names} - exported
    assert others == {"node_systemd_unit_state"}  # node_exporter's systemd collector


def test_the_metrics_table_of_the_docs_names_exactly_what_is_exported(sim):
    """The names the rules and the dashboard rely on are the documented ones."""
    table = (REPO / "docs" / "operations.md").read_text()
    documented = set(re.findall(r"^\| `(charly_arbiter_\w+)` \|", table, re.MULTILINE))
    assert documented == exported_names(sim.cli("metrics", check=True).stdout)


def test_a_rewrite_of_an_unchanged_state_differs_only_in_its_timestamp(sim, tmp_path) -> None:
    """What lets Scrapes.rewritten reuse a file for the minutes nothing happens."""
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    assert sim.cli("acquire", "--exclusive", "libvirt:other", "gpu1").returncode == 3
    first, second = (parse(sim.cli("metrics", check=True).stdout) for _ in range(2))
    assert first[STAMP_KEY] < second[STAMP_KEY]
    del first[STAMP_KEY], second[STAMP_KEY]
    assert first == second


# -- one test per alert ------------------------------------------------------------------


def test_a_poisoned_gpu_fires_at_once_and_resolves_when_the_poison_is_cleared(sim, tmp_path):
    alert = "CharlyArbiterGPUPoisoned"
    scrapes = scrapes_of(sim, tmp_path)
    scrapes.write()
    scrapes.rewritten(2)  # minutes 0-2: healthy
    sim.set_host(default_host(gpu0="fail_switch = true"))
    assert sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0").returncode == 1
    poisoned = scrapes.write()  # minute 3: the switch failed
    assert value(poisoned, "charly_arbiter_token_poisoned", token="gpu0") == 1
    scrapes.rewritten(4)  # minutes 4-7
    sim.set_host(default_host())
    sim.cli("poison", "clear", "gpu0", check=True)
    scrapes.write()  # minute 8: cleared
    scrapes.rewritten(2)
    gpu0 = {"token": "gpu0"}
    checks = [quiet(alert, 2), firing(alert, 3, gpu0), firing(alert, 7, gpu0), quiet(alert, 8)]
    verify(
        tmp_path,
        scrapes.input_series(TARGET),
        checks,
        alert,
        [
            {"expr": "charly_arbiter_token_poisoned == 0"},  # every healthy GPU
            {"expr": "charly_arbiter_token_poisoned > 1"},  # never
            {"expr": "sum without (token) (charly_arbiter_token_poisoned) > 0"},  # which GPU?
            {"for": "5m"},  # late
        ],
    )


def test_a_stranded_lease_fires_after_15_minutes_and_resolves_on_restore(sim, tmp_path):
    alert = "CharlyArbiterLeaseStranded"
    scrapes = scrapes_of(sim, tmp_path)
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    scrapes.write()
    scrapes.rewritten(1)  # minutes 0-1: the VM runs
    sim.cli("sim", "stop", "libvirt:win11", check=True)  # it crashed, no release hook ran
    stranded = scrapes.write()  # minute 2
    assert value(stranded, "charly_arbiter_lease_stranded", claimant="libvirt:win11") == 1
    scrapes.rewritten(16)  # minutes 3-18
    sim.cli("restore", "--stranded", check=True)
    restored = scrapes.write()  # minute 19: the series is gone
    assert not [key for key in restored if key[0] == "charly_arbiter_lease_stranded"]
    scrapes.rewritten(2)
    win11 = {"claimant": "libvirt:win11"}
    checks = [
        quiet(alert, 2),
        quiet(alert, 16),  # pending for 14 minutes
        firing(alert, 17, win11),
        firing(alert, 18, win11),
        quiet(alert, 19),
        quiet(alert, 21),
    ]
    verify(
        tmp_path,
        scrapes.input_series(TARGET),
        checks,
        alert,
        [
            {"for": "5m"},  # early
            {"for": "30m"},  # never within the scenario
            {"expr": "charly_arbiter_stranded_claimants > 0"},  # which claimant?
            {"expr": "charly_arbiter_lease_stranded == 0"},
        ],
    )


def test_a_ledger_that_does_not_verify_fires_until_it_is_recovered(sim, tmp_path):
    alert = "CharlyArbiterLedgerCorrupt"
    scrapes = scrapes_of(sim, tmp_path)
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    scrapes.write()
    scrapes.rewritten(1)  # minutes 0-1
    ledger = sim.state_dir / "ledger.toml"
    data = bytearray(ledger.read_bytes())
    data[data.index(b"win11")] ^= 0x01  # one bit flipped on disk; the backup is intact
    ledger.write_bytes(bytes(data))
    corrupt = scrapes.write()  # minute 2
    assert value(corrupt, "charly_arbiter_ledger_corrupt") == 1
    scrapes.rewritten(3)  # minutes 3-5
    recovered = sim.cli("recover", "--yes", check=True)
    assert "moved the corrupt ledger" in recovered.stdout
    scrapes.write()  # minute 6
    scrapes.rewritten(1)
    checks = [quiet(alert, 1), firing(alert, 2, {}), firing(alert, 5, {}), quiet(alert, 6)]
    verify(
        tmp_path,
        scrapes.input_series(TARGET),
        checks,
        alert,
        [
            {"expr": "charly_arbiter_ledger_corrupt == 0"},
            {"expr": "charly_arbiter_ledger_corupt == 1"},  # a typo: never
            {"for": "5m"},
        ],
    )


def test_claims_refused_again_and_again_fire_one_refusal_does_not(sim, tmp_path):
    """gpu1's display manager may not be stopped: an exclusive claim on it is refused."""
    alert = "CharlyArbiterClaimsRefused"
    scrapes = scrapes_of(sim, tmp_path)
    scrapes.write()
    scrapes.rewritten(4)  # minutes 0-4

    def refused(claimant: str) -> Samples:
        assert sim.cli("acquire", "--exclusive", claimant, "gpu1").returncode == 3
        return scrapes.write()

    refused("libvirt:once")  # minute 5: someone tries once
    scrapes.rewritten(19)  # minutes 6-24
    for _ in range(3):
        last = refused("libvirt:loop")  # minutes 25, 26, 27: something keeps trying
    assert value(last, "charly_arbiter_refusals_total", token="gpu1") == 4
    sim.stopped("systemd:display-manager.service")  # the operator makes room
    sim.cli("acquire", "--exclusive", "libvirt:loop", "gpu1", check=True)
    scrapes.write()  # minute 28: the claim succeeds
    scrapes.rewritten(14)  # minutes 29-42
    gpu1 = {"token": "gpu1"}
    checks = [
        quiet(alert, 5),
        quiet(alert, 6),
        quiet(alert, 24),
        quiet(alert, 26),  # two refusals in the window
        firing(alert, 27, gpu1),  # the third
        firing(alert, 39, gpu1),  # 15 minutes still hold three
        quiet(alert, 40),
        quiet(alert, 42),
    ]
    verify(
        tmp_path,
        scrapes.input_series(TARGET),
        checks,
        alert,
        [
            {"expr": "increase(charly_arbiter_refusals_total[15m]) >= 1"},  # one refusal
            {"expr": "increase(charly_arbiter_refusals_total[15m]) > 3"},  # the fourth
            {"expr": "increase(charly_arbiter_refusals_total[5m]) >= 3"},  # forgets early
            {"expr": "increase(charly_arbiter_claims_total[15m]) >= 3"},
            {"expr": "charly_arbiter_refusals_total >= 3"},  # forever
        ],
    )


def test_refusals_that_a_history_rotation_drops_are_not_counted_again(sim, tmp_path):
    """The history is rotated by size (1 MiB, then .1 … .3); dropping its oldest file
    takes refusals with it, and the counter goes down.  `increase` takes every
    refusal left after such a drop for a new one; the rule must not.  After the
    first refusal (the real CLI), claims and refusals run through the real Arbiter
    in this process, with the history's bound made small enough for three refusals
    a file, so that a few events rotate it; the metrics are the real command's."""
    alert = "CharlyArbiterClaimsRefused"
    scrapes = scrapes_of(sim, tmp_path)
    scrapes.write()
    scrapes.rewritten(4)  # minutes 0-4
    assert sim.cli("acquire", "--exclusive", "libvirt:loop", "gpu1").returncode == 3
    scrapes.write()  # minute 5
    line = len((sim.state_dir / "history.jsonl").read_bytes())  # the one refusal's line
    config = load_config(sim.config_path, environ={})
    history = HistoryLog(config.state_dir, max_bytes=line * 3 + line // 2)
    arbiter = Arbiter(
        config,
        sim.host(),
        Ledger(config.state_dir, config.timeouts.lock_wait),
        Events([history.append]),
    )
    for _ in range(5):  # minutes 6-10: refused again and again
        with pytest.raises(ClaimRefused):
            arbiter.acquire("libvirt:loop", Mode.EXCLUSIVE, ["gpu1"], wait=0)
        refusals = value(scrapes.write(), "charly_arbiter_refusals_total", token="gpu1")
    assert refusals == 6 and len(history.files()) == 2, "three refusals a file"
    scrapes.rewritten(20)  # minutes 11-30: quiet; the alert resolves
    while refusals == 6:  # minute 31: other claims, until a rotation drops the oldest file
        arbiter.acquire("container:job", Mode.SHARED, ["gpu1"])
        arbiter.release_claimant("container:job", force=True)
        refusals = sum(1 for record in history.read().records if record.kind == "refused")
    assert refusals == 3, "the rotation dropped the file of the first three refusals"
    assert value(scrapes.write(), "charly_arbiter_refusals_total", token="gpu1") == 3
    scrapes.rewritten(15)  # minutes 32-46
    gpu1 = {"token": "gpu1"}
    checks = [firing(alert, 7, gpu1), quiet(alert, 30)]
    checks += [quiet(alert, minute) for minute in (31, 32, 38, 45)]
    verify(
        tmp_path,
        scrapes.input_series(TARGET),
        checks,
        alert,
        [{"expr": "increase(charly_arbiter_refusals_total[15m]) >= 3"}],  # no guard
    )


def test_metrics_no_longer_written_fire_after_7_minutes_and_resolve_when_written(sim, tmp_path):
    alert = "CharlyArbiterMetricsStale"
    scrapes = scrapes_of(sim, tmp_path)
    scrapes.write()
    scrapes.rewritten(5)  # minutes 0-5: the timer writes every minute
    scrapes.unwritten(12)  # minutes 6-17: it stopped; node_exporter serves minute 5's file
    scrapes.write()  # minute 18: written again
    scrapes.rewritten(2)
    checks = [
        quiet(alert, 5),
        quiet(alert, 10),  # 5 minutes old
        quiet(alert, 12),  # over 5 minutes old since minute 11: pending
        firing(alert, 13, {}),
        firing(alert, 17, {}),
        quiet(alert, 18),
        quiet(alert, 20),
    ]
    verify(
        tmp_path,
        scrapes.input_series(TARGET),
        checks,
        alert,
        [
            {"expr": "time() - charly_arbiter_metrics_generated_timestamp_seconds > 60"},
            {"expr": "time() - charly_arbiter_metrics_generated_timestamp_seconds > 900"},
            {"expr": "time() - charly_arbiter_metrics_generated_timestamp_seconds < 300"},
            {"expr": "charly_arbiter_metrics_generated_timestamp_seconds > 300"},  # not an age
            {"for": "0m"},
        ],
    )


class ReconcileUnit:
    """Stands in for systemd running charly-arbiter-reconcile.service, and for
    node_exporter's systemd collector reporting it: systemd is not PID 1 here.

    The commands are the unit file's own ExecStart and ExecStartPost lines, run in
    order as the real CLI against the simulated host, stopping at the first that
    fails (as systemd does).  A Type=oneshot service without RemainAfterExit= is
    `inactive` after its command exits 0 and `failed` after it exits otherwise
    (systemd.service(5)); the collector exports node_systemd_unit_state with one
    series per state, 1 for the unit's own, labelled name, state and type (the
    Service's Type=) (node_exporter's collector/systemd_linux.go).
    """

    NAME = "charly-arbiter-reconcile.service"
    STATES = ("active", "activating", "deactivating", "inactive", "failed")

    def __init__(self, sim) -> None:
        unit = (REPO / "etc" / "systemd" / self.NAME).read_text()
        settings = dict(re.findall(r"^(\w+)=(.*)$", unit, re.MULTILINE))
        assert settings["Type"] == "oneshot" and "RemainAfterExit" not in settings
        self.commands = []
        for line in re.findall(r"^ExecStart(?:Post)?=(.*)$", unit, re.MULTILINE):
            program, *args = line.split()
            assert program == "/usr/bin/charly-arbiter"
            self.commands.append(args)
        self.sim = sim
        self.state = "inactive"  # it ran fine at the last boot

    def start(self) -> int:
        returncode = 0
        for args in self.commands:
            returncode = self.sim.cli(*args).returncode
            if returncode:
                break
        self.state = "inactive" if returncode == 0 else "failed"
        return int(returncode)

    def samples(self) -> Samples:
        return {
            (
                "node_systemd_unit_state",
                (("name", self.NAME), ("state", state), ("type", "oneshot")),
            ): float(state == self.state)
            for state in self.STATES
        }


def test_a_failed_reconcile_unit_fires_until_a_run_succeeds(sim, tmp_path):
    alert = "CharlyArbiterReconcileFailed"
    unit = ReconcileUnit(sim)
    scrapes = scrapes_of(sim, tmp_path, unit.samples)
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    scrapes.write()
    scrapes.rewritten(1)  # minutes 0-1: a VM holds gpu0
    # The container stopped for the VM is not started at boot, and cannot be started.
    host = default_host(llm="fail_start = true")
    assert host.count("running = true\nfail") == 1
    sim.set_host(
        host.replace("running = true\nfail_start = true", "running = false\nfail_start = true")
    )
    sim.cli("sim", "reboot", check=True)  # the VM's lease is stranded by the reboot
    assert unit.start() == 1
    scrapes.write()  # minute 2: the unit failed at boot
    scrapes.rewritten(5)  # minutes 3-7
    sim.set_host(default_host())  # the cause is fixed
    assert unit.start() == 0  # systemctl start charly-arbiter-reconcile.service
    scrapes.write()  # minute 8
    scrapes.rewritten(1)
    failed = {"name": unit.NAME, "state": "failed", "type": "oneshot"}
    checks = [quiet(alert, 1), firing(alert, 2, failed), firing(alert, 7, failed), quiet(alert, 8)]
    verify(
        tmp_path,
        scrapes.input_series(TARGET),
        checks,
        alert,
        [
            {"expr": f'node_systemd_unit_state{{name="{unit.NAME}"}} == 1'},  # any state
            {"expr": f'node_systemd_unit_state{{name="{unit.NAME}",state="inactive"}} == 0'},
            {"expr": 'node_systemd_unit_state{name="charly-arbiter",state="failed"} == 1'},
        ],
    )


# -- what the rules say to an operator ---------------------------------------------------


def test_every_alert_says_what_to_run_and_the_cli_accepts_it(sim, tmp_path):
    """Each description names at least one `charly-arbiter …` command; rendered for
    a host, each is one the real CLI accepts (run against the simulated host, it
    may find nothing to do or refuse, but never a usage error)."""
    labels = {**TARGET, "token": "gpu0", "claimant": "libvirt:win11"}
    commands: dict[str, str] = {}  # command -> the first alert that says it
    for alert, rule in alerting_rules().items():
        annotations = rendered(rule, labels)
        assert set(annotations) == {"summary", "description"}, alert
        said = re.findall(r"`(charly-arbiter [^`]*)`", annotations["description"])
        assert said, f"{alert} does not say which charly-arbiter command to run"
        for command in said:
            commands.setdefault(command, alert)
    for command, alert in commands.items():
        args = command.split()[1:]
        if "--output" in args:  # not into this machine's textfile directory
            args[args.index("--output") + 1] = str(tmp_path / "by-hand.prom")
        result = sim.cli(*args)
        assert result.returncode in (0, 1, 3), (alert, command, result.stderr)
        assert "Usage:" not in result.stderr, (alert, command, result.stderr)
