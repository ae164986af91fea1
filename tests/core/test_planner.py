"""The pure rules (planner.decide_claim) over hand-built ledger and host states.

No I/O: every rule is checked on values, so a failure names the rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from charly_arbiter.core.host import (
    NO_DRIVER,
    DeviceUser,
    Holder,
    PciFunction,
    ScreenProcess,
    ScreenSession,
    ScreenUse,
    Sriov,
    TokenSpec,
    Vgpu,
)
from charly_arbiter.core.model import (
    VFIO,
    Claimant,
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    Poison,
    ScreenPolicy,
    StepState,
    StoppedHolder,
    blocks_token,
    human_time,
    operation_claimant,
)
from charly_arbiter.core.planner import Policy, Switch, decide_claim, home_map, unaccounted
from charly_arbiter.errors import ClaimRefused, ScreenInUse, TokenPoisoned, TokenUnaccounted

GPU0 = "0000:0a:00.0"
AUDIO0 = "0000:0a:00.1"
GPU1 = "0000:0b:00.0"


def token(name: str = "gpu0", drivers: tuple[str | None, ...] = ("nvidia", "snd_hda_intel")):
    addresses = (GPU0, AUDIO0) if name == "gpu0" else (GPU1,)
    functions = tuple(
        PciFunction(
            address, "10de", "0000", "030000" if address.endswith("0") else "040300", driver, name
        )
        for address, driver in zip(addresses, drivers, strict=False)
    )
    return TokenSpec(name, addresses[0], functions)


def lease(claimant: str, mode: Mode, *tokens: str, state=LeaseState.ACTIVE, stopped=()):
    return Lease(
        claimant=claimant,
        mode=mode,
        tokens=tokens or ("gpu0",),
        state=state,
        transient=False,
        boot_id="boot",
        created="2026-01-01T00:00:00+00:00",
        stopped=tuple(stopped),
    )


LLM = Holder("container:llm", ("gpu0",), preemptible=True, running=True, how="podman stop")
OLLAMA = Holder("systemd:ollama.service", ("gpu0",), preemptible=True, running=True)
DM = Holder("systemd:display-manager.service", ("gpu1",), preemptible=False, running=True)
EMPTY = LedgerState()
NONE: frozenset[str] = frozenset()


def test_exclusive_stops_running_preemptible_holders_and_switches_every_function():
    plan = decide_claim(EMPTY, "libvirt:win11", Mode.EXCLUSIVE, [token()], [LLM, OLLAMA], NONE)
    assert [step.holder for step in plan.stops] == ["container:llm", "systemd:ollama.service"]
    assert plan.stops[0].how == "podman stop"
    assert {(s.address, s.from_driver, s.to_driver) for s in plan.switches} == {
        (GPU0, "nvidia", VFIO),
        (AUDIO0, "snd_hda_intel", VFIO),
    }
    assert plan.homes == {"gpu0": {GPU0: "nvidia", AUDIO0: "snd_hda_intel"}}
    assert plan.switched_tokens == ("gpu0",)


def test_exclusive_ignores_holders_that_do_not_run_and_functions_already_on_vfio():
    """(On vfio-pci with no lease, as the administrator keeps it: its home is vfio-pci.)"""
    stopped_llm = Holder("container:llm", ("gpu0",), preemptible=False, running=False)
    admin = EMPTY.with_home("gpu0", {GPU0: VFIO, AUDIO0: VFIO})
    plan = decide_claim(
        admin, "libvirt:win11", Mode.EXCLUSIVE, [token(drivers=(VFIO, VFIO))], [stopped_llm], NONE
    )
    assert plan.stops == () and plan.switches == ()


def test_exclusive_refusal_names_the_non_preemptible_holder_and_the_token():
    with pytest.raises(ClaimRefused) as refused:
        decide_claim(
            EMPTY, "libvirt:win11", Mode.EXCLUSIVE, [token("gpu1", ("nvidia",))], [DM], NONE
        )
    message = str(refused.value)
    assert "systemd:display-manager.service" in message and "not preemptible" in message
    assert "gpu1" in message and GPU1 in message
    assert refused.value.exit_code == 3
    assert "systemd:display-manager.service" in refused.value.hint


def test_second_exclusive_lease_is_refused_naming_the_holder_of_the_first():
    state = EMPTY.with_lease(lease("libvirt:win11", Mode.EXCLUSIVE))
    with pytest.raises(ClaimRefused, match="held exclusively by libvirt:win11"):
        decide_claim(state, "libvirt:other", Mode.EXCLUSIVE, [token()], [], NONE)


def test_shared_claim_is_refused_under_an_exclusive_lease():
    state = EMPTY.with_lease(lease("libvirt:win11", Mode.EXCLUSIVE))
    with pytest.raises(ClaimRefused, match="held exclusively by libvirt:win11"):
        decide_claim(state, "container:llm", Mode.SHARED, [token(drivers=(VFIO, VFIO))], [], NONE)


def test_exclusive_preempts_shared_claimants_and_inherits_what_they_stopped():
    shared = lease(
        "container:llm",
        Mode.SHARED,
        stopped=[StoppedHolder("systemd:ollama.service", StepState.DONE)],
    )
    state = EMPTY.with_lease(shared)
    ollama_down = Holder("systemd:ollama.service", ("gpu0",), preemptible=True, running=False)
    plan = decide_claim(state, "libvirt:win11", Mode.EXCLUSIVE, [token()], [LLM, ollama_down], NONE)
    assert plan.preempted_leases == ("container:llm",)
    assert [(s.holder, s.shared_tokens) for s in plan.stops] == [("container:llm", ("gpu0",))]
    assert [r.holder for r in plan.inherited] == ["systemd:ollama.service"]


def test_shared_claimants_are_stopped_and_inherited_by_name_whatever_the_ledger_order():
    """Holders come back last stopped first, so the stops' order is part of the plan:
    the preempted shared claimants by name, not in the order their leases were last
    written (a lease moves to the end of the ledger each time)."""
    first = lease("libvirt:zed", Mode.SHARED, stopped=[StoppedHolder("systemd:z.service")])
    second = lease("container:amy", Mode.SHARED, stopped=[StoppedHolder("systemd:a.service")])
    for state in (
        EMPTY.with_lease(first).with_lease(second),
        EMPTY.with_lease(second).with_lease(first),
    ):
        plan = decide_claim(state, "libvirt:win11", Mode.EXCLUSIVE, [token()], [], NONE)
        assert [str(s.holder) for s in plan.stops] == ["container:amy", "libvirt:zed"]
        assert [str(r.holder) for r in plan.inherited] == ["systemd:a.service", "systemd:z.service"]


def test_exclusive_waits_for_a_shared_lease_still_being_acquired():
    state = EMPTY.with_lease(lease("container:llm", Mode.SHARED, state=LeaseState.ACQUIRING))
    with pytest.raises(ClaimRefused, match="acquiring"):
        decide_claim(state, "libvirt:win11", Mode.EXCLUSIVE, [token()], [], NONE)


def test_first_shared_claim_goes_home_stops_only_passthrough_holders_and_regenerates_cdi():
    """Sharing is use on the home driver: ollama (a unit on nvidia) stays beside it; a
    VM that has the GPU passed through cannot, and is stopped."""
    state = EMPTY.with_home("gpu0", {GPU0: "nvidia", AUDIO0: "snd_hda_intel"})
    vm = Holder("libvirt:vm", ("gpu0",), preemptible=True, running=True, passthrough=True)
    plan = decide_claim(
        state,
        "container:llm",
        Mode.SHARED,
        [token(drivers=("nouveau", "snd_hda_intel"))],
        [LLM, OLLAMA, vm],
        NONE,
    )
    assert [step.holder for step in plan.stops] == ["libvirt:vm"]
    assert {(s.address, s.to_driver) for s in plan.switches} == {(GPU0, "nvidia")}
    assert plan.cdi_tokens == ("gpu0",)


def test_a_shared_claim_is_refused_beside_a_passthrough_holder_that_may_not_stop():
    rigid = Holder("libvirt:vm", ("gpu0",), preemptible=False, running=True, passthrough=True)
    with pytest.raises(ClaimRefused, match=r"libvirt:vm.*not preemptible"):
        decide_claim(EMPTY, "container:llm", Mode.SHARED, [token()], [rigid], NONE)


def test_later_shared_claims_only_count():
    state = EMPTY.with_lease(lease("container:llm", Mode.SHARED))
    plan = decide_claim(state, "container:other", Mode.SHARED, [token()], [OLLAMA], NONE)
    assert plan.stops == () and plan.switches == () and plan.cdi_tokens == ()
    assert plan.tokens == ("gpu0",)


def test_shared_claim_coexists_with_a_running_non_preemptible_holder():
    plan = decide_claim(EMPTY, "container:x", Mode.SHARED, [token("gpu1", ("nvidia",))], [DM], NONE)
    assert plan.stops == ()


def test_every_claim_on_a_poisoned_token_is_refused_with_the_clear_hint():
    state = EMPTY.with_poison("gpu0", Poison("unbind hung", "2026-01-01T00:00:00+00:00"))
    for mode in Mode:
        with pytest.raises(TokenPoisoned) as refused:
            decide_claim(
                state, "libvirt:win11", mode, [token("gpu1", ("nvidia",)), token()], [], NONE
            )
        assert "poisoned" in str(refused.value) and "unbind hung" in str(refused.value)
        assert refused.value.hint is not None
        assert "charly-arbiter poison clear gpu0" in refused.value.hint
        assert refused.value.exit_code == 3


def test_a_multi_token_claim_is_refused_whole_when_one_token_is_not_free():
    state = EMPTY.with_lease(lease("libvirt:a", Mode.EXCLUSIVE, "gpu1"))
    with pytest.raises(ClaimRefused, match="gpu1"):
        decide_claim(
            state, "libvirt:b", Mode.EXCLUSIVE, [token(), token("gpu1", ("nvidia",))], [LLM], NONE
        )


def test_the_same_claim_again_is_already_held_and_a_different_one_refused():
    state = EMPTY.with_lease(lease("libvirt:win11", Mode.EXCLUSIVE))
    again = decide_claim(state, "libvirt:win11", Mode.EXCLUSIVE, [token()], [LLM], NONE)
    assert again.already_held and again.stops == ()
    with pytest.raises(ClaimRefused, match="already holds"):
        decide_claim(state, "libvirt:win11", Mode.SHARED, [token()], [], NONE)


def test_a_lease_from_an_earlier_boot_is_not_already_held_again():
    state = EMPTY.with_lease(lease("libvirt:win11", Mode.EXCLUSIVE))
    with pytest.raises(ClaimRefused, match="earlier boot") as refused:
        decide_claim(
            state,
            "libvirt:win11",
            Mode.EXCLUSIVE,
            [token()],
            [],
            frozenset({"libvirt:win11"}),
            boot_id="new-boot",
        )
    assert "restore libvirt:win11" in (refused.value.hint or "")


def test_a_stranded_lease_refuses_with_the_restore_hint():
    state = EMPTY.with_lease(lease("libvirt:gone", Mode.SHARED))
    with pytest.raises(ClaimRefused, match="stranded") as refused:
        decide_claim(
            state, "libvirt:win11", Mode.EXCLUSIVE, [token()], [], frozenset({"libvirt:gone"})
        )
    assert "restore --stranded" in (refused.value.hint or "")


def test_policy_can_refuse_preemptible_kinds():
    policy = Policy(frozenset({"container"}), "stop {holder} yourself")
    with pytest.raises(ClaimRefused, match="container:llm") as refused:
        decide_claim(EMPTY, "libvirt:win11", Mode.EXCLUSIVE, [token()], [LLM], NONE, policy=policy)
    assert refused.value.hint == "stop container:llm yourself"


def test_a_function_held_under_another_token_name_is_never_claimed_again():
    """Tokens that overlap (the catalogue refuses them; this is the planner's own check,
    by address): gpu0 is held exclusively, the same group under another name, or only
    its audio function as a token of its own, is refused in either mode."""
    held = EMPTY.with_lease(lease("libvirt:win11", Mode.EXCLUSIVE, "gpu0"))
    coverage = {"gpu0": (GPU0, AUDIO0), "alias": (GPU0, AUDIO0), "audio": (AUDIO0,)}
    audio_only = TokenSpec("audio", AUDIO0, token().functions)
    for spec in (replace(token(), name="alias"), audio_only):
        for mode in Mode:
            with pytest.raises(ClaimRefused) as refused:
                decide_claim(held, "container:x", mode, [spec], [], NONE, coverage=coverage)
            assert "also part of token gpu0, which is held by libvirt:win11" in str(refused.value)
            assert "tokens must not overlap" in str(refused.value)
    # A lease on a token that has left the configuration: its recorded homes say which
    # functions it had.
    gone = held.with_home("gpu0", {GPU0: "nvidia", AUDIO0: "snd_hda_intel"})
    with pytest.raises(ClaimRefused, match="also part of token gpu0"):
        decide_claim(gone, "container:x", Mode.SHARED, [audio_only], [], NONE, coverage={})
    # A token that shares nothing with it is claimed as before.
    gpu1 = token("gpu1", ("nvidia",))
    plan = decide_claim(held, "container:x", Mode.SHARED, [gpu1], [], NONE, coverage=coverage)
    assert plan.tokens == ("gpu1",)


def test_a_token_on_vfio_that_nothing_accounts_for_is_refused_with_what_to_do():
    """On vfio-pci with no lease and no poison (the ledger was deleted or replaced while
    it was passed through): every claim is refused until an operator decides."""
    lost = token(drivers=(VFIO, VFIO))
    assert unaccounted(EMPTY, lost) == (GPU0, AUDIO0)
    for mode in Mode:
        with pytest.raises(TokenUnaccounted) as refused:
            decide_claim(EMPTY, "libvirt:win11", mode, [lost], [], NONE)
        assert refused.value.exit_code == 3
        assert f"{GPU0}, {AUDIO0} on vfio-pci" in str(refused.value)
        hint = refused.value.hint or ""
        assert "`charly-arbiter adopt gpu0 KIND:NAME`" in hint
        assert "`charly-arbiter adopt --admin gpu0`" in hint
        assert "`charly-arbiter send-home gpu0`" in hint
    # What accounts for it: an exclusive lease in any state, a poison, or a home of
    # vfio-pci recorded by `adopt --admin`.
    releasing = lease("libvirt:a", Mode.EXCLUSIVE, state=LeaseState.RELEASING)
    assert unaccounted(EMPTY.with_lease(releasing), lost) == ()
    assert unaccounted(EMPTY.with_poison("gpu0", Poison("hung", "t")), lost) == ()
    assert unaccounted(EMPTY.with_home("gpu0", {GPU0: VFIO, AUDIO0: VFIO}), lost) == ()
    # A shared lease does not: shared means on the home driver.
    assert unaccounted(EMPTY.with_lease(lease("container:s", Mode.SHARED)), lost) == (
        GPU0,
        AUDIO0,
    )


def test_refusals_say_times_as_every_other_output_does_and_mind_their_articles():
    state = EMPTY.with_lease(lease("libvirt:win11", Mode.EXCLUSIVE))
    with pytest.raises(ClaimRefused) as refused:
        decide_claim(state, "libvirt:other", Mode.EXCLUSIVE, [token()], [], NONE)
    assert f"since {human_time('2026-01-01T00:00:00+00:00')}" in str(refused.value)
    assert "T00:00:00" not in str(refused.value)
    with pytest.raises(ClaimRefused) as refused:
        decide_claim(state, "libvirt:win11", Mode.SHARED, [token()], [], NONE)
    assert "already holds an exclusive lease" in str(refused.value)
    poisoned = EMPTY.with_poison("gpu0", Poison("unbind hung", "2026-01-01T00:00:00+00:00"))
    with pytest.raises(TokenPoisoned) as refused:
        decide_claim(poisoned, "libvirt:win11", Mode.SHARED, [token()], [], NONE)
    assert f"poisoned since {human_time('2026-01-01T00:00:00+00:00')}" in str(refused.value)


def test_home_is_recorded_first_never_vfio_and_falls_back_to_configuration():
    recorded = EMPTY.with_home("gpu0", {GPU0: "nouveau"})
    assert home_map(recorded, token()) == {GPU0: "nouveau", AUDIO0: "snd_hda_intel"}
    on_vfio = TokenSpec("gpu0", GPU0, token(drivers=(VFIO, None)).functions, home_driver="nvidia")
    assert home_map(EMPTY, on_vfio) == {GPU0: "nvidia", AUDIO0: NO_DRIVER}


def test_a_releasing_lease_stops_blocking_a_token_once_it_went_home():
    releasing = lease("libvirt:a", Mode.EXCLUSIVE, "gpu0", "gpu1", state=LeaseState.RELEASING)
    releasing = releasing.with_switch("gpu0", StepState.DONE).with_switch("gpu1", StepState.PLANNED)
    assert not blocks_token(releasing, "gpu0")
    assert blocks_token(releasing, "gpu1")
    assert not blocks_token(releasing, "gpu2")


EXISTING = {
    "none": (),
    "shared": (lease("container:s", Mode.SHARED),),
    "two-shared": (lease("container:s", Mode.SHARED), lease("container:t", Mode.SHARED)),
    "shared-acquiring": (lease("container:s", Mode.SHARED, state=LeaseState.ACQUIRING),),
    "exclusive": (lease("libvirt:x", Mode.EXCLUSIVE),),
    "exclusive-acquiring": (lease("libvirt:x", Mode.EXCLUSIVE, state=LeaseState.ACQUIRING),),
    "exclusive-gone-home": (
        lease("libvirt:x", Mode.EXCLUSIVE, state=LeaseState.RELEASING).with_switch(
            "gpu0", StepState.DONE
        ),
    ),
    # Leases on tokens with other names whose functions are gpu0's (a configuration
    # whose overlap the catalogue did not catch): the whole group, or its audio only.
    "alias-exclusive": (lease("libvirt:x", Mode.EXCLUSIVE, "gpu0-again"),),
    "alias-shared": (lease("container:s", Mode.SHARED, "gpu0-again"),),
    "audio-exclusive": (lease("libvirt:x", Mode.EXCLUSIVE, "gpu0-audio"),),
}
# The catalogue's token -> addresses: gpu0's functions under two more names.
COVERAGE = {
    "gpu0": (GPU0, AUDIO0),
    "gpu0-again": (GPU0, AUDIO0),
    "gpu0-audio": (AUDIO0,),
    "gpu1": (GPU1,),
}
VM = "libvirt:vm"
HOLDER_KINDS = {
    "none": (),
    "preemptible-running": (LLM,),
    "preemptible-stopped": (Holder("container:llm", ("gpu0",), True, False),),
    "fixed-running": (Holder("systemd:gdm.service", ("gpu0",), False, True),),
    "fixed-stopped": (Holder("systemd:gdm.service", ("gpu0",), False, False),),
    # A VM that has the GPU passed through: nothing shares the GPU beside it.
    "passthrough-running": (Holder(VM, ("gpu0",), True, True, passthrough=True),),
    "passthrough-fixed-running": (Holder(VM, ("gpu0",), False, True, passthrough=True),),
}
DRIVERS = {"home": ("nvidia", "snd_hda_intel"), "vfio": (VFIO, VFIO), "mixed": (VFIO, None)}
# What the ledger records as gpu0's home: its drivers, or vfio-pci (`adopt --admin`).
HOMES = {
    "recorded": {GPU0: "nvidia", AUDIO0: "snd_hda_intel"},
    "admin": {GPU0: VFIO, AUDIO0: VFIO},
}


def test_a_claim_waits_rather_than_stop_a_holder_a_release_is_starting_again():
    """The release of libvirt:a is starting container:s again (preempted on gpu0),
    which shares gpu1 meanwhile: a claim on gpu1 that would stop s waits (a retry),
    exclusive or, for a holder, shared; with a's release stranded it says restore."""
    starting = StoppedHolder("container:s", StepState.STARTING, ("gpu0",), tokens=("gpu0",))
    releasing = lease("libvirt:a", Mode.EXCLUSIVE, "gpu0", state=LeaseState.RELEASING)
    releasing = releasing.with_stopped(starting)
    state = LedgerState(leases=(releasing, lease("container:s", Mode.SHARED, "gpu1")))
    gpu1 = token("gpu1", drivers=("nvidia",))
    with pytest.raises(ClaimRefused) as refused:
        decide_claim(state, "libvirt:b", Mode.EXCLUSIVE, [gpu1], [], NONE)
    assert refused.value.retry
    assert "container:s is being started again by the release of libvirt:a" in str(refused.value)
    with pytest.raises(ClaimRefused) as refused:
        decide_claim(state, "libvirt:b", Mode.EXCLUSIVE, [gpu1], [], frozenset({"libvirt:a"}))
    assert not refused.value.retry and "restore --stranded" in (refused.value.hint or "")

    # A shared claim stops only a holder that has the GPU passed through: a VM (a
    # vGPU one preempted on gpu0, which has gpu1 passed through as well).
    vm_starting = StoppedHolder("libvirt:v", StepState.STARTING, ("gpu0",), tokens=("gpu0",))
    as_holder = Holder("libvirt:v", ("gpu1",), preemptible=True, running=True, passthrough=True)
    alone = LedgerState(leases=(releasing.with_stopped(vm_starting),))
    with pytest.raises(ClaimRefused, match="being started again"):
        decide_claim(alone, "container:t", Mode.SHARED, [gpu1], [as_holder], NONE)
    # Once it runs (the record restored), the same claim goes ahead and stops it.
    done = alone.with_lease(releasing.with_stopped(replace(vm_starting, restored=True)))
    plan = decide_claim(done, "container:t", Mode.SHARED, [gpu1], [as_holder], NONE)
    assert [step.holder for step in plan.stops] == ["libvirt:v"]


