"""Fixtures of the operator-experience tests (helpers live in opstools.py)."""

from __future__ import annotations

import subprocess

import pytest


@pytest.fixture
def dead_pid() -> int:
    """The pid of a real process that has exited and been reaped."""
    child = subprocess.Popen(["/bin/true"])
    child.wait()
    return child.pid
