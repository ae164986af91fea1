"""The `charly-arbiter` command: a thin click layer over the arbiter.

Commands live one concept per module and are imported only when used.  The
hooks bypass click entirely: the libvirt hook (`charly-arbiter hook qemu …`)
runs on every VM start and stop, the OCI hook (`charly-arbiter hook oci`) on
every container's, the Proxmox hookscript (`charly-arbiter hook proxmox`) on
every start and stop of the VMs it is attached to, and their paths must import
almost nothing.  The verbs a hook starts as a detached process of its own
(`_finish-release`, `_watch-start`: cli/detached.py) bypass it too, and are not
listed in --help.

When it is the program (`main()` without arguments), a command is first offered
to the resident helper (`charly-arbiter serve`, hidden from --help), which runs
this very `main(argv)` in a fresh fork of a process that has imported everything
already; without the helper, or when it does not answer within its deadline, the
command runs here (serve/client.py).  The hooks offer only their slow paths.
The installed program starts Python without `site` (packaging/launcher.py),
which whatever runs here sets up first (`hookio.python_with_site`).

Errors are turned into one or two sentences on stderr here, at one boundary;
a traceback only with `-v`.

No `from __future__ import annotations` here, as in serve/client.py: the program's
path imports nothing it does not need before the hand-over.
"""

import sys

TYPE_CHECKING = False  # not typing's: the hook's path imports no `typing` at run time
if TYPE_CHECKING:
    from typing import NoReturn

COMMANDS = {
    "status": "charly_arbiter.cli.status:status",
    "acquire": "charly_arbiter.cli.claims:acquire",
    "release": "charly_arbiter.cli.claims:release",
    "restore": "charly_arbiter.cli.claims:restore",
    "poison": "charly_arbiter.cli.poison:poison",
    "sim": "charly_arbiter.cli.sim:sim",
    "detect": "charly_arbiter.cli.detect:detect",
    "doctor": "charly_arbiter.cli.doctor:doctor",
    "plan": "charly_arbiter.cli.plan:plan",
    "explain": "charly_arbiter.cli.explain:explain",
    "history": "charly_arbiter.cli.history:history",
    "metrics": "charly_arbiter.cli.metrics:metrics",
    "recover": "charly_arbiter.cli.recover:recover_command",
    "attach": "charly_arbiter.cli.attach:attach",
    "detach": "charly_arbiter.cli.attach:detach",
    "adopt": "charly_arbiter.cli.adopt:adopt",
    "send-home": "charly_arbiter.cli.adopt:send_home_command",
    "vfs": "charly_arbiter.cli.vfs:vfs",
    "mig": "charly_arbiter.cli.mig:mig",
}


def main(argv: list[str] | None = None) -> "NoReturn":
    args = sys.argv[1:] if argv is None else argv
    if argv is None and args[:1] not in (["hook"], ["serve"]):
        from charly_arbiter.serve.client import exit_now, run_program

        code = run_program(args)
        if code is not None:
            exit_now(code)  # the program, whose command the helper ran
    if args[:1] != ["hook"] or args[1:2] == ["oci-inject"]:
        # What runs here needs the installed libraries; the hooks set `site` up
        # themselves, on their slow paths only.
        from charly_arbiter.hookio import python_with_site

        python_with_site()
    if args[:1] == ["serve"]:
        from charly_arbiter.serve.server import main as serve_main

        sys.exit(serve_main(args[1:], run=main, ahead=_read_ahead))
    if args[:2] == ["hook", "oci"]:
        from charly_arbiter.oci.hook import main as oci_main

        sys.exit(oci_main(args[2:]))
    if args[:2] == ["hook", "proxmox"]:
        from charly_arbiter.proxmox.hook import main as proxmox_main

        sys.exit(proxmox_main(args[2:]))
    if args[:2] == ["hook", "oci-inject"]:
        from charly_arbiter.oci.inject import main as inject_main

        sys.exit(inject_main(args[2:]))
    if args[:1] and args[0].startswith("_"):
        from charly_arbiter.cli.detached import main as detached_main

        sys.exit(detached_main(args))
    if args[:1] == ["hook"]:
        from charly_arbiter.libvirt.hook import main as hook_main

        sys.exit(hook_main(args[1:]))
    from charly_arbiter.cli.app import built

    built(COMMANDS)(args=args, prog_name="charly-arbiter")
    sys.exit(0)


__all__ = ["COMMANDS", "main"]


def _read_ahead() -> str:
    """What a spare of the resident helper does while it waits: build the click group
    (app.built: the command it then runs uses it), and decode the ledger of the
    configuration a command without options reads (Ledger.read_ahead), so that
    `status` of a large ledger does not decode it again while nothing changed."""
    from charly_arbiter.cli.app import built
    from charly_arbiter.compose import open_ledger
    from charly_arbiter.core.config import load_config

    built(COMMANDS)
    ledger = open_ledger(load_config())
    return f"read {ledger.path} ahead: {ledger.read_ahead()} leases"
