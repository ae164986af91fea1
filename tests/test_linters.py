"""Linters as tests: ruff (lint and format) and mypy --strict on the package."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


def _tool(name: str) -> str:
    path = BIN / name
    if path.exists():
        return str(path)
    found = shutil.which(name)
    if found is None:
        pytest.skip(f"{name} is not installed for {sys.executable} (scripts/setup installs it)")
    return found


@pytest.mark.parametrize(
    "argv",
    [
        ["ruff", "check", "charly_arbiter", "tests", "bench"],
        ["ruff", "format", "--check", "charly_arbiter", "tests", "bench"],
        ["mypy", "charly_arbiter"],
    ],
    ids=["ruff-check", "ruff-format", "mypy-strict"],
)
def test_linter_is_clean(argv):
    result = subprocess.run(
        [_tool(argv[0]), *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_hook_script_is_posix_sh():
    hook = REPO / "hooks" / "qemu"
    if not hook.exists():
        pytest.fail("hooks/qemu is missing")
    result = subprocess.run(["/bin/sh", "-n", str(hook)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
