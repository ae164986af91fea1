"""The OCI hook's contract, run as a runtime runs it, without a runtime.

`charly-arbiter hook oci` gets a container's state on stdin and reads the
bundle's config.json, as runc hands them over (the shape Podman 4.3 was seen
to produce here: tests/oci/test_oci_hook.py runs the real thing).
Nothing on stdout; a refusal is one line on stderr and a non-zero exit; a
release always exits 0; a container given no GPU imports nothing of the
arbiter but the hook.  The simulated host's GPU node is a character device
made with mknod as a clone of a misc device no process holds (conftest's
free_devices): its number is what the spec names.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from simhosts import audio, gpu, host

from charly_arbiter.oci.hook import may_claim
from tests.oci.podman import free_devices

REPO = Path(__file__).resolve().parents[2]
HEAVY = ("charly_arbiter.core", "charly_arbiter.host", "charly_arbiter.compose", "tomllib")


def spec(*devices: tuple[int, int], annotations: dict[str, str] | None = None) -> dict[str, Any]:
    return {
        "ociVersion": "1.0.2-dev",
        "process": {"args": ["/bin/sh"]},
        "annotations": annotations or {"io.container.manager": "libpod"},
        "linux": {
            "devices": [
                {"path": f"/dev/dri/card{i}", "type": "c", "major": major, "minor": minor}
                for i, (major, minor) in enumerate(devices)
            ],
            "resources": {"devices": [{"allow": False, "access": "rwm"}]},
        },
    }


def state(container_id: str, bundle: Path, status: str = "creating") -> dict[str, Any]:
    return {
        "ociVersion": "1.0.2-dev",
        "id": container_id,
        "status": status,
        "pid": os.getpid() if status == "creating" else 0,
        "bundle": str(bundle),
        "annotations": {"io.container.manager": "libpod"},
    }


@pytest.fixture
def oci(make_sim: Callable[..., Any], tmp_path: Path) -> Any:
    if os.geteuid() != 0:
        pytest.skip("making the simulated GPU node (mknod) needs root")
    sim = make_sim(
        host=host(
            gpu("0000:0a:00.0", group=12, extra='nodes = ["dri/card1"]'),
            audio("0000:0a:00.1", group=12),
            gpu("0000:0b:00.0", group=13, model="2204"),
        )
    )
    (sim.sim_dir / "dev" / "dri").mkdir(parents=True)
    [device] = free_devices(1)
    os.mknod(sim.sim_dir / "dev" / "dri" / "card1", 0o600 | 0o020000, device.st_rdev)
    sim.node = (os.major(device.st_rdev), os.minor(device.st_rdev))

    def hook(
        document: dict[str, Any], container_spec: dict[str, Any] | None, *args: str
    ) -> subprocess.CompletedProcess[bytes]:
        bundle = Path(document["bundle"])
        bundle.mkdir(parents=True, exist_ok=True)
        if container_spec is not None:
            (bundle / "config.json").write_text(json.dumps(container_spec))
        return subprocess.run(
            [sys.executable, "-m", "charly_arbiter", "hook", "oci", *args],
            input=json.dumps(document).encode(),
            capture_output=True,
            cwd=REPO,
            env=sim.env(),
            timeout=60,
        )

    sim.hook = hook
    sim.bundle = lambda name: tmp_path / "bundles" / name / "userdata"
    return sim


def test_a_gpu_container_claims_at_creation_and_releases_at_stop(oci: Any) -> None:
    bundle = oci.bundle("c1")
    created = oci.hook(state("c1", bundle), spec(oci.node))
    assert (created.returncode, created.stdout, created.stderr) == (0, b"", b"")
    [lease] = oci.status()["leases"]
    assert (lease["claimant"], lease["mode"], lease["tokens"]) == (
        "container:c1",
        "shared",
        ["gpu0"],
    )

    stopped = oci.hook(state("c1", bundle, "stopped"), spec(oci.node))
    assert (stopped.returncode, stopped.stdout, stopped.stderr) == (0, b"", b"")
    assert oci.status()["leases"] == []


def test_a_refusal_fails_the_start_with_one_line_and_nothing_on_stdout(oci: Any) -> None:
    oci.cli("acquire", "--exclusive", "libvirt:vm", "gpu0", check=True)
    refused = oci.hook(state("c2", oci.bundle("c2")), spec(oci.node), "prestart")
    assert refused.returncode == 3
    assert refused.stdout == b""
    lines = refused.stderr.decode().splitlines()
    assert len(lines) == 1, lines
    assert lines[0].startswith(
        "charly-arbiter: container:c2 cannot claim gpu0 (0000:0a:00.0): gpu0 is held "
        "exclusively by libvirt:vm"
    ), lines
    assert [lease["claimant"] for lease in oci.status()["leases"]] == ["libvirt:vm"]
    # Its poststop (the runtime runs it after a failed start) releases nothing of another's.
    after = oci.hook(state("c2", oci.bundle("c2"), "stopped"), spec(oci.node), "poststop")
    assert (after.returncode, after.stdout) == (0, b"")
    assert [lease["claimant"] for lease in oci.status()["leases"]] == ["libvirt:vm"]


def test_a_node_of_a_gpu_away_from_its_driver_claims_the_tokens_away(oci: Any) -> None:
    """On vfio-pci the GPU's node answers to no function (as on a real host, where
    the node goes with the driver): the claim then takes the tokens that are away."""
    oci.cli("acquire", "--exclusive", "libvirt:vm", "gpu0", check=True)
    oci.stopped("libvirt:vm")
    # A stranded VM: its lease still holds gpu0 on vfio-pci.
    refused = oci.hook(state("c3", oci.bundle("c3")), spec(oci.node))
    assert refused.returncode == 3
    assert b"it holds a stranded lease of libvirt:vm" in refused.stderr


def test_a_cdi_name_claims_the_token_that_lists_it(oci: Any) -> None:
    config = oci.config_path.read_text().replace(
        '[tokens.gpu1]\naddress = "0000:0b:00.0"',
        '[tokens.gpu1]\naddress = "0000:0b:00.0"\ncdi_devices = ["nvidia.com/gpu=1"]',
    )
    oci.config_path.write_text(config)
    annotations = {"io.container.manager": "libpod", "cdi.k8s.io/gpu": "nvidia.com/gpu=1"}
    created = oci.hook(state("c4", oci.bundle("c4")), spec(annotations=annotations))
    assert created.returncode == 0, created.stderr
    assert oci.status()["leases"][0]["tokens"] == ["gpu1"]


def test_a_mig_devices_cdi_name_claims_the_token_of_its_gpu_shared(oci: Any) -> None:
    """NVIDIA's CDI spec names MIG device 3 of GPU 1 `nvidia.com/gpu=1:3` (and
    `nvidia.com/gpu=mig1:3` with type-index names): the container uses that GPU, so
    the token that lists the GPU's own name takes a shared lease on it."""
    config = oci.config_path.read_text().replace(
        '[tokens.gpu1]\naddress = "0000:0b:00.0"',
        '[tokens.gpu1]\naddress = "0000:0b:00.0"\ncdi_devices = ["nvidia.com/gpu=1"]',
    )
    oci.config_path.write_text(config)
    for container, name in (("c6", "nvidia.com/gpu=1:3"), ("c7", "nvidia.com/gpu=mig1:0")):
        annotations = {"io.container.manager": "libpod", "cdi.k8s.io/gpu": name}
        if name.endswith("mig1:0"):
            oci.config_path.write_text(config.replace('gpu=1"]', 'gpu=gpu1"]'))
        created = oci.hook(state(container, oci.bundle(container)), spec(annotations=annotations))
        assert created.returncode == 0, created.stderr
    leases = {lease["claimant"]: lease for lease in oci.status()["leases"]}
    assert [(x["tokens"], x["mode"]) for x in leases.values()] == [(["gpu1"], "shared")] * 2


