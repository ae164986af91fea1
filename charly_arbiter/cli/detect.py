"""`detect`: the PCI functions, GPUs and VFIO readiness of this machine."""

from __future__ import annotations

import json

import click

from charly_arbiter.cli.app import App, vm_memory_option
from charly_arbiter.errors import NeedsHost, cli_command


@click.command()
@click.option("--json", "as_json", is_flag=True, help="One JSON object, for scripts.")
@vm_memory_option
@click.pass_obj
def detect(app: App, as_json: bool, vm_memory: int) -> None:
    """List PCI functions, GPUs (NVML, KFD or sysfs) and whether VFIO passthrough can work."""
    from charly_arbiter.host.detect import detect as run_detect
    from charly_arbiter.host.detect import document, render
    from charly_arbiter.host.draining import machine
    from charly_arbiter.host.local import LocalHost

    host = machine(app.host())
    if not isinstance(host, LocalHost):
        raise NeedsHost(
            "detect",
            f"this machine's PCI devices and sysfs; {host.description} is simulated",
            "run it without --host sim:… (and without CHARLY_ARBITER_HOST), or read the "
            "simulated host's devices with " + cli_command("--host", "sim:DIR", "sim", "show"),
        )
    result = run_detect(host, vm_memory * 2**20)
    if as_json:
        click.echo(json.dumps(document(result), indent=2, sort_keys=True))
    else:
        click.echo(render(result))