@pytest.mark.parametrize("existing", sorted(EXISTING))
@pytest.mark.parametrize("holders", sorted(HOLDER_KINDS))
@pytest.mark.parametrize("drivers", sorted(DRIVERS))
@pytest.mark.parametrize("home", sorted(HOMES))
@pytest.mark.parametrize("mode", list(Mode))
def test_every_state_pair_obeys_the_rules(existing, holders, drivers, home, mode):
    """Exhaustive over (existing lease, holder, drivers, recorded home, requested mode).

    The rules, written out here rather than read back from the planner: a claim is
    refused exactly when one of these reasons holds, and a granted claim does what
    its mode says."""
    state = EMPTY.with_home("gpu0", HOMES[home])
    for item in EXISTING[existing]:
        state = state.with_lease(item)
    spec = token(drivers=DRIVERS[drivers])
    running = [h for h in HOLDER_KINDS[holders] if h.running]
    blocking = [item for item in state.leases if blocks_token(item, "gpu0")]
    on_vfio = any(f.driver == VFIO for f in spec.functions)
    reasons = set()
    # I1 by address: a function covered by another token's lease is never claimed.
    if any(
        set(COVERAGE[name]) & {GPU0, AUDIO0}
        for item in state.leases
        for name in item.tokens
        if name != "gpu0" and blocks_token(item, name)
    ):
        reasons.add("overlap")
    # I2: on vfio-pci only under an exclusive lease (any state) or a home of vfio-pci.
    exclusive_listed = any(
        item.mode is Mode.EXCLUSIVE and "gpu0" in item.tokens for item in state.leases
    )
    if on_vfio and not exclusive_listed and home != "admin":
        reasons.add("unaccounted")
    if any(item.mode is Mode.EXCLUSIVE for item in blocking):
        reasons.add("held exclusively")
    if mode is Mode.EXCLUSIVE:
        if any(not h.preemptible for h in running):
            reasons.add("not preemptible")
        if any(item.state is not LeaseState.ACTIVE for item in blocking):
            reasons.add("in progress")
    elif not blocking:
        # The first shared claim: what has the GPU passed through cannot stay beside
        # it, and a GPU whose home is vfio-pci is not shared at all.
        if any(h.passthrough and not h.preemptible for h in running):
            reasons.add("passthrough holder")
        if home == "admin":
            reasons.add("home is vfio-pci")
    try:
        plan = decide_claim(
            state, "libvirt:me", mode, [spec], HOLDER_KINDS[holders], NONE, coverage=COVERAGE
        )
    except ClaimRefused as refused:
        assert refused.exit_code == 3 and refused.claimant == "libvirt:me"
        assert reasons, (existing, holders, drivers, home, mode, refused)
        return
    assert not reasons, (existing, holders, drivers, home, mode, reasons)
    stopped = {step.holder for step in plan.stops}
    if mode is Mode.EXCLUSIVE:
        # Every running holder and every shared claimant makes room...
        assert all(h.ref in stopped for h in running)
        assert set(plan.preempted_leases) == {item.claimant for item in blocking}
        # ...and every function not yet on vfio-pci goes there.
        assert {s.address for s in plan.switches} == {
            f.address for f in spec.functions if f.driver != VFIO
        }
        assert all(s.to_driver == VFIO for s in plan.switches)
    elif blocking:
        # A later shared claim only counts.
        assert plan.stops == () and plan.switches == () and plan.cdi_tokens == ()
    else:
        # The first shared claim brings every function home and stops only what has
        # the GPU passed through: a unit or a container on the home driver stays.
        assert {s.address for s in plan.switches} == {
            f.address for f in spec.functions if f.driver != HOMES["recorded"][f.address]
        }
        assert stopped == {h.ref for h in running if h.passthrough}
        assert plan.cdi_tokens == ("gpu0",)


