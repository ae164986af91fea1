"""What <Tab> offers for a token or a claimant: the configured tokens and the claimants
in the ledger, asked of the live configuration and ledger at each <Tab>.

The completion scripts (packaging/gen-completions.py) run this very program with
_CHARLY_ARBITER_COMPLETE set; click parses the words typed so far (the global
options included, so `--config` and `--host sim:DIR` are honoured) and calls these.
They read and never write (no state directory is created, no lock taken), keep to
files (no libvirt, no holder is asked), and answer nothing rather than an error: a
completion must never print one.  bash inserts a completion as it is, so for bash a
name a shell would split or expand is offered quoted, as it must be typed.
"""

from __future__ import annotations

import os
import shlex
from typing import Any

import click
from click.shell_completion import CompletionItem

COMPLETE_VAR = "_CHARLY_ARBITER_COMPLETE"  # what click derives from the program's name


def tokens(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The configured tokens; without any, the GPUs of the host (named by address)."""
    try:
        config = _config(ctx)
        names = [token.name for token in config.tokens]
        if not names:
            from charly_arbiter import compose

            host = compose.open_host(config)
            try:
                names = [gpu.address for gpu in host.gpus()]
            finally:
                host.close()
    except Exception:  # a completion answers nothing rather than an error
        return []
    return _items(names, incomplete)


def claimants(ctx: click.Context, param: click.Parameter, incomplete: str) -> list[CompletionItem]:
    """The claimants in the ledger (leases, and holders they stopped), then the holders
    the configuration names."""
    try:
        from charly_arbiter.core.ledger import Ledger

        config = _config(ctx)
        found: list[str] = []
        if (config.state_dir / "ledger.toml").exists():
            state = Ledger(config.state_dir).read()
            for lease in state.leases:
                found += [lease.claimant, *(record.holder for record in lease.stopped)]
        found += [holder.ref for holder in config.holders]
    except Exception:  # a completion answers nothing rather than an error
        return []
    return _items(list(dict.fromkeys(found)), incomplete)


def token_or_claimant(
    ctx: click.Context, param: click.Parameter, incomplete: str
) -> list[CompletionItem]:
    """`explain`'s subject: a token, or a claimant."""
    return [*tokens(ctx, param, incomplete), *claimants(ctx, param, incomplete)]


def _config(ctx: click.Context) -> Any:
    from charly_arbiter.core.config import load_config

    root = ctx.find_root().params
    return load_config(
        root.get("config_path"), state_dir=root.get("state_dir"), host=root.get("host_spec")
    )


def _items(names: list[str], incomplete: str) -> list[CompletionItem]:
    bash = os.environ.get(COMPLETE_VAR, "").startswith("bash")
    return [
        CompletionItem(_for_bash(name) if bash else name)
        for name in names
        if name.startswith(incomplete)
    ]


def _for_bash(name: str) -> str:
    """Quoted as typed; backslashes doubled for the `read` (without -r) of click's bash
    script, which takes one level of them away."""
    return shlex.quote(name).replace("\\", "\\\\")


__all__ = ["claimants", "token_or_claimant", "tokens"]
