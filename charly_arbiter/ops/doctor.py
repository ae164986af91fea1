"""`doctor`'s checks of the host: one line each, with what to do.

The checks read the host through the same layers as everything else (`detect`
for PCI and IOMMU facts, the ledger, the arbiter's idea of who is stranded);
`cli/doctor.py` only prints them.  A layer above adds its own group (libvirt's
reachability) through `run_checks(more=...)`.
"""

from __future__ import annotations

import contextlib
import errno
import os
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path

from charly_arbiter.core import files
from charly_arbiter.core.arbiter import Arbiter, rollback_found
from charly_arbiter.core.config import Config
from charly_arbiter.core.events import EventKind
from charly_arbiter.core.host import Host
from charly_arbiter.core.model import VFIO, LedgerState, SleepPolicy, human_time
from charly_arbiter.core.planner import unaccounted, unaccounted_hint
from charly_arbiter.errors import ArbiterError, TokensOverlap, cli_command
from charly_arbiter.host import run
from charly_arbiter.host.detect import FunctionInfo, detect, group_problems
from charly_arbiter.host.draining import machine
from charly_arbiter.host.local import NVIDIA_VENDOR, LocalHost
from charly_arbiter.host.sysfs import BRIDGE_CLASS
from charly_arbiter.ops.history import HistoryLog, Record, last_holder

HOOK_PATH = Path("/etc/libvirt/hooks/qemu.d/charly-arbiter")


class Level(StrEnum):
    OK = "ok"
    WARNING = "warning"
    PROBLEM = "problem"


@dataclass(frozen=True)
class Check:
    name: str
    level: Level
    message: str
    fix: str = ""


def host_checks(
    config: Config, host: Host, vm_memory: int, merged: Collection[str] = ()
) -> list[Check]:
    """IOMMU, vfio-pci, each token's group, nvidia-ctk and memlock (local host only).
    `merged` are GPUs that are part of another GPU's token (no configuration, one
    IOMMU group): they are checked as that token's group, not as tokens of their own."""
    local = machine(host)
    if not isinstance(local, LocalHost):
        return [Check("host", Level.WARNING, f"{host.description} is simulated; PCI not checked")]
    found = detect(local, vm_memory)
    v = found.vfio
    checks = [
        Check("iommu", Level.OK, f"IOMMU on ({v.iommu_groups} groups)")
        if v.iommu_on
        else Check(
            "iommu",
            Level.PROBLEM,
            "the IOMMU is off (no IOMMU groups)",
            "enable VT-d/AMD-Vi in the firmware and boot with intel_iommu=on or amd_iommu=on",
        ),
        Check("vfio-pci", Level.OK, f"vfio-pci is {v.vfio_pci}")
        if v.vfio_pci != "missing"
        else Check(
            "vfio-pci",
            Level.PROBLEM,
            "the vfio-pci module is not available",
            "install a kernel with vfio-pci",
        ),
    ]
    functions = {f.address: f for f in found.functions}
    wanted = [(t.name, t.address) for t in config.tokens] or [
        (g.address, g.address) for g in found.gpus if g.address not in merged
    ]
    for name, address in wanted:
        function = functions.get(address)
        if function is None:
            checks.append(
                Check(
                    f"token {name}",
                    Level.PROBLEM,
                    f"there is no PCI device {address}",
                    f"fix the token's address in arbiter.toml (see {cli_command('detect')})",
                )
            )
            continue
        problems = group_problems(functions, function)
        members = [function, *(functions[a] for a in function.group_members if a in functions)]
        resets = reset_check(name, members)
        if resets is not None:
            checks.append(resets)
        group = ", ".join((address, *function.group_members))
        checks.append(
            Check(
                f"token {name}",
                Level.OK,
                f"{address} present, group {function.iommu_group} ({group}) viable for passthrough",
            )
            if not problems
            else Check(
                f"token {name}",
                Level.PROBLEM,
                f"{address}: group not viable: {'; '.join(problems)}",
                "put the GPU in another slot, or enable ACS, so that its group holds only it",
            )
        )
    if any(f.vendor == NVIDIA_VENDOR for f in functions.values() if f.pci_class.startswith("03")):
        if run.which("nvidia-ctk"):
            checks.append(Check("nvidia-ctk", Level.OK, "nvidia-ctk is installed"))
            cdi_tokens = {t.name for t in config.tokens if t.cdi} or {n for n, _ in wanted}
            records = HistoryLog(config.state_dir).read().records
            checks.append(cdi_check(local.cdi_spec, cdi_tokens, records))
        else:
            checks.append(
                Check(
                    "nvidia-ctk",
                    Level.WARNING,
                    "NVIDIA GPUs are present but nvidia-ctk is not: no CDI spec is regenerated",
                    "install nvidia-container-toolkit",
                )
            )
    memlock = f"RLIMIT_MEMLOCK {'unlimited' if v.memlock_soft is None else v.memlock_soft}"
    checks.append(
        Check("memlock", Level.OK, f"{memlock}, enough for a {vm_memory // 2**20} MiB VM")
        if v.memlock_enough
        else Check(
            "memlock",
            Level.WARNING,
            f"{memlock} bytes is less than a {vm_memory // 2**20} MiB VM pins",
            "libvirt raises it for <hostdev>; other launchers need `ulimit -l` or LimitMEMLOCK=",
        )
    )
    return checks