# -- SR-IOV: a physical function and its virtual functions (core/vfs.py) ------------------

PF = "0000:01:00.0"
VF0 = "0000:01:00.1"
FAMILY_COVERAGE = {"pf": (PF,), "vf0": (VF0,)}
PARENTS = {"vf0": "pf"}


def pf_token(vfs: tuple[str, ...] = (VF0,)) -> TokenSpec:
    sriov = Sriov(total_vfs=2, vfs=vfs)
    return TokenSpec("pf", PF, (PciFunction(PF, "8086", "56c0", "030000", "xe", "4", sriov=sriov),))


def vf_token(driver: str | None = "xe", *, present: bool = True) -> TokenSpec:
    function = PciFunction(VF0, "8086", "56c1", "030000", driver, "5", physfn=PF)
    return TokenSpec("vf0", VF0, (function,) if present else (), vf_of=PF)


def vm_with_the_vf(pid: int = 4242) -> DeviceUser:
    return DeviceUser(pid, "qemu-system-x86", "/dev/vfio/5", VF0, Claimant.parse("libvirt:vm"))


def claim(state, claimant, mode, spec, **extra):
    return decide_claim(
        state, claimant, mode, [spec], [], NONE, coverage=FAMILY_COVERAGE, parents=PARENTS, **extra
    )


