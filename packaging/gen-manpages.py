#!/usr/bin/python3
"""Write charly-arbiter(8) and one page per command from the click definitions.

The pages are generated at build time from the same command tree that the
program runs, so an option cannot exist without its man page saying so, and
no runtime dependency is added (click only).  Each page has its EXIT STATUS
from charly_arbiter/cli/exits.py (the table docs/operations.md shows too), its
EXAMPLES and the FILES it reads and writes (below: the build fails for a
command that has none).  Usage:

    PYTHONPATH=. python3 packaging/gen-manpages.py OUTDIR
    PYTHONPATH=. python3 packaging/gen-manpages.py --exit-table docs/operations.md

The second form rewrites the exit-status table of docs/operations.md from the
same source.  The date on the pages is SOURCE_DATE_EPOCH where set
(reproducible builds).
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from charly_arbiter import __version__
from charly_arbiter.cli import COMMANDS, exits
from charly_arbiter.cli.app import build

PROGRAM = "charly-arbiter"
SECTION = "8"

ENVIRONMENT = [
    ("CHARLY_ARBITER_CONFIG", "The configuration file, like --config."),
    ("CHARLY_ARBITER_STATE_DIR", "The state directory, like --state-dir."),
    ("CHARLY_ARBITER_HOST", "The host to act on, like --host."),
    ("CHARLY_ARBITER_DEBUG", "Set to 1 for debug logging, like -vv."),
    (
        "CHARLY_ARBITER_SERVE",
        "off: never hand a command to the resident helper; must: fail (exit 1) rather "
        "than run a command in-process (for checks). Unset: use the helper when it answers.",
    ),
    (
        "CHARLY_ARBITER_SOCKET",
        "The resident helper's socket (default /run/charly-arbiter/serve.sock).",
    ),
    (
        "CHARLY_ARBITER_SERVE_DEADLINE_MS",
        "How long a command waits for the resident helper to take it before it runs "
        "in-process (default 50).",
    ),
]


# What each command reads (r) and writes (w): a path and what it is to the command.
CONFIG = ("/etc/charly-arbiter/arbiter.toml", "r: the tokens, holders, timeouts (--config)")
ATTACHED = ("/etc/charly-arbiter/attached.d/", "r: the units attach made claim by themselves")
LEDGER_R = ("/var/lib/charly-arbiter/ledger.toml", "r: the lease ledger (--state-dir)")
LEDGER_W = (
    "/var/lib/charly-arbiter/ledger.toml",
    "r, w: the lease ledger (and ledger.toml.bak, ledger.lock), written under its lock",
)
HISTORY_R = ("/var/lib/charly-arbiter/history.jsonl", "r: the events (and history.jsonl.1 ...)")
HISTORY_W = ("/var/lib/charly-arbiter/history.jsonl", "w: an event per step, appended")
SYSFS = ("/sys/bus/pci/", "r, w: the PCI functions and their drivers (a switch binds them)")
SYSFS_R = ("/sys/bus/pci/", "r: the PCI functions, their drivers and IOMMU groups")
PROC = ("/proc/", "r: the processes that hold a GPU's device nodes")
CDI = ("/etc/cdi/nvidia.yaml", "w: the CDI spec, regenerated after a switch (nvidia-ctk)")
UNITS = (
    "/etc/systemd/system/UNIT.d/charly-arbiter.conf",
    "w: the unit's drop-in (--unit-dir; DIR/units for a simulated host)",
)
HOOK = ("/etc/libvirt/hooks/qemu.d/charly-arbiter", "r: the libvirt hook (--hook)")
SIM = ("DIR/host.toml, DIR/state.json", "r, w: a simulated host (--host sim:DIR)")
SIM_OWN = (
    "DIR/arbiter.toml, DIR/state/",
    "r, w: a simulated host's own configuration and state, without --config",
)
CLAIMING = [CONFIG, ATTACHED, LEDGER_W, HISTORY_W, SYSFS, PROC, CDI]
FILES_OF: dict[str, list[tuple[str, str]]] = {
    "charly-arbiter": [CONFIG, ATTACHED, LEDGER_W, HISTORY_W, SYSFS, PROC, CDI, HOOK, SIM_OWN],
    "status": [CONFIG, LEDGER_R, HISTORY_R, SYSFS_R, PROC],
    "acquire": CLAIMING,
    "release": CLAIMING,
    "restore": CLAIMING,
    "poison": [LEDGER_W],
    "poison list": [LEDGER_R],
    "poison clear": [CONFIG, LEDGER_W, HISTORY_W],
    "sim": [SIM, SIM_OWN],
    "sim init": [("DIR/host.toml, DIR/arbiter.toml", "w: the example host and its configuration")],
    "sim show": [SIM],
    "sim stop": [SIM],
    "sim start": [SIM],
    "sim reboot": [SIM],
    "detect": [SYSFS_R, ("/dev/, /proc/driver/", "r: device nodes, NVIDIA's driver")],
    "doctor": [
        CONFIG,
        LEDGER_R,
        HISTORY_R,
        SYSFS_R,
        HOOK,
        ("/var/lib/charly-arbiter/", "w: a probe file, removed at once"),
    ],
    "plan": [CONFIG, LEDGER_R, SYSFS_R, PROC],
    "explain": [CONFIG, LEDGER_R, HISTORY_R, SYSFS_R],
    "history": [HISTORY_R, CONFIG],
    "metrics": [CONFIG, LEDGER_R, HISTORY_R, ("FILE", "w: --output, replaced atomically")],
    "recover": [
        CONFIG,
        LEDGER_W,
        ("/var/lib/charly-arbiter/ledger.toml.bak", "r: the previous generation"),
        (
            "/var/lib/charly-arbiter/ledger.toml.corrupt-*",
            "w: where --yes moves the corrupt ledger",
        ),
    ],
    "attach": [
        CONFIG,
        UNITS,
        ("/etc/charly-arbiter/attached.d/UNIT.toml", "w: the unit as a holder"),
    ],
    "detach": [CONFIG, LEDGER_R, UNITS, ("/etc/charly-arbiter/attached.d/UNIT.toml", "w: removed")],
    "adopt": [CONFIG, LEDGER_W, HISTORY_R, HISTORY_W, SYSFS_R],
    "send-home": [*CLAIMING, HISTORY_R],
    "mig": [CONFIG, LEDGER_W, HISTORY_W, PROC, ("/dev/nvidia*", "r, w: NVML's (libnvidia-ml)")],
    "vfs": [
        CONFIG,
        LEDGER_W,
        HISTORY_W,
        ("/sys/bus/pci/devices/ADDRESS/sriov_numvfs", "w: the physical function's VF count"),
        PROC,
    ],
}
# Examples: (a command line, what it does).  Each one parses with the real command tree
# (tests/package/test_manpages_install.py).
EXAMPLES: dict[str, list[tuple[str, str]]] = {
    "charly-arbiter": [
        ("charly-arbiter sim init /tmp/demo", "a simulated host to try everything on"),
        ("charly-arbiter --host sim:/tmp/demo status", "its tokens and leases"),
        ("charly-arbiter acquire --exclusive libvirt:win11 gpu0", "give gpu0 to a VM"),
    ],
    "status": [
        ("charly-arbiter status", "a table per GPU: drivers, leases, what they stopped"),
        ("charly-arbiter status --json --follow", "one JSON line per change, for a program"),
    ],
    "acquire": [
        ("charly-arbiter acquire --exclusive libvirt:win11 gpu0", "pass gpu0 through to a VM"),
        ("charly-arbiter acquire --shared container:llm gpu0 --transient", "share it, briefly"),
        ("charly-arbiter acquire --exclusive -- 'libvirt:my vm' gpu0", "a name with a space"),
    ],
    "release": [
        ("charly-arbiter release libvirt:win11", "once the VM has stopped"),
        ("charly-arbiter release --force container:llm", "although it still runs"),
    ],
    "restore": [
        ("charly-arbiter restore --stranded --dry-run", "what a restore would bring back"),
        ("charly-arbiter restore libvirt:win11", "converge one claimant after a crash or Ctrl-C"),
    ],
    "poison": [("charly-arbiter poison list", "the GPUs kept out of use")],
    "poison list": [("charly-arbiter poison list --json", "for a program")],
    "poison clear": [("charly-arbiter poison clear gpu0", "after checking it with lspci -nnk")],
    "sim": [("charly-arbiter --host sim:/tmp/demo sim show", "the simulated host's state")],
    "sim init": [
        ("charly-arbiter sim init /tmp/demo", "write /tmp/demo/host.toml and arbiter.toml")
    ],
    "sim show": [("charly-arbiter --host sim:/tmp/demo sim show", "drivers, running holders")],
    "sim stop": [("charly-arbiter --host sim:/tmp/demo sim stop libvirt:win11", "a VM crashes")],
    "sim start": [("charly-arbiter --host sim:/tmp/demo sim start container:llm", "it runs")],
    "sim reboot": [("charly-arbiter --host sim:/tmp/demo sim reboot", "a new boot")],
    "detect": [("charly-arbiter detect --json", "this machine's GPUs, groups and VFIO readiness")],
    "doctor": [("charly-arbiter doctor", "one line per check, with the fix")],
    "plan": [
        (
            "charly-arbiter plan --exclusive libvirt:win11 gpu0",
            "what acquire would stop and switch",
        ),
        ("charly-arbiter plan libvirt:win11", "what starting the VM would do, from its XML"),
    ],
    "explain": [
        ("charly-arbiter explain gpu0", "who holds it, since when, how to fix"),
        ("charly-arbiter explain libvirt:win11", "what it holds and stopped"),
    ],
    "history": [
        ("charly-arbiter history --token gpu0 --since 2h", "the last two hours of gpu0"),
        ("charly-arbiter history --claimant libvirt:win11 --json", "for a program"),
    ],
    "metrics": [
        (
            "charly-arbiter metrics --output /var/lib/prometheus/node-exporter/charly-arbiter.prom",
            "for node_exporter's textfile collector",
        )
    ],
    "recover": [
        ("charly-arbiter recover", "compare a corrupt ledger's backup with the host"),
        ("charly-arbiter recover --yes", "continue from the backup"),
    ],
    "attach": [
        ("charly-arbiter attach ollama.service gpu0", "the unit claims gpu0 when it starts")
    ],
    "detach": [("charly-arbiter detach ollama.service", "remove its drop-in and holder record")],
    "adopt": [
        ("charly-arbiter adopt gpu0 libvirt:win11", "win11, which runs with gpu0, holds it"),
        ("charly-arbiter adopt --admin gpu0", "gpu0 was bound to vfio-pci at boot, on purpose"),
    ],
    "send-home": [
        ("charly-arbiter send-home gpu0", "gpu0 goes home, and what was stopped for it comes back")
    ],
    "mig": [
        ("charly-arbiter mig gpu0", "its MIG mode and instances, each a sub-token gpu0:N"),
        ("charly-arbiter mig gpu0 on", "MIG mode on: what uses the GPU is stopped and back"),
        ("charly-arbiter mig gpu0 layout 3g.40gb,2g.20gb,1g.10gb", "three instances"),
    ],
    "vfs": [
        ("charly-arbiter vfs gpu0 4", "four virtual functions (through 0 if it has some)"),
        ("charly-arbiter vfs gpu0 0", "none: every VF goes (refused while one is in use)"),
        ("charly-arbiter vfs --configured", "every count arbiter.toml sets (the boot's step)"),
    ],
}


OVERVIEW = [
    "A token is a GPU together with every function of its IOMMU group. A claimant "
    "(KIND:NAME, e.g. libvirt:win11, container:llm, systemd:ollama.service) claims tokens "
    "exclusively (the GPU moves to vfio-pci for passthrough) or shared (the GPU stays on its "
    "home driver, refcounted). A claim stops the holders that must make room, switches the "
    "drivers of the whole group, and records every step in the lease ledger first, so that "
    "release, or restore after a crash or a reboot, brings the host back as it was.",
    "Deciding is separate from acting: plan shows what a claim would do, explain says why a "
    "token or claimant is in its state, status lists leases and tokens, doctor checks the host.",
]


def roff(text: str) -> str:
    """Escape text for roff: backslashes, hyphens, and lines that start with a control char."""
    text = text.replace("\\", "\\e").replace("-", "\\-")
    return "\n".join("\\&" + line if line[:1] in (".", "'") else line for line in text.split("\n"))


def paragraphs(text: str) -> Iterator[str]:
    """click help text: blank lines separate paragraphs; a paragraph after \\b keeps its lines."""
    for block in text.strip().split("\n\n"):
        lines = block.strip("\n").split("\n")
        if lines[0].strip() == "\b":
            yield ".nf\n" + roff("\n".join(lines[1:])) + "\n.fi"
        else:
            yield roff(" ".join(line.strip() for line in lines))


def page_name(path: list[str]) -> str:
    return "-".join(path)


def header(name: str, date: str) -> list[str]:
    return [
        f'.TH "{name.upper()}" "{SECTION}" "{date}" "{PROGRAM} {__version__}" '
        '"System Administration"',
        ".SH NAME",
    ]


def options_section(ctx: click.Context, title: str) -> list[str]:
    records = [
        record
        for param in ctx.command.get_params(ctx)
        if isinstance(param, click.Option) and (record := param.get_help_record(ctx)) is not None
    ]
    if not records:
        return []
    lines = [f".SH {title}"]
    for flags, help_text in records:
        lines += [".TP", f"\\fB{roff(flags)}\\fR", roff(help_text or "")]
    return lines


def command_page(ctx: click.Context, path: list[str], date: str, see_also: list[str]) -> str:
    command = ctx.command
    name = page_name(path)
    summary = command.get_short_help_str(limit=200).rstrip(".")
    usage = " ".join(command.collect_usage_pieces(ctx))
    lines = header(name, date)
    lines.append(f"{roff(name)} \\- {roff(summary)}")
    lines += [".SH SYNOPSIS", f"\\fB{roff(' '.join(path))}\\fR {roff(usage)}"]
    lines.append(".SH DESCRIPTION")
    for paragraph in paragraphs(command.help or summary):
        lines += [".PP", paragraph]
    if len(path) == 1:
        for paragraph in OVERVIEW:
            lines += [".PP", roff(paragraph)]
    arguments = [p for p in command.get_params(ctx) if isinstance(p, click.Argument)]
    if arguments:
        lines.append(".SH ARGUMENTS")
        for argument in arguments:
            lines += [".TP", f"\\fI{roff(' '.join(argument.get_usage_pieces(ctx)))}\\fR"]
            lines.append("Required." if argument.required else "Optional.")
    lines += options_section(ctx, "OPTIONS")
    if isinstance(command, click.Group):
        lines += subcommands_section(ctx, path)
    if len(path) > 1:
        lines += [
            ".PP",
            f"The global options of \\fB{PROGRAM}\\fR(8) go before the command name.",
        ]
    key = table_key(path)
    lines += exit_status_section(key) + examples_section(key) + files_section(key)
    lines += [".SH SEE ALSO", ",\n".join(f"\\fB{roff(other)}\\fR({SECTION})" for other in see_also)]
    return "\n".join(lines) + "\n"


def subcommands_section(ctx: click.Context, path: list[str]) -> list[str]:
    group = ctx.command
    assert isinstance(group, click.Group)
    lines = [".SH COMMANDS"]
    for name in group.list_commands(ctx):
        sub = group.get_command(ctx, name)
        if sub is None or sub.hidden:
            continue
        lines += [".TP", f"\\fB{roff(name)}\\fR", roff(sub.get_short_help_str(limit=200))]
        lines.append(f"See \\fB{roff(page_name([*path, name]))}\\fR({SECTION}).")
    return lines


def table_key(path: list[str]) -> str:
    """The key of cli/exits.py, EXAMPLES and FILES_OF: the words after charly-arbiter."""
    return " ".join(path[1:]) or PROGRAM


def exit_status_section(key: str) -> list[str]:
    lines = [
        ".SH EXIT STATUS",
        ".PP",
        roff(
            "0 success, 1 error, 2 usage, 3 refused, for every command and hook; errors and "
            "refusals are one or two sentences on standard error, with a hint."
        ),
    ]
    for row in exits.rows(key):
        lines += [".TP", f"\\fB{row.code}\\fR ({exits.MEANING[row.code]})", roff(row.when)]
    return lines


def examples_section(key: str) -> list[str]:
    lines = [".SH EXAMPLES"]
    for command, what in EXAMPLES[key]:
        lines += [
            ".PP",
            roff(what.rstrip(".") + ":"),
            ".PP",
            ".RS 4",
            ".nf",
            roff(command),
            ".fi",
            ".RE",
        ]
    return lines


def files_section(key: str) -> list[str]:
    lines = [".SH FILES"]
    for path, what in FILES_OF[key]:
        lines += [".TP", f"\\fI{roff(path)}\\fR", roff(what)]
    return lines


def hooks_exit_status() -> list[str]:
    lines = [".SH HOOK EXIT STATUS"]
    for hook in exits.HOOKS:
        lines += [".SS", roff(f"{PROGRAM} {hook}")]
        for row in exits.rows(hook):
            lines += [".TP", f"\\fB{row.code}\\fR ({exits.MEANING[row.code]})", roff(row.when)]
    return lines


def detached_section() -> list[str]:
    """The verbs the hooks start (not in --help: no person runs them), for whoever
    meets them in `ps` or the log."""
    lines = [
        ".SH PROCESSES THE HOOKS START",
        ".PP",
        roff(
            f"A hook that must not keep its caller waiting starts `{PROGRAM} _finish-release` "
            "(the rest of a release that brings holders back) or, for a Proxmox VM's start, "
            f"`{PROGRAM} _watch-start` (a start that fails after pre-start gets no post-stop) "
            "as a process of its own, with one argument, the hook's hand-off as JSON, its "
            "output on /dev/null and its steps in the log. They are not meant to be run by hand."
        ),
    ]
    for verb in exits.DETACHED:
        lines += [".SS", roff(f"{PROGRAM} {verb}")]
        for row in exits.rows(verb):
            lines += [".TP", f"\\fB{row.code}\\fR ({exits.MEANING[row.code]})", roff(row.when)]
    return lines


def resident_helper() -> list[str]:
    lines = [
        ".SH RESIDENT HELPER",
        ".PP",
        roff(
            f"{PROGRAM} serve, started by charly-arbiter.socket (or by hand), keeps the "
            "program imported and runs each command in a fresh fork of itself, in the "
            "command's place (its stdin, stdout, stderr, arguments, environment, working "
            "directory): the same command, without Python's start. Every command and hook "
            "uses it when it answers within the deadline, and runs in-process otherwise. "
            "Turn it off with `systemctl disable --now charly-arbiter.socket "
            "charly-arbiter.service`."
        ),
        ".SS",
        roff(f"{PROGRAM} serve [--socket PATH] [--idle-exit SECONDS] [-v]"),
    ]
    for row in exits.rows("serve"):
        lines += [".TP", f"\\fB{row.code}\\fR ({exits.MEANING[row.code]})", roff(row.when)]
    return lines


def main_page_extra() -> list[str]:
    lines = [
        ".SH LIBVIRT HOOK",
        ".PP",
        roff(
            "libvirt runs /etc/libvirt/hooks/qemu.d/charly-arbiter for every VM; it calls "
            f"`{PROGRAM} hook qemu GUEST OP SUBOP EXTRA`, which claims the GPUs named in the "
            "VM's configuration when it is prepared and releases them when it is released. "
            "libvirt notices a new hook only when its daemon starts: restart libvirtd or "
            "virtqemud after installing (running VMs keep running)."
        ),
    ]
    lines += hooks_exit_status()
    lines += detached_section()
    lines += resident_helper()
    lines.append(".SH ENVIRONMENT")
    for variable, what in ENVIRONMENT:
        lines += [".TP", f"\\fB{variable}\\fR", roff(what)]
    return lines


def walk(ctx: click.Context, path: list[str]) -> Iterator[tuple[click.Context, list[str]]]:
    yield ctx, path
    command = ctx.command
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                child = click.Context(sub, info_name=name, parent=ctx, **sub.context_settings)
                yield from walk(child, [*path, name])


def generate(outdir: Path) -> list[Path]:
    epoch = int(os.environ.get("SOURCE_DATE_EPOCH", "0")) or None
    moment = (
        datetime.datetime.fromtimestamp(epoch, datetime.UTC)
        if epoch
        else datetime.datetime.now(datetime.UTC)
    )
    date = moment.strftime("%Y-%m-%d")
    cli = build(COMMANDS)
    root = click.Context(cli, info_name=PROGRAM, **cli.context_settings)
    tree = list(walk(root, [PROGRAM]))
    names = [page_name(path) for _, path in tree]
    outdir.mkdir(parents=True, exist_ok=True)
    written = []
    for ctx, path in tree:
        name = page_name(path)
        see_also = [PROGRAM] if len(path) > 1 else [n for n in names if n != PROGRAM]
        text = command_page(ctx, path, date, see_also)
        if len(path) == 1:
            before_see_also, _, rest = text.partition(".SH SEE ALSO")
            text = before_see_also + "\n".join(main_page_extra()) + "\n.SH SEE ALSO" + rest
        target = outdir / f"{name}.{SECTION}"
        target.write_text(text, encoding="utf-8")
        written.append(target)
    return written


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--exit-table":
        target = Path(sys.argv[2])
        target.write_text(exits.in_document(target.read_text()))
        sys.exit(0)
    if len(sys.argv) != 2 or sys.argv[1].startswith("-"):  # `--help` is no directory
        sys.exit(f"usage: {sys.argv[0]} OUTDIR | --exit-table FILE")
    for page in generate(Path(sys.argv[1])):
        print(page)