def sleep_check(policy: SleepPolicy, host: Host) -> Check:
    """Whether the host can keep itself from suspending while a GPU is passed through
    (a logind inhibitor lock held by a transient unit: host/inhibit.py)."""
    if policy is SleepPolicy.ALLOW:
        return Check(
            "sleep",
            Level.OK,
            'sleep = "allow": the host may suspend while a GPU is passed through',
        )
    problem = host.sleep_lock_unavailable()
    if problem is not None:
        return Check(
            "sleep",
            Level.WARNING,
            f"sleep cannot be blocked while a GPU is passed through: {problem}; VMs start "
            "all the same, and the host may suspend under them",
            "run systemd with logind (systemd-run, systemd-inhibit), or set "
            '`sleep = "allow"` in arbiter.toml to accept it',
        )
    return Check(
        "sleep",
        Level.OK,
        "sleep is blocked while a GPU is passed through (a logind inhibitor lock)",
    )


def reset_check(token: str, members: Sequence[FunctionInfo]) -> Check | None:
    """Whether the kernel can reset the token's functions between two guests (a GPU
    without one carries a guest's state into the next, and may not start again).
    None when this kernel does not say (no `reset_method`, before Linux 5.15)."""
    known = {
        f.address: f.reset_method
        for f in members
        if f.reset_method is not None and not f.pci_class.startswith(BRIDGE_CLASS)
    }
    if not known:
        return None
    none = sorted(address for address, method in known.items() if not method)
    if none:
        return Check(
            f"reset {token}",
            Level.WARNING,
            f"{', '.join(none)} cannot be reset by the kernel (no reset method)",
            "a guest may leave it in a state the next one cannot start from: prefer a slot "
            "or card with FLR, or power the host off and on between guests",
        )
    methods = sorted({m for method in known.values() for m in method.split()})
    return Check(f"reset {token}", Level.OK, f"every function can be reset ({', '.join(methods)})")


