"""scripts/private-root: what scripts/test's services lane writes to /etc, /usr and
/var never reaches this machine's root, which the real-kernel guests read over 9p
at the same time; Podman's storage and the test cache stay the real ones.

Real: a real mount namespace and real overlays (root only; a machine that cannot
make them fails here, as scripts/test would there)."""

from __future__ import annotations

import os
import subprocess
import uuid
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
PRIVATE_ROOT = REPO / "scripts" / "private-root"
CACHE = Path("/var/cache/charly-arbiter-tests")


def private(directory: Path, script: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [str(PRIVATE_ROOT), str(directory), "/bin/sh", "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
    )


@pytest.fixture
def probe() -> str:
    if os.geteuid() != 0:
        pytest.fail("scripts/private-root needs root (scripts/test runs as root)")
    return f"charly-private-root-{uuid.uuid4().hex}"


def test_writes_to_etc_usr_and_var_stay_in_the_private_root(tmp_path: Path, probe: str) -> None:
    paths = [Path("/etc") / probe, Path("/usr/share") / probe, Path("/var/lib") / probe]
    script = "".join(f"echo inside > {path} && cat {path} && " for path in paths) + "true"
    result = private(tmp_path / "root", script)
    leaked = [path for path in paths if path.exists()]
    for path in leaked:
        path.unlink()
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["inside"] * 3
    assert not leaked, f"{leaked} reached the real root"
    upper = sorted(p.name for p in (tmp_path / "root").rglob(probe))
    assert upper == [probe] * 3, "the writes are in the private root's upper layers"


def test_the_test_cache_is_the_real_one(tmp_path: Path, probe: str) -> None:
    CACHE.mkdir(parents=True, exist_ok=True)
    shared = CACHE / probe
    try:
        result = private(tmp_path / "root", f"echo kept > {shared}")
        assert result.returncode == 0, result.stderr
        assert shared.read_text() == "kept\n", "the debootstrap cache must outlive the run"
    finally:
        shared.unlink(missing_ok=True)


def test_a_command_that_fails_fails_the_run(tmp_path: Path) -> None:
    assert private(tmp_path / "root", "exit 7").returncode == 7
    usage = subprocess.run([str(PRIVATE_ROOT)], capture_output=True, text=True, timeout=60)
    assert usage.returncode == 2 and "usage" in usage.stderr
