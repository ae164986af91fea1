"""Containers claim and release by themselves: real Podman, the installed OCI hook.

Each scenario asserts the ledger (through `status --json`), what Podman says
of the containers, and the invariants (tests/invariants.py).  The PCI side
and the VMs are simulated (tests/oci/podman.py): a VM is a claimant
the CLI acquires for, as libvirt's hook would.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from invariants import HostFacts, assert_invariants
from simhosts import holder

from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Claimant
from charly_arbiter.host.sim import SimHost
from tests.oci.podman import PREFIX, Podman

pytestmark = [pytest.mark.slow, pytest.mark.podman]

GPU0 = ("0000:0a:00.0", "0000:0a:00.1")
FUNCTIONS = {"gpu0": GPU0, "gpu1": ("0000:0b:00.0",)}


def check_invariants(pm: Podman, *running: str) -> None:
    """I1-I3 over the ledger, the simulated drivers and what Podman runs; `running`
    are the containers that run unless the arbiter stopped them."""
    facts = HostFacts(
        drivers=pm.drivers(),
        token_functions=FUNCTIONS,
        running={
            f"container:{name}": pm.state(name.removeprefix(PREFIX)) == "running"
            for name in pm.names()
        },
        expected_running=frozenset(f"container:{name}" for name in running),
    )
    assert_invariants(Ledger(pm.state_dir).read(), facts)


def test_a_container_without_a_gpu_passes_and_leaves_nothing(pm: Podman) -> None:
    result = pm.run("plain", script="echo plain", detach=False, remove=True)
    assert result.stdout.strip() == "plain"
    # A character device that is no GPU's (/dev/null's number): let through too.
    other = pm.run(
        "null",
        script="echo null",
        detach=False,
        remove=True,
        options=(*pm_options(), "--device", "/dev/null:/dev/other"),
    )
    assert other.stdout.strip() == "null"
    assert pm.status()["leases"] == []
    assert not (pm.state_dir / "ledger.toml").exists()


def pm_options() -> tuple[str, ...]:
    from tests.oci.podman import RUN_OPTIONS

    return RUN_OPTIONS


def test_a_container_given_the_gpu_node_claims_it_shared_and_releases_it_at_stop(
    pm: Podman,
) -> None:
    pm.run("llm", gpu="gpu0")
    assert pm.state("llm") == "running"
    lease = pm.leases()["container:ca-test-llm"]
    assert (lease["mode"], lease["tokens"], lease["state"]) == ("shared", ["gpu0"], "active")
    assert pm.status()["tokens"]["gpu0"]["mode"] == "shared"
    assert any(
        line.endswith("container:ca-test-llm holds gpu0 (shared)") for line in pm.hook_lines()
    )
    check_invariants(pm, "ca-test-llm")

    pm.podman("stop", PREFIX + "llm")
    pm.wait_for("the release at stop", lambda: pm.leases() == {})
    assert pm.status()["tokens"]["gpu0"]["mode"] == "idle"
    assert list((pm.state_dir / "containers").glob("*.json")) == [], "its claim record stays"


def test_a_container_that_runs_to_its_end_with_rm_leaves_no_lease(pm: Podman) -> None:
    result = pm.run("once", gpu="gpu0", script="echo done", detach=False, remove=True)
    assert result.stdout.strip() == "done"
    pm.wait_for("the release at stop", lambda: pm.leases() == {})
    assert pm.names() == []


def test_refused_while_a_vm_holds_the_gpu_exclusively(pm: Podman) -> None:
    pm.cli("acquire", "--exclusive", "libvirt:vm", "gpu0", check=True)
    before = pm.leases()
    result = pm.run("late", gpu="gpu0", check=False)
    assert result.returncode != 0
    # The arbiter's reason, as Podman shows it for the failed start.
    assert (
        "charly-arbiter: container:ca-test-late cannot claim gpu0 (0000:0a:00.0): gpu0 is held "
        "exclusively by libvirt:vm since"
    ) in result.stderr, result.stderr
    assert "Hint: stop libvirt:vm first" in result.stderr
    assert pm.state("late") in ("created", "exited", "stopped", "configured")
    assert pm.leases() == before
    assert set(pm.drivers().values()) >= {"vfio-pci"}
    check_invariants(pm)

    # Once the VM is gone, the same container starts and claims.
    pm.claimant_stopped("libvirt:vm")
    pm.cli("release", "libvirt:vm", check=True)
    pm.podman("start", PREFIX + "late")
    assert pm.state("late") == "running"
    assert list(pm.leases()) == ["container:ca-test-late"]
    assert pm.drivers()["0000:0a:00.0"] == "nvidia"


def test_a_container_holder_is_preempted_by_a_vm_and_started_again_after_it(pm: Podman) -> None:
    pm.run("holder", gpu="gpu0")
    first_pid = pm.pid("holder")
    result = pm.cli("acquire", "--exclusive", "libvirt:vm", "gpu0", check=True)
    assert "stopped container:ca-test-holder" in result.stdout
    assert pm.state("holder") == "exited"
    leases = pm.leases()
    assert list(leases) == ["libvirt:vm"]
    assert leases["libvirt:vm"]["stopped"] == ["container:ca-test-holder"]
    assert {pm.drivers()[address] for address in GPU0} == {"vfio-pci"}
    # Its own poststop hook ran, nested, and changed nothing.
    assert "container:ca-test-holder stopped by the arbiter" in "\n".join(pm.hook_lines())
    check_invariants(pm, "ca-test-holder")

    pm.claimant_stopped("libvirt:vm")
    pm.cli("release", "libvirt:vm", check=True)
    assert pm.state("holder") == "running"
    assert pm.pid("holder") != first_pid
    leases = pm.leases()
    assert list(leases) == ["container:ca-test-holder"]
    assert leases["container:ca-test-holder"]["mode"] == "shared"
    assert pm.drivers()["0000:0a:00.0"] == "nvidia"
    check_invariants(pm, "ca-test-holder")


def test_a_cdi_device_name_claims_the_token_that_lists_it(pm: Podman) -> None:
    pm.run("cdi", annotations={"cdi.k8s.io/gpu": "nvidia.com/gpu=1"})
    leases = pm.leases()
    assert leases["container:ca-test-cdi"]["tokens"] == ["gpu1"]


def test_the_name_annotation_names_the_claimant(pm: Podman) -> None:
    pm.run("annotated", gpu="gpu1", annotations={"org.charly-arbiter.name": "inference"})
    assert list(pm.leases()) == ["container:inference"]
    pm.podman("stop", PREFIX + "annotated")
    pm.wait_for("the release at stop", lambda: pm.leases() == {})


def test_a_stop_never_waits_for_the_holders_its_release_brings_back(pm: Podman) -> None:
    """The container's claim, the GPU's first, stopped a VM that had gpu0 passed
    through (simulated: what a shared claim stops, since a unit or a container on the
    home driver stays beside it), whose `ready` takes seconds: the container's release
    at stop hands that to a detached process, and `podman stop` returns without
    waiting."""
    pm.configure(
        """