def cdi_check(spec: Path, tokens: set[str], records: Sequence[Record]) -> Check:
    """Whether the CDI spec exists and was written after the last switch of a token
    it describes: one older than that lists a GPU that left, or lacks one that came back."""
    fix = f"run `nvidia-ctk cdi generate --output={spec}`"
    try:
        written = datetime.fromtimestamp(spec.stat().st_mtime).astimezone()
    except OSError:
        return Check(
            "cdi", Level.WARNING, f"there is no CDI spec at {spec}: CDI containers get no GPU", fix
        )
    switches = [r for r in records if r.kind == EventKind.SWITCHED and set(r.tokens) & tokens]
    last = switches[-1] if switches else None
    if last is not None and written < last.time:
        return Check(
            "cdi",
            Level.WARNING,
            f"the CDI spec {spec} ({human_time(written)}) is older than the last switch "
            f"of {', '.join(last.tokens)} ({human_time(last.time)})",
            fix,
        )
    since = f", after the last switch ({human_time(last.time)})" if last else ""
    return Check("cdi", Level.OK, f"CDI spec {spec} written {human_time(written)}{since}")


def hook_check(path: Path) -> Check:
    if path.is_file() and os.access(path, os.X_OK):
        return Check("hook", Level.OK, f"{path} is installed")
    return Check(
        "hook",
        Level.WARNING,
        f"{path} is not installed: libvirt VMs will not claim GPUs",
        f"install hooks/qemu as {path} (executable) and restart libvirtd",
    )


def ledger_checks(arbiter: Arbiter, history: Sequence[Record] = ()) -> list[Check]:
    """The ledger: it verifies, it is not behind the history, nothing is poisoned or
    stranded, and the host agrees with it (`token_checks`)."""
    recorded = arbiter.history_generation()  # (before the ledger, as the arbiter reads them)
    reading = arbiter.ledger.inspect()
    if reading.corrupt is not None:
        return [Check("ledger", Level.PROBLEM, str(reading.corrupt), reading.corrupt.hint or "")]
    state = reading.state
    assert state is not None
    if recorded > state.generation:
        checks = [
            Check(
                "ledger",
                Level.PROBLEM,
                rollback_found(state.generation, recorded),
                f"run {cli_command('recover')} to compare what the history says it held with "
                f"the host, then {cli_command('recover', '--yes')} to continue from it",
            )
        ]
    else:
        checks = [Check("ledger", Level.OK, f"ledger healthy (generation {state.generation})")]
    for token, poison in state.poisoned:
        checks.append(
            Check(
                f"poison {token}",
                Level.PROBLEM,
                f"{token} is poisoned since {human_time(poison.since)}: {poison.reason}",
                f"check the GPU by hand, then {cli_command('poison', 'clear', operands=[token])}",
            )
        )
    if not state.poisoned:
        checks.append(Check("poison", Level.OK, "no token is poisoned"))
    stranded = sorted(arbiter.stranded_claimants(state))
    checks.append(
        Check(
            "stranded",
            Level.PROBLEM,
            f"stranded leases: {', '.join(stranded)}",
            f"run {cli_command('restore', '--stranded')}",
        )
        if stranded
        else Check("stranded", Level.OK, "no stranded leases")
    )
    return checks + token_checks(arbiter, state, history)


