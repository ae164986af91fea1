"""Man pages and shell completion generated from the click tree, and `make install`.

The man page generator and the completion scripts run for real on the
checkout's command tree; groff checks every page (warnings are failures); each
page has its exit statuses (from cli/exits.py, the source of docs/operations.md's
table), examples that the real command tree parses, and the files it touches.
bash's completion script is sourced in a real bash and its function called as a
<Tab> calls it: it completes token names and the claimants in the ledger, quoted
as they must be typed, without writing anything.  zsh and fish are not installed
here: their scripts' questions go to the program as those shells ask them.
`make install DESTDIR=... PREFIX=/usr/local` builds a wheel, installs it and
every other file, and the installed program runs from there.
"""

from __future__ import annotations

import importlib.util
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import click
import pytest
from pkgtools import CLEAN_ENV, REPO, VERSION, run

from charly_arbiter.cli import COMMANDS, exits
from charly_arbiter.cli.app import build

pytestmark = [pytest.mark.package]


def _load(name: str) -> object:
    spec = importlib.util.spec_from_file_location(name, REPO / "packaging" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _command_paths(words: dict[str, str] | None = None) -> dict[str, click.Command]:
    """Every command and subcommand of the real CLI, by man page name (and, into
    `words`, each page's command as cli/exits.py names it: `send-home`, `poison list`)."""
    paths: dict[str, click.Command] = {}

    def walk(command: click.Command, ctx: click.Context, path: list[str]) -> None:
        paths["-".join(path)] = command
        if words is not None:
            words["-".join(path)] = " ".join(path[1:]) or "charly-arbiter"
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


def test_each_page_has_its_exit_statuses_examples_and_files(tmp_path: Path) -> None:
    generator = _load("gen-manpages")
    pages = {page.stem: page.read_text() for page in generator.generate(tmp_path)}  # type: ignore[attr-defined]
    roff = generator.roff  # type: ignore[attr-defined]
    keys: dict[str, str] = {}
    _command_paths(keys)
    for name, text in pages.items():
        key = keys[name]
        exit_section = text.partition(".SH EXIT STATUS")[2].partition(".SH ")[0]
        for row in exits.rows(key):
            assert f"\\fB{row.code}\\fR ({exits.MEANING[row.code]})\n{roff(row.when)}" in (
                exit_section
            ), f"{name}(8): exit {row.code}"
        examples = text.partition(".SH EXAMPLES")[2].partition(".SH ")[0]
        commands = [
            line.replace("\\-", "-").replace("\\e", "\\")
            for line in examples.splitlines()
            if line.startswith("charly")
        ]
        assert commands, f"{name}(8) has no example"
        for command in commands:
            _parses(command)
        files = text.partition(".SH FILES")[2].partition(".SH ")[0]
        assert files.count(".TP") >= 1, f"{name}(8) names no file"
    hooks = pages["charly-arbiter"].partition(".SH HOOK EXIT STATUS")[2]
    for hook in exits.HOOKS:
        assert roff(f"charly-arbiter {hook}") in hooks
    started = pages["charly-arbiter"].partition(".SH PROCESSES THE HOOKS START")[2]
    for verb in exits.DETACHED:
        assert roff(f"charly-arbiter {verb}") in started.partition(".SH ")[0]


def _parses(command: str) -> None:
    """An example is a command the real tree accepts (every word, every option)."""
    words = shlex.split(command)
    assert words[0] == "charly-arbiter", command
    cli = build(COMMANDS)
    ctx = cli.make_context("charly-arbiter", words[1:])
    while isinstance(ctx.command, click.Group):
        protected = ctx._protected_args if hasattr(ctx, "_protected_args") else ctx.protected_args
        name, sub, args = ctx.command.resolve_command(ctx, [*protected, *ctx.args])
        assert sub is not None, command
        ctx = sub.make_context(name, args, parent=ctx)


def _completion_sim(tmp_path: Path) -> tuple[dict[str, str], Path]:
    """A simulated host with leases, one of them a claimant with a space and a quote."""
    directory = tmp_path / "sim"
    env = {**CLEAN_ENV, "PYTHONPATH": str(REPO), "CHARLY_ARBITER_HOST": f"sim:{directory}"}
    program = [sys.executable, "-m", "charly_arbiter"]
    run([*program, "sim", "init", str(directory)], env=env)
    run([*program, "acquire", "--shared", "--", "libvirt:it's my vm", "gpu0"], env=env)
    run([*program, "acquire", "--shared", "container:llm", "gpu0"], env=env)
    return env, directory


def test_bash_completes_tokens_and_ledger_claimants_quoted_without_writing(
    tmp_path: Path,
) -> None:
    scripts = {p.name: p for p in _load("gen-completions").generate(tmp_path / "scripts")}  # type: ignore[attr-defined]
    env, directory = _completion_sim(tmp_path)
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    wrapper = bin_dir / "charly-arbiter"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(sys.executable)} -m charly_arbiter "$@"\n')
    wrapper.chmod(0o755)
    env = {**env, "PATH": f"{bin_dir}:{env.get('PATH', '/usr/bin:/bin')}"}

    def complete(line: str) -> list[str]:
        """COMPREPLY after <Tab> at the end of `line`, in a real bash."""
        words = shlex.split(line) + ([""] if line.endswith(" ") else [])
        script = (
            f"source {shlex.quote(str(scripts['charly-arbiter.bash']))}\n"
            f"COMP_WORDS=({' '.join(shlex.quote(w) for w in words)})\n"
            f"COMP_CWORD={len(words) - 1}\n"
            "_charly_arbiter_completion charly-arbiter\n"
            "printf '%s\\n' \"${COMPREPLY[@]}\"\n"
        )
        result = run(["/bin/bash", "-c", script], env=env)
        return [line for line in result.stdout.splitlines() if line]

    before = sorted((p, p.stat().st_mtime_ns) for p in directory.rglob("*"))
    started = time.monotonic()
    assert complete("charly-arbiter acquire --shared container:x ") == ["gpu0", "gpu1"]
    elapsed = time.monotonic() - started
    assert complete("charly-arbiter poison clear gpu") == ["gpu0", "gpu1"]
    released = complete("charly-arbiter release ")
    assert "container:llm" in released
    # The one with a space and a quote, as it must be typed: the shell makes it whole.
    quoted = next(item for item in released if "my vm" in item)
    assert shlex.split(quoted) == ["libvirt:it's my vm"]
    assert complete("charly-arbiter release lib") == [quoted]
    assert complete("charly-arbiter explain g") == ["gpu0", "gpu1"]
    assert sorted((p, p.stat().st_mtime_ns) for p in directory.rglob("*")) == before
    assert elapsed < 5, f"a <Tab> took {elapsed:.1f} s"
    # A host whose state directory does not exist yet: nothing is created by a <Tab>.
    fresh = tmp_path / "fresh"
    run(
        [sys.executable, "-m", "charly_arbiter", "sim", "init", str(fresh)],
        env={**CLEAN_ENV, "PYTHONPATH": str(REPO)},
    )
    env = {**env, "CHARLY_ARBITER_HOST": f"sim:{fresh}"}
    assert complete("charly-arbiter release ") == []
    assert not (fresh / "state").exists()


