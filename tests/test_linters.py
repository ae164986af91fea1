"""Linters as tests: ruff (lint and format) and mypy --strict on the package.

They run under the interpreter that runs the tests (`python -m ruff`, `python -m
mypy`), so the linter is the one scripts/setup pinned into .venv and mypy sees
the libraries the package is checked against.  A missing linter is a failure,
not a skip: a skipped lint test reads as a clean one.  scripts/test runs these
with .venv's Python; its second run, on Debian's /usr/bin/python3 without the
linters, collects only tests/core and never gets here.
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent


def linter(module: str) -> list[str]:
    """`python -m MODULE` for this interpreter; fails the test when it is not installed."""
    if importlib.util.find_spec(module) is None:
        pytest.fail(
            f"{module} is not installed for {sys.executable}: run scripts/setup "
            "(it installs ruff and mypy into .venv), or run the tests with .venv/bin/python",
            pytrace=False,
        )
    return [sys.executable, "-m", module]


@pytest.mark.parametrize(
    "argv",
    [
        ["ruff", "check", "charly_arbiter", "tests", "bench"],
        ["ruff", "format", "--check", "charly_arbiter", "tests", "bench"],
        ["mypy", "charly_arbiter"],
    ],
    ids=["ruff-check", "ruff-format", "mypy-strict"],
)
def test_linter_is_clean(argv: list[str]) -> None:
    result = subprocess.run(
        [*linter(argv[0]), *argv[1:]], cwd=REPO, capture_output=True, text=True, timeout=600
    )
    assert result.returncode == 0, result.stdout + result.stderr


@pytest.mark.parametrize("name", ["qemu", "proxmox"])
def test_hook_script_is_posix_sh(name: str) -> None:
    hook = REPO / "hooks" / name
    assert hook.exists(), f"hooks/{name} is missing"
    result = subprocess.run(["/bin/sh", "-n", str(hook)], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