def test_a_vf_lease_is_a_shared_use_of_its_pf_which_an_exclusive_claim_may_not_take():
    """libvirt:vm has vf0 passed through: the PF stays on its driver for it.  An
    exclusive claim on the PF is refused naming the lease; a shared one goes on beside
    it (sharing is use on the home driver, which is what the VF needs of its PF)."""
    state = EMPTY.with_lease(lease("libvirt:vm", Mode.EXCLUSIVE, "vf0"))
    with pytest.raises(ClaimRefused) as refused:
        claim(state, "libvirt:whole", Mode.EXCLUSIVE, pf_token())
    assert f"{VF0} (token vf0) is leased by libvirt:vm (exclusive)" in str(refused.value)
    assert "virtual functions are in use" in str(refused.value) and not refused.value.retry
    plan = claim(state, "container:ai", Mode.SHARED, pf_token())
    assert plan.tokens == ("pf",) and plan.stops == () and plan.switches == ()


def test_an_exclusive_claim_on_the_pf_names_who_has_a_vf_open_and_then_the_vfs_that_exist():
    with pytest.raises(ClaimRefused) as refused:
        claim(EMPTY, "libvirt:whole", Mode.EXCLUSIVE, pf_token(), vf_users=[vm_with_the_vf()])
    assert f"{VF0} is open: pid 4242 (qemu-system-x86) of libvirt:vm has /dev/vfio/5 open" in str(
        refused.value
    )
    # Nobody uses them, but they exist: vfio-pci would not take the PF.
    with pytest.raises(ClaimRefused) as refused:
        claim(EMPTY, "libvirt:whole", Mode.EXCLUSIVE, pf_token())
    assert f"SR-IOV enabled (1 virtual function(s)): {VF0}" in str(refused.value)
    assert refused.value.hint == "remove them first: `charly-arbiter vfs pf 0`"
    # Without VFs the PF is passed through like any GPU.
    plan = claim(EMPTY, "libvirt:whole", Mode.EXCLUSIVE, pf_token(vfs=()))
    assert {(s.address, s.to_driver) for s in plan.switches} == {(PF, VFIO)}


