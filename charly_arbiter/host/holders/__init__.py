"""Holders on the real host, one module per kind.

`LocalHost` answers holder questions by asking each source in turn; a source
says which refs it owns (by kind) and implements discovery, liveness, stop and
start for them.  The sources are handed in as factories (by `compose`, which
also knows libvirt's): each is built only when a ref of its kind comes up, so
the hook's path for a domain with no claim never imports libvirt.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Protocol

from charly_arbiter.core.config import Config, HolderConfig
from charly_arbiter.core.host import Holder, TokenSpec
from charly_arbiter.core.model import Claimant, HolderKind
from charly_arbiter.errors import HostError
from charly_arbiter.host.procscan import cgroup_paths


class HolderSource(Protocol):
    kind: HolderKind

    def holders(self, tokens: Sequence[TokenSpec]) -> Sequence[Holder]:
        """Every holder of this kind that uses one of `tokens`, running or not."""
        ...

    def is_running(self, ref: Claimant) -> bool: ...

    def stop(self, ref: Claimant) -> None:
        """Stop it within the configured timeout, or raise `HolderError`."""
        ...

    def start(self, ref: Claimant) -> None:
        """Start it again (or do nothing, for what cannot be restarted)."""
        ...


class CgroupOwners(Protocol):
    """A source whose holders' processes can be told by their cgroup (units, containers)."""

    def cgroup_owner(self, paths: Sequence[str]) -> Claimant | None:
        """The holder of this kind a process in these cgroups runs in, if any."""
        ...


def listed_holders(
    listed: Iterable[HolderConfig],
    tokens: Sequence[TokenSpec],
    is_running: Callable[[Claimant], bool],
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


SourceFactory = Callable[[Config], HolderSource]


class HolderRegistry:
    """Builds each kind's source on first use and routes a ref to it by its kind."""

    def __init__(self, config: Config, factories: Mapping[str, SourceFactory]) -> None:
        self.config = config
        self.factories = dict(factories)
        self.kinds = tuple(self.factories)
        self._sources: dict[str, HolderSource] = {}

    def source(self, kind: str) -> HolderSource | None:
        factory = self.factories.get(kind)
        if factory is None:
            return None
        if kind not in self._sources:
            self._sources[kind] = factory(self.config)
        return self._sources[kind]

    def close(self) -> None:
        for source in self._sources.values():
            close = getattr(source, "close", None)
            if close is not None:
                close()

    def for_ref(self, ref: Claimant) -> HolderSource:
        kind = Claimant.parse(ref).kind
        source = self.source(kind)
        if source is None:
            raise HostError(f"{ref}: this host has no holders of kind '{kind}'")
        return source

    def cgroup_owner(self, paths: Sequence[str]) -> Claimant | None:
        """The unit or container these cgroups belong to, among the sources' holders."""
        for kind in self.kinds:
            owner = getattr(self.source(kind), "cgroup_owner", None)
            if owner is not None:
                found: Claimant | None = owner(paths)
                if found is not None:
                    return found
        return None

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        found: list[Holder] = []
        for kind in self.kinds:
            source = self.source(kind)
            if source is not None:
                found.extend(source.holders(tokens))
        return found


def known_owner(
    registry: HolderRegistry, proc_root: Path, among: Collection[Claimant] | None
) -> Callable[[int], Claimant | None]:
    """The holder a process runs in, by its cgroup, when it is one of `among`
    (None: any unit or container the sources know)."""

    def owner(pid: int) -> Claimant | None:
        found = registry.cgroup_owner(cgroup_paths(proc_root, pid))
        return found if found is not None and (among is None or found in among) else None

    return owner
