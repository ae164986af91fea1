"""Drains: a holder that lets go of its GPU gracefully, or without stopping at all.

A holder listed with `drain = [...]` has that command run before it is stopped
(an inference server unloads its models, finishes its requests), bounded by
`timeouts.holder_drain`, its output logged; a drain that fails or times out
is logged and the holder is stopped anyway.  With `stop = "drain"` it is not
stopped: it keeps running (serving from the CPU or another GPU) and only has
to let go of the GPU's device nodes, which the device-node scan checks before
the stop counts as done.  What still holds a node then is named in the
refusal, and the claim is rolled back.

A drained holder is "not running" as far as the arbiter is concerned (it
does not hold its GPU), so a release brings it back: `start` forgets the
drain and runs its `ready` command.  `ready = [...]` runs after any holder is
started again, once a second until it succeeds or `timeouts.holder_ready` has
passed, so that the release ends only when the holder is really back (a
server that answers, a model loaded again).

Whether a holder is drained is a marker under the state directory, holding
the boot id: after a reboot the holder runs as it was started, not drained.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import replace
from pathlib import Path

from charly_arbiter.core import files
from charly_arbiter.core.config import Config, HolderConfig
from charly_arbiter.core.host import DeviceUser, Holder, PciFunction, TokenSpec
from charly_arbiter.core.model import Claimant
from charly_arbiter.errors import CommandFailed, HolderError
from charly_arbiter.host import run

log = logging.getLogger(__name__)

DRAINED_DIR = "drained"
POLL_SECONDS = 0.25
READY_INTERVAL = 1.0
MAX_LOGGED = 2000  # characters of a command's output kept in the log


class Drains:
    """The drain and ready steps of the holders the configuration gives them."""

    def __init__(
        self,
        config: Config,
        tokens: Callable[[Sequence[str]], Sequence[TokenSpec]],
        users: Callable[[Sequence[TokenSpec]], Sequence[DeviceUser]],
        boot_id: Callable[[], str],
    ) -> None:
        """`tokens` gives the specs of token names, `users` the processes holding their
        nodes now, `boot_id` the host's boot (the host these drains belong to)."""
        self.config = config
        self.tokens = tokens
        self.users = users
        self.boot_id = boot_id
        self.listed = {h.ref: h for h in config.holders if h.drain or h.ready}

    # -- what the host asks --------------------------------------------------------------

    def is_running(self, ref: Claimant, running: bool) -> bool:
        """Running, and not drained (a drained holder does not hold its GPU)."""
        return running and not self.drained(ref)

    def holders(self, found: Sequence[Holder]) -> list[Holder]:
        return [
            replace(holder, running=False, detail=_joined(holder.detail, "drained"))
            if holder.running and self.drained(holder.ref)
            else holder
            for holder in found
        ]

    def stop(self, ref: Claimant, stop: Callable[[], None]) -> None:
        """Drain it, then stop it (or, with `stop = "drain"`, check it let go)."""
        entry = self.listed.get(ref)
        if entry is None:
            stop()
            return
        deadline = time.monotonic() + self.config.timeouts.holder_drain
        if entry.drain:
            self._run(ref, "drain", entry.drain, self.config.timeouts.holder_drain)
        if not entry.drains_only:
            stop()
            return
        self._wait_let_go(entry, deadline)
        self._mark(ref)
        log.info("%s: drained; it keeps running without its GPU", ref)

    def start(self, ref: Claimant, start: Callable[[], None], running: Callable[[], bool]) -> None:
        """Start it again (a drained one just may use its GPU again, unless it stopped
        meanwhile), then wait until its `ready` command succeeds."""
        entry = self.listed.get(ref)
        if entry is None:
            start()
            return
        drained = self.drained(ref)
        if drained:
            self._forget(ref)
        if not drained or not running():
            start()
        if entry.ready:
            self._wait_ready(ref, entry.ready)

    # -- the steps ------------------------------------------------------------------

    def _run(self, ref: Claimant, step: str, argv: Sequence[str], timeout: float) -> bool:
        try:
            result = run.run(list(argv), check=False, timeout=max(timeout, 0.1))
        except CommandFailed as error:
            log.warning("%s: %s command %s", ref, step, error)
            return False
        output = (result.stdout + result.stderr).strip()
        if output:
            log.info("%s: %s: %s", ref, step, output[-MAX_LOGGED:])
        if result.returncode != 0:
            log.warning("%s: %s command %s exited with %d", ref, step, argv[0], result.returncode)
            return False
        return True

    def _wait_let_go(self, entry: HolderConfig, deadline: float) -> None:
        """Until no process of this holder (or of none) holds its tokens' nodes."""
        tokens = self.tokens(entry.tokens)
        while True:
            holding = [user for user in self.users(tokens) if user.owner in (None, entry.ref)]
            if not holding:
                return
            if time.monotonic() >= deadline:
                names = "; ".join(str(user) for user in holding)
                raise HolderError(
                    entry.ref,
                    "drain",
                    f"its GPU is still held {self.config.timeouts.holder_drain:g} s after "
                    f"the drain: {names}",
                )
            time.sleep(POLL_SECONDS)

    def _wait_ready(self, ref: Claimant, argv: Sequence[str]) -> None:
        limit = self.config.timeouts.holder_ready
        deadline = time.monotonic() + limit
        while True:
            left = deadline - time.monotonic()
            if self._run(ref, "ready", argv, min(left, 30.0)):
                log.info("%s: ready", ref)
                return
            if time.monotonic() + READY_INTERVAL >= deadline:
                log.warning("%s: not ready %g s after it was started again", ref, limit)
                return
            time.sleep(READY_INTERVAL)

    # -- the drained markers -----------------------------------------------------------

    def drained(self, ref: Claimant) -> bool:
        entry = self.listed.get(ref)
        if entry is None or not entry.drains_only:
            return False
        try:
            boot_id = self._marker(ref).read_text().strip()
        except OSError:
            return False
        return boot_id == self.boot_id()

    def _mark(self, ref: Claimant) -> None:
        marker = self._marker(ref)
        marker.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
        marker.with_suffix(".tmp").unlink(missing_ok=True)  # left by a crash
        files.replace_file(
            marker,
            f"{self.boot_id()}\n".encode(),
            temp=marker.with_suffix(".tmp"),
            durable=False,
        )

    def _forget(self, ref: Claimant) -> None:
        self._marker(ref).unlink(missing_ok=True)

    def _marker(self, ref: Claimant) -> Path:
        name = hashlib.sha256(ref.encode()).hexdigest()[:32]
        return self.config.state_dir / DRAINED_DIR / name


def token_specs(
    config: Config, functions: Callable[[str, str], Sequence[PciFunction]]
) -> Callable[[Sequence[str]], list[TokenSpec]]:
    """Token names to specs, for a host whose `token_functions` is `functions`
    (without configured tokens, a token is named after its GPU's address)."""

    def specs(names: Sequence[str]) -> list[TokenSpec]:
        addresses = {token.name: token.address for token in config.tokens}
        found = []
        for name in names:
            address = addresses.get(name) if config.tokens else name
            if address is not None:
                found.append(TokenSpec(name, address, tuple(functions(name, address))))
        return found

    return specs


def _joined(*parts: str) -> str:
    return "; ".join(part for part in parts if part)
