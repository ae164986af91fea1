"""The arbiter's rules, as pure functions from (ledger, host snapshot) to a plan.

`acquire`, `plan` and `status` all decide here; executing a plan is the
arbiter's job.  Nothing in this module performs I/O, so every rule can be
tested over every pair of states.
"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field, replace

from charly_arbiter.core.events import a_or_an
from charly_arbiter.core.host import (
    NO_DRIVER,
    Blocker,
    DeviceUser,
    Holder,
    ScreenUse,
    TokenSpec,
)
from charly_arbiter.core.model import (
    SCREEN_KINDS,
    VFIO,
    Claimant,
    HolderKind,
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    ScreenPolicy,
    StepState,
    StoppedHolder,
    blocks_token,
    human_time,
    user_unit,
)
from charly_arbiter.core.vfs import refuse_by_relation
from charly_arbiter.core.vgpu import vgpu_target_of
from charly_arbiter.errors import (
    ClaimRefused,
    PassthroughImpossible,
    ScreenInUse,
    TokenPoisoned,
    TokenUnaccounted,
    cli_command,
)


@dataclass(frozen=True)
class Switch:
    token: str
    address: str
    from_driver: str | None
    to_driver: str  # NO_DRIVER means "whatever the kernel binds, not vfio-pci"


@dataclass(frozen=True)
class StopStep:
    holder: Claimant
    how: str
    shared_tokens: tuple[str, ...] = ()  # set when the holder is a shared claimant
    tokens: tuple[str, ...] = ()  # the tokens it uses (where it must not come back)


@dataclass(frozen=True)
class ClaimPlan:
    """Everything an acquire will do, decided before anything is done."""

    claimant: Claimant
    mode: Mode
    tokens: tuple[str, ...]
    transient: bool
    stops: tuple[StopStep, ...] = ()
    switches: tuple[Switch, ...] = ()
    preempted_leases: tuple[Claimant, ...] = ()  # shared claimants whose leases move into this one
    # Holders stopped by other leases that this one now keeps stopped: those of
    # the preempted leases, and those a releasing lease has not started yet but
    # which use a token this claim takes (it brings them back instead).
    inherited: tuple[StoppedHolder, ...] = ()
    # (lease, holder) records taken from releasing leases
    taken_over: tuple[tuple[Claimant, Claimant], ...] = ()
    homes: Mapping[str, Mapping[str, str]] = field(default_factory=dict)
    cdi_tokens: tuple[str, ...] = ()
    already_held: bool = False
    # Who uses the screens of the tokens an exclusive claim passes through (those that
    # drive one): what `screen = "release"` stops, and what `plan` shows.
    screens: Mapping[str, ScreenUse] = field(default_factory=dict)

    @property
    def switched_tokens(self) -> tuple[str, ...]:
        return tuple(dict.fromkeys(switch.token for switch in self.switches))


@dataclass(frozen=True)
class Policy:
    """What the configuration allows the planner to stop."""

    refuse_kinds: frozenset[HolderKind] = frozenset()  # preemptible ones of these still refuse
    refuse_hint: str = ""


NO_POLICY = Policy()


def home_map(ledger: LedgerState, token: TokenSpec) -> dict[str, str]:
    """Each function's home driver: as recorded, else as seen now (never vfio-pci),
    else as configured, else the one this host would bind it to by itself."""
    recorded = ledger.home_of(token.name)
    home: dict[str, str] = {}
    for function in token.functions:
        if recorded.get(function.address):
            home[function.address] = recorded[function.address]
        elif function.driver and function.driver != VFIO:
            home[function.address] = function.driver
        elif function.address == token.address and token.home_driver:
            home[function.address] = token.home_driver
        elif function.default_driver:
            home[function.address] = function.default_driver
        else:
            home[function.address] = recorded.get(function.address, NO_DRIVER)
    return home


def unaccounted(ledger: LedgerState, token: TokenSpec) -> tuple[str, ...]:
    """The token's functions on vfio-pci that nothing in the ledger accounts for.

    A function is on vfio-pci rightly while an exclusive lease lists its token (in
    any state: acquiring, active, or releasing it), while the token is poisoned (a
    switch that failed left it there), or when its recorded home is vfio-pci (an
    operator's `adopt --admin`: bound there on purpose).  Anything else is the
    host contradicting the ledger (I2): a lease was lost with a deleted or replaced
    ledger, or something outside the arbiter bound it.  Empty when all is well.
    """
    # (an NVIDIA vGPU VF with a type set is given to a VM as one on vfio-pci is)
    on_vfio = [
        f.address
        for f in token.functions
        if f.driver == VFIO or (f.vgpu is not None and f.vgpu.current)
    ]
    if not on_vfio or ledger.poison_of(token.name) is not None:
        return ()
    if any(lease.mode is Mode.EXCLUSIVE for lease in ledger.leases_on(token.name)):
        return ()
    home = ledger.home_of(token.name)
    return tuple(address for address in on_vfio if home.get(address) != VFIO)


def unaccounted_hint(token: str) -> str:
    """What an operator does about a token `unaccounted` names: look, then decide."""
    return (
        f"run {cli_command('explain', operands=[token])} to see what the history says, then "
        f"{cli_command('adopt', operands=[token, 'KIND:NAME'])} for whoever uses it, "
        f"{cli_command('adopt', '--admin', operands=[token])} if it is bound there on purpose, "
        f"or {cli_command('send-home', operands=[token])}"
    )


def overlapping(
    ledger: LedgerState,
    token: TokenSpec,
    coverage: Mapping[str, Collection[str]],
) -> tuple[str, str] | None:
    """Another token, held or poisoned, with a function of `token`, and that function.

    The catalogue refuses overlapping tokens; this is the planner's own check, by
    address, so that a configuration that slipped through (or a lease on a token
    that has left the configuration since: its recorded homes say which functions
    it had) can never give one function two owners (I1)."""
    mine = {f.address for f in token.functions} | {token.address}
    others = {name for lease in ledger.leases for name in lease.tokens if blocks_token(lease, name)}
    others |= {name for name, _ in ledger.poisoned}
    for other in sorted(others - {token.name}):
        addresses = set(coverage.get(other, ())) or set(ledger.home_of(other))
        shared = sorted(mine & addresses)
        if shared:
            return other, shared[0]
    return None


def decide_claim(
    ledger: LedgerState,
    claimant: Claimant,
    mode: Mode,
    tokens: Sequence[TokenSpec],
    holders: Sequence[Holder],
    stranded: frozenset[Claimant],
    *,
    transient: bool = False,
    policy: Policy = NO_POLICY,
    boot_id: str | None = None,
    blockers: Mapping[str, Blocker] | None = None,
    coverage: Mapping[str, Collection[str]] | None = None,
    parents: Mapping[str, str] | None = None,
    vf_users: Sequence[DeviceUser] = (),
    in_place: bool = False,
    screens: Mapping[str, ScreenUse] | None = None,
) -> ClaimPlan:
    """Decide a claim, or raise the `ClaimRefused` that says why it cannot be had.

    `boot_id` is the current boot's: a lease of the claimant's own from an earlier
    boot is not "already held" (the reboot undid it on the host) but refused
    until `restore` has removed it, loudly.  `blockers` say which tokens this
    host cannot pass through at all; an exclusive claim on one is refused
    before anything is stopped.  `coverage` maps every token of the catalogue to
    its functions' addresses: a claim on a function another token's lease (or
    poison) covers is refused, whatever the tokens are called.  `parents` maps
    each token on an SR-IOV virtual function to its physical function's address,
    and `vf_users` are the processes that have a node of a claimed token's VFs
    open: the PF↔VF rules of `core/vfs.py` refuse an exclusive claim on a PF
    whose VFs are in use, and a claim on a VF whose PF is held exclusively.
    `in_place` is an exclusive claim that leaves the GPU on its driver (the
    arbiter's own MIG change): it stops every holder, as any exclusive claim
    does, and switches nothing.  `screens` says who uses each token's screen (a
    snapshot, as `holders` is), and the token's `screen` what an exclusive claim
    that passes it through does with them: "refuse" refuses it, naming the display
    manager, its sessions or a compositor (`refuse_screen`); "release" stops them,
    last and each recorded first (`screen_stops`).  A screen with only the boot
    display or the console on it is the console policy's either way.
    """
    names = tuple(token.name for token in tokens)
    for token in tokens:
        poison = ledger.poison_of(token.name)
        if poison is not None:
            raise TokenPoisoned(token.name, claimant, poison.reason, human_time(poison.since))
    for token in tokens:
        shared_with = overlapping(ledger, token, coverage or {})
        if shared_with is not None:
            other, address = shared_with
            owners = [lease.claimant for lease in ledger.leases if other in lease.tokens]
            held = f"held by {', '.join(owners)}" if owners else "poisoned"
            raise ClaimRefused(
                _label(token),
                claimant,
                f"its function {address} is also part of token {other}, which is {held}; "
                "tokens must not overlap",
                hint="give each IOMMU group one token in arbiter.toml "
                f"({cli_command('detect')} shows the groups), then run {cli_command('doctor')}",
            )

    for token in tokens:
        found = unaccounted(ledger, token)
        if found:
            raise TokenUnaccounted(
                _label(token), claimant, ", ".join(found), hint=unaccounted_hint(token.name)
            )
    refuse_by_relation(
        ledger,
        claimant,
        mode,
        tokens,
        parents=parents or {},
        coverage=coverage or {},
        vf_users=vf_users,
        in_place=in_place,
    )
    vgpu_targets = {}
    for token in tokens:
        target = None if in_place else vgpu_target_of(token, claimant, mode)
        if target is not None:
            vgpu_targets[token.name] = target
    passed = [t for t in tokens if t.name not in vgpu_targets]
    if mode is Mode.EXCLUSIVE and not in_place:
        for token in passed:
            refuse_screen(claimant, token, (screens or {}).get(token.name))
    if mode is Mode.EXCLUSIVE and not in_place:
        for token in tokens:
            blocker = None if token.name in vgpu_targets else (blockers or {}).get(token.name)
            if blocker is not None:
                raise PassthroughImpossible(_label(token), claimant, blocker.why, blocker.hint)

    own = ledger.lease_of(claimant)
    if own is not None and boot_id is not None and own.boot_id != boot_id:
        raise ClaimRefused(
            ", ".join(own.tokens),
            claimant,
            "it still has a lease from an earlier boot, which the reboot undid on the host",
            hint=f"run {cli_command('restore', operands=[claimant])} "
            f"(or {cli_command('restore', '--stranded')}) first",
        )
    if own is not None:
        if own.state is LeaseState.ACTIVE and own.mode is mode and set(own.tokens) == set(names):
            return ClaimPlan(claimant, mode, names, transient, already_held=True)
        if own.state is LeaseState.RELEASING:
            # A VM destroyed and started at once: its release is still under way
            # (it may be between the hook that began it and the process that
            # finishes it, and look stranded for that moment).
            raise ClaimRefused(
                ", ".join(own.tokens),
                claimant,
                "its previous lease is still being released",
                hint=f"run {cli_command('restore', operands=[claimant])} if no release is running"
                if claimant in stranded
                else "try again once the release has finished",
                retry=True,
            )
        raise ClaimRefused(
            ", ".join(own.tokens),
            claimant,
            f"it already holds {a_or_an(own.mode)} lease in state {own.state}",
            hint=f"run {cli_command('release', operands=[claimant])} "
            f"(or {cli_command('restore', operands=[claimant])}) first",
        )

    for token in tokens:
        for lease in ledger.leases_on(token.name):
            if not blocks_token(lease, token.name):
                continue
            if lease.claimant in stranded:
                raise ClaimRefused(
                    _label(token),
                    claimant,
                    f"it holds a stranded lease of {lease.claimant}",
                    hint=f"run {cli_command('restore', '--stranded')} first",
                )
            if lease.mode is Mode.EXCLUSIVE:
                raise ClaimRefused(
                    _label(token),
                    claimant,
                    f"{token.name} is held exclusively by {lease.claimant} "
                    f"since {human_time(lease.created)}",
                    hint=f"stop {lease.claimant} first, or wait until it releases the GPU",
                )
            if mode is Mode.EXCLUSIVE and lease.state is not LeaseState.ACTIVE:
                raise ClaimRefused(
                    _label(token),
                    claimant,
                    f"the shared lease of {lease.claimant} is {lease.state}",
                    hint="try again in a moment",
                    retry=True,
                )

    for token in tokens if in_place else ():
        away = [f.address for f in token.functions if f.driver == VFIO]
        if away:
            raise ClaimRefused(
                _label(token),
                claimant,
                f"{', '.join(away)} is on vfio-pci: this is done on the GPU's own driver",
                hint=f"bring it home first ({cli_command('status')} shows what holds it)",
            )
    if mode is Mode.EXCLUSIVE:
        # The screens this claim takes: those of the GPUs it passes through (a claim in
        # place and a vGPU leave their GPU, and its screen, on its driver).
        seen: Mapping[str, ScreenUse] = {} if in_place else screens or {}
        used = {t.name: seen[t.name] for t in passed if t.name in seen}
        used = {name: use for name, use in used.items() if use.drives_screen}
        holders, screen = screen_stops(passed, used, holders)
        plan = _decide_exclusive(
            ledger, claimant, tokens, holders, stranded, transient, policy, vgpu_targets, screen
        )
        return replace(plan, switches=()) if in_place else replace(plan, screens=used)
    return _decide_shared(ledger, claimant, tokens, holders, transient, policy)


def _decide_exclusive(
    ledger: LedgerState,
    claimant: Claimant,
    tokens: Sequence[TokenSpec],
    holders: Sequence[Holder],
    stranded: frozenset[Claimant],
    transient: bool,
    policy: Policy,
    in_place: Mapping[str, str],
    screen: Sequence[StopStep] = (),
) -> ClaimPlan:
    names = tuple(token.name for token in tokens)
    preempted: dict[Claimant, tuple[str, ...]] = {}
    inherited: list[StoppedHolder] = []
    # By name, not by ledger order (a lease moves to the end of the ledger each time
    # it is written): the stops, and so the order they come back in, are the plan's.
    for lease in sorted(ledger.leases, key=lambda lease: lease.claimant):
        # Only active shared leases that still hold a token are preempted; one that
        # is releasing and has let go of the token brings back its own holders.
        shared_here = [t for t in lease.tokens if t in names and blocks_token(lease, t)]
        if lease.mode is Mode.SHARED and shared_here and lease.claimant != claimant:
            preempted[lease.claimant] = lease.tokens
            inherited.extend(lease.unrestored())
    taken_over = _take_over_pending_restarts(ledger, claimant, tokens, stranded, preempted)
    inherited.extend(record for _, record in taken_over)

    stops: list[StopStep] = []
    for holder in _running_holders(holders, claimant, names):
        # A holder that says it may not be stopped refuses the claim, even when it
        # shares the GPU through a lease of its own.
        _refuse_unless_preemptible(holder, claimant, tokens, policy)
        if holder.ref in preempted:
            continue  # stopped below, as the shared claimant it is
        elsewhere = ledger.lease_of(holder.ref)
        if elsewhere is not None:
            # It holds a lease on other GPUs: stopping it ends that use too, so the
            # lease moves into this one and comes back with it.
            _refuse_unless_shared_elsewhere(elsewhere, holder, claimant, tokens, stranded)
            preempted[holder.ref] = elsewhere.tokens
            inherited.extend(elsewhere.unrestored())
            stops.append(
                StopStep(
                    holder.ref,
                    holder.how,
                    elsewhere.tokens,
                    tuple(dict.fromkeys(holder.tokens + elsewhere.tokens)),
                )
            )
            continue
        stops.append(StopStep(holder.ref, holder.how, tokens=holder.tokens))
    how: dict[Claimant, str] = {holder.ref: holder.how for holder in holders}
    stopped = {step.holder for step in stops}
    for ref, shared_tokens in preempted.items():
        if ref in stopped:
            continue
        # A shared claimant is preemptible unless it says otherwise (above), but a
        # policy may still forbid stopping its kind (from a hook, a nested hook).
        token = next(t for t in tokens if t.name in shared_tokens)
        _refuse_by_policy(ref, "", claimant, token, policy)
        stops.append(StopStep(ref, how.get(ref, "stop"), shared_tokens, shared_tokens))
    for step in screen:  # (a nested hook's policy stops no screen either)
        token = next(t for t in tokens if t.name in step.tokens)
        _refuse_by_policy(step.holder, "", claimant, token, policy)
    stops.extend(screen)  # last: the desktop stays up while the rest is stopped

    _refuse_stops_being_started(ledger, claimant, stops, tokens, stranded)
    # To vfio-pci; an NVIDIA vGPU VF stays on its driver and gets its type (`in_place`).
    switches = tuple(
        Switch(token.name, function.address, function.driver, in_place.get(token.name, VFIO))
        for token in tokens
        for function in token.functions
        if function.driver != VFIO
        and (token.name not in in_place or function.address == token.address)
    )
    return ClaimPlan(
        claimant,
        Mode.EXCLUSIVE,
        names,
        transient,
        stops=tuple(stops),
        switches=switches,
        preempted_leases=tuple(preempted),
        inherited=tuple(inherited),
        taken_over=tuple((lease, record.holder) for lease, record in taken_over),
        homes={token.name: home_map(ledger, token) for token in tokens},
    )


SCREEN_HOW = {
    HolderKind.SYSTEMD_USER: "systemctl --user stop",
    HolderKind.SESSION: "told why, then loginctl terminate-session",
    HolderKind.DISPLAY_MANAGER: "systemctl stop",
}


def screen_stops(
    tokens: Sequence[TokenSpec], screens: Mapping[str, ScreenUse], holders: Sequence[Holder]
) -> tuple[list[Holder], list[StopStep]]:
    """What an exclusive claim stops to free the screens of its tokens that have
    `screen = "release"`, and the holders left once those are taken out.

    In order: the user units of the sessions' users that hold the GPU (a desktop's
    shell may run as one, outside its session's scope), the sessions on it, the
    display manager that opened them (`display-manager:UNIT`); each is recorded in
    the lease before anything is stopped.  The screen's processes go with their
    session or unit: their process holders are left out, and so is the display
    manager listed as a systemd holder of these GPUs (it is stopped, and started
    again, once).
    A screen driven by the boot display or the framebuffer console alone stops
    nothing: the host releases the console at the switch."""
    stops: dict[Claimant, tuple[str, ...]] = {}
    freed_pids: set[str] = set()
    freed_units: set[str] = set()
    for token in tokens:
        use = screens.get(token.name)
        if token.screen is not ScreenPolicy.RELEASE or use is None or not use.drives_screen:
            continue
        found: list[Claimant] = []
        for process in use.processes:
            unit = process.unit or ""
            if unit.startswith(f"user@{process.uid}.service/"):
                found.append(user_unit(process.uid, unit.rsplit("/", 1)[-1]))
        for text in use.user_units:
            owner, _, unit = text.partition(": ")
            uid = owner.removeprefix("user@").removesuffix(".service")
            if unit and uid.isdigit():
                found.append(user_unit(int(uid), unit.strip()))
        found += [Claimant.of(HolderKind.SESSION, session.id) for session in use.sessions]
        managers = {
            dm for dm in (use.display_manager, *(s.display_manager for s in use.sessions)) if dm
        }
        found += [Claimant.of(HolderKind.DISPLAY_MANAGER, dm) for dm in sorted(managers)]
        for ref in found:
            stops[ref] = tuple(dict.fromkeys((*stops.get(ref, ()), token.name)))
        sessions = {session.id for session in use.sessions}
        # Only a process that goes with what is stopped: one of nobody's session or
        # unit (a display server started by hand) stays a holder of its own.
        freed_pids |= {
            str(process.pid)
            for process in use.processes
            if process.session in sessions
            or (process.unit or "").startswith(f"user@{process.uid}.service/")
            or process.unit in managers
        }
        freed_units |= managers | ({"display-manager.service"} if managers else set())
    ordered = sorted(stops, key=lambda ref: SCREEN_KINDS.index(ref.kind))
    steps = [StopStep(ref, SCREEN_HOW[ref.kind], tokens=stops[ref]) for ref in ordered]
    if not steps:
        return list(holders), []
    released = {token for ref in ordered for token in stops[ref]}
    left = [
        holder
        for holder in holders
        if not (holder.ref.kind is HolderKind.PROCESS and holder.ref.name in freed_pids)
        and not (
            holder.ref.kind is HolderKind.SYSTEMD
            and holder.ref.name in freed_units
            and set(holder.tokens) <= released  # (the alias on another GPU is another's)
        )
    ]
    return left, steps


def _take_over_pending_restarts(
    ledger: LedgerState,
    claimant: Claimant,
    tokens: Sequence[TokenSpec],
    stranded: frozenset[Claimant],
    preempted: Mapping[Claimant, tuple[str, ...]],
) -> list[tuple[Claimant, StoppedHolder]]:
    """Records of holders a releasing lease will start again on tokens this claim takes.

    Started now, such a holder would run on a GPU this claim holds exclusively;
    so the claim keeps it stopped and brings it back itself.  One that is being
    started right now (STARTING) cannot be taken: the claim waits until it runs
    and then stops it like any other holder.
    """
    names = {token.name for token in tokens}
    label = {token.name: _label(token) for token in tokens}
    taken = []
    for lease in sorted(ledger.leases, key=lambda lease: lease.claimant):  # by name, as above
        if lease.state is not LeaseState.RELEASING or lease.claimant in preempted:
            continue
        for record in lease.unrestored():
            used = [t for t in record.tokens if t in names]
            if not used or record.holder == claimant:
                continue
            if record.state is StepState.STARTING:
                raise _being_started(label[used[0]], claimant, record, lease, stranded)
            taken.append((lease.claimant, record))
    return taken


def _refuse_stops_being_started(
    ledger: LedgerState,
    claimant: Claimant,
    stops: Sequence[StopStep],
    tokens: Sequence[TokenSpec],
    stranded: frozenset[Claimant],
) -> None:
    """A claim waits rather than stop a holder that a release is starting again.

    That release starts it outside the lock and then, for a preempted shared
    claimant, gives it its lease back; its STARTING record is what keeps claims
    on the holder's old tokens waiting meanwhile.  A claim elsewhere that stopped
    the holder now would have to mark that record done, and so let a claim on
    the old tokens in before the lease comes back there (found by the 75 s
    stress run), besides racing the start with its stop.
    """
    stopping = {step.holder for step in stops}
    for lease in ledger.leases:
        if lease.claimant == claimant:
            continue
        for record in lease.unrestored():
            if record.state is StepState.STARTING and record.holder in stopping:
                label = ", ".join(_label(token) for token in tokens)
                raise _being_started(label, claimant, record, lease, stranded)


def _being_started(
    label: str,
    claimant: Claimant,
    record: StoppedHolder,
    releasing: Lease,
    stranded: frozenset[Claimant],
) -> ClaimRefused:
    """The refusal while `releasing` starts `record`'s holder again: a retry, unless
    that release is stranded (then only `restore` finishes it)."""
    stale = releasing.claimant in stranded
    return ClaimRefused(
        label,
        claimant,
        f"{record.holder} is being started again by the release of {releasing.claimant}",
        hint=f"run {cli_command('restore', '--stranded')} first"
        if stale
        else "try again in a moment",
        retry=not stale,
    )


def _decide_shared(
    ledger: LedgerState,
    claimant: Claimant,
    tokens: Sequence[TokenSpec],
    holders: Sequence[Holder],
    transient: bool,
    policy: Policy,
) -> ClaimPlan:
    names = tuple(token.name for token in tokens)
    first = [
        token
        for token in tokens
        if not any(blocks_token(lease, token.name) for lease in ledger.leases_on(token.name))
    ]
    first_names = {token.name for token in first}
    claimants = {lease.claimant for lease in ledger.leases}
    stops = []
    for holder in _running_holders(holders, claimant, tuple(first_names)):
        # Sharing means using the GPU on its home driver, beside whatever else uses it
        # there (a unit, a container, a process, a shared claimant): only a holder
        # that has it passed through cannot stay, and is stopped (or, not
        # preemptible, refuses the claim).
        if holder.passthrough and holder.ref not in claimants:
            _refuse_unless_preemptible(holder, claimant, first, policy)
            stops.append(StopStep(holder.ref, holder.how, tokens=holder.tokens))
    _refuse_stops_being_started(ledger, claimant, stops, first, frozenset())
    switches = []
    homes = {}
    for token in first:
        home = home_map(ledger, token)
        homes[token.name] = home
        if any(home[f.address] == VFIO for f in token.functions):
            raise ClaimRefused(
                _label(token),
                claimant,
                "its home is vfio-pci: the administrator keeps it there on purpose, so it "
                "is only ever passed through",
                hint="claim it exclusively, or run "
                f"{cli_command('send-home', operands=[token.name])} "
                "if it should come back to the host",
            )
        for function in token.functions:
            target = home[function.address]
            if function.is_display and function.driver in (None, VFIO) and target == NO_DRIVER:
                # Shared means used on its home driver: a GPU no driver takes is no use.
                where = "on vfio-pci" if function.driver == VFIO else "bound to no driver"
                raise ClaimRefused(
                    _label(token),
                    claimant,
                    f"it is {where} and no driver on this host can take {function.address} "
                    f"(none is recorded or configured, and this kernel has no module for it)",
                    hint=f"install the GPU's driver, or set `home_driver` for {token.name} "
                    "in arbiter.toml",
                )
            if function.driver == VFIO or (target and function.driver != target):
                switches.append(Switch(token.name, function.address, function.driver, target))
    return ClaimPlan(
        claimant,
        Mode.SHARED,
        names,
        transient,
        stops=tuple(stops),
        switches=tuple(switches),
        homes=homes,
        cdi_tokens=tuple(token.name for token in first if token.cdi),
    )


def refuse_screen(claimant: Claimant, token: TokenSpec, use: ScreenUse | None) -> None:
    """Refuse passing through a GPU that people's screen runs on (a display manager, a
    graphical session, a compositor: processes of the screen with its DRM nodes open),
    naming them, unless the token's `screen` is "release".  A boot display or a console
    with nobody on it is the console policy's (the host's passthrough blocker)."""
    if use is None or not use.processes or token.screen is ScreenPolicy.RELEASE:
        return
    compositors = [p for p in use.processes if any(n.startswith("card") for n in p.nodes)]
    compositor = (compositors or list(use.processes))[0]
    sessions = {s.id: s for s in use.sessions}
    session = sessions.get(compositor.session or "")
    holder = use.display_manager or compositor.describe()
    whose = f" of {session.describe()}" if session else ""
    if not (use.boot_vga or use.fbcon):
        # Item 5: a desktop's compositor that opened the second GPU too.
        why = (
            f"the compositor {compositor.describe()}{whose} has it open, although it is not "
            f"the boot display; passing it through would end that ({use.describe()})"
        )
    else:
        draws = f"; {compositor.describe()} draws on it" if compositor.session else ""
        why = f"{use.describe()}{draws}; passing it through would end that desktop"
    stops = ", ".join(
        [
            *([use.display_manager] if use.display_manager else []),
            *(f"session {s}" for s in sessions),
        ]
    )
    hint = (
        f'set `screen = "release"` for {token.name} in arbiter.toml to let the arbiter stop '
        f"{stops or compositor.describe()} before the switch and start the display manager "
        "again when the GPU comes back (the user gets a login screen back, not the session), "
        "or end the session first"
        + (f" (`loginctl terminate-session {' '.join(sessions)}`)" if sessions else "")
    )
    raise ScreenInUse(_label(token), claimant, why, hint, holder, use.users)


def _running_holders(
    holders: Sequence[Holder], claimant: Claimant, names: tuple[str, ...]
) -> list[Holder]:
    seen: set[str] = set()
    result = []
    for holder in holders:
        if holder.ref == claimant or holder.ref in seen or not holder.running:
            continue
        if any(token in names for token in holder.tokens):
            seen.add(holder.ref)
            result.append(holder)
    return result


def _refuse_unless_preemptible(
    holder: Holder, claimant: Claimant, tokens: Sequence[TokenSpec], policy: Policy
) -> None:
    token = next(t for t in tokens if t.name in holder.tokens)
    detail = f" ({holder.detail})" if holder.detail else ""
    if not holder.preemptible:
        raise ClaimRefused(
            _label(token),
            claimant,
            f"it is in use by {holder.ref}{detail}, which is not preemptible",
            hint=f"stop {holder.ref} first, or "
            + (holder.made_preemptible or "mark it preemptible in arbiter.toml"),
        )
    _refuse_by_policy(holder.ref, detail, claimant, token, policy)


def _refuse_unless_shared_elsewhere(
    lease: Lease,
    holder: Holder,
    claimant: Claimant,
    tokens: Sequence[TokenSpec],
    stranded: frozenset[Claimant],
) -> None:
    """A holder that holds another GPU exclusively, or whose lease is changing or
    stranded, is not stopped for this claim: the first would lose its GPU, the second
    is in motion, the third waits for `restore`."""
    token = next(t for t in tokens if t.name in holder.tokens)
    if lease.mode is Mode.EXCLUSIVE:
        raise ClaimRefused(
            _label(token),
            claimant,
            f"it is in use by {holder.ref}, which holds {', '.join(lease.tokens)} exclusively",
            hint=f"stop {holder.ref} first",
        )
    if holder.ref in stranded:
        raise ClaimRefused(
            _label(token),
            claimant,
            f"it is in use by {holder.ref}, whose lease on {', '.join(lease.tokens)} is stranded",
            hint=f"run {cli_command('restore', '--stranded')} first",
        )
    if lease.state is not LeaseState.ACTIVE:
        raise ClaimRefused(
            _label(token),
            claimant,
            f"it is in use by {holder.ref}, whose lease is {lease.state}",
            hint="try again in a moment",
            retry=True,
        )


def _refuse_by_policy(
    ref: Claimant, detail: str, claimant: Claimant, token: TokenSpec, policy: Policy
) -> None:
    kind = ref.kind
    if kind in policy.refuse_kinds:
        raise ClaimRefused(
            _label(token),
            claimant,
            f"it is in use by {ref}{detail}, and this configuration does not stop "
            f"{kind} holders from a hook",
            hint=policy.refuse_hint.format(
                holder=ref,
                claimant=claimant,
                token=token.name,
                acquire=cli_command("acquire", "--exclusive", operands=[claimant, token.name]),
            ),
        )


def _label(token: TokenSpec) -> str:
    return token.label
