#!/usr/bin/python3
"""Write charly-arbiter(8) and one page per command from the click definitions.

The pages are generated at build time from the same command tree that the
program runs, so an option cannot exist without its man page saying so, and
no runtime dependency is added (click only).  Usage:

    PYTHONPATH=. python3 packaging/gen-manpages.py OUTDIR

The date on the pages is SOURCE_DATE_EPOCH where set (reproducible builds).
"""

from __future__ import annotations

import datetime
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import click

from charly_arbiter import __version__
from charly_arbiter.cli import COMMANDS
from charly_arbiter.cli.app import build

PROGRAM = "charly-arbiter"
SECTION = "8"

FILES = [
    ("/etc/charly-arbiter/arbiter.toml", "The configuration: tokens, holders, timeouts, policies."),
    ("/var/lib/charly-arbiter/ledger.toml", "The lease ledger (root only, mode 0700 directory)."),
    (
        "/etc/libvirt/hooks/qemu.d/charly-arbiter",
        "The libvirt hook: claims a VM's GPUs when it starts, releases them when it stops.",
    ),
]
ENVIRONMENT = [
    ("CHARLY_ARBITER_CONFIG", "The configuration file, like --config."),
    ("CHARLY_ARBITER_STATE_DIR", "The state directory, like --state-dir."),
    ("CHARLY_ARBITER_HOST", "The host to act on, like --host."),
    ("CHARLY_ARBITER_DEBUG", "Set to 1 for debug logging, like -vv."),
]


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
        ".SH FILES",
    ]
    for path, what in FILES:
        lines += [".TP", f"\\fI{roff(path)}\\fR", roff(what)]
    lines.append(".SH ENVIRONMENT")
    for variable, what in ENVIRONMENT:
        lines += [".TP", f"\\fB{variable}\\fR", roff(what)]
    lines += [
        ".SH EXIT STATUS",
        ".PP",
        roff(
            "0 on success. On an error the command prints one or two sentences naming the "
            "GPU, holder or file concerned and a hint, and exits non-zero; -v adds a traceback."
        ),
    ]
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
    if len(sys.argv) != 2:
        sys.exit(f"usage: {sys.argv[0]} OUTDIR")
    for page in generate(Path(sys.argv[1])):
        print(page)
