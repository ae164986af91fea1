"""Benchmark: a token's driver switch through charly-arbiter against bare sysfs writes.

Boots Debian's kernel under QEMU/TCG (the harness of tests/kernel), and in the
guest switches the GPU-shaped pair 00:02.0 (bochs-drm) + 00:02.1
(snd_hda_intel) to vfio-pci and back, many cycles, three ways in alternating
blocks: the bare shell sequence of sysfs writes (`driver_override`, unbind,
`drivers_probe` per function), `LocalHost.switch` (the switching layer, with
its checks, watchdog and verification), and a whole exclusive acquire +
release through the arbiter.  Prints the medians per cycle and the ratios.

    .venv/bin/python bench/bench_switch.py [--cycles 50]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "tests" / "kernel"))

from guest import boot, check_qemu, prepare_kernel, repo_mount_script  # noqa: E402


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cycles", type=int, default=50, help="cycles per way (default 50)")
    parser.add_argument("--block", type=int, default=5, help="cycles per alternating block")
    args = parser.parse_args()
    check_qemu()
    kernel = prepare_kernel()
    with tempfile.TemporaryDirectory(prefix="charly-bench-") as directory:
        results = Path(directory)
        script = (
            "export PATH=/usr/sbin:/usr/bin:/sbin:/bin PYTHONDONTWRITEBYTECODE=1 HOME=/tmp\n"
            + repo_mount_script(REPO)
            + f"export PYTHONPATH={REPO}\n"
            f"/usr/bin/python3 {REPO}/tests/kernel/scenario.py {kernel.root} bench "
            f"{args.cycles} {args.block}\n"
        )
        booted = boot(kernel, results, script, timeout=1800, repo=REPO)
        path = results / "results.json"
        if not path.exists():
            print(booted.serial[-3000:], file=sys.stderr)
            return 1
        recorded = json.loads(path.read_text())
    if recorded["errors"]:
        print(json.dumps(recorded["errors"], indent=1), file=sys.stderr)
        return 1
    bench = recorded["bench"]
    print(f"kernel {kernel.version} under QEMU/TCG, guest run {booted.seconds:.1f} s")
    print(f"{bench['cycles']} cycles per way (both functions to vfio-pci and back), medians:")
    print(f"  bare sysfs writes (sh)        {bench['bare_ms']:8.1f} ms per cycle")
    print(
        f"  charly-arbiter LocalHost.switch {bench['host_switch_ms']:6.1f} ms per cycle"
        f"  ratio {bench['host_switch_ratio']:.2f}x"
    )
    print(
        f"  charly-arbiter acquire+release {bench['arbiter_ms']:7.1f} ms per cycle"
        f"  ratio {bench['arbiter_ratio']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
