"""`mig TOKEN on|off|layout P,...`: a GPU's MIG mode or layout, changed by the arbiter.

NVML refuses a change while any process uses the GPU (mig-parted#181: nvidia_drm
counts too), and a layout change destroys the instances the containers run on.
So the change is an exclusive claim of the arbiter's own (`arbiter:mig/TOKEN`)
that leaves the GPU on its driver (`in_place`): the claim stops or drains every
holder and preempts every shared lease on the GPU (a container on one of its
MIG instances holds the GPU), exactly as a VM's claim would, the lease in the
ledger first; the change runs with the lock let go; then the claim is released
and everything it stopped comes back, with its shared lease, as after a VM.
No second mechanism: a crash in the middle leaves a stranded lease, and
`restore` brings everyone back.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

from charly_arbiter.core.arbiter import Arbiter
from charly_arbiter.core.crashpoints import crashpoint
from charly_arbiter.core.events import EventKind
from charly_arbiter.core.host import MigChange, MigState
from charly_arbiter.core.model import Claimant, Mode, operation_claimant
from charly_arbiter.errors import ArbiterError, MigInvalid, cli_command

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigDone:
    token: str
    before: MigState
    after: MigState
    stopped: tuple[Claimant, ...]  # what made room, and came back


def mig_state(arbiter: Arbiter, token_name: str) -> MigState:
    """The token's GPU's MIG state, or `MigInvalid` (exit 2) saying why it has none."""
    [spec] = arbiter.tokens.resolve([token_name])
    state = arbiter.host.mig(spec)
    if state is None:
        why = getattr(arbiter.host, "mig_error", "") or "NVML says it has no MIG"
        raise MigInvalid(
            token_name,
            f"{spec.address} has no MIG mode ({why})",
            hint=f"{cli_command('detect')} shows the GPUs and what NVML says of them",
        )
    return state


def change_mig(arbiter: Arbiter, token_name: str, change: MigChange) -> MigDone:
    """Change the mode or the layout, making room first and bringing everyone back."""
    before = mig_state(arbiter, token_name)
    if change.layout is not None and not before.enabled:
        raise MigInvalid(
            token_name,
            "MIG mode is off: a layout needs it on",
            hint=f"run {cli_command('mig', operands=[token_name, 'on'])} first",
        )
    ours = operation_claimant("mig", token_name)
    plan = arbiter.acquire(ours, Mode.EXCLUSIVE, [token_name], in_place=True)
    arbiter.events.emit(EventKind.MIG, claimant=ours, token=token_name, change=str(change))
    try:
        crashpoint("mig.change")
        [spec] = arbiter.tokens.reread([token_name])
        after = arbiter.host.set_mig(spec, change)
    finally:
        # What it stopped comes back whether the change worked or not (NVML's refusal
        # is the operator's to read, never a reason to keep a service down).
        try:
            arbiter.release_claimant(ours, force=True)
        except ArbiterError as error:
            log.error("%s: bringing back what the MIG change stopped failed: %s", token_name, error)
    arbiter.events.emit(EventKind.MIG_DONE, claimant=ours, token=token_name, change=str(change))
    return MigDone(token_name, before, after, tuple(step.holder for step in plan.stops))
