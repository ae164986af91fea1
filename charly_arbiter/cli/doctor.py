"""`doctor`: one line per check of the host, with what to do; non-zero on a problem."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from dataclasses import asdict, dataclass
from enum import StrEnum
from pathlib import Path
from typing import Any

import click

from charly_arbiter.cli.app import App, vm_memory_option
from charly_arbiter.errors import ArbiterError
from charly_arbiter.host import run

HOOK_PATH = Path("/etc/libvirt/hooks/qemu.d/charly-arbiter")


class Level(StrEnum):
    OK = "ok"
    WARNING = "warning"
    PROBLEM = "problem"


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    message: str
    fix: str = ""


def host_checks(app: App, vm_memory: int) -> list[Check]:
    """IOMMU, vfio-pci, each token's group, nvidia-ctk and memlock (local host only)."""
    from charly_arbiter.host.detect import detect, group_problems
    from charly_arbiter.host.local import LocalHost

    host = app.host()
    if not isinstance(host, LocalHost):
        return [Check("host", Level.WARNING, f"{host.description} is simulated; PCI not checked")]
    found = detect(host, vm_memory)
    v = found.vfio
    checks = [
        Check("iommu", Level.OK, f"IOMMU on ({v.iommu_groups} groups)")
        if v.iommu_on
        else Check(
            "iommu",
            Level.PROBLEM,
            "the IOMMU is off (no IOMMU groups)",
            "enable VT-d/AMD-Vi in the firmware and boot with intel_iommu=on or amd_iommu=on",
        ),
        Check("vfio-pci", Level.OK, f"vfio-pci is {v.vfio_pci}")
        if v.vfio_pci != "missing"
        else Check(
            "vfio-pci",
            Level.PROBLEM,
            "the vfio-pci module is not available",
            "install a kernel with vfio-pci",
        ),
    ]
    functions = {f.address: f for f in found.functions}
    config = app.config()
    wanted = [(t.name, t.address) for t in config.tokens] or [
        (g.address, g.address) for g in found.gpus
    ]
    for name, address in wanted:
        function = functions.get(address)
        if function is None:
            checks.append(
                Check(
                    f"token {name}",
                    Level.PROBLEM,
                    f"there is no PCI device {address}",
                    "fix the token's address in arbiter.toml (see `charly-arbiter detect`)",
                )
            )
            continue
        problems = group_problems(functions, function)
        group = ", ".join((address, *function.group_members))
        checks.append(
            Check(
                f"token {name}",
                Level.OK,
                f"{address} present, group {function.iommu_group} ({group}) viable for passthrough",
            )
            if not problems
            else Check(
                f"token {name}",
                Level.PROBLEM,
                f"{address}: group not viable: {'; '.join(problems)}",
                "put the GPU in another slot, or enable ACS, so that its group holds only it",
            )
        )
    if any(f.vendor == "10de" for f in functions.values() if f.pci_class.startswith("03")):
        checks.append(
            Check("nvidia-ctk", Level.OK, "nvidia-ctk is installed")
            if run.which("nvidia-ctk")
            else Check(
                "nvidia-ctk",
                Level.WARNING,
                "NVIDIA GPUs are present but nvidia-ctk is not: no CDI spec is regenerated",
                "install nvidia-container-toolkit",
            )
        )
    memlock = f"RLIMIT_MEMLOCK {'unlimited' if v.memlock_soft is None else v.memlock_soft}"
    checks.append(
        Check("memlock", Level.OK, f"{memlock}, enough for a {vm_memory // 2**20} MiB VM")
        if v.memlock_enough
        else Check(
            "memlock",
            Level.WARNING,
            f"{memlock} bytes is less than a {vm_memory // 2**20} MiB VM pins",
            "libvirt raises it for <hostdev>; other launchers need `ulimit -l` or LimitMEMLOCK=",
        )
    )
    return checks


def hook_check(path: Path) -> Check:
    if path.is_file() and os.access(path, os.X_OK):
        return Check("hook", Level.OK, f"{path} is installed")
    return Check(
        "hook",
        Level.WARNING,
        f"{path} is not installed: libvirt VMs will not claim GPUs",
        f"install hooks/qemu as {path} (executable) and restart libvirtd",
    )


def ledger_checks(app: App) -> list[Check]:
    reading = app.ledger().inspect()
    if reading.corrupt is not None:
        return [Check("ledger", Level.PROBLEM, str(reading.corrupt), reading.corrupt.hint or "")]
    state = reading.state
    assert state is not None
    checks = [Check("ledger", Level.OK, f"ledger healthy (generation {state.generation})")]
    for token, poison in state.poisoned:
        checks.append(
            Check(
                f"poison {token}",
                Level.PROBLEM,
                f"{token} is poisoned since {poison.since}: {poison.reason}",
                f"check the GPU by hand, then `charly-arbiter poison clear {token}`",
            )
        )
    if not state.poisoned:
        checks.append(Check("poison", Level.OK, "no token is poisoned"))
    stranded = sorted(app.arbiter().stranded_claimants(state))
    checks.append(
        Check(
            "stranded",
            Level.PROBLEM,
            f"stranded leases: {', '.join(stranded)}",
            "run `charly-arbiter restore --stranded`",
        )
        if stranded
        else Check("stranded", Level.OK, "no stranded leases")
    )
    return checks


def libvirt_check(uri: str) -> Check:
    try:
        import libvirt
    except ImportError:
        return Check(
            "libvirt",
            Level.WARNING,
            "python3-libvirt is not installed",
            "install python3-libvirt to arbitrate libvirt VMs",
        )
    libvirt.registerErrorHandler(lambda _ctx, _err: None, None)
    try:
        connection = libvirt.openReadOnly(uri)
    except libvirt.libvirtError as error:
        return Check(
            "libvirt",
            Level.WARNING,
            f"{uri} is not reachable: {error}",
            "start libvirtd (and virtlogd)",
        )
    connection.close()
    return Check("libvirt", Level.OK, f"{uri} is reachable")


def run_checks(app: App, vm_memory: int, hook: Path) -> list[Check]:
    checks: list[Check] = []
    groups: list[Callable[[], list[Check]]] = [
        lambda: host_checks(app, vm_memory),
        lambda: [hook_check(hook)],
        lambda: ledger_checks(app),
        lambda: [libvirt_check(app.config().libvirt_uri)],
    ]
    for group in groups:
        try:
            checks.extend(group())
        except ArbiterError as error:
            checks.append(Check("doctor", Level.PROBLEM, str(error), error.hint or ""))
    return checks


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@vm_memory_option
@click.option(
    "--hook",
    "hook_path",
    type=click.Path(path_type=Path),
    default=HOOK_PATH,
    show_default=True,
    help="Where the libvirt hook should be installed.",
)
@click.pass_obj
def doctor(app: App, as_json: bool, vm_memory: int, hook_path: Path) -> None:
    """Check the host (IOMMU, vfio-pci, tokens, hook, ledger, libvirt, memlock)."""
    checks = run_checks(app, vm_memory * 2**20, hook_path)
    if as_json:
        document: dict[str, Any] = {
            "checks": [asdict(check) for check in checks],
            "problems": sum(check.level is Level.PROBLEM for check in checks),
        }
        click.echo(json.dumps(document, indent=2, sort_keys=True))
    else:
        for check in checks:
            click.echo(f"{check.level.value:<8} {check.name}: {check.message}")
            if check.fix and check.level is not Level.OK:
                click.echo(f"{'':<8} fix: {check.fix}")
    if any(check.level is Level.PROBLEM for check in checks):
        raise SystemExit(1)
