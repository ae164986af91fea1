"""The pure rules (planner.decide_claim) over hand-built ledger and host states.

No I/O: every rule is checked on values, so a failure names the rule."""

from __future__ import annotations

from dataclasses import replace

import pytest

from charly_arbiter.core.host import NO_DRIVER, Holder, PciFunction, TokenSpec
from charly_arbiter.core.model import (
    VFIO,
    Lease,
    LeaseState,
    LedgerState,
    Mode,
    Poison,
    StepState,
    StoppedHolder,
)
from charly_arbiter.core.planner import Policy, blocks_token, decide_claim, home_map
from charly_arbiter.errors import ClaimRefused, TokenPoisoned

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
    stopped_llm = Holder("container:llm", ("gpu0",), preemptible=False, running=False)
    plan = decide_claim(
        EMPTY, "libvirt:win11", Mode.EXCLUSIVE, [token(drivers=(VFIO, VFIO))], [stopped_llm], NONE
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


def test_exclusive_waits_for_a_shared_lease_still_being_acquired():
    state = EMPTY.with_lease(lease("container:llm", Mode.SHARED, state=LeaseState.ACQUIRING))
    with pytest.raises(ClaimRefused, match="acquiring"):
        decide_claim(state, "libvirt:win11", Mode.EXCLUSIVE, [token()], [], NONE)


def test_first_shared_claim_goes_home_stops_preemptible_holders_and_regenerates_cdi():
    state = EMPTY.with_home("gpu0", {GPU0: "nvidia", AUDIO0: "snd_hda_intel"})
    plan = decide_claim(
        state, "container:llm", Mode.SHARED, [token(drivers=(VFIO, VFIO))], [LLM, OLLAMA], NONE
    )
    assert [step.holder for step in plan.stops] == ["systemd:ollama.service"]
    assert {(s.address, s.to_driver) for s in plan.switches} == {
        (GPU0, "nvidia"),
        (AUDIO0, "snd_hda_intel"),
    }
    assert plan.cdi_tokens == ("gpu0",)


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
}
HOLDER_KINDS = {
    "none": (),
    "preemptible-running": (LLM,),
    "preemptible-stopped": (Holder("container:llm", ("gpu0",), True, False),),
    "fixed-running": (Holder("systemd:gdm.service", ("gpu0",), False, True),),
    "fixed-stopped": (Holder("systemd:gdm.service", ("gpu0",), False, False),),
}
DRIVERS = {"home": ("nvidia", "snd_hda_intel"), "vfio": (VFIO, VFIO), "mixed": (VFIO, None)}


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

    as_holder = Holder("container:s", ("gpu1",), preemptible=True, running=True)
    alone = LedgerState(leases=(releasing,))
    with pytest.raises(ClaimRefused, match="being started again"):
        decide_claim(alone, "container:t", Mode.SHARED, [gpu1], [as_holder], NONE)
    # Once it runs (the record restored), the same claims go ahead and stop it.
    done = alone.with_lease(releasing.with_stopped(replace(starting, restored=True)))
    plan = decide_claim(done, "container:t", Mode.SHARED, [gpu1], [as_holder], NONE)
    assert [step.holder for step in plan.stops] == ["container:s"]


@pytest.mark.parametrize("existing", sorted(EXISTING))
@pytest.mark.parametrize("holders", sorted(HOLDER_KINDS))
@pytest.mark.parametrize("drivers", sorted(DRIVERS))
@pytest.mark.parametrize("mode", list(Mode))
def test_every_state_pair_obeys_the_rules(existing, holders, drivers, mode):
    """Exhaustive over (existing lease, holder, drivers, requested mode)."""
    state = EMPTY.with_home("gpu0", {GPU0: "nvidia", AUDIO0: "snd_hda_intel"})
    for item in EXISTING[existing]:
        state = state.with_lease(item)
    spec = token(drivers=DRIVERS[drivers])
    blocking = [item for item in state.leases if blocks_token(item, "gpu0")]
    try:
        plan = decide_claim(state, "libvirt:me", mode, [spec], HOLDER_KINDS[holders], NONE)
    except ClaimRefused as refused:
        assert refused.exit_code == 3 and refused.claimant == "libvirt:me"
        assert (
            any(item.mode is Mode.EXCLUSIVE for item in blocking)
            or (mode is Mode.EXCLUSIVE and holders == "fixed-running")
            or (mode is Mode.EXCLUSIVE and any(i.state is not LeaseState.ACTIVE for i in blocking))
        ), (existing, holders, drivers, mode, refused)
        return
    # Never alongside an exclusive lease that still holds the token.
    assert not any(item.mode is Mode.EXCLUSIVE for item in blocking)
    stopped = {step.holder for step in plan.stops}
    if mode is Mode.EXCLUSIVE:
        # A running holder that may not be stopped refuses the claim...
        assert not any(h.running and not h.preemptible for h in HOLDER_KINDS[holders])
        # ...every other running holder and every shared claimant makes room...
        assert all(h.ref in stopped for h in HOLDER_KINDS[holders] if h.running)
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
        # The first shared claim brings every function home and stops
        # preemptible holders, never a fixed one.
        assert {s.address for s in plan.switches} == {
            f.address
            for f in spec.functions
            if f.driver != {GPU0: "nvidia", AUDIO0: "snd_hda_intel"}[f.address]
        }
        assert stopped == {h.ref for h in HOLDER_KINDS[holders] if h.running and h.preemptible}
        assert plan.cdi_tokens == ("gpu0",)