def test_a_release_always_exits_0_even_on_a_corrupt_ledger(oci: Any) -> None:
    bundle = oci.bundle("c5")
    assert oci.hook(state("c5", bundle), spec(oci.node)).returncode == 0
    ledger = oci.state_dir / "ledger.toml"
    ledger.write_text(ledger.read_text().replace("shared", "sharde"))
    stopped = oci.hook(state("c5", bundle, "stopped"), spec(oci.node))
    assert (stopped.returncode, stopped.stdout) == (0, b"")
    assert b"charly-arbiter:" in stopped.stderr


def test_an_unreadable_state_fails_a_start_closed_and_never_a_stop(oci: Any) -> None:
    for stage, expected in (("prestart", 1), ("poststop", 0)):
        result = subprocess.run(
            [sys.executable, "-m", "charly_arbiter", "hook", "oci", stage],
            input=b"{not json",
            capture_output=True,
            cwd=REPO,
            env=oci.env(),
            timeout=60,
        )
        assert (result.returncode, result.stdout) == (expected, b""), (stage, result)
        assert result.stderr.startswith(
            b"charly-arbiter: the container state on stdin cannot be used: it is not JSON"
        )


def test_a_container_without_a_gpu_imports_nothing_of_the_arbiter(tmp_path: Path) -> None:
    bundle = tmp_path / "plain"
    bundle.mkdir()
    (bundle / "config.json").write_text(json.dumps(spec()))
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "charly_arbiter", "hook", "oci"],
        input=json.dumps(state("plain", bundle)).encode(),
        capture_output=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    assert (result.returncode, result.stdout) == (0, b"")
    modules = {
        line.rsplit("|", 1)[1].strip()
        for line in result.stderr.decode().splitlines()
        if line.startswith("import time:") and "|" in line
    }
    assert "charly_arbiter.oci.hook" in modules, "no import was measured: the check is empty"
    assert {m for m in modules if m.startswith(HEAVY)} == set()
    assert "logging" not in modules and "charly_arbiter.oci.hookrun" not in modules


