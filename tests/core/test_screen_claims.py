"""Claims on a GPU someone's desktop runs on, over the simulated host's `[[sessions]]`
(issue 19 items 3 and 5): refused by default before anything is stopped, naming the
display manager, the session and its user; not refused for the screen with
`screen = "release"` (what is stopped then is the release's own work)."""

from __future__ import annotations

import json

import pytest
from coretools import check_invariants, host_state
from simhosts import audio, gpu, holder, host, session

from charly_arbiter.core.model import VFIO, Mode
from charly_arbiter.errors import ClaimRefused, ScreenInUse

EXCL = Mode.EXCLUSIVE
GPU1 = "0000:0b:00.0"


def desktop_host(*, dm_preemptible: bool = True, boot_vga: bool = True) -> str:
    """gpu0 (a container's), gpu1 the desktop's: display-manager.service's session 2."""
    return host(
        gpu("0000:0a:00.0", group=12),
        audio("0000:0a:00.1", group=12),
        gpu(GPU1, group=13, model="2204", extra="boot_vga = true" if boot_vga else ""),
        holder("container", "llm", ["gpu0"], preemptible=True),
        holder("systemd", "ollama.service", ["gpu0"], preemptible=True),
        holder("systemd", "display-manager.service", ["gpu1"], preemptible=dm_preemptible),
        session(GPU1, user_units=("pipewire.service",)),
    )


def test_the_desktops_gpu_is_refused_naming_its_display_manager_session_and_user(make_sim):
    sim = make_sim(desktop_host())
    before = host_state(sim)
    with pytest.raises(ScreenInUse) as refused:
        sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu1"])
    message = str(refused.value)
    assert "gpu1 drives seat0: display-manager.service" in message
    assert "the wayland session of alice, uid 1000 (session 2)" in message
    assert "user@1000.service: pipewire.service" in message
    assert host_state(sim) == before  # refused before anything was stopped
    check_invariants(sim)
    # The claim on the other GPU is none of the desktop's business.
    sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu0"])


def test_a_compositor_on_the_gpu_that_is_not_the_boot_display_is_refused_too(make_sim):
    sim = make_sim(desktop_host(boot_vga=False))
    with pytest.raises(ScreenInUse, match=r"the compositor gnome-shell \(pid 912\)"):
        sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu1"])


def test_with_release_the_screen_refuses_nothing_and_the_plan_carries_it(make_sim):
    sim = make_sim(desktop_host())
    config = sim.config_path.read_text().replace(
        'address = "0000:0b:00.0"', 'address = "0000:0b:00.0"\nscreen = "release"'
    )
    sim.config_path.write_text(config)
    plan = sim.arbiter().plan("libvirt:win11", EXCL, ["gpu1"])
    assert plan.screens["gpu1"].display_manager == "display-manager.service"
    sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu1"])
    assert json.loads((sim.sim_dir / "state.json").read_text())["drivers"][GPU1] == VFIO
    # Passed through, its desktop is gone (the display manager was stopped as a holder).
    assert sim.host().screen(sim.arbiter().tokens.all()["gpu1"]).processes == ()


def test_once_the_desktop_is_gone_the_claim_goes_ahead(make_sim):
    sim = make_sim(desktop_host(dm_preemptible=False))
    with pytest.raises(ScreenInUse):
        sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu1"])
    sim.host().set_running("systemd:display-manager.service", False)
    sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu1"])


def test_a_shared_claim_leaves_the_desktop_be(make_sim):
    sim = make_sim(desktop_host())
    sim.arbiter().acquire("container:x", Mode.SHARED, ["gpu1"])
    with pytest.raises(ClaimRefused):
        sim.arbiter().acquire("libvirt:win11", EXCL, ["gpu1"])