def test_a_claim_on_a_vf_is_refused_while_its_pf_is_held_exclusively_poisoned_or_the_vf_absent():
    held = EMPTY.with_lease(lease("libvirt:whole", Mode.EXCLUSIVE, "pf"))
    for mode in Mode:
        with pytest.raises(
            ClaimRefused,
            match=f"its physical function {PF} \\(token pf\\) is held exclusively by libvirt:whole",
        ):
            claim(held, "libvirt:vm", mode, vf_token())
    poisoned = EMPTY.with_poison("pf", Poison("unbind hung", "2026-01-01T00:00:00+00:00"))
    with pytest.raises(ClaimRefused) as refused:
        claim(poisoned, "libvirt:vm", Mode.EXCLUSIVE, vf_token())
    assert "(token pf) is poisoned since" in str(refused.value) and "unbind hung" in str(
        refused.value
    )
    assert refused.value.hint.endswith("`charly-arbiter poison clear pf`")
    with pytest.raises(ClaimRefused) as refused:
        claim(EMPTY, "libvirt:vm", Mode.EXCLUSIVE, vf_token(present=False))
    assert f"a virtual function of {PF} that does not exist now" in str(refused.value)
    assert refused.value.hint == "raise the VF count of pf: `charly-arbiter vfs pf N`"
    # A shared lease on the PF is a use on its home driver: the VF is claimed beside it.
    shared = EMPTY.with_lease(lease("container:ai", Mode.SHARED, "pf"))
    plan = claim(shared, "libvirt:vm", Mode.EXCLUSIVE, vf_token())
    assert plan.switches == (Switch("vf0", VF0, "xe", VFIO),) and plan.preempted_leases == ()


PF_LEASES = {
    "none": (),
    "shared": (lease("container:ai", Mode.SHARED, "pf"),),
    "exclusive": (lease("libvirt:whole", Mode.EXCLUSIVE, "pf"),),
    "exclusive-acquiring": (
        lease("libvirt:whole", Mode.EXCLUSIVE, "pf", state=LeaseState.ACQUIRING),
    ),
    "poisoned": (),
}
VF_LEASES = {
    "none": (),
    "exclusive": (lease("libvirt:vm", Mode.EXCLUSIVE, "vf0"),),
    "shared": (lease("container:vf", Mode.SHARED, "vf0"),),
    "exclusive-releasing": (
        lease("libvirt:vm", Mode.EXCLUSIVE, "vf0", state=LeaseState.RELEASING).with_switch(
            "vf0", StepState.PLANNED
        ),
    ),
    "exclusive-gone-home": (
        lease("libvirt:vm", Mode.EXCLUSIVE, "vf0", state=LeaseState.RELEASING).with_switch(
            "vf0", StepState.DONE
        ),
    ),
    # The VF went home, and the release is about to give container:vf (which it had
    # preempted) its shared lease on the VF back.
    "gone-home-giving-back": (
        lease(
            "libvirt:vm",
            Mode.EXCLUSIVE,
            "vf0",
            state=LeaseState.RELEASING,
            stopped=[StoppedHolder("container:vf", StepState.DONE, ("vf0",), tokens=("vf0",))],
        ).with_switch("vf0", StepState.DONE),
    ),
}
VF_STATES = ("present", "open", "absent")
FAMILY_CLAIMS = [(name, mode) for name in ("pf", "vf0") for mode in Mode]


