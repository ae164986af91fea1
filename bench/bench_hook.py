"""How much the qemu hook costs, measured on a real libvirtd with QEMU/TCG domains.

1. The hook process for a domain with no claim, and for a claim with nothing
   to preempt, as a ratio to `python3 -c pass` with the same interpreter.
2. The extra time the hook adds to `virsh start` of a TCG domain, against the
   same start with no hook installed (libvirtd restarted without it).

Run as root on a machine set up by scripts/setup:
    .venv/bin/python bench/bench_hook.py [--runs N]
It takes /tmp/charly-libvirt.lock, starts and stops libvirtd itself and
restores /etc/libvirt afterwards (tests/libvirt/conftest.py).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from tests.libvirt.conftest import (  # noqa: E402
    Libvirt,
    Unavailable,
    claim,
    libvirt_environment,
    why_not,
)

PLAIN_XML = b"<domain type='qemu'><name>plain</name><devices><serial/></devices></domain>"


def timed(action: Callable[[], object], runs: int) -> float:
    """Median wall time of `action` over `runs` runs, in milliseconds."""
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def hook_overhead(lv: Libvirt, runs: int) -> dict[str, float]:
    baseline = timed(lambda: subprocess.run([sys.executable, "-c", "pass"], check=True), runs)
    claim_xml = (
        f"<domain type='qemu'><name>bench</name><metadata>{claim('shared', ('gpu1',))}"
        "</metadata></domain>"
    ).encode()

    def no_claim() -> None:
        result = lv.hook("qemu", "plain", "prepare", "begin", "-", stdin=PLAIN_XML)
        assert result.returncode == 0, result.stderr

    plain = timed(no_claim, runs)
    prepares = []
    for _ in range(runs):
        started = time.perf_counter()
        result = lv.hook("qemu", "bench", "prepare", "begin", "-", stdin=claim_xml)
        prepares.append((time.perf_counter() - started) * 1000)
        assert result.returncode == 0, result.stderr
        lv.hook("qemu", "bench", "release", "end", "-", stdin=claim_xml)
    prepare = statistics.median(prepares)
    return {
        "python3 -c pass (ms)": baseline,
        "hook, no claim (ms)": plain,
        "hook, no claim / python3 -c pass": plain / baseline,
        "hook prepare, claim with nothing to preempt (ms)": prepare,
        "hook prepare, claim / python3 -c pass": prepare / baseline,
    }


def start_times(lv: Libvirt, runs: int, with_claim: bool) -> float:
    name = lv.define(
        "bench-claim" if with_claim else "bench-plain",
        claim("shared", ("gpu1",)) if with_claim else "",
    )
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        lv.virsh("start", name)
        samples.append((time.perf_counter() - started) * 1000)
        lv.virsh("destroy", name)
        if with_claim:
            lv.wait_for("the release", lambda: lv.leases() == {})
    return statistics.median(samples)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=15)
    args = parser.parse_args()
    reason = why_not()
    if reason:
        print(f"bench_hook: cannot run: {reason}", file=sys.stderr)
        return 1
    figures: dict[str, float] = {}
    try:
        with (
            tempfile.TemporaryDirectory() as work,
            libvirt_environment(Path(work), with_hook=False) as lv,
        ):
            figures["virsh start, no hook (ms)"] = start_times(lv, args.runs, False)
        with (
            tempfile.TemporaryDirectory() as work,
            libvirt_environment(Path(work), with_hook=True) as lv,
        ):
            figures["virsh start, hook, no claim (ms)"] = start_times(lv, args.runs, False)
            figures["virsh start, hook, claim (ms)"] = start_times(lv, args.runs, True)
            figures.update(hook_overhead(lv, args.runs))
    except Unavailable as error:
        print(f"bench_hook: cannot run: {error}", file=sys.stderr)
        return 1
    base = figures["virsh start, no hook (ms)"]
    figures["virsh start: extra for the hook, no claim (ms)"] = (
        figures["virsh start, hook, no claim (ms)"] - base
    )
    figures["virsh start: extra for the hook, claim (ms)"] = (
        figures["virsh start, hook, claim (ms)"] - base
    )
    print(f"median of {args.runs} runs, {sys.executable}")
    for key, value in figures.items():
        print(f"  {key:<52} {value:8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
