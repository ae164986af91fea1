"""Core benchmark: the CLI on a simulated host, measured against the bare
start-up of the same interpreter (`python -c pass`) in the same run, because
these machines are noisy and only the ratio travels.  Not a timed test.

Prints, in one run:
- the median latency of one acquire + release cycle through the CLI;
- the throughput of 16 concurrent claimants (real processes, real flock);
- the time of `status --json` with 1,000 leases in the ledger.

Run: python3 bench/bench_core.py [--cycles N]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from charly_arbiter.core.ledger import Ledger  # noqa: E402
from charly_arbiter.core.model import Lease, LeaseState, Mode  # noqa: E402
from charly_arbiter.host.sim import SimHost  # noqa: E402

CLAIMANTS = 16


def timed(argv: list[str], env: dict[str, str]) -> float:
    started = time.perf_counter()
    subprocess.run(argv, env=env, cwd=REPO, check=True, capture_output=True)
    return time.perf_counter() - started


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "charly_arbiter", *args]


def setup(root: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")}
    env["PYTHONPATH"] = str(REPO)
    subprocess.run(
        cli("sim", "init", str(root)), env=env, cwd=REPO, check=True, capture_output=True
    )
    env["CHARLY_ARBITER_CONFIG"] = str(root / "arbiter.toml")
    return env


def baseline(env: dict[str, str], runs: int) -> float:
    return statistics.median(timed([sys.executable, "-c", "pass"], env) for _ in range(runs))


def cycle_latency(env: dict[str, str], cycles: int) -> float:
    samples = []
    for _ in range(cycles):
        started = time.perf_counter()
        timed(cli("acquire", "--exclusive", "libvirt:bench", "gpu0"), env)
        timed(cli("release", "--force", "libvirt:bench"), env)
        samples.append(time.perf_counter() - started)
    return statistics.median(samples)


WORKER = """
import subprocess, sys
claimant, cycles = sys.argv[1], int(sys.argv[2])
for _ in range(cycles):
    for args in (["acquire", "--shared", claimant, "gpu0"], ["release", claimant]):
        subprocess.run([sys.executable, "-m", "charly_arbiter", *args], check=True,
                       capture_output=True)
"""


def throughput(env: dict[str, str], cycles: int) -> tuple[float, float]:
    """Cycles per second of 16 concurrent claimants, and the same for 16
    concurrent pairs of bare interpreter start-ups (the ceiling of this machine)."""

    def run(code: str, argv: list[str]) -> float:
        started = time.perf_counter()
        workers = [
            subprocess.Popen([sys.executable, "-c", code, *argv(index)], env=env, cwd=REPO)
            for index in range(CLAIMANTS)
        ]
        for worker in workers:
            if worker.wait() != 0:
                raise SystemExit("a benchmark worker failed")
        return CLAIMANTS * cycles / (time.perf_counter() - started)

    claims = run(WORKER, lambda index: [f"container:bench{index}", str(cycles)])
    bare = (
        "import subprocess, sys\n"
        "for _ in range(int(sys.argv[1]) * 2):\n"
        "    subprocess.run([sys.executable, '-c', 'pass'], check=True)\n"
    )
    ceiling = run(bare, lambda index: [str(cycles)])
    return claims, ceiling


def status_with_leases(root: Path, env: dict[str, str], leases: int, runs: int) -> float:
    boot_id = SimHost(root).boot_id()
    ledger = Ledger(root / "state")
    template = Lease(
        claimant="",
        mode=Mode.SHARED,
        tokens=("gpu1",),
        state=LeaseState.ACTIVE,
        transient=False,
        boot_id=boot_id,
        created="2026-01-01T00:00:00+00:00",
    )
    with ledger.transaction() as txn:
        for index in range(leases):
            txn.state = txn.state.with_lease(replace(template, claimant=f"container:c{index}"))
    return statistics.median(timed(cli("status", "--json"), env) for _ in range(runs))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cycles", type=int, default=20, help="cycles per measurement")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="charly-bench-") as directory:
        root = Path(directory)
        env = setup(root)
        base = baseline(env, 20)
        print(f"interpreter: {sys.executable} (python {sys.version.split()[0]})")
        print(f"bare start-up (python -c pass), median:  {base * 1000:8.1f} ms   1.0x")
        latency = cycle_latency(env, args.cycles)
        print(
            f"acquire+release cycle via CLI, median:   {latency * 1000:8.1f} ms "
            f"{latency / base:5.1f}x"
        )
        claims, ceiling = throughput(env, max(2, args.cycles // 4))
        print(
            f"16 concurrent claimants:                 {claims:8.1f} cycles/s "
            f"({1000 / claims:.1f} ms/cycle, {(1 / claims) / base:.1f}x start-up; "
            f"bare start-up pairs at 16-way: {ceiling:.1f}/s)"
        )
        status = status_with_leases(root, env, 1000, 5)
        print(
            f"status --json with 1,000 leases, median: {status * 1000:8.1f} ms "
            f"{status / base:5.1f}x"
        )


if __name__ == "__main__":
    main()
