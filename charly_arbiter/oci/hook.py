"""`charly-arbiter hook oci [STAGE] [--engine=NAME]`: what a container runtime's OCI hook runs.

The runtime runs it for every container it creates and stops (hooks.d's
`charly-arbiter.json`, `when: always`), so the path for a container that
cannot use a GPU imports `json` and nothing of the arbiter: hooks/oci-hook has
already let through only containers whose spec mentions a character device
or a CDI device; this parses the state and the spec and looks at each
character device in sysfs (`/sys/dev/char/MAJOR:MINOR`) and /proc/devices, so
that a container given /dev/fuse or /dev/net/tun is let go before the
configuration, the ledger or the host are loaded.  Everything after that is
`hookrun`, imported here and only here, unless the resident helper takes it
(`serve`: the same command, with the state read here).

The stage comes from the state's status (`creating`: the prestart hook, a
claim; `stopped`: poststop, a release) unless an argument names it.

Contract (docs/containers.md): nothing on stdout; a claim that is refused
exits non-zero with one or two sentences on stderr, which the runtime shows as
the reason the container did not start; a release always exits 0 and never
waits for the holders it brings back.
"""

from __future__ import annotations

import os
import sys

from charly_arbiter.hookio import guarded, python_with_site, scan_config

MAX_STATE = 1 << 20
MAX_SPEC = 16 << 20  # spec.MAX_SPEC, not imported: the fast path stays light
STAGES = {"prestart": "claim", "createRuntime": "claim", "poststop": "release"}
STATUSES = {"creating": "claim", "created": "claim", "stopped": "release"}
CDI_PREFIX = "cdi.k8s.io/"
GPU_MAJOR_NAMES = ("drm", "nvidia", "nvidia-frontend")  # host/devnodes.GPU_MAJORS
# Where the fast path looks: host/sysfs.HOST_ROOTS, spelled here so that it imports
# nothing (tests/host/test_sysfs.py holds the two equal); tests pass others.
SYS_ROOT = "/sys"
PROC_ROOT = "/proc"
USAGE = "usage: charly-arbiter hook oci [prestart|createRuntime|poststop] [--engine=NAME]"


def main(argv: list[str]) -> int:
    stage, engine = None, None
    for argument in argv:
        if argument.startswith("--engine="):
            engine = argument.partition("=")[2] or None
        elif argument in STAGES:
            stage = STAGES[argument]
        elif argument not in ("oci-hook", "charly-arbiter"):
            print(f"charly-arbiter: {USAGE}", file=sys.stderr)
            return 2
    stages = [stage]  # what _dispatch learns from the state, for the boundary
    return guarded(
        lambda: _dispatch(argv, stages, engine),
        what="the OCI hook",
        lets_go=lambda: stages[-1] == "release",
    )


def _dispatch(argv: list[str], stages: list[str | None], engine: str | None) -> int:
    import json

    raw = sys.stdin.buffer.read(MAX_STATE + 1)
    if len(raw) > MAX_STATE:
        raise _unreadable(f"it is larger than {MAX_STATE >> 20} MiB")
    try:
        state = json.loads(raw)
    except ValueError as error:
        raise _unreadable(f"it is not JSON ({error})") from None
    if not isinstance(state, dict):
        raise _unreadable("it is not a JSON object")
    stage = stages[0] or STATUSES.get(str(state.get("status")))
    stages.append(stage)
    if stage is None:
        return 0  # a stage the arbiter has nothing to do in
    spec = _read_spec(state.get("bundle"))
    if spec is not None and not may_claim(spec, state):
        return 0  # the fast path: no GPU device, no CDI device
    from charly_arbiter.serve.client import forward

    served = forward(["hook", "oci", *argv], raw)
    if served is not None:
        return served
    python_with_site()
    from charly_arbiter.oci import hookrun

    return hookrun.dispatch(stage, state, spec, engine)


def _unreadable(why: str) -> Exception:
    """What the runtime handed on stdin is not a container's state (exit 1: the start
    fails closed, a stop still exits 0)."""
    from charly_arbiter.errors import ArbiterError

    return ArbiterError(f"the container state on stdin cannot be used: {why}")


def _read_spec(bundle: object) -> object:
    if not isinstance(bundle, str) or not bundle.startswith("/"):
        return None
    import json

    try:
        with open(os.path.join(bundle, "config.json"), "rb") as handle:
            data = handle.read(MAX_SPEC + 1)
    except OSError:
        return None  # gone before poststop: the ledger decides
    if len(data) > MAX_SPEC:
        return None
    try:
        return json.loads(data)
    except ValueError:
        return None


def may_claim(
    spec: object,
    state: object,
    sys_root: str = SYS_ROOT,
    config: str | None = None,
    proc_root: str = PROC_ROOT,
) -> bool:
    """Whether the container may be given a GPU; False only when sure it is not.

    Sure means: no CDI device in its annotations, and each character device is
    neither under a PCI function in sysfs nor a node of a GPU driver's major,
    and the host is not simulated (its GPUs' nodes are not in sysfs).
    """
    for document in (spec, state):
        annotations = document.get("annotations") if isinstance(document, dict) else None
        if isinstance(annotations, dict) and any(
            str(key).startswith(CDI_PREFIX) for key in annotations
        ):
            return True
    numbers = _char_devices(spec)
    if not numbers:
        return False
    if _simulated(config):
        return True
    majors = None
    for major, minor in numbers:
        if _under_pci(f"{sys_root}/dev/char/{major}:{minor}"):
            return True
        if majors is None:
            majors = _gpu_majors(proc_root)
        if major in majors:
            return True
    return False


def _char_devices(spec: object) -> list[tuple[int, int]]:
    linux = spec.get("linux") if isinstance(spec, dict) else None
    entries = linux.get("devices") if isinstance(linux, dict) else None
    found = []
    for entry in entries if isinstance(entries, list) else []:
        if isinstance(entry, dict) and entry.get("type") == "c":
            major, minor = entry.get("major"), entry.get("minor")
            if isinstance(major, int) and isinstance(minor, int):
                found.append((major, minor))
    return found


def _under_pci(link: str) -> bool:
    try:
        target = os.path.realpath(link, strict=True)
    except OSError:
        return False
    return any(_is_pci_address(part) for part in target.split("/"))


def _is_pci_address(part: str) -> bool:
    """`0000:0a:00.0`: core/pci.py's grammar without importing re (a domain of 4 to 8
    hex digits, a device 00 to 1f, a function 0 to 7, lower case); the test of the
    grammars, tests/core/test_pci_grammars.py, holds both to the same verdicts."""
    domain, _, rest = part.partition(":")
    bus, _, rest = rest.partition(":")
    slot, _, function = rest.partition(".")
    hexdigits = "0123456789abcdef"
    return (
        4 <= len(domain) <= 8
        and len(bus) == 2
        and len(slot) == 2
        and slot[0] in "01"
        and len(function) == 1
        and all(c in hexdigits for c in domain + bus + slot)
        and function in "01234567"
    )


def _gpu_majors(proc_root: str) -> set[int]:
    try:
        with open(f"{proc_root}/devices") as handle:
            text = handle.read()
    except OSError:
        return set()
    majors = set()
    for line in text.partition("Block devices:")[0].splitlines():
        number, _, name = line.strip().partition(" ")
        if number.isdigit() and name.strip() in GPU_MAJOR_NAMES:
            majors.add(int(number))
    return majors


def _simulated(config: str | None) -> bool:
    """Whether the configured host is simulated (`sim:DIR`): its nodes are its own files."""
    scan = scan_config(config)
    return scan is None or scan[0]
