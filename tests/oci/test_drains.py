"""Drains with real processes: a container that lets go of its GPU node on a signal.

The container is the holder (listed in arbiter.toml, and claiming through the
OCI hook); its shell holds the simulated GPU node open as fd 3, the way an
inference server's runner holds /dev/nvidia0, closes it on SIGUSR1 (a model
unloaded) and opens it again on SIGUSR2 (loaded again).  The device-node scan
that verifies a drain is the real one: /proc/PID/fd of the container's
processes, matched by device number, attributed to the container by its cgroup.
"""

from __future__ import annotations

import json
import time

import pytest

from tests.oci.podman import PREFIX, Podman
from tests.oci.test_oci_hook import GPU0, check_invariants

pytestmark = [pytest.mark.slow, pytest.mark.podman]

PODMAN = "/usr/bin/podman"
SERVER = (
    'trap "exit 0" TERM; '
    'trap "exec 3<&-; rm -f /tmp/loaded" USR1; '
    'trap "exec 3</dev/dri/card0; touch /tmp/loaded" USR2; '
    "exec 3</dev/dri/card0; touch /tmp/loaded; "
    "while :; do sleep 1 3<&- & wait $!; done"
)


def holder(name: str, **keys: object) -> str:
    lines = [
        "",
        "[[holders]]",
        'kind = "container"',
        f'name = "{PREFIX}{name}"',
        'tokens = ["gpu0"]',
        "preemptible = true",
    ]
    # JSON strings and lists are TOML strings and arrays too.
    lines += [f"{key} = {json.dumps(value)}" for key, value in keys.items()]
    return "\n".join(lines) + "\n"


def unload(name: str) -> list[str]:
    return [PODMAN, "kill", "--signal", "USR1", "--", PREFIX + name]


def reload(name: str) -> list[str]:
    """Load again, then succeed once the node is open (what `ready` waits for)."""
    script = "kill -USR2 1; sleep 0.3; test -e /tmp/loaded"
    return [PODMAN, "exec", PREFIX + name, "/bin/sh", "-c", script]


def test_a_drained_holder_keeps_running_without_the_gpu_and_gets_it_back(pm: Podman) -> None:
    pm.configure(holder("srv", stop="drain", drain=unload("srv"), ready=reload("srv")))
    pm.run("srv", gpu="gpu0", script=SERVER)
    pm.wait_for("the server to open its node", lambda: pm.holds_node("srv", "gpu0"))
    pid = pm.pid("srv")

    result = pm.cli("-v", "acquire", "--exclusive", "libvirt:vm", "gpu0", check=True)
    assert "stopped container:ca-test-srv" in result.stdout
    assert f"container:{PREFIX}srv: drain: {PREFIX}srv" in result.stderr  # its output, logged
    assert "drained; it keeps running without its GPU" in result.stderr
    assert pm.state("srv") == "running" and pm.pid("srv") == pid
    assert not pm.holds_node("srv", "gpu0")
    assert {pm.drivers()[address] for address in GPU0} == {"vfio-pci"}
    assert pm.leases()["libvirt:vm"]["stopped"] == [f"container:{PREFIX}srv"]
    check_invariants(pm, f"{PREFIX}srv")

    pm.claimant_stopped("libvirt:vm")
    result = pm.cli("-v", "release", "libvirt:vm", check=True)
    # `ready` ran until the server had its node again, before the release returned.
    assert f"container:{PREFIX}srv: ready" in result.stderr
    assert pm.holds_node("srv", "gpu0")
    assert pm.pid("srv") == pid, "a drained holder is not restarted"
    assert list(pm.leases()) == [f"container:{PREFIX}srv"]
    assert pm.drivers()["0000:0a:00.0"] == "nvidia"
    check_invariants(pm, f"{PREFIX}srv")


def test_a_drain_that_does_not_let_go_refuses_the_claim_naming_what_holds_the_gpu(
    pm: Podman,
) -> None:
    pm.configure(holder("stuck", stop="drain", drain=["/bin/true"]))
    pm.run("stuck", gpu="gpu0", script=SERVER)
    pm.wait_for("the server to open its node", lambda: pm.holds_node("stuck", "gpu0"))
    pid = pm.pid("stuck")

    started = time.monotonic()
    result = pm.cli("acquire", "--exclusive", "libvirt:vm", "gpu0")
    assert result.returncode == 1
    assert 3.5 < time.monotonic() - started < 30  # holder_drain = 4 s
    assert (
        f"could not drain container:{PREFIX}stuck: its GPU is still held 4 s after the drain: "
        f"pid {pid} (sh) of container:{PREFIX}stuck has {pm.nodes['gpu0']} open"
    ) in result.stderr, result.stderr
    # Nothing switched, the holder still runs with its node and its shared lease.
    assert "libvirt:vm" not in pm.leases()
    assert list(pm.leases()) == [f"container:{PREFIX}stuck"]
    assert pm.drivers()["0000:0a:00.0"] == "nvidia"
    assert pm.holds_node("stuck", "gpu0")
    check_invariants(pm, f"{PREFIX}stuck")


def test_a_drain_runs_before_the_stop_and_a_hanging_one_is_cut_short(pm: Podman) -> None:
    marker = pm.work / "drained-before-stop"
    marker.unlink(missing_ok=True)
    # The drain records whether the container still ran when it was asked to drain.
    record = (
        f"{PODMAN} container inspect --format '{{{{.State.Status}}}}' {PREFIX}polite > {marker}"
    )
    pm.configure(
        holder("polite", drain=["/bin/sh", "-c", record])
        + holder("hanging", drain=["/bin/sleep", "60"]).replace('"gpu0"', '"gpu1"')
    )
    pm.run("polite", gpu="gpu0")
    pm.run("hanging", gpu="gpu1")

    pm.cli("acquire", "--exclusive", "libvirt:vm", "gpu0", check=True)
    assert marker.read_text().strip() == "running"
    assert pm.state("polite") == "exited"

    started = time.monotonic()
    result = pm.cli("acquire", "--exclusive", "libvirt:vm2", "gpu1", check=True)
    took = time.monotonic() - started
    assert 3.5 < took < 30, took  # cut after holder_drain = 4 s, then stopped
    assert "did not finish within 4 s" in result.stderr
    assert pm.state("hanging") == "exited"
    check_invariants(pm, f"{PREFIX}polite", f"{PREFIX}hanging")


def test_a_release_waits_until_the_holder_is_ready(pm: Podman) -> None:
    ready = [PODMAN, "exec", f"{PREFIX}slow", "/bin/sh", "-c", "test -e /tmp/up"]
    pm.configure(holder("slow", ready=ready))
    slow_start = 'rm -f /tmp/up; (sleep 2; touch /tmp/up) & trap "exit 0" TERM; ' + (
        "while :; do sleep 1 & wait $!; done"
    )
    pm.run("slow", gpu="gpu0", script=slow_start)
    pm.wait_for("it to be up", lambda: pm.podman(*ready[1:], check=False).returncode == 0)
    pm.cli("acquire", "--exclusive", "libvirt:vm", "gpu0", check=True)
    assert pm.state("slow") == "exited"

    pm.claimant_stopped("libvirt:vm")
    started = time.monotonic()
    pm.cli("release", "libvirt:vm", check=True)
    assert time.monotonic() - started > 1.5
    assert pm.podman(*ready[1:], check=False).returncode == 0, "released before it was ready"
    assert list(pm.leases()) == [f"container:{PREFIX}slow"]