@pytest.mark.parametrize("shell", ["zsh", "fish"])
def test_zsh_and_fish_ask_the_program_for_the_same_names(tmp_path: Path, shell: str) -> None:
    scripts = {p.name: p for p in _load("gen-completions").generate(tmp_path / "scripts")}  # type: ignore[attr-defined]
    source = scripts["_charly-arbiter" if shell == "zsh" else "charly-arbiter.fish"].read_text()
    assert f"_CHARLY_ARBITER_COMPLETE={shell}_complete" in source
    env, _ = _completion_sim(tmp_path)
    # zsh passes the index of the word under the cursor, fish that word itself
    words, current = "charly-arbiter release ", "2" if shell == "zsh" else ""
    answer = run(
        [sys.executable, "-m", "charly_arbiter"],
        env={
            **env,
            "_CHARLY_ARBITER_COMPLETE": f"{shell}_complete",
            "COMP_WORDS": words,
            "COMP_CWORD": current,
        },
    ).stdout.splitlines()
    # zsh: type, value, description lines; fish: type,value (the shell quotes on insert)
    assert "libvirt:it's my vm" in answer or "plain,libvirt:it's my vm" in answer, answer


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
        "share/charly-arbiter/prometheus/charly-arbiter.rules.yml",
        "share/charly-arbiter/grafana/charly-arbiter.json",
    ):
        assert (prefix / path).is_file(), f"{path} is missing"
    packages = list(prefix.glob("lib/python3*/*-packages/charly_arbiter/__init__.py"))
    assert len(packages) == 1, packages
    version = run(
        [str(prefix / "bin/charly-arbiter"), "--version"],
        env={**CLEAN_ENV, "PYTHONPATH": str(packages[0].parent.parent)},
    )
    assert VERSION in version.stdout
