"""What happened, said once: every claim, refusal, preemption, switch, restore,
poisoning and clear goes through `Events.emit`.

The arbiter only emits; where events go (the log, the history file, the
journal) is decided here, so adding a destination touches no rule.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("charly_arbiter.events")

Sink = Callable[[str, dict[str, Any]], None]


class Events:
    def __init__(self, sinks: list[Sink] | None = None) -> None:
        self.sinks: list[Sink] = list(sinks or [])

    def emit(self, kind: str, **fields: Any) -> None:
        """Record one event; a failing sink is logged and never stops the caller."""
        log.info("%s %s", kind, " ".join(f"{key}={value}" for key, value in fields.items()))
        for sink in self.sinks:
            try:
                sink(kind, fields)
            except Exception:
                log.exception("could not record event %s", kind)
