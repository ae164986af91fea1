"""`doctor`'s checks of the host: one line each, with what to do.

The checks read the host through the same layers as everything else (`detect`
for PCI and IOMMU facts, the ledger, the arbiter's idea of who is stranded);
`cli/doctor.py` only prints them.  A layer above adds its own group (libvirt's
reachability) through `run_checks(more=...)`.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import datetime
from enum import StrEnum
from pathlib import Path

from charly_arbiter.core import files
from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.config import Config
from charly_arbiter.core.host import Host
from charly_arbiter.errors import ArbiterError, cli_command
from charly_arbiter.host import run
from charly_arbiter.host.detect import FunctionInfo, detect, group_problems
from charly_arbiter.host.local import NVIDIA_VENDOR, LocalHost
from charly_arbiter.host.sysfs import BRIDGE_CLASS
from charly_arbiter.ops.history import HistoryLog, Record

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


def host_checks(config: Config, host: Host, vm_memory: int) -> list[Check]:
    """IOMMU, vfio-pci, each token's group, nvidia-ctk and memlock (local host only)."""
    if not isinstance(host, LocalHost):
        return [Check("host", Level.WARNING, f"{host.description} is simulated; PCI not checked")]
    found = detect(host, vm_memory)
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
        (g.address, g.address) for g in found.gpus
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
            checks.append(cdi_check(host.cdi_spec, cdi_tokens, records))
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
    switches = [r for r in records if r.kind == "switched" and set(r.tokens) & tokens]
    last = switches[-1] if switches else None
    if last is not None and written < last.time:
        return Check(
            "cdi",
            Level.WARNING,
            f"the CDI spec {spec} ({written:%Y-%m-%d %H:%M:%S}) is older than the last switch "
            f"of {', '.join(last.tokens)} ({last.time:%Y-%m-%d %H:%M:%S})",
            fix,
        )
    since = f", after the last switch ({last.time:%Y-%m-%d %H:%M:%S})" if last else ""
    return Check("cdi", Level.OK, f"CDI spec {spec} written {written:%Y-%m-%d %H:%M:%S}{since}")


def hook_check(path: Path) -> Check:
    if path.is_file() and os.access(path, os.X_OK):
        return Check("hook", Level.OK, f"{path} is installed")
    return Check(
        "hook",
        Level.WARNING,
        f"{path} is not installed: libvirt VMs will not claim GPUs",
        f"install hooks/qemu as {path} (executable) and restart libvirtd",
    )


def ledger_checks(arbiter: Arbiter) -> list[Check]:
    reading = arbiter.ledger.inspect()
    if reading.corrupt is not None:
        return [Check("ledger", Level.PROBLEM, str(reading.corrupt), reading.corrupt.hint or "")]
    state = reading.state
    assert state is not None
    checks = [Check("ledger", Level.OK, f"ledger healthy (generation {state.generation})")]
    for token, poison in state.poisoned:
        checks.append(
            Check(
                f"poison {token}",
                Level.PROBLEM,
                f"{token} is poisoned since {poison.since}: {poison.reason}",
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
    return checks


def run_checks(
    arbiter: Arbiter,
    vm_memory: int,
    hook: Path,
    more: Sequence[Callable[[], list[Check]]] = (),
) -> list[Check]:
    """Every check, in order; `more` are groups from the layers above (libvirt's)."""
    checks: list[Check] = []
    groups: list[Callable[[], list[Check]]] = [
        lambda: host_checks(arbiter.config, arbiter.host, vm_memory),
        lambda: [hook_check(hook)],
        lambda: ledger_checks(arbiter),
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
