"""The human side of the CLI: the status table (golden), colours only on a real
terminal (a pseudo-terminal), the unchanged `--json`, and progress of long steps."""

from __future__ import annotations

import io
import json
import re
import signal
import time
from datetime import datetime, timedelta

from opstools import assert_golden, normalise, run_in_pty

from charly_arbiter.cli.status import render
from charly_arbiter.ops.progress import Progress

ANSI = "\x1b["


def busy_host(sim) -> None:
    """gpu0 held by a VM (two holders stopped), gpu1 shared, and one stranded claim."""
    sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0", check=True)
    sim.cli("acquire", "--shared", "container:batch", "gpu1", check=True)
    crashed = sim.cli(
        "acquire",
        "--shared",
        "container:jupyter",
        "gpu1",
        env=sim.env(CHARLY_ARBITER_CRASH_AT="acquire.intent"),
    )
    assert crashed.returncode == -signal.SIGKILL


def test_status_is_a_table_per_token(sim):
    busy_host(sim)
    status = sim.arbiter().status()
    win11 = next(lease for lease in status.leases if lease.claimant == "libvirt:win11")
    now = datetime.fromisoformat(win11.created) + timedelta(minutes=3, seconds=5)
    assert_golden("status.txt", render(status, now=now) + "\n")


def test_status_of_a_poisoned_token_says_how_to_clear_it(sim):
    host = (sim.sim_dir / "host.toml").read_text()
    marker = 'driver = "snd_hda_intel"\n'
    sim.set_host(host.replace(marker, marker + "fail_switch = true\n"))
    assert sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0").returncode == 1
    text = sim.cli("status", check=True).stdout
    assert "POISONED since" in text
    assert "hint: run `charly-arbiter poison clear gpu0` once it is checked" in text


def without_ages(text: str) -> str:
    """The two runs are a moment apart: a lease may be 0 s old in one and 1 s in the
    other (and a wider age shifts the columns)."""
    return re.sub(r" +", " ", re.sub(r"\b\d+ (?:s|min|h|d)\b", "<AGE>", text))


def test_colours_only_on_a_terminal(sim):
    busy_host(sim)
    piped = sim.cli("status")
    assert ANSI not in piped.stdout
    on_terminal = run_in_pty(["status"], sim.env())
    assert ANSI in on_terminal
    plain = re.sub(r"\x1b\[[0-9;]*m", "", on_terminal).replace("\r\n", "\n")
    assert without_ages(plain) == without_ages(piped.stdout)


def test_status_json_is_unchanged(sim):
    busy_host(sim)
    document = json.loads(sim.cli("status", "--json").stdout)
    assert document["generation"] > 0
    document["generation"] = "<GENERATION>"  # how many writes the arbiter needed: not ours
    assert_golden("status.json", normalise(json.dumps(document, indent=2, sort_keys=True)) + "\n")
    assert ANSI not in run_in_pty(["status", "--json"], sim.env())


def test_a_claim_reports_each_step_on_a_terminal(sim):
    output = run_in_pty(["acquire", "--exclusive", "libvirt:win11", "gpu0"], sim.env())
    assert "\r\x1b[K✓ libvirt:win11: stopped container:llm (stop) (" in output
    assert "✓ gpu0 is now on vfio-pci for libvirt:win11" in output
    assert "libvirt:win11 holds gpu0 (exclusive)" in output


def test_a_claim_logs_a_line_per_step_when_not_on_a_terminal(sim):
    result = sim.cli("acquire", "--exclusive", "libvirt:win11", "gpu0")
    assert result.returncode == 0
    assert result.stderr.splitlines() == [
        "charly-arbiter: libvirt:win11: stopping container:llm (stop)",
        "charly-arbiter: libvirt:win11: stopped container:llm (stop)",
        "charly-arbiter: libvirt:win11: stopping systemd:ollama.service (stop)",
        "charly-arbiter: libvirt:win11: stopped systemd:ollama.service (stop)",
        "charly-arbiter: libvirt:win11: switching gpu0 to vfio-pci",
        result.stderr.splitlines()[5],
    ]
    assert re.fullmatch(
        r"charly-arbiter: gpu0 is now on vfio-pci for libvirt:win11 \(took [0-9.]+ s\)",
        result.stderr.splitlines()[5],
    )
    assert ANSI not in result.stderr and "\r" not in result.stderr


def test_a_long_step_shows_the_seconds_it_has_waited():
    """A real ticker thread on a terminal-like stream: the line is redrawn while waiting."""
    stream = io.StringIO()
    progress = Progress(stream, terminal=True)
    progress("stopping", {"claimant": "libvirt:win11", "holder": "libvirt:old", "how": "shutdown"})
    # Waited for, not slept for: the ticker's second redraw (it redraws every half
    # second), so the step has lasted a second.
    deadline = time.monotonic() + 30
    while len(re.findall(r"… \d+ s", stream.getvalue())) < 2:
        assert time.monotonic() < deadline, stream.getvalue()
        time.sleep(0.01)
    progress("preempted", {"claimant": "libvirt:win11", "holder": "libvirt:old", "how": "shutdown"})
    text = stream.getvalue()
    assert "\r\x1b[K  libvirt:win11: stopping libvirt:old (shutdown) … 1 s" in text
    assert re.search(r"✓ libvirt:win11: stopped libvirt:old \(shutdown\) \(1\.\d s\)\n$", text)


def test_a_failed_step_is_crossed_out():
    stream = io.StringIO()
    progress = Progress(stream, terminal=True)
    progress("switching", {"claimant": "libvirt:win11", "token": "gpu0", "driver": "vfio-pci"})
    progress("poisoned", {"claimant": "libvirt:win11", "token": "gpu0", "why": "hung"})
    assert "✗ gpu0 is poisoned (libvirt:win11's switch failed): hung (" in stream.getvalue()
