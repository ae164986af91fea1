"""The click group: global options, lazy commands and the one error boundary."""

from __future__ import annotations

import importlib
import importlib.util
import logging
import sys
import traceback
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import click

from charly_arbiter import __version__, compose
from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import Config, load_config
from charly_arbiter.core.host import Host
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.errors import ArbiterError
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


def build(lazy: Mapping[str, str]) -> click.Group:
    @click.group(cls=LazyGroup, lazy=lazy, context_settings={"help_option_names": ["-h", "--help"]})
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

    return cli


def vm_memory_option(command: Any) -> Any:
    """`--vm-memory MIB`, shared by `detect` and `doctor` (what RLIMIT_MEMLOCK must cover)."""
    return click.option(
        "--vm-memory",
        type=click.IntRange(min=1),
        default=8192,
        show_default=True,
        help="MiB of guest memory to compare RLIMIT_MEMLOCK against.",
    )(command)