@pytest.mark.parametrize("pf_lease", sorted(PF_LEASES))
@pytest.mark.parametrize("vf_lease", sorted(VF_LEASES))
@pytest.mark.parametrize("vf_state", VF_STATES)
@pytest.mark.parametrize("claimed", FAMILY_CLAIMS, ids=lambda c: f"{c[0]}-{c[1]}")
def test_every_pf_and_vf_state_obeys_the_relation(pf_lease, vf_lease, vf_state, claimed):
    """Exhaustive over (the PF's lease or poison, the VF's lease, whether the VF exists
    and is open, which of the two is claimed and how).  The rules, written out here:
    a VF's lease is a shared use of its PF, the PF is never taken exclusively from under
    a VF in use nor while VFs exist, and a VF is never claimed from under its PF's
    exclusive owner, its poison, or while it does not exist."""
    name, mode = claimed
    state = EMPTY
    for item in PF_LEASES[pf_lease] + VF_LEASES[vf_lease]:
        state = state.with_lease(item)
    if pf_lease == "poisoned":
        state = state.with_poison("pf", Poison("hung", "2026-01-01T00:00:00+00:00"))
    present = vf_state != "absent"
    vf_blocking = [item for item in state.leases if blocks_token(item, "vf0")]
    vf_exclusive = [
        item for item in state.leases if item.mode is Mode.EXCLUSIVE and "vf0" in item.tokens
    ]
    # On vfio-pci while an exclusive lease holds it; home again once its release sent it.
    vf_driver = VFIO if present and any(item in vf_blocking for item in vf_exclusive) else "xe"
    users = [vm_with_the_vf()] if vf_state == "open" else []
    pf_spec = pf_token(vfs=(VF0,) if present else ())
    spec = pf_spec if name == "pf" else vf_token(vf_driver, present=present)
    pf_blocking = [item for item in state.leases if blocks_token(item, "pf")]

    reasons = set()
    if name == "pf":
        if pf_lease == "poisoned":
            reasons.add("poisoned")
        if any(item.mode is Mode.EXCLUSIVE for item in pf_blocking):
            reasons.add("held exclusively")
        giving_back = [
            r for item in state.leases for r in item.unrestored() if "vf0" in r.shared_tokens
        ]
        if mode is Mode.EXCLUSIVE:
            if vf_blocking or users or giving_back:
                reasons.add("its VFs are in use")
            if present:
                reasons.add("VFs exist")
    else:
        if not present:
            reasons.add("absent")
        if pf_lease == "poisoned":
            reasons.add("its PF is poisoned")
        if any(item.mode is Mode.EXCLUSIVE for item in pf_blocking):
            reasons.add("its PF is held exclusively")
        if any(item.mode is Mode.EXCLUSIVE for item in vf_blocking):
            reasons.add("held exclusively")
        if mode is Mode.EXCLUSIVE and any(
            item.state is not LeaseState.ACTIVE for item in vf_blocking
        ):
            reasons.add("in progress")
        if present and vf_driver == VFIO and not vf_exclusive:
            reasons.add("unaccounted")
    try:
        plan = claim(state, "libvirt:me", mode, spec, vf_users=users if name == "pf" else [])
    except ClaimRefused as refused:
        assert refused.exit_code == 3, refused
        assert reasons, (pf_lease, vf_lease, vf_state, claimed, refused)
        if reasons == {"its VFs are in use"}:
            for item in vf_blocking:
                assert f"is leased by {item.claimant}" in str(refused)
            for user in users:
                assert f"pid {user.pid}" in str(refused)
        return
    assert not reasons, (pf_lease, vf_lease, vf_state, claimed, reasons)
    if name == "pf" and mode is Mode.EXCLUSIVE:
        assert {s.address for s in plan.switches} == {PF}
    if name == "vf0" and mode is Mode.EXCLUSIVE:
        # The VF goes to vfio-pci; its PF is never switched, and never stopped for it.
        assert {s.address for s in plan.switches} <= {VF0}
        assert all(s.address != PF for s in plan.switches)


# -- NVIDIA vGPU on virtual functions (core/vgpu.py) --------------------------------------

GVF = "0000:41:00.4"
TYPES = ((557, "NVIDIA L40S-1Q"), (558, "NVIDIA L40S-2Q"))


def vgpu_token(type_wanted, driver, files, current):
    """The VF as the host reads it: on `driver`, with nvidia/'s vGPU files or not (listing
    only 558 while another VF has it, everything else while none has), `current` its
    type; the token's configured `vgpu_type`."""
    creatable = () if current else TYPES
    vgpu = Vgpu(creatable, current) if files else None
    function = PciFunction(GVF, "10de", "26b9", "030200", driver, "31", physfn=PF, vgpu=vgpu)
    return TokenSpec("gvf", GVF, (function,), vgpu_type=type_wanted)


VGPU_LEASES = {
    "none": (),
    "exclusive": (lease("libvirt:vm", Mode.EXCLUSIVE, "gvf"),),
    "shared": (lease("container:s", Mode.SHARED, "gvf"),),
}


