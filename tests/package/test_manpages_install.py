"""Man pages and shell completion generated from the click tree, and `make install`.

The man page generator and the completion scripts run for real on the
checkout's command tree; groff checks every page (warnings are failures), and
bash's completion goes through the program itself, as a <Tab> would.
`make install DESTDIR=... PREFIX=/usr/local` builds a wheel, installs it and
every other file, and the installed program runs from there.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import click
import pytest
from pkgtools import CLEAN_ENV, REPO, VERSION, run

from charly_arbiter.cli import COMMANDS
from charly_arbiter.cli.app import build

pytestmark = [pytest.mark.package]


def _load(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, REPO / "packaging" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _command_paths() -> dict[str, click.Command]:
    """Every command and subcommand of the real CLI, by man page name."""
    paths: dict[str, click.Command] = {}

    def walk(command: click.Command, ctx: click.Context, path: list[str]) -> None:
        paths["-".join(path)] = command
        if isinstance(command, click.Group):
            for name in command.list_commands(ctx):
                sub = command.get_command(ctx, name)
                assert sub is not None
                walk(sub, click.Context(sub, info_name=name, parent=ctx), [*path, name])

    cli = build(COMMANDS)
    walk(cli, click.Context(cli, info_name="charly-arbiter"), ["charly-arbiter"])
    return paths


def test_one_man_page_per_command_naming_every_option(tmp_path: Path) -> None:
    pages = {page.stem: page for page in _load("gen-manpages").generate(tmp_path)}  # type: ignore[attr-defined]
    commands = _command_paths()
    assert set(pages) == set(commands)
    for name, command in commands.items():
        text = pages[name].read_text()
        assert f'.TH "{name.upper()}" "8"' in text and VERSION in text
        for param in command.params:
            for flag in getattr(param, "opts", []):
                if flag.startswith("-"):
                    assert flag.replace("-", "\\-") in text, f"{name}(8) does not mention {flag}"
    groff = shutil.which("groff")
    if groff is None:
        pytest.fail("groff is missing: run scripts/setup (groff-base)")
    for page in pages.values():
        result = subprocess.run(
            [groff, "-man", "-ww", "-z", str(page)], capture_output=True, text=True, check=False
        )
        assert result.returncode == 0 and not result.stderr, f"{page.name}: {result.stderr}"


def test_completion_scripts_drive_the_real_program(tmp_path: Path) -> None:
    scripts = {p.name: p for p in _load("gen-completions").generate(tmp_path)}  # type: ignore[attr-defined]
    assert set(scripts) == {"charly-arbiter.bash", "_charly-arbiter", "charly-arbiter.fish"}
    assert scripts["_charly-arbiter"].read_text().startswith("#compdef charly-arbiter")
    assert (
        "complete --no-files --command charly-arbiter" in scripts["charly-arbiter.fish"].read_text()
    )
    registered = run(
        [
            "/bin/bash",
            "-c",
            f"source {scripts['charly-arbiter.bash']} && complete -p charly-arbiter",
        ]
    )
    assert "charly-arbiter" in registered.stdout
    # What bash's completion function asks the program at <Tab> after `charly-arbiter res`.
    answer = subprocess.run(
        [sys.executable, "-m", "charly_arbiter"],
        env={
            **os.environ,
            "_CHARLY_ARBITER_COMPLETE": "bash_complete",
            "COMP_WORDS": "charly-arbiter res",
            "COMP_CWORD": "1",
        },
        capture_output=True,
        text=True,
        cwd=REPO,
        check=False,
    )
    assert "plain,restore" in answer.stdout.splitlines(), answer.stdout + answer.stderr


@pytest.mark.slow
def test_make_install_from_source_gives_a_working_layout(tmp_path: Path) -> None:
    destdir = tmp_path / "root"
    run(
        [
            "make",
            "-C",
            str(REPO),
            "install",
            f"DESTDIR={destdir}",
            "PREFIX=/usr/local",
            f"BUILDDIR={tmp_path}/build",
        ],
        env=CLEAN_ENV,
    )
    prefix = destdir / "usr" / "local"
    hook = destdir / "etc/libvirt/hooks/qemu.d/charly-arbiter"
    assert hook.is_file() and not hook.is_symlink() and os.access(hook, os.X_OK)
    # The hook runs the program where this install put it: a hook still naming
    # /usr/bin/charly-arbiter would find nothing there and let every VM start unclaimed.
    assert "CHARLY_ARBITER=/usr/local/bin/charly-arbiter\n" in hook.read_text()
    hookscript = prefix / "libexec/charly-arbiter/proxmox-hookscript"
    assert hookscript.is_file() and os.access(hookscript, os.X_OK)
    assert "CHARLY_ARBITER=/usr/local/bin/charly-arbiter\n" in hookscript.read_text()
    assert (destdir / "etc/charly-arbiter/arbiter.toml").is_file()
    unit = (prefix / "lib/systemd/system/charly-arbiter-reconcile.service").read_text()
    assert "ExecStart=/usr/local/bin/charly-arbiter restore --stranded" in unit
    for path in (
        "lib/tmpfiles.d/charly-arbiter.conf",
        "share/man/man8/charly-arbiter.8",
        "share/man/man8/charly-arbiter-restore.8",
        "share/bash-completion/completions/charly-arbiter",
        "share/zsh/site-functions/_charly-arbiter",
        "share/fish/vendor_completions.d/charly-arbiter.fish",
    ):
        assert (prefix / path).is_file(), f"{path} is missing"
    packages = list(prefix.glob("lib/python3*/*-packages/charly_arbiter/__init__.py"))
    assert len(packages) == 1, packages
    version = run(
        [str(prefix / "bin/charly-arbiter"), "--version"],
        env={**CLEAN_ENV, "PYTHONPATH": str(packages[0].parent.parent)},
    )
    assert VERSION in version.stdout
