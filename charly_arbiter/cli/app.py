"""The click group: global options, lazy commands and the one error boundary.

The boundary keeps the exit-code contract (errors.EXIT_*, the table of every
command's cases in cli/exits.py): an `ArbiterError` exits with its own code
after one or two sentences; an OSError that reached this far is said as what
the host refused on which file, and the fix; a signal (Ctrl-C, SIGTERM, SIGHUP)
says what it cut short; "internal error" is left for what is truly a bug.
"""

from __future__ import annotations

import contextlib
import importlib
import importlib.util
import logging
import signal
import sys
import traceback
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import FrameType
from typing import Any

import click

from charly_arbiter import __version__, compose
from charly_arbiter.core import files
from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import Config, load_config
from charly_arbiter.core.host import Host
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Claimant, LeaseState, Mode, StepState
from charly_arbiter.errors import (
    EXIT_ERROR,
    EXIT_USAGE,
    ArbiterError,
    Interrupt,
    Interrupted,
    cli_command,
    signal_name,
)
from charly_arbiter.logsetup import log_setup

log = logging.getLogger("charly_arbiter.cli")


@dataclass
class App:
    """What every command shares: the options, and the objects built from them on demand
    (`compose` wires them, as it does for the hooks)."""

    config_path: Path | None
    state_dir: Path | None
    host_spec: str | None
    verbose: int
    _config: Config | None = None
    _host: Host | None = None
    _ledger: Ledger | None = None
    _arbiter: Arbiter | None = None

    def config(self) -> Config:
        if self._config is None:
            self._config = load_config(
                self.config_path, state_dir=self.state_dir, host=self.host_spec
            )
        return self._config

    def host(self) -> Host:
        if self._host is None:
            self._host = compose.open_host(self.config())
        return self._host

    def ledger(self) -> Ledger:
        if self._ledger is None:
            self._ledger = compose.open_ledger(self.config())
        return self._ledger

    def arbiter(self) -> Arbiter:
        if self._arbiter is None:
            self._arbiter = compose.build_arbiter(
                self.config(), host=self.host(), ledger=self.ledger(), progress=True
            )
        return self._arbiter

    def close(self) -> None:
        if self._host is not None:
            self._host.close()


