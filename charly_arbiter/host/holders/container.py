"""Containers as holders: listed in arbiter.toml, or claimed by the OCI hook.

A listed container (`[[holders]] kind = "container"`) names its runtime
(podman by default).  A container the OCI hook claimed a GPU for leaves a
*claim record* under the state directory (`containers/`): its name, the
runtime's id, the tokens, the runtime, and its init process (pid and start
time).  The record is what makes such a container a holder the arbiter knows:

- whether it runs is whether that very process lives, so the runtime is never
  asked about a container it may hold locked (Podman keeps a container locked
  while its hooks run; `podman inspect` of it from there waits until the hook
  is killed: measured);
- its processes are told by their cgroup, which names the runtime's id;
- stopping and starting it again go through the runtime it was claimed under.

A container whose own hook runs now (a marker, as for libvirt domains) counts
as running and is never stopped, started or queried meanwhile.  The CLI is run
by absolute path with an argv list and `--` before the container name; whether
a container runs is read from its exit status and a fixed Go template, never
from localized text.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

from charly_arbiter.core import files
from charly_arbiter.core.config import Config, HolderConfig
from charly_arbiter.core.host import Holder, TokenSpec
from charly_arbiter.core.model import Claimant, HolderKind, ProcessRef
from charly_arbiter.errors import CommandFailed, HolderError
from charly_arbiter.host import run
from charly_arbiter.host.holders import listed_holders
from charly_arbiter.host.markers import ACTING_DIR, in_hook, marked
from charly_arbiter.host.procscan import process_alive
from charly_arbiter.host.sysfs import HOST_ROOTS, Roots

log = logging.getLogger(__name__)

KIND = HolderKind.CONTAINER
RECORD_DIR = "containers"
STOPPABLE = ("podman", "docker")  # runtimes whose CLI stops and starts a container


@dataclass(frozen=True)
class ClaimRecord:
    """A container the OCI hook claimed for (see the module docstring)."""

    name: str
    id: str
    tokens: tuple[str, ...]
    runtime: str  # podman, docker, cri-o or unknown
    pid: int
    start: int
    preemptible: bool = True

    @property
    def ref(self) -> Claimant:
        return Claimant.of(KIND, self.name)

    @property
    def process(self) -> ProcessRef:
        return ProcessRef(self.pid, self.start)


def write_record(state_dir: Path, record: ClaimRecord) -> None:
    directory = state_dir / RECORD_DIR
    directory.mkdir(mode=0o700, parents=True, exist_ok=True)
    path = directory / _record_name(record.id)
    files.replace_file(
        path,
        json.dumps(asdict(record), sort_keys=True).encode(),
        temp=path.with_suffix(f".{os.getpid()}.tmp"),
        durable=False,
    )


def forget_record(state_dir: Path, container_id: str) -> None:
    (state_dir / RECORD_DIR / _record_name(container_id)).unlink(missing_ok=True)


def read_records(state_dir: Path) -> dict[str, ClaimRecord]:
    """Every claim record, by container name (an unreadable one is skipped, and said)."""
    found: dict[str, ClaimRecord] = {}
    directory = state_dir / RECORD_DIR
    try:
        paths = sorted(directory.glob("*.json"))
    except OSError:
        return found
    for path in paths:
        try:
            data = json.loads(path.read_text())
            record = ClaimRecord(**{**data, "tokens": tuple(data["tokens"])})
            found[record.name] = record
        except (OSError, ValueError, TypeError, KeyError) as error:
            log.warning("%s: ignored, not a claim record: %s", path, error)
    return found


def _record_name(container_id: str) -> str:
    """A file name that never carries the runtime's (untrusted) id itself."""
    return hashlib.sha256(container_id.encode()).hexdigest()[:32] + ".json"