@pytest.mark.parametrize("type_wanted", [None, "558", "NVIDIA L40S-1Q", "999"])
@pytest.mark.parametrize("driver", ["nvidia", None])
@pytest.mark.parametrize("files", [True, False])
@pytest.mark.parametrize("current", [0, 558])
@pytest.mark.parametrize("existing", sorted(VGPU_LEASES))
@pytest.mark.parametrize("mode", list(Mode))
def test_every_vgpu_state_obeys_the_rules(type_wanted, driver, files, current, existing, mode):
    """Exhaustive over (the configured type, the VF's driver, whether it has nvidia/'s
    vGPU files, its current type, a lease on it, the mode).  A vGPU VF is only claimed
    exclusively, with a type it lists as creatable now, while on nvidia; the claim
    switches no driver, its one step is the type; a type set with no exclusive lease
    to account for it is the host contradicting the ledger."""
    if current and not files:
        return  # a type needs the files
    state = EMPTY
    for item in VGPU_LEASES[existing]:
        state = state.with_lease(item)
    spec = vgpu_token(type_wanted, driver, files, current)
    vgpu_vf = files or type_wanted is not None
    creatable = {str(i) for i, _ in TYPES} | {n.lower() for _, n in TYPES} if not current else set()
    reasons = set()
    exclusive_lease = existing == "exclusive"
    if current and not exclusive_lease:
        reasons.add("unaccounted")
    if exclusive_lease:
        reasons.add("held exclusively")
    if vgpu_vf and mode is Mode.SHARED:
        reasons.add("shared")
    if vgpu_vf and mode is Mode.EXCLUSIVE:
        if type_wanted is None:
            reasons.add("no type")
        elif not files or driver != "nvidia":
            reasons.add("not a vGPU VF")
        elif type_wanted.lower() not in creatable:
            reasons.add("not creatable")
    if not vgpu_vf and mode is Mode.SHARED and driver is None and existing == "none":
        reasons.add("no driver takes it")  # the first shared claim, as for any GPU
    try:
        plan = decide_claim(state, "libvirt:me", mode, [spec], [], NONE)
    except ClaimRefused as refused:
        assert reasons, (type_wanted, driver, files, current, existing, mode, refused)
        return
    assert not reasons, (type_wanted, driver, files, current, existing, mode, reasons)
    if vgpu_vf:
        # The VF never leaves nvidia: its claim's one step is the type.
        wanted = {"558": 558, "nvidia l40s-1q": 557}[type_wanted.lower()]
        assert [(s.address, s.to_driver) for s in plan.switches] == [(GVF, f"vgpu:{wanted}")]
    elif mode is Mode.EXCLUSIVE and driver != VFIO:
        assert [(s.address, s.to_driver) for s in plan.switches] == [(GVF, VFIO)]


# -- an exclusive claim that leaves the GPU on its driver (the arbiter's MIG change) -----


@pytest.mark.parametrize("existing", sorted(EXISTING))
@pytest.mark.parametrize("holders", sorted(HOLDER_KINDS))
@pytest.mark.parametrize("drivers", sorted(DRIVERS))
@pytest.mark.parametrize("home", sorted(HOMES))
def test_every_state_obeys_the_rules_of_a_claim_in_place(existing, holders, drivers, home):
    """Exhaustive as above, for `in_place`: refused exactly when an exclusive claim is,
    or when a function is on vfio-pci (it is done on the GPU's own driver); granted, it
    stops every running holder and every shared claimant, as an exclusive claim does,
    and switches nothing."""
    state = EMPTY.with_home("gpu0", HOMES[home])
    for item in EXISTING[existing]:
        state = state.with_lease(item)
    spec = token(drivers=DRIVERS[drivers])
    running = [h for h in HOLDER_KINDS[holders] if h.running]
    blocking = [item for item in state.leases if blocks_token(item, "gpu0")]
    on_vfio = any(f.driver == VFIO for f in spec.functions)
    reasons = set()
    if any(
        set(COVERAGE[name]) & {GPU0, AUDIO0}
        for item in state.leases
        for name in item.tokens
        if name != "gpu0" and blocks_token(item, name)
    ):
        reasons.add("overlap")
    if any(item.mode is Mode.EXCLUSIVE for item in blocking):
        reasons.add("held exclusively")
    if any(not h.preemptible for h in running):
        reasons.add("not preemptible")
    if any(item.state is not LeaseState.ACTIVE for item in blocking):
        reasons.add("in progress")
    if on_vfio:
        reasons.add("on vfio-pci")  # unaccounted, held, or bound there: not its driver
    ours = operation_claimant("mig", "gpu0")
    try:
        plan = decide_claim(
            state, ours, Mode.EXCLUSIVE, [spec], HOLDER_KINDS[holders], NONE,
            coverage=COVERAGE, in_place=True,
        )  # fmt: skip
    except ClaimRefused as refused:
        assert refused.exit_code == 3 and reasons, (existing, holders, drivers, home, refused)
        return
    assert not reasons, (existing, holders, drivers, home, reasons)
    assert plan.switches == ()
    assert {step.holder for step in plan.stops} >= {h.ref for h in running}
    assert set(plan.preempted_leases) == {item.claimant for item in blocking}


# -- the screen: a display manager, sessions, a compositor (issue 19 items 3 and 5) --------

ALICE = ScreenSession("3", "seat0", "wayland", 1000, "alice", 900, "gdm.service")
SHELL = ScreenProcess(912, "gnome-shell", 1000, ("card0",), "3", "session-3.scope")
PIPEWIRE = ScreenProcess(
    950, "pipewire", 1000, ("renderD128",), None, "user@1000.service/app.slice/pipewire.service"
)
XORG = ScreenProcess(700, "Xorg", 0, ("card0",), None, "lightdm.service")
WESTON = ScreenProcess(800, "weston", 0, ("card0",), None, None)
SCREENS = {
    "unread": None,
    "nothing": ScreenUse("gpu0", False, False),
    # The boot display with the console on it and nobody's session: the console policy's.
    "console": ScreenUse("gpu0", True, True),
    "desktop": ScreenUse(
        "gpu0",
        True,
        True,
        (SHELL, PIPEWIRE),
        (ALICE,),
        "gdm.service",
        ("user@1000.service: pipewire.service",),
    ),
    # Item 5: the compositor of a desktop on another GPU opened this one's card too.
    "compositor": ScreenUse("gpu0", False, False, (SHELL,), (ALICE,), "gdm.service"),
    # A display server the display manager's unit runs itself (lightdm), no session.
    "server": ScreenUse("gpu0", False, True, (XORG,), (), "lightdm.service"),
    # A display server started by hand: nobody's session, no display manager.
    "stray": ScreenUse("gpu0", False, False, (WESTON,)),
    # A desktop, and beside it that display server of nobody's.
    "mixed": ScreenUse("gpu0", True, True, (SHELL, WESTON), (ALICE,), "gdm.service"),
}
# What `screen = "release"` stops of each, in order (user units, sessions, the display
# manager), and the holders that go with them (the screen's processes, the display
# manager the host lists as a systemd holder too); a process of nobody's stays a holder.
RELEASED = {
    "desktop": (
        ["systemd-user:1000/pipewire.service", "session:3", "display-manager:gdm.service"],
        {"process:912", "process:950", "systemd:display-manager.service"},
    ),
    "compositor": (
        ["session:3", "display-manager:gdm.service"],
        {"process:912", "systemd:display-manager.service"},
    ),
    "mixed": (
        ["session:3", "display-manager:gdm.service"],
        {"process:912", "systemd:display-manager.service"},
    ),
    "server": (
        ["display-manager:lightdm.service"],
        {"process:700", "systemd:display-manager.service"},
    ),
}


