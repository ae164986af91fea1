"""What the OCI hook costs a container start: measured like the libvirt hook's (bench_costs.py).

Each figure is a median, printed with its ratio to `python3 -c pass` of the same
interpreter measured in the same run (these machines are noisy; only ratios
travel).  Not a timed test.

Rows:
1. hooks/oci-hook (sh) for a container given no device: what Podman runs for
   every container, twice (prestart and poststop); it exits without Python
2. the same for a container given a character device that is no GPU's
   (/dev/fuse): the sh filter passes it on, the Python fast path lets it go
3. prestart + poststop of a container given a GPU node (the simulated host):
   a shared claim and its release, the slow path
4. `podman run --rm` of a busybox container with no device, with the hook
   installed against without it (real Podman; skipped, with the reason, where it
   cannot run): what every container start pays
5. the same with a GPU node: the claim and release included

The hook is run as the runtime runs it: hooks/oci-hook (sh), which execs a
launcher like the one the package installs (`#!PYTHON` + `from charly_arbiter.cli
import main`), pointed at this checkout.

Run: python3 bench/bench_oci_hook.py [--python /usr/bin/python3] [--runs N] [--no-podman]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))

from simhosts import audio, gpu, host  # noqa: E402


def median_ms(action: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def run(argv: list[str], stdin: bytes = b"", env: dict[str, str] | None = None) -> None:
    result = subprocess.run(argv, input=stdin, capture_output=True, env=env, check=False)
    if result.returncode != 0 or result.stdout:
        raise SystemExit(f"{argv}: exit {result.returncode}: {result.stderr.decode()[-300:]}")


class Setup:
    """A simulated host with a GPU node, a launcher, the hook script and three bundles."""

    def __init__(self, root: Path, python: str) -> None:
        from tests.oci.podman import free_devices

        self.root = root
        os.chmod(root, 0o700)
        sim = root / "sim"
        (sim / "dev").mkdir(parents=True)
        [device] = free_devices(1)
        os.mknod(sim / "dev" / "card1", 0o600 | 0o020000, device.st_rdev)
        self.gpu_node = (os.major(device.st_rdev), os.minor(device.st_rdev))
        (sim / "host.toml").write_text(
            host(
                gpu("0000:0a:00.0", group=12, extra='nodes = ["card1"]'),
                audio("0000:0a:00.1", group=12),
            )
        )
        config = root / "arbiter.toml"
        config.write_text(
            f'host = "sim:{sim}"\nstate_dir = "{root / "state"}"\n'
            '[tokens.gpu0]\naddress = "0000:0a:00.0"\n'
        )
        self.launcher = root / "charly-arbiter"
        self.launcher.write_text(
            f"#!{python}\nimport sys\nsys.path.insert(0, {str(REPO)!r})\n"
            "from charly_arbiter.cli import main\nmain()\n"
        )
        self.launcher.chmod(0o755)
        self.hook = root / "oci-hook"
        script = (REPO / "hooks" / "oci-hook").read_text()
        self.hook.write_text(script.replace("/usr/bin/charly-arbiter", str(self.launcher)))
        self.hook.chmod(0o755)
        self.env = {"PATH": "/usr/bin:/bin", "CHARLY_ARBITER_CONFIG": str(config)}
        # A real host's configuration, for the /dev/fuse row: the fast path asks sysfs.
        plain = root / "plain.toml"
        plain.write_text("# no tokens: every detected GPU is one\n")
        self.plain_env = {"PATH": "/usr/bin:/bin", "CHARLY_ARBITER_CONFIG": str(plain)}

    def bundle(self, name: str, *devices: tuple[int, int]) -> Path:
        bundle = self.root / "bundles" / name / "userdata"
        bundle.mkdir(parents=True)
        entries = [
            {"path": f"/dev/d{i}", "type": "c", "major": major, "minor": minor}
            for i, (major, minor) in enumerate(devices)
        ]
        spec = {
            "ociVersion": "1.0.2-dev",
            "annotations": {"io.container.manager": "libpod"},
            "linux": {"devices": entries, "resources": {"devices": [{"allow": False}]}},
        }
        (bundle / "config.json").write_text(json.dumps(spec))
        return bundle


def state(name: str, bundle: Path, status: str) -> bytes:
    document = {"ociVersion": "1.0.2-dev", "id": name, "status": status, "bundle": str(bundle)}
    document["pid"] = os.getpid() if status == "creating" else 0
    return json.dumps(document).encode()


def hook_rows(setup: Setup, runs: int) -> dict[str, float | str]:
    hook = [str(setup.hook)]
    plain = setup.bundle("plain")
    fuse = os.stat("/dev/fuse") if os.path.exists("/dev/fuse") else None
    rows: dict[str, float | str] = {}
    rows["hook, a container given no device"] = median_ms(
        lambda: run(hook, state("plain", plain, "creating"), setup.env), runs
    )
    if fuse is None:
        rows["hook, a container given /dev/fuse"] = "no /dev/fuse here"
    else:
        number = (os.major(fuse.st_rdev), os.minor(fuse.st_rdev))
        bundle = setup.bundle("fuse", number)
        rows["hook, a container given /dev/fuse"] = median_ms(
            lambda: run(hook, state("fuse", bundle, "creating"), setup.plain_env), runs
        )
    gpu_bundle = setup.bundle("gpu", setup.gpu_node)
    claims, releases = [], []
    for _ in range(runs):
        started = time.perf_counter()
        run(hook, state("gpu", gpu_bundle, "creating"), setup.env)
        claims.append((time.perf_counter() - started) * 1000)
        started = time.perf_counter()
        run(hook, state("gpu", gpu_bundle, "stopped"), setup.env)
        releases.append((time.perf_counter() - started) * 1000)
    rows["hook prestart, a GPU container's claim"] = statistics.median(claims)
    rows["hook poststop, its release"] = statistics.median(releases)
    return rows


def podman_rows(setup: Setup, runs: int) -> dict[str, float | str]:
    from tests.oci.podman import PROGRAMS, RUN_OPTIONS, why_not

    reason = why_not()
    label = "podman run --rm, no device: with the hook / without"
    if reason:
        return {label: f"skipped: {reason}"}
    rootfs = setup.root / "rootfs"
    (rootfs / "bin").mkdir(parents=True)
    (rootfs / "bin" / "busybox").write_bytes(Path(PROGRAMS["busybox"]).read_bytes())
    (rootfs / "bin" / "busybox").chmod(0o755)
    (rootfs / "bin" / "sh").symlink_to("busybox")
    hooks_with, hooks_without = setup.root / "hooks.d", setup.root / "none.d"
    hooks_with.mkdir()
    hooks_without.mkdir()
    # The launcher needs the configuration: the runtime gives hooks an empty environment.
    wrapper = setup.root / "oci-hook-env"
    wrapper.write_text(
        f"#!/bin/sh\nexport CHARLY_ARBITER_CONFIG={setup.env['CHARLY_ARBITER_CONFIG']}\n"
        f'exec {setup.hook} "$@"\n'
    )
    wrapper.chmod(0o755)
    (hooks_with / "charly-arbiter.json").write_text(
        (REPO / "hooks" / "charly-arbiter.json")
        .read_text()
        .replace("/usr/libexec/charly-arbiter/oci-hook", str(wrapper))
    )
    node = setup.root / "sim" / "dev" / "card1"

    def start(hooks: Path, device: bool) -> float:
        argv = [PROGRAMS["podman"], "--hooks-dir", str(hooks), "run", "--rm", *RUN_OPTIONS]
        argv += ["--device", f"{node}:/dev/dri/card0"] if device else []
        started = time.perf_counter()
        run([*argv, "--rootfs", str(rootfs), "/bin/sh", "-c", "true"])
        return (time.perf_counter() - started) * 1000

    rows: dict[str, float | str] = {}
    for device, name in ((False, "no device"), (True, "a GPU node")):
        # Interleaved, so that the machine's drift falls on both alike.
        with_hook, without, added = [], [], []
        for _ in range(runs):
            without.append(start(hooks_without, device))
            with_hook.append(start(hooks_with, device))
            added.append(with_hook[-1] - without[-1])
        rows[f"podman run --rm, {name}, with the hook"] = statistics.median(with_hook)
        rows[f"podman run --rm, {name}, without it"] = statistics.median(without)
        rows[f"added by the hook, {name} (median of the differences)"] = statistics.median(added)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable)
    parser.add_argument("--runs", type=int, default=20)
    parser.add_argument("--no-podman", action="store_true")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-oci-") as directory:
        setup = Setup(Path(directory), args.python)
        baseline = median_ms(lambda: run([args.python, "-c", "pass"]), args.runs)
        rows = {"python -c pass": baseline, **hook_rows(setup, args.runs)}
        if not args.no_podman:
            rows.update(podman_rows(setup, args.runs))
    width = max(len(label) for label in rows)
    print(f"{args.python}, median of {args.runs}")
    for label, value in rows.items():
        if isinstance(value, str):
            print(f"{label:<{width}}  {value}")
        else:
            print(f"{label:<{width}}  {value:8.1f} ms  ({value / baseline:5.1f}x)")


if __name__ == "__main__":
    main()
