"""Every command the arbiter prints for a person to paste runs as the command it reads as.

Claimants with names a shell would mangle (spaces, quotes, `$(…)`, `;`, a leading
`-`, a backtick, CJK, 200 characters: each one a name libvirt accepts for a
domain) are driven through each refusal and error that prints a hint: the CLI's
own (status, explain, acquire, release, restore), the libvirt hook's (its refusal
on stderr and its warnings in the hook log) and `explain`'s sentences.  Every
`charly-arbiter …` between backticks is taken out the way a person would select
it, split with a POSIX shell parser (shlex), parsed by the real command tree, and
must name the very claimant (or token) it is about.  Real processes on the
simulated host throughout.
"""

from __future__ import annotations

import shlex
import signal
import subprocess
import sys
from collections.abc import Callable
from typing import Any

import click
import pytest
from clitools import interrupted_claim
from simhosts import default_host, gpu, holder

from charly_arbiter.cli import COMMANDS
from charly_arbiter.cli.app import build
from charly_arbiter.core.model import KINDS
from tests.conftest import DEFAULT_CONFIG, REPO, SimEnv

# Names libvirt accepts for a domain (anything but '/'; the arbiter also refuses
# control and format characters, which no terminal can show as they are).
HOSTILE = [
    "my vm",
    "it's",
    'say "hi"',
    "$(touch pwned)",
    "a;b|c&&d>e",
    "-rf",
    "--help",
    "a`b`c",
    "back\\slash",
    "*?[x]~#!",
    "虚拟机",
    "x" * 200,
]
# Every path of hints below runs for these (each process costs a fraction of a second):
# all of the shell's hazards at once, the longest, and one that reads as an option.
EVERY_PATH = ['-rf it\'s "x" $(y);z|w&&v>u `a` *?[b]~#! back\\slash 虚拟机', "x" * 200, "--help"]
SYSTEMD = "systemd:a\\x2db@-i.service"  # systemd's own escapes and a leading '-' instance


def hints(text: str) -> list[str]:
    """Each `charly-arbiter …` between backticks, as a person would select it: up to
    the backtick that closes it outside any quotes (a quoted name may hold one)."""
    found = []
    start = text.find("`charly-arbiter")
    while start != -1:
        quote = ""
        end = start + 1
        while end < len(text):
            char = text[end]
            if quote:
                if char == quote:
                    quote = ""
                elif char == "\\" and quote == '"':
                    end += 1
            elif char in "'\"":
                quote = char
            elif char == "`":
                break
            end += 1
        assert end < len(text), f"a hint that does not end: {text[start:]!r}"
        found.append(text[start + 1 : end])
        start = text.find("`charly-arbiter", end + 1)
    return found


def parsed(command: str) -> tuple[list[str], dict[str, Any]]:
    """The command path and parameters the real CLI parses `command` into."""
    words = shlex.split(command)
    assert words[0] == "charly-arbiter"
    cli = build(COMMANDS)
    ctx = cli.make_context("charly-arbiter", words[1:])
    path: list[str] = []
    params: dict[str, Any] = dict(ctx.params)
    while isinstance(ctx.command, click.Group):
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
        rest = [*protected, *ctx.args]
        name, command_object, args = ctx.command.resolve_command(ctx, rest)
        assert name is not None and command_object is not None
        path.append(name)
        ctx = command_object.make_context(name, args, parent=ctx)
        params.update(ctx.params)
    return path, params


def operands(params: dict[str, Any]) -> list[str]:
    found: list[str] = []
    for value in params.values():
        if isinstance(value, str):
            found.append(value)
        elif isinstance(value, tuple):
            found.extend(str(item) for item in value)
    return found


def check_hints(text: str, about: str, *, at_least: int = 1) -> list[list[str]]:
    """Every hint in `text` parses with the real CLI; every claimant one names is `about`
    (never a piece of it, or it with a quote more), and `at_least` of them name it."""
    commands = hints(text)
    paths = []
    naming = 0
    for command in commands:
        path, params = parsed(command)
        claimants = [o for o in operands(params) if o.partition(":")[0] in KINDS]
        assert set(claimants) <= {about}, (command, about, params)
        naming += about in claimants
        paths.append(path)
    assert naming >= at_least, f"{at_least} hints should name {about!r}: {commands}\n{text}"
    return paths