class ContainerHolders:
    kind = KIND

    def __init__(
        self,
        config: Config,
        programs: dict[str, str] | None = None,
        subject: str | None = None,
        roots: Roots = HOST_ROOTS,
    ) -> None:
        """`subject` is the container whose OCI hook this process runs in (None outside one)."""
        self.config = config
        self.programs = programs or {}
        self.subject = subject or None
        self.roots = roots
        self.listed = {h.ref: h for h in config.holders if h.ref.kind == KIND}
        self._ids: dict[str, str] = {}  # listed container name -> the runtime's id

    def records(self) -> dict[str, ClaimRecord]:
        """Read each time: a container started meanwhile has written a new one."""
        return read_records(self.config.state_dir)

    # -- HolderSource -----------------------------------------------------------------

    def holders(self, tokens: Sequence[TokenSpec]) -> list[Holder]:
        found = listed_holders(self.listed.values(), tokens, self.is_running, self._how)
        names = {token.name for token in tokens}
        for record in read_records(self.config.state_dir).values():
            held = tuple(token for token in record.tokens if token in names)
            if not held or record.ref in self.listed:
                continue
            found.append(
                Holder(
                    ref=record.ref,
                    tokens=held,
                    preemptible=record.preemptible and record.runtime in STOPPABLE,
                    running=self.is_running(record.ref),
                    how=f"{record.runtime} stop",
                    detail=f"claimed by its OCI hook ({record.runtime})",
                )
            )
        return found

    def is_running(self, ref: Claimant) -> bool:
        name = _name(ref)
        if name == self.subject or in_hook(self.config.state_dir, ref):
            return True  # its own hook runs: the runtime holds it locked, it is starting
        record = self.records().get(name)
        if record is not None:
            return process_alive(self.roots.proc, record.process)
        program, name = self._target(ref, "query")
        result = run.run(
            [program, "container", "inspect", "--format", "{{.State.Running}} {{.Id}}", "--", name],
            check=False,
            timeout=self.config.timeouts.holder_stop,
        )
        running, _, container_id = result.stdout.strip().partition(" ")
        if result.returncode == 0 and container_id:
            self._ids[name] = container_id
        return result.returncode == 0 and running == "true"

    def stop(self, ref: Claimant) -> None:
        self._refuse_subject(ref, "stop")
        program, name = self._target(ref, "stop")
        grace = str(max(1, int(self.config.timeouts.holder_stop) - 5))
        with marked(self.config.state_dir, ACTING_DIR, ref):
            self._run(ref, "stop", [program, "stop", "--time", grace, "--", name])

    def start(self, ref: Claimant) -> None:
        self._refuse_subject(ref, "start")
        program, name = self._target(ref, "start")
        with marked(self.config.state_dir, ACTING_DIR, ref):
            self._run(ref, "start", [program, "start", "--", name])

    # -- processes ----------------------------------------------------------------------

    def cgroup_owner(self, paths: Sequence[str]) -> Claimant | None:
        """The container whose id a cgroup path names (`libpod-ID.scope`, `docker-ID`,
        `/docker/ID`): claimed ones by their record, listed ones by the runtime's id."""
        ids = {record.id: record.ref for record in self.records().values()}
        for ref in self.listed:
            if ref.name in self._ids:
                ids[self._ids[ref.name]] = ref
        for path in paths:
            for part in path.split("/"):
                for container_id, ref in ids.items():
                    if len(container_id) >= 12 and container_id in part:
                        return ref
        return None

    # -- the runtime's CLI ----------------------------------------------------------------

    def _how(self, entry: HolderConfig) -> str:
        return "drain" if entry.drains_only else f"{entry.runtime} stop"

    def _run(self, ref: Claimant, action: str, argv: list[str]) -> None:
        timeout = self.config.timeouts.holder_stop + 5
        try:
            run.run(argv, timeout=timeout)
        except CommandFailed as error:
            raise HolderError(ref, action, str(error)) from error

    def _refuse_subject(self, ref: Claimant, action: str) -> None:
        if _name(ref) == self.subject:
            raise HolderError(ref, action, "it is the container this hook runs for")
        if in_hook(self.config.state_dir, ref):
            raise HolderError(ref, action, "its own OCI hook is running; try again")

    def _target(self, ref: Claimant, action: str) -> tuple[str, str]:
        name = _name(ref)
        listed: HolderConfig | None = self.listed.get(ref)
        record = self.records().get(name)
        runtime = listed.runtime if listed else (record.runtime if record else "podman")
        if runtime not in STOPPABLE:
            raise HolderError(
                ref, action, f"it runs under {runtime}, which the arbiter cannot {action}"
            )
        program = self.programs.get(runtime) or run.which(runtime)
        if program is None:
            raise HolderError(ref, action, f"{runtime} is not installed")
        return program, name


def _name(ref: str) -> str:
    claimant = Claimant.parse(ref)
    if claimant.kind != KIND:
        raise HolderError(ref, "handle", "it is not a container")
    return claimant.name
