"""`doctor`: one line per check of the host, with what to do; non-zero on a problem."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

import click

from charly_arbiter.cli.app import App, vm_memory_option
from charly_arbiter.compose import real_kinds
from charly_arbiter.core.model import HolderKind
from charly_arbiter.libvirt.domains import reachable
from charly_arbiter.ops.doctor import HOOK_PATH, Check, Level, run_checks, state_dir_check


def libvirt_check(uri: str) -> Check:
    problem = reachable(uri)
    if problem is None:
        return Check("libvirt", Level.OK, f"{uri} is reachable")
    fix = (
        "install python3-libvirt to arbitrate libvirt VMs"
        if "not installed" in problem
        else "start libvirtd (and virtlogd)"
    )
    return Check("libvirt", Level.WARNING, problem, fix)


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
    config = app.config()
    arbiter = app.arbiter()
    more = [lambda: [state_dir_check(config.state_dir)]]
    kinds = real_kinds(arbiter.host)
    if (
        kinds is None or HolderKind.LIBVIRT in kinds
    ):  # a simulated host asks no libvirtd unless told
        more.append(lambda: [libvirt_check(config.libvirt_uri)])
    checks = run_checks(arbiter, vm_memory * 2**20, hook_path, more=more)
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
