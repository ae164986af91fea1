"""What the arbiter costs where users feel it: every row of issue 12's table, in one run.

Each figure is a median, printed as a ratio to `python3 -c pass` of the same
interpreter measured in the same run (these machines are noisy; only the ratio
travels).  Not a timed test.

Rows:
1. hook, `prepare` of a domain with no hostdev and no claim element
2. hook, an operation the arbiter ignores (`started`) of a domain with a hostdev
3. hook, `prepare` of a domain whose only hostdev is not a GPU (a NIC from /sys)
4. `virsh start` + `virsh destroy` of a domain with no claim, with the hook against
   without it (a real libvirtd with QEMU/TCG; skipped, with the reason, where none
   can run)
5. hook `prepare` with a claim and nothing to preempt (the simulated host)
6. hook `release` of a domain with a GPU hostdev and no lease (every refused start)
7. `acquire` + `release` through the CLI (two processes)
8. `status --json` with 1,000 leases
Rows 5-8 twice, their samples taken in turn with one of the baseline's:
in-process (CHARLY_ARBITER_SERVE=off), and through the resident helper
(`charly-arbiter serve`, started by hand in this run with the same interpreter;
CHARLY_ARBITER_SERVE=must, so a row fails rather than measure a command that
ran in-process); then where a request through the helper spends its time
(serve_phases.py).

The hook is run as libvirt runs it: hooks/qemu (sh), which execs the launcher
the package installs (packaging/launcher.py: `#!PYTHON -S`, Python without
`site` until a command runs in-process), pointed at this checkout; the CLI's
rows run that launcher too.

Run: python3 bench/bench_costs.py [--python /usr/bin/python3] [--runs N] [--no-libvirt]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "packaging"))

from launcher import write_launcher  # noqa: E402

from charly_arbiter.core.ledger import Ledger  # noqa: E402
from charly_arbiter.core.model import Lease, LeaseState, Mode  # noqa: E402
from charly_arbiter.host.sim import SimHost  # noqa: E402

PLAIN = b"<domain type='qemu'><name>plain</name><devices><serial type='pty'/></devices></domain>"
NAMESPACE = "https://charly-arbiter.org/xmlns/claim/1"


def median_ms(action: Callable[[], object], runs: int) -> float:
    samples = []
    for _ in range(runs):
        started = time.perf_counter()
        action()
        samples.append((time.perf_counter() - started) * 1000)
    return statistics.median(samples)


def run(argv: list[str], stdin: bytes = b"", env: dict[str, str] | None = None) -> None:
    result = subprocess.run(argv, input=stdin, capture_output=True, env=env, check=False)
    if result.returncode != 0:
        raise SystemExit(f"{argv}: exit {result.returncode}: {result.stderr.decode()[-300:]}")


def hostdev(address: str) -> str:
    domain, bus, rest = address.split(":")
    slot, function = rest.split(".")
    return (
        "<hostdev mode='subsystem' type='pci' managed='yes'><source>"
        f"<address domain='0x{domain}' bus='0x{bus}' slot='0x{slot}' function='0x{function}'/>"
        "</source></hostdev>"
    )


def a_non_gpu_function(sys_root: Path = Path("/sys")) -> str | None:
    """A PCI function of this machine that is not a display controller, with none in its
    slot (what the hook's fast path can let go from sysfs alone)."""
    devices = sys_root / "bus/pci/devices"
    try:
        found = sorted(devices.iterdir())
    except OSError:
        return None
    classes = {d.name: (d / "class").read_text().strip() for d in found}
    for address, pci_class in classes.items():
        slot = address.rpartition(".")[0]
        if pci_class.startswith("0x03") or pci_class.startswith("0x0604"):
            continue
        if not any(a.startswith(slot) and c.startswith("0x03") for a, c in classes.items()):
            return address
    return None


class Setup:
    """A simulated host, a launcher and the hook script, in a temporary directory."""

    def __init__(self, root: Path, python: str) -> None:
        self.root = root
        self.python = python
        self.base: list[float] = []  # `python -c pass`, sampled throughout the run
        self.env = {k: v for k, v in os.environ.items() if not k.startswith("CHARLY_ARBITER_")}
        self.env["PYTHONPATH"] = str(REPO)
        subprocess.run(
            [python, "-m", "charly_arbiter", "sim", "init", str(root / "sim")],
            env=self.env,
            check=True,
            capture_output=True,
        )
        self.env["CHARLY_ARBITER_CONFIG"] = str(root / "sim" / "arbiter.toml")
        # The program as the package installs it (packaging/launcher.py: without
        # `site`), pointing at this checkout.
        self.launcher = root / "charly-arbiter"
        write_launcher(self.launcher, python, str(REPO))
        self.hook = root / "qemu"
        script = (REPO / "hooks" / "qemu").read_text()
        self.hook.write_text(script.replace("/usr/bin/charly-arbiter", str(self.launcher)))
        self.hook.chmod(0o755)
        # The launcher sees the simulated host's configuration (a hook has no environment).
        self.hook_env = {
            "PATH": "/usr/bin:/bin",
            **{k: self.env[k] for k in ("CHARLY_ARBITER_CONFIG",)},
        }

    def cli(self, *args: str) -> list[str]:
        """The program as installed (the launcher, not `python -m`, whose runpy costs
        milliseconds the installed program does not pay)."""
        return [str(self.launcher), *args]

    def ways(self, served: bool) -> tuple[dict[str, str], dict[str, str]]:
        """The CLI's and the hook's environment, in-process or through the helper."""
        how = {"CHARLY_ARBITER_SERVE": "off"}
        if served:
            how = {
                "CHARLY_ARBITER_SERVE": "must",
                "CHARLY_ARBITER_SOCKET": str(self.socket),
                # Generous: a row measures how long it takes, never a fall-back.
                "CHARLY_ARBITER_SERVE_DEADLINE_MS": "2000",
            }
        return {**self.env, **how}, {**self.hook_env, **how}

    @property
    def socket(self) -> Path:
        return self.root / "serve.sock"


class Server:
    """`charly-arbiter serve` on the setup's socket, started by hand for this run."""

    def __init__(self, setup: Setup) -> None:
        self.process = subprocess.Popen(
            [*setup.cli("serve", "--socket", str(setup.socket))],
            env=setup.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
        )
        env, _ = setup.ways(served=True)
        deadline = time.monotonic() + 60
        while True:
            if self.process.poll() is not None:
                raise SystemExit(f"serve exited: {self.process.communicate()[1].decode()}")
            probe = subprocess.run(setup.cli("--version"), env=env, capture_output=True)
            if probe.returncode == 0:
                return
            if time.monotonic() > deadline:
                raise SystemExit(f"serve did not answer: {probe.stderr.decode()}")
            time.sleep(0.1)

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


def hook_rows(setup: Setup, runs: int, nic: str | None) -> dict[str, float | str]:
    hook = str(setup.hook)
    env = setup.hook_env
    rows: dict[str, float | str] = {}
    rows["hook prepare, no hostdev and no claim"] = median_ms(
        lambda: run([hook, "plain", "prepare", "begin", "-"], PLAIN, env), runs
    )
    with_gpu = f"<domain><name>v</name><devices>{hostdev('0000:0a:00.0')}</devices></domain>"
    rows["hook, an operation it ignores (started)"] = median_ms(
        lambda: run([hook, "v", "started", "begin", "-"], with_gpu.encode(), env), runs
    )
    if nic is None:
        rows["hook prepare, only a hostdev that is not a GPU"] = "no such PCI function here"
    else:
        # A real host's configuration: the fast path checks the class in /sys (the
        # simulated host's configuration would send it the slow way, on purpose).
        plain_config = setup.root / "plain.toml"
        plain_config.write_text("# no tokens: every detected GPU is one\n")
        nic_env = {"PATH": "/usr/bin:/bin", "CHARLY_ARBITER_CONFIG": str(plain_config)}
        nic_xml = f"<domain><name>n</name><devices>{hostdev(nic)}</devices></domain>".encode()
        rows["hook prepare, only a hostdev that is not a GPU"] = median_ms(
            lambda: run([hook, "n", "prepare", "begin", "-"], nic_xml, nic_env), runs
        )
    return rows


CLAIM = (
    f"<domain><name>bench</name><metadata><ca:claim xmlns:ca='{NAMESPACE}' mode='shared'>"
    "<ca:token>gpu1</ca:token></ca:claim></metadata></domain>"
).encode()
NO_LEASE = f"<domain><name>nolease</name><devices>{hostdev('0000:0a:00.0')}</devices></domain>"


WAYS = {False: "in-process", True: "through the helper"}


def both_ways(
    name: str, setup: Setup, runs: int, sample: Callable[[bool], float]
) -> dict[str, float | str]:
    """`name`'s row in-process and through the helper, their samples taken in turn
    with one of the baseline's (this machine's load drifts within seconds; a row
    measured after the other, or after the baseline, would carry the drift)."""
    samples: dict[bool, list[float]] = {False: [], True: []}
    for _ in range(runs):
        for served in (False, True):
            samples[served].append(sample(served))
        setup.base.append(timed(lambda: run([setup.python, "-c", "pass"])))
    return {f"{name}, {WAYS[served]}": statistics.median(samples[served]) for served in WAYS}


def timed(action: Callable[[], object]) -> float:
    started = time.perf_counter()
    action()
    return (time.perf_counter() - started) * 1000


def claim_rows(setup: Setup, runs: int) -> dict[str, float | str]:
    """Rows 5-7."""
    hook = str(setup.hook)

    def prepare(served: bool) -> float:
        _, env = setup.ways(served)
        took = timed(lambda: run([hook, "bench", "prepare", "begin", "-"], CLAIM, env))
        run([hook, "bench", "release", "end", "destroyed"], CLAIM, env)
        return took

    def release(served: bool) -> float:
        _, env = setup.ways(served)
        return timed(lambda: run([hook, "nolease", "release", "end", "-"], NO_LEASE.encode(), env))

    def cycle(served: bool) -> float:
        env, _ = setup.ways(served)
        return timed(
            lambda: (
                run(setup.cli("acquire", "--exclusive", "libvirt:bench", "gpu0"), env=env),
                run(setup.cli("release", "--force", "libvirt:bench"), env=env),
            )
        )

    return {
        **both_ways("hook prepare, a claim with nothing to preempt", setup, runs, prepare),
        **both_ways("hook release, a GPU hostdev and no lease", setup, runs, release),
        **both_ways("acquire + release through the CLI", setup, runs, cycle),
    }


def status_rows(setup: Setup, runs: int) -> dict[str, float | str]:
    """Row 8, both ways, on a ledger of 1,000 leases."""
    root = setup.root / "sim"
    template = Lease(
        claimant="container:c",
        mode=Mode.SHARED,
        tokens=("gpu1",),
        state=LeaseState.ACTIVE,
        transient=False,
        boot_id=SimHost(root).boot_id(),
        created="2026-01-01T00:00:00+00:00",
    )
    with Ledger(root / "state").transaction() as txn:
        txn.state = replace(
            txn.state,
            leases=tuple(replace(template, claimant=f"container:c{i}") for i in range(1000)),
        )

    def status(served: bool) -> float:
        env, _ = setup.ways(served)
        return timed(lambda: run(setup.cli("status", "--json"), env=env))

    return both_ways("status --json with 1,000 leases", setup, runs, status)


def phase_rows(setup: Setup, runs: int) -> dict[str, float | str]:
    """Where a request through the helper spends its time (serve_phases.py, run by the
    interpreter measured)."""
    env, _ = setup.ways(served=True)
    result = subprocess.run(
        [setup.python, str(REPO / "bench" / "serve_phases.py"), str(runs)],
        env=env,
        capture_output=True,
        text=True,
    )
    if result.returncode != 0:
        raise SystemExit(f"serve_phases.py: {result.stderr[-500:]}")
    rows: dict[str, float | str] = {}
    for line in result.stdout.splitlines():
        name, _, value = line.rpartition(" ")
        rows[f"  {name} (ms)"] = float(value)
    rows["  the client's start: python -S + `import charly_arbiter.cli` (ms)"] = median_ms(
        lambda: run(
            [setup.python, "-S", "-c", "import charly_arbiter.cli, charly_arbiter.serve.client"],
            env=setup.env,
        ),
        runs,
    )
    return rows


def virsh_rows(runs: int) -> dict[str, float | str]:
    sys.path.insert(0, str(REPO / "tests"))  # the libvirt test bed imports tests' helpers
    from tests.libvirt.libvirtd import Unavailable, libvirt_environment, why_not

    reason = why_not()
    if reason:
        return {"virsh start + destroy, no claim: with the hook / without": f"skipped: {reason}"}

    def cycle_ms(with_hook: bool) -> float:
        with (
            tempfile.TemporaryDirectory() as work,
            libvirt_environment(Path(work), with_hook=with_hook) as lv,
        ):
            name = lv.define("bench-plain", "")
            return median_ms(lambda: (lv.virsh("start", name), lv.virsh("destroy", name)), runs)

    try:
        without, with_hook = cycle_ms(False), cycle_ms(True)
    except Unavailable as error:
        return {"virsh start + destroy, no claim: with the hook / without": f"skipped: {error}"}
    return {
        "virsh start + destroy, no claim, without the hook (ms)": without,
        "virsh start + destroy, no claim, with the hook (ms)": with_hook,
        "virsh start + destroy, no claim: added by the hook (%)": (with_hook / without - 1) * 100,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--python", default=sys.executable, help="the interpreter measured")
    parser.add_argument("--runs", type=int, default=21)
    parser.add_argument("--no-libvirt", action="store_true", help="skip row 4")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="charly-bench-") as directory:
        setup = Setup(Path(directory), args.python)
        setup.base += [timed(lambda: run([args.python, "-c", "pass"])) for _ in range(args.runs)]
        rows = hook_rows(setup, args.runs, a_non_gpu_function())
        server = Server(setup)
        try:
            rows.update(claim_rows(setup, args.runs))
            rows.update(status_rows(setup, args.runs))
            rows["a request through the helper:"] = ""
            rows.update(phase_rows(setup, args.runs))
        finally:
            server.stop()
        base = statistics.median(setup.base)
    if not args.no_libvirt:
        rows.update(virsh_rows(max(5, args.runs // 3)))
    version = subprocess.run(
        [args.python, "-c", "import sys; print(sys.version.split()[0])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    print(f"{args.python} (Python {version}); medians of {args.runs} runs")
    print(f"  {'python3 -c pass':<58} {base:8.1f} ms    1.0x")
    for name, value in rows.items():
        if value == "":
            print(f"  {name}")
        elif isinstance(value, str):
            print(f"  {name:<58} {value}")
        elif name.endswith("(%)"):
            print(f"  {name:<58} {value:+8.1f} %")
        elif name.endswith("(ms)"):
            print(f"  {name:<58} {value:8.1f} ms")
        else:
            print(f"  {name:<58} {value:8.1f} ms {value / base:5.1f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
