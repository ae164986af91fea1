"""The hook's path for a domain that claims nothing stays light: measured with
`python -X importtime` on the real hook process."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
PLAIN = b"<domain type='qemu'><name>plain</name><devices><serial type='pty'/></devices></domain>"
HEAVY = ("libvirt", "pyudev", "pynvml", "click", "tomlkit", "portalocker")


def imported_modules(
    *args: str, stdin: bytes
) -> tuple[subprocess.CompletedProcess[bytes], set[str]]:
    result = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "charly_arbiter", "hook", *args],
        input=stdin,
        capture_output=True,
        cwd=REPO,
        env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(REPO)},
        timeout=60,
    )
    modules = set()
    for line in result.stderr.decode().splitlines():
        if line.startswith("import time:") and "|" in line:
            modules.add(line.rsplit("|", 1)[1].strip())
    return result, modules


@pytest.mark.parametrize(
    "operation",
    [["prepare", "begin", "-"], ["release", "end", "destroyed"], ["start", "begin", "-"]],
)
def test_no_claim_path_imports_nothing_heavy(operation: list[str]) -> None:
    result, modules = imported_modules("qemu", "plain", *operation, stdin=PLAIN)
    assert result.returncode == 0
    assert result.stdout == b""
    assert "charly_arbiter.libvirt.hook" in modules, (
        "no import was measured: the check would be empty"
    )
    heavy = {m for m in modules if m.split(".")[0] in HEAVY}
    assert heavy == set(), heavy
    for module in (
        "charly_arbiter.core.config",
        "charly_arbiter.core.ledger",
        "charly_arbiter.libvirt.domainxml",
    ):
        assert module not in modules
    assert "logging" not in modules


def test_fast_path_markers_match_the_claim_rules() -> None:
    from charly_arbiter.libvirt.domainxml import NAMESPACE
    from charly_arbiter.libvirt.hook import CLAIM_MARKERS

    assert set(CLAIM_MARKERS) == {b"hostdev", NAMESPACE.encode()}
    assert not any(marker in PLAIN for marker in CLAIM_MARKERS)


def test_hook_script_hands_arguments_and_stdin_on(tmp_path: Path) -> None:
    script = (REPO / "hooks" / "qemu").read_text()
    fake = tmp_path / "charly-arbiter"
    fake.write_text('#!/bin/sh\nprintf "%s|" "$@" >&2; cat >&2; exit 3\n')
    fake.chmod(0o755)
    hook = tmp_path / "qemu"
    hook.write_text(script.replace("/usr/bin/charly-arbiter", str(fake)))
    hook.chmod(0o755)
    result = subprocess.run(
        [str(hook), "odd name;$(x)", "prepare", "begin", "-"],
        input=PLAIN,
        capture_output=True,
        timeout=10,
    )
    assert result.returncode == 3
    assert result.stdout == b""
    assert result.stderr == b"hook|qemu|odd name;$(x)|prepare|begin|-|" + PLAIN
