"""Holders on the real host, one module per kind.

`LocalHost` answers holder questions by asking each source in turn; a source
says which refs it owns (by kind) and implements discovery, liveness, stop and
start for them.  Sources are imported only when a ref of their kind comes up,
so the hook's path for a domain with no claim never imports libvirt.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable, Iterable, Sequence
from typing import Protocol

from charly_arbiter.core.config import Config, HolderConfig
from charly_arbiter.core.host import Holder, TokenSpec
from charly_arbiter.errors import HostError

# kind -> "module:class"; each class is built with (config) and implements HolderSource.
SOURCES = {
    "process": "charly_arbiter.host.holders.process:ProcessHolders",
    "systemd": "charly_arbiter.host.holders.systemd:SystemdHolders",
    "container": "charly_arbiter.host.holders.container:ContainerHolders",
    "libvirt": "charly_arbiter.libvirt.domains:LibvirtHolders",
}


class HolderSource(Protocol):
    kind: str

    def holders(self, tokens: Sequence[TokenSpec]) -> Sequence[Holder]:
        """Every holder of this kind that uses one of `tokens`, running or not."""
        ...

    def is_running(self, ref: str) -> bool: ...

    def stop(self, ref: str) -> None:
        """Stop it within the configured timeout, or raise `HolderError`."""
        ...

    def start(self, ref: str) -> None:
        """Start it again (or do nothing, for what cannot be restarted)."""
        ...


def listed_holders(
    listed: Iterable[HolderConfig],
    tokens: Sequence[TokenSpec],
    is_running: Callable[[str], bool],
    how: Callable[[HolderConfig], str],
) -> list[Holder]:
    """The holders arbiter.toml lists for any of `tokens` (units, containers)."""
    names = {token.name for token in tokens}
    found = []
    for entry in listed:
        held = tuple(token for token in entry.tokens if token in names)
        if held:
            found.append(
                Holder(
                    ref=entry.ref,
                    tokens=held,
                    preemptible=entry.preemptible,
                    running=is_running(entry.ref),
                    how=how(entry),
                    detail="listed in arbiter.toml",
                )
            )
    return found


class HolderRegistry:
    """Builds each kind's source on first use and routes a ref to it by its kind."""

    def __init__(self, config: Config, kinds: Sequence[str] = tuple(SOURCES)) -> None:
        self.config = config
        self.kinds = tuple(kinds)
        self._sources: dict[str, HolderSource] = {}

    def source(self, kind: str) -> HolderSource | None:
        if kind not in self.kinds:
            return None
        if kind not in self._sources:
            module, _, name = SOURCES[kind].partition(":")
            factory = getattr(importlib.import_module(module), name)
            self._sources[kind] = factory(self.config)
        return self._sources[kind]

    def for_ref(self, ref: str) -> HolderSource:
        kind = ref.partition(":")[0]
        source = self.source(kind)
        if source is None:
            raise HostError(f"{ref}: this host has no holders of kind {kind!r}")
        return source

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        found: list[Holder] = []
        for kind in self.kinds:
            source = self.source(kind)
            if source is not None:
                found.extend(source.holders(tokens))
        return found