def screen_holders(use: ScreenUse | None) -> list[Holder]:
    """What the host lists as holders of a screen: its processes, and the display
    manager's unit (`display-manager.service`) where it has one."""
    if use is None:
        return []
    found = [Holder(f"process:{p.pid}", ("gpu0",), True, True, how="kill") for p in use.processes]
    if use.display_manager:
        found.append(Holder("systemd:display-manager.service", ("gpu0",), True, True))
    return found


@pytest.mark.parametrize("screen", sorted(SCREENS))
@pytest.mark.parametrize("policy", list(ScreenPolicy))
@pytest.mark.parametrize("existing", sorted(EXISTING))
@pytest.mark.parametrize("mode", list(Mode))
@pytest.mark.parametrize("how", ["claim", "in-place", "vgpu"])
def test_every_screen_state_obeys_the_rule(screen, policy, existing, mode, how):
    """Exhaustive over (who uses the screen, the token's `screen`, an existing lease, the
    mode, how it is claimed), with the screen's processes and display manager among the
    holders, as a host lists them.  One rule for both policies: an exclusive claim that
    passes the GPU through, where processes of the screen have it open, is refused
    naming them under "refuse", and under "release" stops, last and in order, the user
    units, sessions and display manager they belong to instead of them as holders (a
    process of nobody's stays a holder); never either otherwise.  Whatever else refuses
    the claim refuses it as without the snapshot; a granted exclusive claim carries the
    screen it takes in its plan."""
    state = EMPTY.with_home("gpu0", HOMES["recorded"])
    for item in EXISTING[existing]:
        state = state.with_lease(item)
    spec = replace(token(), screen=policy)
    if how == "vgpu":
        spec = vgpu_token("558", "nvidia", True, 0)
        spec = replace(spec, name="gpu0", screen=policy)
    use = SCREENS[screen]
    screens = {} if use is None else {"gpu0": use}
    holders = screen_holders(use)
    extra = {"in_place": how == "in-place", "coverage": COVERAGE}
    claimant = operation_claimant("mig", "gpu0") if how == "in-place" else "libvirt:me"
    mode = Mode.EXCLUSIVE if how == "in-place" else mode

    def decide(**more):
        return decide_claim(state, claimant, mode, [spec], holders, NONE, **extra, **more)

    try:
        without = decide()
    except ClaimRefused as refused:
        without = refused
    takes = mode is Mode.EXCLUSIVE and how == "claim" and use is not None
    used = takes and bool(use.processes)
    refuses = used and policy is ScreenPolicy.REFUSE
    stops, freed = RELEASED.get(screen, ([], set())) if used else ([], set())
    try:
        plan = decide(screens=screens)
    except ScreenInUse as refused:
        assert refuses, (screen, policy, existing, mode, how, refused)
        assert refused.exit_code == 3 and refused.token == spec.label
        assert 'screen = "release"' in (refused.hint or "")
        return
    except ClaimRefused as refused:
        # Another reason, which refuses the claim with or without the screen (the
        # poison, an overlap and the PF/VF relation are checked first).
        assert isinstance(without, ClaimRefused) and str(refused) == str(without)
        return
    assert not refuses, (screen, policy, existing, mode, how)
    assert not isinstance(without, ClaimRefused), (screen, policy, existing, mode, how)
    kept = [step for step in without.stops if str(step.holder) not in freed]
    assert [(str(s.holder), s.tokens) for s in plan.stops] == [
        *((str(s.holder), s.tokens) for s in kept),
        *((holder, ("gpu0",)) for holder in stops),
    ], (screen, policy, existing, mode, how)
    assert replace(plan, screens={}, stops=()) == replace(without, stops=())
    if takes and use.drives_screen:
        assert plan.screens == {"gpu0": use}
    else:
        assert plan.screens == {}


def test_the_refusal_names_the_display_manager_the_session_and_the_user():
    with pytest.raises(ScreenInUse) as refused:
        decide_claim(
            EMPTY, "libvirt:win11", Mode.EXCLUSIVE, [token()], [], NONE,
            screens={"gpu0": SCREENS["desktop"]},
        )  # fmt: skip
    error = refused.value
    assert str(error) == (
        "libvirt:win11 cannot claim gpu0 (0000:0a:00.0): gpu0 drives seat0: gdm.service, "
        "the wayland session of alice, uid 1000 (session 3), the user units "
        "user@1000.service: pipewire.service; it is the boot display; the text console runs "
        "on it; gnome-shell (pid 912) draws on it; passing it through would end that desktop"
    )
    assert (error.holder, error.users) == ("gdm.service", ("alice (uid 1000)",))
    assert 'set `screen = "release"` for gpu0' in (error.hint or "")
    assert "gdm.service, session 3" in (error.hint or "")
    assert "loginctl terminate-session 3" in (error.hint or "")


def test_a_compositor_on_a_gpu_that_is_not_the_boot_display_is_named_with_its_user():
    """Item 5: never killed silently; refused naming the compositor, session, user."""
    with pytest.raises(ScreenInUse) as refused:
        decide_claim(
            EMPTY, "libvirt:win11", Mode.EXCLUSIVE, [token()], [], NONE,
            screens={"gpu0": SCREENS["compositor"]},
        )  # fmt: skip
    why = refused.value.why
    assert why.startswith(
        "the compositor gnome-shell (pid 912) of the wayland session of alice, uid 1000 "
        "(session 3) has it open, although it is not the boot display"
    )
    released = replace(token(), screen=ScreenPolicy.RELEASE)
    plan = decide_claim(
        EMPTY, "libvirt:win11", Mode.EXCLUSIVE, [released], [], NONE,
        screens={"gpu0": SCREENS["compositor"]},
    )  # fmt: skip
    assert plan.screens == {"gpu0": SCREENS["compositor"]}