[[holders]]
kind = "libvirt"
name = "ca-test-vm"
tokens = ["gpu0"]
preemptible = true
ready = ["/bin/sh", "-c", "sleep 4"]
"""
    )
    host_toml = pm.sim_dir / "host.toml"
    plain = host_toml.read_text()
    host_toml.write_text(plain + "\n" + holder("libvirt", "ca-test-vm", ["gpu0"], preemptible=True))
    try:
        pm.run("first", gpu="gpu0")
        assert not SimHost(pm.sim_dir).is_running(Claimant.parse("libvirt:ca-test-vm"))
        assert pm.leases()["container:ca-test-first"]["stopped"] == ["libvirt:ca-test-vm"]
        started = time.monotonic()
        pm.podman("stop", PREFIX + "first")
        assert time.monotonic() - started < 4, "podman stop waited for the holder's ready command"
        pm.wait_for(
            "the holder to run again",
            lambda: SimHost(pm.sim_dir).is_running(Claimant.parse("libvirt:ca-test-vm")),
        )
        pm.wait_for("the release to finish", lambda: pm.leases() == {}, timeout=60)
        pm.settle()
        check_invariants(pm)
    finally:
        host_toml.write_text(plain)


def test_the_docker_runtime_wrapper_claims_without_hooks_d(pm: Podman, tmp_path: Path) -> None:
    """hooks/oci-runtime as Podman's runtime, with no hooks directory at all: the
    wrapper adds the hook to the spec, as it does for Docker (which has no engine here)."""
    from tests.oci.podman import INSTALLED, REPO, RUN_OPTIONS

    wrapper = Path("/usr/libexec/charly-arbiter/oci-runtime")
    if not INSTALLED:
        wrapper = tmp_path / "oci-runtime"
        wrapper.write_text(
            (REPO / "hooks" / "oci-runtime")
            .read_text()
            .replace("/usr/bin/charly-arbiter", str(pm.work / "charly-arbiter"))
            .replace("/usr/libexec/charly-arbiter/oci-hook", str(pm.hook_program))
        )
        wrapper.chmod(0o755)
    empty = tmp_path / "no-hooks"
    empty.mkdir()
    options = ("--runtime", str(wrapper), *RUN_OPTIONS[2:])
    pm.run("wrapped", gpu="gpu0", global_options=("--hooks-dir", str(empty)), options=options)
    lease = pm.leases()["container:ca-test-wrapped"]
    assert lease["tokens"] == ["gpu0"]
    records = list((pm.state_dir / "containers").glob("*.json"))
    assert len(records) == 1 and '"runtime": "docker"' in records[0].read_text()

    pm.cli("acquire", "--exclusive", "libvirt:vm2", "gpu1", check=True)
    refused = pm.run(
        "wrapped-late",
        gpu="gpu1",
        global_options=("--hooks-dir", str(empty)),
        options=options,
        check=False,
    )
    assert refused.returncode != 0
    assert "container:ca-test-wrapped-late cannot claim gpu1" in refused.stderr

    pm.podman("--hooks-dir", str(empty), "stop", PREFIX + "wrapped")
    pm.wait_for("the release at stop", lambda: "container:ca-test-wrapped" not in pm.leases())