# The default host, and gpu2, held by a VM only (libvirt_preemption = "refuse" keeps it).
HOST = (
    default_host()
    + gpu("0000:0c:00.0", group=14)
    + holder("libvirt", "holder-vm", ["gpu2"], preemptible=True)
)
CONFIG = DEFAULT_CONFIG + '\n[tokens.gpu2]\naddress = "0000:0c:00.0"\n'


@pytest.fixture
def hostile_sim(make_sim: Callable[..., SimEnv]) -> SimEnv:
    return make_sim(host=HOST, config=CONFIG)


def test_the_refusal_of_a_second_claim_names_each_hostile_name(hostile_sim: SimEnv) -> None:
    """Every name of HOSTILE through the most common hints (release, restore of it)."""
    sim = hostile_sim
    for name in HOSTILE:
        ref = f"libvirt:{name}"
        sim.cli("acquire", "--shared", "--", ref, "gpu1", check=True)
        refused = sim.cli("acquire", "--exclusive", "--", ref, "gpu1")
        assert refused.returncode == 3, refused.stderr
        paths = check_hints(refused.stderr, ref, at_least=2)
        assert {tuple(p) for p in paths} == {("release",), ("restore",)}
        sim.cli("release", "--force", "--", ref, check=True)


@pytest.mark.parametrize("name", EVERY_PATH, ids=["hazards", "long", "option-like"])
def test_every_hint_for_a_hostile_libvirt_name_parses_and_names_it(
    hostile_sim: SimEnv, name: str
) -> None:
    sim = hostile_sim
    ref = f"libvirt:{name}"

    def cli(*args: str, code: int = 0) -> str:
        result = sim.cli(*args)
        assert result.returncode == code, (args, result.stdout, result.stderr)
        return result.stdout + result.stderr

    cli("acquire", "--exclusive", "--", ref, "gpu0")
    # It holds a lease: another mode is refused, naming release and restore of it.
    said = cli("acquire", "--shared", "--", ref, "gpu0", code=3)
    assert {tuple(p) for p in check_hints(said, ref, at_least=2)} == {("release",), ("restore",)}
    # Stranded: explain (of it, of its GPU) says the restore of it; status says restore.
    cli("sim", "stop", "--", ref)
    check_hints(cli("explain", "--", ref), ref)
    check_hints(cli("explain", "gpu0"), ref)
    assert ["restore"] in [parsed(c)[0] for c in hints(cli("status"))]
    # Running the hint explain printed is what converges it.
    [restore] = [c for c in hints(cli("explain", "--", ref)) if ref in shlex.split(c)]
    result = subprocess.run(
        [sys.executable, "-m", "charly_arbiter", *shlex.split(restore)[1:]],
        capture_output=True,
        text=True,
        env=sim.env(),
        cwd=REPO,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert sim.status()["leases"] == []
    # A lease from an earlier boot: the claim names the restore of it.
    cli("acquire", "--exclusive", "--", ref, "gpu0")
    cli("sim", "reboot")
    check_hints(cli("acquire", "--exclusive", "--", ref, "gpu0", code=3), ref)
    cli("restore", "--stranded")
    # A release that cannot bring everything back names the restore of it.
    cli("acquire", "--exclusive", "--", ref, "gpu0")
    sim.set_host(HOST.replace('name = "llm"\n', 'name = "llm"\nfail_start = true\n'))
    check_hints(cli("release", "--force", "--", ref, code=1), ref)


def test_hints_of_the_libvirt_hook_parse_and_name_the_domain(hostile_sim: SimEnv) -> None:
    """The hook's refusal (stderr, which libvirt shows) and its warnings (hook_log)."""
    sim = hostile_sim
    log = sim.root / "hook.log"
    sim.config_path.write_text(
        f'libvirt_preemption = "refuse"\nhook_log = "{log}"\n' + sim.config_path.read_text()
    )
    xml = (
        "<domain><name>x</name><devices><hostdev mode='subsystem' type='pci'><source>"
        "<address domain='0x0000' bus='0x0c' slot='0x00' function='0x0'/></source></hostdev>"
        "</devices></domain>"
    )
    for name in HOSTILE:
        ref = f"libvirt:{name}"
        run = hook(sim, name, "prepare", xml)
        assert run.returncode == 3, run.stderr
        check_hints(run.stderr, ref)
        # reconnect of a running domain without a lease: a warning with the acquire to run.
        assert hook(sim, name, "reconnect", xml).returncode == 0
    warnings = log.read_text()
    for name in HOSTILE:
        line = next(line for line in warnings.splitlines() if f"libvirt:{name} runs" in line)
        check_hints(line, f"libvirt:{name}")


def hook(sim: SimEnv, guest: str, operation: str, xml: str) -> subprocess.CompletedProcess[str]:
    sub = "begin"
    return subprocess.run(
        [sys.executable, "-m", "charly_arbiter", "hook", "qemu", guest, operation, sub, "-"],
        input=xml,
        capture_output=True,
        text=True,
        env={**sim.env(), "PYTHONPATH": str(REPO)},
        cwd=sim.root,
        timeout=120,
    )


def test_a_token_that_starts_with_a_dash_is_put_after_double_dash(
    make_sim: Callable[..., SimEnv],
) -> None:
    config = DEFAULT_CONFIG.replace("[tokens.gpu0]", '[tokens."-g0"]') + "\n"
    sim = make_sim(host=default_host(gpu0="fail_switch = true"), config=config)
    failed = sim.cli("acquire", "--exclusive", "--", "libvirt:vm", "-g0")
    assert failed.returncode == 1
    for text in (failed.stderr, sim.cli("status").stdout, sim.cli("explain", "--", "-g0").stdout):
        [command] = [c for c in hints(text) if "poison" in c]
        assert command.endswith("poison clear -- -g0"), command
        assert parsed(command) == (["poison", "clear"], {**parsed(command)[1], "token": "-g0"})
    cleared = sim.cli(*shlex.split(command)[1:])
    assert cleared.returncode == 0 and "cleared the poison of -g0" in cleared.stdout


def test_a_systemd_unit_with_escapes_in_hints_and_drop_ins(hostile_sim: SimEnv) -> None:
    sim = hostile_sim
    units = sim.root / "units"
    attached = sim.cli("attach", "--unit-dir", str(units), SYSTEMD, "gpu0")
    assert attached.returncode == 0, attached.stderr
    dropin = next(units.glob("*.d/charly-arbiter.conf")).read_text()
    check_hints(dropin, SYSTEMD, at_least=2)
    record = next((sim.root / "attached.d").glob("*.toml")).read_text()
    check_hints(record, SYSTEMD)
    sim.cli("acquire", "--shared", SYSTEMD, "gpu0", check=True)
    sim.cli("sim", "stop", SYSTEMD, check=True)
    check_hints(sim.cli("explain", SYSTEMD).stdout, SYSTEMD)


def test_a_ctrl_c_during_a_hung_switch_names_the_restore_and_the_poison_clear(
    make_sim: Callable[..., SimEnv],
) -> None:
    """Item 5 through a hostile name: the interrupted claim's hint runs as it reads."""
    config = DEFAULT_CONFIG.replace("driver_switch = 2", "driver_switch = 60") + "\n"
    sim = make_sim(host=default_host(gpu0="hang_switch = true"), config=config)
    ref = "libvirt:it's $(x) 虚拟机"
    said = interrupted_claim(sim, ref, signal.SIGINT)
    paths = check_hints(said, ref)
    assert ["restore"] in paths and ["poison", "clear"] in paths


def test_hint_extraction_is_not_fooled_by_a_backtick_in_a_name() -> None:
    text = "hint: run `charly-arbiter restore 'libvirt:a`b'` to end it"
    assert hints(text) == ["charly-arbiter restore 'libvirt:a`b'"]
    assert operands(parsed(hints(text)[0])[1]) == ["libvirt:a`b"]
