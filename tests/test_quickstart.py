"""The README's quick start, first command: `scripts/demo` runs its scenario on a
simulated host with Debian's python3 and ends as the README says it does.  (It
once stopped half-way, when `release` of a claimant that still runs began to be
refused, and nothing noticed.)"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_the_demo_runs_to_its_end() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("CHARLY_", "PYTHON"))}
    result = subprocess.run(
        ["/bin/bash", str(REPO / "scripts" / "demo")],
        capture_output=True,
        text=True,
        env=env,
        cwd="/",
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    out = result.stdout
    assert "libvirt:win11 holds gpu0 (exclusive); stopped container:llm" in out
    assert "held exclusively by libvirt:win11" in out and "(refused, exit 3)" in out
    assert "released libvirt:win11" in out
    final = out.rsplit("$ charly-arbiter status", 1)[1]
    assert "gpu0 (0000:0a:00.0)  shared" in final and "container:llm  shared  active" in final
    assert "Traceback" not in out
