"""A token's driver switch and what follows from it: poison when it fails, CDI after.

Acquiring and releasing both switch tokens, and both must poison a token whose
switch failed or hung (nothing may touch it again until an operator has looked)
and refresh the CDI spec after every switch that happened, either way: a GPU
that came home must be in it, one that left for vfio-pci must not be (a
container started from a stale spec would get device nodes of a GPU it cannot
use).  This is the one place that does both.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping

from charly_arbiter.core.events import EventKind, Events, drivers_label
from charly_arbiter.core.host import Host, TokenSpec
from charly_arbiter.core.ledger import Ledger
from charly_arbiter.core.model import Claimant, Poison, now
from charly_arbiter.errors import ArbiterError, SwitchFailed, cli_command, signal_name

log = logging.getLogger(__name__)


class Switching:
    def __init__(self, host: Host, ledger: Ledger, events: Events) -> None:
        self.host = host
        self.ledger = ledger
        self.events = events

    def switch(self, token: TokenSpec, targets: Mapping[str, str], claimant: Claimant) -> None:
        """Switch one token; on failure poison it, so nothing touches it again."""
        started = time.monotonic()
        try:
            self.host.switch(token, targets)
        except KeyboardInterrupt as interrupt:
            # Cut short by a signal (Ctrl-C on a hung unbind): whether the write went
            # through, or is stuck in the kernel still, nobody knows; nothing may touch
            # the GPU until an operator has looked, as after a switch that hung.
            self.poison(
                token.name,
                f"its switch to {drivers_label(targets)} was interrupted by "
                f"{signal_name(interrupt)} before it returned; its drivers are not known",
                claimant,
            )
            raise
        except SwitchFailed as error:
            self.poison(token.name, str(error), claimant)
            error.hint = (
                f"{token.name} is poisoned now: nothing claims it until you have checked the "
                "GPU and its driver and run "
                + cli_command("poison", "clear", operands=[token.name])
                + (f" ({error.hint})" if error.hint else "")
            )
            raise
        self.events.emit(
            EventKind.SWITCHED,
            token=token.name,
            claimant=claimant,
            driver=drivers_label(self._bound_now(token, targets)),
            seconds=round(time.monotonic() - started, 3),
        )
        if token.cdi:
            self.regenerate_cdi(token)

    def _bound_now(self, token: TokenSpec, targets: Mapping[str, str]) -> dict[str, str]:
        """The drivers the switched functions are on now: a switch home to the kernel's
        choice is said as the driver it chose ("gpu1 is now on nvidia", not "home")."""
        try:
            functions = self.host.token_functions(token.name, token.address)
            found = {function.address: function.driver for function in functions}
        except ArbiterError:
            return dict(targets)
        return {address: found.get(address) or target for address, target in targets.items()}

    def poison(self, token: str, reason: str, claimant: Claimant) -> None:
        with self.ledger.transaction() as txn:
            txn.state = txn.state.with_poison(token, Poison(reason, now()))
        self.events.emit(EventKind.POISONED, token=token, claimant=claimant, why=reason)

    def regenerate_cdi(self, token: TokenSpec) -> None:
        """A CDI spec that cannot be refreshed is worth a warning, never a failed claim."""
        try:
            self.host.regenerate_cdi(token)
        except ArbiterError as error:
            log.warning("%s: could not regenerate the CDI spec: %s", token.name, error)
