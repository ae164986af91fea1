"""What a container is given and what it is called, from what its runtime hands a hook.

An OCI hook receives the container's *state* on stdin (id, status, the init
process's pid, the bundle directory, annotations); the bundle's `config.json`
is the spec, whose `linux.devices` lists each device node with its host
major:minor, and whose annotations may name CDI devices
(`cdi.k8s.io/KEY: vendor.com/class=name,...`, as Kubernetes device plugins do).

The container's name (its claimant is `container:NAME`) is, in this order: an
`org.charly-arbiter.name` annotation; CRI-O's own unique name
(`io.kubernetes.cri-o.ContainerName`); the name containers/storage records for
the id (Podman and CRI-O keep it in `containers.json` beside the bundle:
`…/overlay-containers/ID/userdata`); else the id itself (Docker sets none).
Everything read here is untrusted and checked: a claimant never comes from
anything but `Claimant.parse`.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from charly_arbiter.core.model import Claimant, HolderKind
from charly_arbiter.errors import ArbiterError

NAME_ANNOTATION = "org.charly-arbiter.name"
PREEMPTIBLE_ANNOTATION = "org.charly-arbiter.preemptible"
CRIO_NAME = "io.kubernetes.cri-o.ContainerName"
CRIO_ID = "io.kubernetes.cri-o.ContainerID"
PODMAN_MANAGER = ("io.container.manager", "libpod")
CDI_PREFIX = "cdi.k8s.io/"
STORES = ("containers.json", "volatile-containers.json")
MAX_STORE = 64 << 20
MAX_SPEC = 16 << 20


class SpecError(ArbiterError):
    """The runtime handed the hook something that is not a container's state or spec."""


@dataclass(frozen=True)
class Device:
    path: str  # as the container sees it
    major: int
    minor: int

    @property
    def number(self) -> tuple[int, int]:
        return self.major, self.minor

    def __str__(self) -> str:
        return f"{self.path} ({self.major}:{self.minor})"


@dataclass(frozen=True)
class ContainerFacts:
    id: str
    name: str
    status: str
    pid: int
    bundle: str
    devices: tuple[Device, ...]  # character devices only
    cdi_devices: tuple[str, ...]
    runtime: str  # podman, cri-o, docker, unknown
    preemptible: bool

    @property
    def ref(self) -> Claimant:
        return Claimant.of(HolderKind.CONTAINER, self.name)


def read_facts(state: Any, spec: Any, engine: str | None = None) -> ContainerFacts:
    """The facts of a container from its state and (when readable) its spec; `engine`
    is the engine the hook was installed for, when it says so (the Docker wrapper)."""
    if not isinstance(state, dict):
        raise SpecError("the container state on stdin is not a JSON object")
    container_id = state.get("id")
    if not isinstance(container_id, str) or not container_id or not container_id.isprintable():
        raise SpecError("the container state has no id")
    raw_bundle, raw_pid = state.get("bundle"), state.get("pid")
    bundle = raw_bundle if isinstance(raw_bundle, str) else ""
    pid = raw_pid if isinstance(raw_pid, int) and not isinstance(raw_pid, bool) else 0
    annotations = {**_annotations(spec), **_annotations(state)}
    runtime = engine or _runtime(annotations)
    name = _name(annotations, container_id, bundle)
    try:
        Claimant.of(HolderKind.CONTAINER, name)
    except ArbiterError:
        name = container_id
    return ContainerFacts(
        id=container_id,
        name=name,
        status=str(state.get("status", "")),
        pid=max(pid, 0),
        bundle=bundle,
        devices=_devices(spec),
        cdi_devices=cdi_names(annotations),
        runtime=runtime,
        preemptible=annotations.get(PREEMPTIBLE_ANNOTATION, "true").lower() != "false",
    )


def read_spec(bundle: str) -> Any:
    """The bundle's config.json, or None when it cannot be read (the poststop of a
    runtime that removed it first: the ledger then decides alone)."""
    if not bundle.startswith("/"):
        return None
    try:
        with open(Path(bundle) / "config.json", "rb") as handle:
            data = handle.read(MAX_SPEC + 1)
    except OSError:
        return None
    if len(data) > MAX_SPEC:
        raise SpecError(f"{bundle}/config.json is larger than {MAX_SPEC >> 20} MiB")
    try:
        return json.loads(data)
    except ValueError as error:
        raise SpecError(f"{bundle}/config.json is not JSON: {error}") from None


def cdi_names(annotations: dict[str, str]) -> tuple[str, ...]:
    found: list[str] = []
    for key, value in sorted(annotations.items()):
        if key.startswith(CDI_PREFIX):
            found.extend(part.strip() for part in value.split(",") if part.strip())
    return tuple(dict.fromkeys(found))


def _annotations(document: Any) -> dict[str, str]:
    if not isinstance(document, dict) or not isinstance(document.get("annotations"), dict):
        return {}
    return {
        str(key): value for key, value in document["annotations"].items() if isinstance(value, str)
    }


def _devices(spec: Any) -> tuple[Device, ...]:
    linux = spec.get("linux") if isinstance(spec, dict) else None
    entries = linux.get("devices") if isinstance(linux, dict) else None
    found = []
    for entry in entries if isinstance(entries, list) else []:
        if not isinstance(entry, dict) or entry.get("type") != "c":
            continue
        major, minor = entry.get("major"), entry.get("minor")
        if isinstance(major, int) and isinstance(minor, int) and major >= 0 and minor >= 0:
            found.append(Device(str(entry.get("path", "?")), major, minor))
    return tuple(found)


def _runtime(annotations: dict[str, str]) -> str:
    if annotations.get(PODMAN_MANAGER[0]) == PODMAN_MANAGER[1]:
        return "podman"
    if CRIO_ID in annotations or CRIO_NAME in annotations:
        return "cri-o"
    return "unknown"


def _name(annotations: dict[str, str], container_id: str, bundle: str) -> str:
    for key in (NAME_ANNOTATION, CRIO_NAME):
        if annotations.get(key):
            return annotations[key]
    return _stored_name(container_id, bundle) or container_id


def _stored_name(container_id: str, bundle: str) -> str | None:
    """The first name containers/storage records for the id (`…/ID/userdata` bundles)."""
    path = Path(bundle)
    if not bundle.startswith("/") or path.name != "userdata" or path.parent.name != container_id:
        return None
    for store in STORES:
        try:
            with open(path.parent.parent / store, "rb") as handle:
                entries = json.loads(handle.read(MAX_STORE))
        except (OSError, ValueError):
            continue
        for entry in entries if isinstance(entries, list) else []:
            if isinstance(entry, dict) and entry.get("id") == container_id:
                names = entry.get("names")
                if isinstance(names, list) and names and isinstance(names[0], str):
                    return names[0]
    return None