def token_checks(arbiter: Arbiter, state: LedgerState, history: Sequence[Record]) -> list[Check]:
    """Tokens that overlap (one GPU, two owners), GPUs made one token because they share
    a group, and GPUs on vfio-pci: a token's that nothing in the ledger accounts for is
    a problem; one kept there on purpose (`adopt --admin`), or one no token claims (an
    administrator's, bound at boot), is left alone."""
    try:
        specs = arbiter.tokens.all()
    except TokensOverlap as error:
        return [Check("tokens", Level.PROBLEM, error.why, error.hint or "")]
    checks = [
        Check(
            f"token {token}",
            Level.WARNING,
            f"{gpu} shares IOMMU group with {token}: they are one token, {token}, and are "
            "claimed, switched and passed through together",
            "name the token in arbiter.toml ([tokens.NAME] with the first GPU's address), "
            "or move one GPU to a slot with a group of its own",
        )
        for gpu, token in sorted(arbiter.tokens.merged.items())
    ]
    for name, spec in specs.items():
        lost = unaccounted(state, spec)
        if not lost:
            continue
        story = last_holder(history, name)
        fix = unaccounted_hint(name)
        if story is not None:
            fix = (
                f"the history says {story.claimant} holds it since {human_time(story.since)}: "
                f"run {cli_command('adopt', operands=[name, story.claimant])} if it still uses it, "
                f"otherwise {cli_command('send-home', operands=[name])}"
            )
        checks.append(
            Check(
                f"token {name}",
                Level.PROBLEM,
                f"{', '.join(lost)} on vfio-pci, and no lease or poison in the ledger accounts "
                "for it: nothing acts on it until you decide",
                fix,
            )
        )
    bound = sorted(
        name
        for name in specs
        if (home := state.home_of(name)) and all(driver == VFIO for driver in home.values())
    )
    checks += [
        Check(f"token {name}", Level.OK, f"{name} stays on vfio-pci on purpose (adopt --admin)")
        for name in bound
    ]
    claimed = {f.address for spec in specs.values() for f in spec.functions}
    try:
        outside = [g for g in arbiter.host.gpus() if g.address not in claimed and g.driver == VFIO]
    except ArbiterError:
        outside = []
    checks += [
        Check(
            f"gpu {gpu.address}",
            Level.OK,
            f"{gpu.address} is on vfio-pci and no token claims it: the arbiter leaves it alone",
        )
        for gpu in outside
    ]
    return checks


def run_checks(
    arbiter: Arbiter,
    vm_memory: int,
    hook: Path,
    more: Sequence[Callable[[], list[Check]]] = (),
) -> list[Check]:
    """Every check, in order; `more` are groups from the layers above (libvirt's)."""
    checks: list[Check] = []
    with contextlib.suppress(ArbiterError):
        arbiter.tokens.all()  # (which GPUs share a token; an overlap is checked below)
    history = HistoryLog(arbiter.config.state_dir).read().records
    groups: list[Callable[[], list[Check]]] = [
        lambda: host_checks(arbiter.config, arbiter.host, vm_memory, arbiter.tokens.merged),
        lambda: [hook_check(hook)],
        lambda: [sleep_check(arbiter.config.sleep, arbiter.host)],
        lambda: ledger_checks(arbiter, history),
        *more,
    ]
    for group in groups:
        try:
            checks.extend(group())
        except ArbiterError as error:
            checks.append(Check("doctor", Level.PROBLEM, str(error), error.hint or ""))
    return checks


# -- the state directory's writability (issue 17) -----------------------------------------

PROBE_BYTES = 4096  # about one ledger generation


def state_dir_check(state_dir: Path) -> Check:
    """Whether the arbiter can write its state directory, by doing it: a probe file
    created, written, fsynced and removed there (permissions and the mount flags
    say nothing of a full filesystem, an immutable or append-only attribute, or a
    security module's rule).  A directory not made yet is judged by the one it will
    be made in, without writing there."""
    existing = state_dir
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    if existing != state_dir:
        read_only = bool(os.statvfs(existing).f_flag & os.ST_RDONLY)
        if read_only or not os.access(existing, os.W_OK | os.X_OK):
            code = errno.EROFS if read_only else errno.EACCES
            why, fix = files.describe_os_error(existing, OSError(code, os.strerror(code)))
            return Check("state dir", Level.PROBLEM, f"{state_dir} cannot be created: {why}", fix)
        return Check("state dir", Level.OK, f"{state_dir} will be created in {existing}")
    probe = state_dir / f".doctor-probe-{os.getpid()}"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            files.write_all(fd, bytes(PROBE_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
            probe.unlink(missing_ok=True)
    except OSError as error:
        why, fix = files.describe_os_error(state_dir, error)
        return Check("state dir", Level.PROBLEM, f"{state_dir} cannot be written: {why}", fix)
    return Check("state dir", Level.OK, f"{state_dir} is writable")
