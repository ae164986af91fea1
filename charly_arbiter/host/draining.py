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

`Drained` is how a host gets them: one wrapper around whichever host the
configuration names (local, simulated, simulated with real holders), applied
where the host is composed (compose.open_host), so that no host wires them in.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Protocol

from charly_arbiter.core import files
from charly_arbiter.core.config import Config, HolderConfig
from charly_arbiter.core.host import (
    Blocker,
    DeviceUser,
    Holder,
    Host,
    MigChange,
    MigState,
    PciFunction,
    ScreenUse,
    TokenSpec,
)
from charly_arbiter.core.model import Claimant, ProcessRef
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


class Drainable(Host, Protocol):
    """A host whose holders come in two parts, so that a drained holder's processes
    can be told apart: the holders its sources manage (units, containers, VMs,
    simulated ones) and the processes that hold the tokens' device nodes outside
    every running one of them."""

    def managed_holders(self, tokens: Sequence[TokenSpec]) -> Sequence[Holder]:
        """Every holder but the device-node processes, running or not."""
        ...

    def process_holders(
        self, tokens: Sequence[TokenSpec], running: Collection[Claimant]
    ) -> Sequence[Holder]:
        """The processes holding the tokens' nodes that belong to none of `running`."""
        ...


class Drained:
    """`inner` with the configured drains around its holders' stops and starts: a
    drained holder does not run as far as its GPU goes (a process of its that holds
    the GPU again is a holder of its own), a stop drains first, a start runs `ready`.
    Everything else is `inner`'s."""

    def __init__(self, inner: Drainable, config: Config) -> None:
        self.inner = inner
        self.config = config
        self.description = inner.description
        self.drains = Drains(
            config,
            token_specs(config, inner.token_functions),
            inner.device_users,
            inner.boot_id,
        )

    # -- what drains change ------------------------------------------------------------

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        found = self.drains.holders(self.inner.managed_holders(tokens))
        running = {holder.ref for holder in found if holder.running}
        return [*self.inner.process_holders(tokens, running), *found]

    def is_running(self, ref: Claimant) -> bool:
        return self.drains.is_running(ref, self.inner.is_running(ref))

    def are_running(self, refs: Sequence[Claimant]) -> dict[Claimant, bool]:
        found = self.inner.are_running(refs)
        return {ref: self.drains.is_running(ref, running) for ref, running in found.items()}

    def stop(self, ref: Claimant) -> None:
        self.drains.stop(ref, lambda: self.inner.stop(ref))

    def start(self, ref: Claimant) -> None:
        self.drains.start(ref, lambda: self.inner.start(ref), lambda: self.inner.is_running(ref))

    def tell(self, sessions: Sequence[Claimant], message: str) -> None:
        self.inner.tell(sessions, message)

    # -- the rest is the host's own ----------------------------------------------------

    def boot_id(self) -> str:
        return self.inner.boot_id()

    def gpus(self) -> Sequence[PciFunction]:
        return self.inner.gpus()

    def token_functions(self, name: str, address: str) -> Sequence[PciFunction]:
        return self.inner.token_functions(name, address)

    def switch(self, token: TokenSpec, targets: Mapping[str, str]) -> None:
        self.inner.switch(token, targets)

    def write_vf_count(self, address: str, count: int) -> None:
        self.inner.write_vf_count(address, count)

    def mig(self, token: TokenSpec) -> MigState | None:
        return self.inner.mig(token)

    def set_mig(self, token: TokenSpec, change: MigChange) -> MigState:
        return self.inner.set_mig(token, change)

    @property
    def mig_error(self) -> str:
        """Why `mig` said None last, where the host says (the local host's NVML)."""
        return str(getattr(self.inner, "mig_error", ""))

    def device_users(self, tokens: Sequence[TokenSpec]) -> Sequence[DeviceUser]:
        return self.inner.device_users(tokens)

    def device_functions(self, numbers: Sequence[tuple[int, int]]) -> Mapping[tuple[int, int], str]:
        return self.inner.device_functions(numbers)

    def screen(self, token: TokenSpec) -> ScreenUse:
        return self.inner.screen(token)

    def passthrough_blocker(self, token: TokenSpec) -> Blocker | None:
        return self.inner.passthrough_blocker(token)

    def current_process(self) -> ProcessRef:
        return self.inner.current_process()

    def process_alive(self, process: ProcessRef) -> bool:
        return self.inner.process_alive(process)

    def regenerate_cdi(self, token: TokenSpec) -> None:
        self.inner.regenerate_cdi(token)

    def inhibit(self, token: str, why: str) -> None:
        self.inner.inhibit(token, why)

    def uninhibit(self, token: str) -> None:
        self.inner.uninhibit(token)

    def inhibitors(self) -> Mapping[str, str]:
        return self.inner.inhibitors()

    def sleep_lock_unavailable(self) -> str | None:
        return self.inner.sleep_lock_unavailable()

    def close(self) -> None:
        self.inner.close()


def machine(host: Host) -> Host:
    """The host itself, without the drains around it (what `detect`, `doctor` and
    `sim` ask about: the machine, local or simulated)."""
    return host.inner if isinstance(host, Drained) else host


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