class LazyGroup(click.Group):
    """Imports a command's module only when that command runs (or help lists it)."""

    def __init__(self, *args: Any, lazy: Mapping[str, str], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.lazy = {
            name: spec
            for name, spec in lazy.items()
            if importlib.util.find_spec(spec.partition(":")[0]) is not None
        }

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted(self.lazy)

    def get_command(self, ctx: click.Context, cmd_name: str) -> click.Command | None:
        spec = self.lazy.get(cmd_name)
        if spec is None:
            return None
        module, _, name = spec.partition(":")
        command: click.Command = getattr(importlib.import_module(module), name)
        return command

    def invoke(self, ctx: click.Context) -> Any:
        try:
            return super().invoke(ctx)
        except ArbiterError as error:
            _report(ctx, error)
            sys.exit(error.exit_code)
        except (click.exceptions.Exit, click.ClickException, click.Abort):
            raise
        except KeyboardInterrupt as interrupt:
            _report(
                ctx,
                Interrupted(
                    f"interrupted by {signal_name(interrupt)}; what the command had done "
                    "so far stays as it is",
                    hint=f"run {cli_command('status')} to see the state",
                ),
            )
            sys.exit(EXIT_ERROR)
        except OSError as error:  # the host refused something: say what (on which file), the fix
            if error.filename is None:
                said = ArbiterError(
                    f"the host refused it: {error.strerror or error}",
                    hint="run the command again with -v to see where",
                )
            else:
                path = Path(error.filename)
                why, fix = files.describe_os_error(path, error)
                said = ArbiterError(f"cannot use {path}: {why}", hint=fix)
            _report(ctx, said)
            sys.exit(EXIT_ERROR)
        except Exception as error:  # the boundary: a plain sentence, a traceback with -v
            app = ctx.find_object(App)
            if app is not None and app.verbose:
                traceback.print_exc()
            click.echo(
                f"charly-arbiter: internal error: {type(error).__name__}: {error} "
                "(run with -v for details)",
                err=True,
            )
            sys.exit(1)
        finally:
            app = ctx.find_object(App)
            if app is not None:
                app.close()


def _report(ctx: click.Context, error: ArbiterError) -> None:
    app = ctx.find_object(App)
    if app is not None and app.verbose:
        traceback.print_exc()
    click.echo(f"charly-arbiter: {error}", err=True)
    if error.hint:
        click.echo(f"hint: {error.hint}", err=True)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    """The first SIGINT, SIGTERM or SIGHUP ends the command where it waits (an
    `Interrupt` in the main thread); the ones after it are ignored, so that the
    cleanup (a poisoning, reading what was left) is not cut short in turn."""
    for number in _SIGNALS:
        signal.signal(number, signal.SIG_IGN)
    raise Interrupt(signal.Signals(signum).name)


_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


@contextlib.contextmanager
def interruption_report(arbiter: Arbiter, claimant: Claimant | None, what: str) -> Iterator[None]:
    """A claim, release or restore cut short by a signal (Ctrl-C; SIGTERM, as systemd
    sends a unit's ExecStartPre that takes too long; SIGHUP, a closed terminal): say
    what it left (the lease, the holders it stopped, the GPUs it switched or
    poisoned) and the command that converges it, `restore CLAIMANT`."""
    previous = {number: signal.getsignal(number) for number in _SIGNALS}
    for number, handler in previous.items():
        if handler is not signal.SIG_IGN:  # nohup's SIGHUP stays ignored
            signal.signal(number, _on_signal)
    try:
        yield
    except KeyboardInterrupt as interrupt:
        raise _interrupted(arbiter, claimant, what, signal_name(interrupt)) from interrupt
    finally:
        for number, handler in previous.items():
            signal.signal(number, signal.SIG_DFL if handler is None else handler)


def _interrupted(
    arbiter: Arbiter, claimant: Claimant | None, what: str, signal_text: str
) -> Interrupted:
    if claimant is None:
        return Interrupted(
            f"the {what} was interrupted by {signal_text}; the leases it had not finished "
            "are still in the ledger",
            hint=f"run {cli_command('restore', '--stranded')} to finish them",
        )
    state = arbiter.ledger.inspect().state
    lease = state.lease_of(claimant) if state is not None else None
    if lease is None:
        return Interrupted(
            f"the {what} of {claimant} was interrupted by {signal_text}; "
            f"{claimant} holds no lease now",
            hint=f"run {cli_command('status')} to see the state",
        )
    stopped = [
        r.holder for r in lease.stopped if r.state is not StepState.PLANNED and not r.restored
    ]
    switched = [token for token, step in lease.switched if step is StepState.DONE]
    poisoned = [token for token in lease.tokens if state and state.poison_of(token)]
    left = [f"its lease on {', '.join(lease.tokens)} is {lease.state}"]
    if stopped:
        left.append(f"{', '.join(stopped)} stopped for it")
    if switched and lease.state is LeaseState.ACQUIRING:
        left.append(f"{', '.join(switched)} switched")
    if poisoned:
        left.append(f"{', '.join(poisoned)} poisoned (a switch was cut short)")
    clear = [cli_command("poison", "clear", operands=[token]) for token in poisoned]
    return Interrupted(
        f"the {what} of {claimant} was interrupted by {signal_text} half-way: " + "; ".join(left),
        hint=f"run {cli_command('restore', operands=[claimant])} to bring back what was "
        "stopped and send the GPU home"
        + (f", then check the GPU and run {' and '.join(clear)}" if clear else ""),
    )


def needs_subcommand(ctx: click.Context) -> None:
    """A group named without a command: its help on stderr and exit 2, on every click
    (8.1 exits 0 there, 8.2 and later 2)."""
    if ctx.invoked_subcommand is None and not ctx.resilient_parsing:
        click.echo(ctx.get_help(), err=True)
        ctx.exit(EXIT_USAGE)


# The group `built` made, and the commands it was made of.
_built: tuple[Mapping[str, str], click.Group] | None = None


def built(lazy: Mapping[str, str]) -> click.Group:
    """`build(lazy)`, once per process: a spare of the resident helper builds it while
    it waits (cli._read_ahead) and the command it takes uses it, 0.3-0.5 ms less per
    command.  The group is structure only (options, help texts, the lazy table), and
    click makes a fresh context per use; of the environment only gettext's locale
    is read while building, for help texts no installed catalog translates
    (click ships none, and the arbiter's own are English)."""
    global _built
    if _built is None or _built[0] is not lazy:
        _built = (lazy, build(lazy))
    return _built[1]


def build(lazy: Mapping[str, str]) -> click.Group:
    @click.group(
        cls=LazyGroup,
        lazy=lazy,
        invoke_without_command=True,
        no_args_is_help=False,
        context_settings={"help_option_names": ["-h", "--help"]},
    )
    @click.version_option(__version__, prog_name="charly-arbiter")
    @click.option(
        "--config",
        "config_path",
        type=click.Path(path_type=Path, dir_okay=False),
        help="Configuration file (default /etc/charly-arbiter/arbiter.toml; "
        "env CHARLY_ARBITER_CONFIG).",
    )
    @click.option(
        "--state-dir",
        type=click.Path(path_type=Path, file_okay=False),
        help="Where the ledger lives (default /var/lib/charly-arbiter; "
        "env CHARLY_ARBITER_STATE_DIR).",
    )
    @click.option(
        "--host",
        "host_spec",
        metavar="local|sim:DIR",
        help="The host to act on (env CHARLY_ARBITER_HOST; default local).",
    )
    @click.option("-v", "--verbose", count=True, help="More log output; tracebacks on errors.")
    @click.pass_context
    def cli(
        ctx: click.Context,
        config_path: Path | None,
        state_dir: Path | None,
        host_spec: str | None,
        verbose: int,
    ) -> None:
        """Arbitrate GPUs between passthrough VMs, containers and host services."""
        log_setup(verbose)
        ctx.obj = App(config_path, state_dir, host_spec, verbose)
        needs_subcommand(ctx)

    return cli


def mode_options(
    command: Any, exclusive_help: str = "Sole use (vfio-pci).", shared_help: str = ""
) -> Any:
    """`--exclusive` and `--shared`, two flags that exclude each other (`claim_mode`)."""
    command = click.option(
        "--shared", "shared", is_flag=True, help=shared_help or "Refcounted, home driver."
    )(command)
    return click.option("--exclusive", "exclusive", is_flag=True, help=exclusive_help)(command)


def claim_mode(exclusive: bool, shared: bool, default: Mode | None = None) -> Mode | None:
    """The mode the flags name; both at once is a usage error (never one silently winning)."""
    if exclusive and shared:
        raise click.UsageError("--exclusive and --shared exclude each other; say one of them")
    if exclusive:
        return Mode.EXCLUSIVE
    if shared:
        return Mode.SHARED
    return default


def vm_memory_option(command: Any) -> Any:
    """`--vm-memory MIB`, shared by `detect` and `doctor` (what RLIMIT_MEMLOCK must cover)."""
    return click.option(
        "--vm-memory",
        type=click.IntRange(min=1),
        default=8192,
        show_default=True,
        help="MiB of guest memory to compare RLIMIT_MEMLOCK against.",
    )(command)
