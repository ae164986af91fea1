"""`metrics` through the real CLI, read back with prometheus-client's own parser."""

from __future__ import annotations

import os
import signal
import stat
import time

from prometheus_client.parser import text_string_to_metric_families


def parse(text: str) -> dict[str, dict[tuple[tuple[str, str], ...], float]]:
    """sample name -> {sorted labels: value}, as Prometheus would scrape it."""
    samples: dict[str, dict[tuple[tuple[str, str], ...], float]] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            samples.setdefault(sample.name, {})[tuple(sorted(sample.labels.items()))] = sample.value
    return samples


def value(samples, name: str, **labels: str) -> float:
    return samples[name][tuple(sorted(labels.items()))]


def test_metrics_count_leases_refusals_preemptions_and_switches(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    assert sim.cli("acquire", "--exclusive", "libvirt:other", "gpu1").returncode == 3
    assert sim.cli("acquire", "--shared", "container:other", "gpu1").returncode == 0
    result = sim.cli("metrics")
    assert result.returncode == 0, result.stderr
    samples = parse(result.stdout)
    prefix = "charly_arbiter_"
    assert value(samples, prefix + "leases", token="gpu0", mode="exclusive") == 1
    assert value(samples, prefix + "leases", token="gpu0", mode="shared") == 0
    assert value(samples, prefix + "leases", token="gpu1", mode="shared") == 1
    assert value(samples, prefix + "claims_total", token="gpu0") == 1
    assert value(samples, prefix + "claims_total", token="gpu1") == 1
    assert value(samples, prefix + "refusals_total", token="gpu1") == 1
    assert value(samples, prefix + "refusals_total", token="gpu0") == 0
    assert value(samples, prefix + "preemptions_total", kind="container") == 1
    assert value(samples, prefix + "preemptions_total", kind="systemd") == 1
    assert value(samples, prefix + "switch_failures_total", token="gpu0") == 0
    assert value(samples, prefix + "token_poisoned", token="gpu0") == 0
    assert value(samples, prefix + "stranded_claimants") == 0
    assert 0 <= value(samples, prefix + "last_switch_duration_seconds", token="gpu0") < 5
    assert (
        value(
            samples,
            prefix + "function_driver",
            token="gpu0",
            address="0000:0a:00.1",
            driver="vfio-pci",
        )
        == 1
    )
    assert value(samples, prefix + "ledger_corrupt") == 0


def test_metrics_show_a_stranded_claimant_and_a_poisoned_token(sim):
    crashed = sim.cli(
        "acquire",
        "--shared",
        "container:other",
        "gpu1",
        env=sim.env(CHARLY_ARBITER_CRASH_AT="acquire.intent"),
    )
    assert crashed.returncode == -signal.SIGKILL
    host = (sim.sim_dir / "host.toml").read_text()
    marker = 'driver = "snd_hda_intel"\n'
    sim.set_host(host.replace(marker, marker + "fail_switch = true\n"))
    assert sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0").returncode == 1
    samples = parse(sim.cli("metrics", check=True).stdout)
    assert value(samples, "charly_arbiter_stranded_claimants") == 1
    assert value(samples, "charly_arbiter_lease_stranded", claimant="container:other") == 1
    assert value(samples, "charly_arbiter_token_poisoned", token="gpu0") == 1
    assert value(samples, "charly_arbiter_token_poisoned", token="gpu1") == 0
    assert value(samples, "charly_arbiter_switch_failures_total", token="gpu0") == 1


def test_metrics_say_when_they_were_made_even_on_a_corrupt_ledger(sim):
    """The time an alert measures staleness by: made while the command ran."""
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    (sim.state_dir / "ledger.toml").write_text("not a ledger\n")
    before = time.time()
    result = sim.cli("metrics")
    after = time.time()
    assert result.returncode == 0, result.stderr
    samples = parse(result.stdout)
    assert value(samples, "charly_arbiter_ledger_corrupt") == 1
    assert before < value(samples, "charly_arbiter_metrics_generated_timestamp_seconds") < after


def test_metrics_output_replaces_the_file_atomically_and_readably(sim, tmp_path):
    target = tmp_path / "textfile" / "charly-arbiter.prom"
    target.parent.mkdir()
    target.write_text("old\n")
    inode = target.stat().st_ino
    result = sim.cli("metrics", "--output", str(target))
    assert result.returncode == 0, result.stderr
    assert result.stdout == ""
    assert target.stat().st_ino != inode, "a new file renamed over the old one"
    assert stat.S_IMODE(target.stat().st_mode) == 0o644, "node_exporter does not run as root"
    assert os.listdir(target.parent) == ["charly-arbiter.prom"], "no temp file left"
    assert "charly_arbiter_leases" in {
        f.name for f in text_string_to_metric_families(target.read_text())
    }


def test_metrics_into_a_missing_directory_is_a_clear_error(sim, tmp_path):
    result = sim.cli("metrics", "--output", str(tmp_path / "absent" / "x.prom"))
    assert result.returncode == 1
    assert "could not write the metrics to" in result.stderr
    assert "Traceback" not in result.stderr


def test_without_prometheus_client_metrics_says_what_to_install(sim, tmp_path):
    """The library made unimportable the way an absent one is: a package on the
    path ahead of site-packages whose import fails."""
    shadow = tmp_path / "shadow" / "prometheus_client"
    shadow.mkdir(parents=True)
    (shadow / "__init__.py").write_text("raise ImportError('not installed')\n")
    result = sim.cli("metrics", env=sim.env(PYTHONPATH=str(shadow.parent)))
    assert result.returncode == 1
    assert "metrics need the prometheus-client library" in result.stderr
    assert "python3-prometheus-client" in result.stderr
    assert sim.cli("status", env=sim.env(PYTHONPATH=str(shadow.parent))).returncode == 0


def test_metrics_show_sleep_blocked_per_token_and_missing_locks(sim):
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    samples = parse(sim.cli("metrics", check=True).stdout)
    assert value(samples, "charly_arbiter_sleep_blocked", token="gpu0") == 1
    assert value(samples, "charly_arbiter_sleep_blocked", token="gpu1") == 0
    assert value(samples, "charly_arbiter_sleep_locks_missing") == 0
    sim.host().uninhibit("gpu0")  # stopped from outside
    samples = parse(sim.cli("metrics", check=True).stdout)
    assert value(samples, "charly_arbiter_sleep_blocked", token="gpu0") == 0
    assert value(samples, "charly_arbiter_sleep_locks_missing") == 1