def test_the_fast_path_lets_only_possible_gpus_through(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    sys_root = tmp_path / "sys"
    (sys_root / "dev" / "char").mkdir(parents=True)
    pci = sys_root / "devices" / "pci0000:00" / "0000:00:02.0" / "drm" / "card0"
    pci.mkdir(parents=True)
    virtual = sys_root / "devices" / "virtual" / "misc" / "fuse"
    virtual.mkdir(parents=True)
    (sys_root / "dev" / "char" / "226:0").symlink_to(pci)
    (sys_root / "dev" / "char" / "10:229").symlink_to(virtual)
    config = tmp_path / "arbiter.toml"
    config.write_text('host = "local"\n')
    monkeypatch.delenv("CHARLY_ARBITER_HOST", raising=False)
    assert not may_claim(spec(), {}, str(sys_root), str(config))
    assert not may_claim(spec((10, 229)), {}, str(sys_root), str(config))
    assert may_claim(spec((226, 0)), {}, str(sys_root), str(config))
    cdi = spec(annotations={"cdi.k8s.io/x": "nvidia.com/gpu=0"})
    assert may_claim(cdi, {}, str(sys_root), str(config))
    config.write_text(f'host = "sim:{tmp_path}"\n')
    assert may_claim(spec((10, 229)), {}, str(sys_root), str(config))


def test_hooks_oci_hook_lets_a_plain_container_go_without_python(tmp_path: Path) -> None:
    """hooks/oci-hook pointed at a program that records being run."""
    called = tmp_path / "called"
    fake = tmp_path / "charly-arbiter"
    fake.write_text(f'#!/bin/sh\nprintf "%s|" "$@" > {called}; cat >> {called}\n')
    fake.chmod(0o755)
    script = tmp_path / "oci-hook"
    script.write_text(
        (REPO / "hooks" / "oci-hook").read_text().replace("/usr/bin/charly-arbiter", str(fake))
    )
    script.chmod(0o755)
    for name, container_spec, passes in (
        ("plain", spec(), False),
        ("gpu", spec((226, 0)), True),
        ("cdi", spec(annotations={"cdi.k8s.io/a": "nvidia.com/gpu=0"}), True),
        ("gone", None, True),
    ):
        called.unlink(missing_ok=True)
        bundle = tmp_path / name
        bundle.mkdir()
        if container_spec is not None:
            (bundle / "config.json").write_text(json.dumps(container_spec))
        document = json.dumps(state(name, bundle))
        started = time.monotonic()
        result = subprocess.run(
            [str(script)], input=document.encode(), capture_output=True, timeout=30
        )
        assert (result.returncode, result.stdout) == (0, b""), name
        assert called.exists() == passes, name
        if passes:
            assert called.read_text() == "hook|oci|" + document, name
        assert time.monotonic() - started < 10
