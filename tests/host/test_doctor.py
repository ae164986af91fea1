"""`doctor` through the real CLI on this machine, and its checks on a known ledger."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Poison

REPO = Path(__file__).resolve().parents[2]


def cli(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    state = tmp_path / "state"
    state.mkdir(mode=0o700, exist_ok=True)
    config = tmp_path / "arbiter.toml"
    config.write_text(f'host = "local"\nstate_dir = "{state}"\n')
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")}
    return subprocess.run(
        [sys.executable, "-m", "charly_arbiter", "--config", str(config), *args],
        capture_output=True,
        text=True,
        cwd=REPO,
        env=env,
        timeout=120,
    )


def test_doctor_reports_a_poisoned_token_and_exits_non_zero(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    with Ledger(state).transaction() as txn:
        txn.state = txn.state.with_poison("gpu0", Poison("unbind hung", "2026-01-01T00:00:00"))
    hook = tmp_path / "hook"
    hook.write_text("#!/bin/sh\n")
    hook.chmod(0o755)
    result = cli(tmp_path, "doctor", "--json", "--hook", str(hook))
    assert result.returncode == 1, result.stderr
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["poison gpu0"]["level"] == "problem"
    assert "poison clear gpu0" in checks["poison gpu0"]["fix"]
    assert checks["hook"]["level"] == "ok"
    assert checks["ledger"]["level"] == "ok"
    assert checks["stranded"]["level"] == "ok"
    assert {"iommu", "vfio-pci", "memlock", "libvirt"} <= set(checks)


def test_doctor_text_has_one_line_per_check_and_a_missing_hook_is_a_warning(tmp_path):
    result = cli(tmp_path, "doctor", "--hook", str(tmp_path / "absent"))
    lines = [line for line in result.stdout.splitlines() if not line.startswith(" ")]
    assert any(line.startswith("warning  hook:") for line in lines), result.stdout
    assert all(line.split()[0] in ("ok", "warning", "problem") for line in lines)
    has_problem = any(line.startswith("problem") for line in lines)
    assert result.returncode == (1 if has_problem else 0)


def test_doctor_reports_a_corrupt_ledger(tmp_path):
    state = tmp_path / "state"
    state.mkdir(mode=0o700)
    (state / "ledger.toml").write_text("this is not a ledger [")
    (state / "ledger.toml").chmod(0o600)
    result = cli(tmp_path, "doctor", "--json")
    checks = {c["name"]: c for c in json.loads(result.stdout)["checks"]}
    assert checks["ledger"]["level"] == "problem"
    assert result.returncode == 1


def test_detect_runs_on_this_machine(tmp_path):
    """The real /sys through pyudev: whatever this machine has, detect describes it."""
    result = cli(tmp_path, "detect", "--json")
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    addresses = sorted(os.listdir("/sys/bus/pci/devices")) if Path("/sys/bus/pci").exists() else []
    assert [f["address"] for f in document["functions"]] == addresses
    assert set(document["vfio"]) >= {"iommu_on", "vfio_pci", "memlock_soft"}


def test_the_cdi_check_says_whether_the_spec_is_missing_stale_or_fresh(tmp_path):
    """The spec must exist and be newer than the last switch of a CDI token (issue 11)."""
    from datetime import UTC, datetime, timedelta

    from charly_arbiter.ops.doctor import Level, cdi_check
    from charly_arbiter.ops.history import HistoryLog

    spec = tmp_path / "nvidia.yaml"
    history = HistoryLog(tmp_path)
    switched = datetime.now(UTC) - timedelta(minutes=5)
    history.append("switched", {"token": "gpu0", "driver": "vfio-pci"}, when=switched)
    history.append("switched", {"token": "gpu9", "driver": "nvidia"}, when=datetime.now(UTC))
    records = history.read().records
    missing = cdi_check(spec, {"gpu0"}, records)
    assert missing.level is Level.WARNING and "no CDI spec" in missing.message
    assert "nvidia-ctk cdi generate" in missing.fix
    spec.write_text("cdiVersion: 0.5.0\n")
    old = (switched - timedelta(minutes=1)).timestamp()
    os.utime(spec, (old, old))
    stale = cdi_check(spec, {"gpu0"}, records)
    assert stale.level is Level.WARNING and "older than the last switch of gpu0" in stale.message
    fresh = (switched + timedelta(minutes=1)).timestamp()
    os.utime(spec, (fresh, fresh))
    assert cdi_check(spec, {"gpu0"}, records).level is Level.OK
    # Only a switch of a token the spec describes counts (gpu9 switched later).
    assert cdi_check(spec, {"gpu0"}, records).level is Level.OK
    assert cdi_check(spec, {"gpu9"}, records).level is Level.WARNING
