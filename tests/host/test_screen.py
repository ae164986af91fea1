"""Who uses a GPU's screen, read from fake /sys, /proc, /dev and /run trees laid out as
real systemd 252, logind and weston lay them out (tests/kernel/sysguest.py boots the
real ones): host/screen.py."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
from fakesys import FakeDevice, FakeKernel, FakeProc, FakeProcess, FakeRun, add_process, desktop

from charly_arbiter.core.config import Config, Timeouts, TokenConfig
from charly_arbiter.host.local import LocalHost
from charly_arbiter.host.screen import unit_of_cgroup
from charly_arbiter.host.sysfs import Roots

BOOT = "0000:0a:00.0"
SECOND = "0000:0b:00.0"


@pytest.fixture
def tree(tmp_path: Path):
    """The boot GPU (card0, renderD128, fb0 with fbcon on it) and a second GPU
    (card1, renderD129) that drives nothing by itself."""
    kernel = FakeKernel(tmp_path, loaded={"vfio-pci", "amdgpu", "nouveau"})
    kernel.fbcon(bound=True)
    kernel.add(
        FakeDevice(
            BOOT,
            "1002",
            "744c",
            "030000",
            "amdgpu",
            "12",
            boot_vga=True,
            drm=("card0", "renderD128"),
            framebuffer="fb0",
        )
    )
    kernel.add(
        FakeDevice(SECOND, "10de", "2684", "030000", "nouveau", "13", drm=("card1", "renderD129"))
    )
    proc = tmp_path / "proc"
    FakeProc(proc)
    run = FakeRun(tmp_path / "run")
    config = Config(
        state_dir=tmp_path / "state",
        timeouts=Timeouts(driver_switch=1.0),
        tokens=(TokenConfig("gpu0", BOOT), TokenConfig("gpu1", SECOND)),
    )
    host = LocalHost(
        config,
        roots=Roots(sys=kernel.sys, proc=proc, dev=kernel.dev, run=tmp_path / "run"),
        writer=kernel.write,
        sources={},
        isolate_writes=False,
    )
    return kernel, proc, run, host


def screen(host: LocalHost, name: str):
    from charly_arbiter.core.tokens import TokenCatalogue

    return host.screen(TokenCatalogue(host.config, host).all()[name])


def test_a_display_manager_with_its_own_session_is_found_by_its_invocation_id(tree):
    """Finding F1: charly-weston.service (PAMName=login) has an empty cgroup, its
    weston is in session-2.scope; only the leader's INVOCATION_ID names the unit."""
    kernel, proc, run, host = tree
    desktop(proc, run, kernel.dev)
    use = screen(host, "gpu0")
    [session] = use.sessions
    assert session.display_manager == "charly-weston.service"
    assert use.display_manager == "charly-weston.service"
    assert (session.id, session.seat, session.type, session.uid, session.user, session.leader) == (
        "2",
        "seat0",
        "wayland",
        998,
        "charly-weston",
        612,
    )
    assert use.describe() == (
        "gpu0 drives seat0: charly-weston.service, "
        "the wayland session of charly-weston, uid 998 (session 2), "
        "the user units user@998.service: pipewire.service; "
        "it is the boot display; the text console runs on it"
    )


def test_whose_processes_are_the_screens_and_which_are_not(tree):
    kernel, proc, run, host = tree
    desktop(proc, run, kernel.dev)
    use = screen(host, "gpu0")
    by_pid = {p.pid: p for p in use.processes}
    # ollama.service renders on it from a system unit: a holder, not the screen.
    assert sorted(by_pid) == [612, 700]
    weston, pipewire = by_pid[612], by_pid[700]
    assert (weston.comm, weston.uid, weston.nodes, weston.session, weston.unit) == (
        "weston",
        998,
        ("card0", "renderD128"),
        "2",
        "session-2.scope",
    )
    assert pipewire.session is None
    assert pipewire.unit == "user@998.service/session.slice/pipewire.service"
    assert use.user_units == ("user@998.service: pipewire.service",)
    assert use.as_json()["display_manager"] == "charly-weston.service"


def test_a_gpu_only_a_system_service_renders_on_drives_no_screen(tree):
    kernel, proc, _run, host = tree
    add_process(
        proc,
        FakeProcess(
            800,
            "ollama",
            uid=997,
            fds=(str(kernel.dev / "dri/renderD129"),),
            cgroup="/system.slice/ollama.service",
        ),
    )
    use = screen(host, "gpu1")
    assert not use.drives_screen
    assert use.processes == ()


def test_a_compositor_that_opened_the_second_gpu_too_is_found_there(tree):
    """Item 5: a two-GPU desktop's compositor holds the card of the GPU that is not
    the boot display."""
    kernel, proc, run, host = tree
    processes = desktop(proc, run, kernel.dev)
    second = replace(
        processes["weston"],
        pid=613,
        fds=(str(kernel.dev / "dri/card0"), str(kernel.dev / "dri/card1")),
    )
    add_process(proc, second)
    use = screen(host, "gpu1")
    assert (use.boot_vga, use.fbcon) == (False, False)
    assert [p.pid for p in use.processes] == [613]
    assert use.processes[0].nodes == ("card1",)
    assert use.display_manager == "charly-weston.service"
    assert use.describe() == (
        "gpu1 drives seat0: charly-weston.service, "
        "the wayland session of charly-weston, uid 998 (session 2)"
    )


def test_without_an_invocation_id_the_leaders_parent_service_is_the_display_manager(tree):
    """gdm's session worker leads the session; gdm itself stays in gdm.service."""
    kernel, proc, run, host = tree
    run.session("3", uid=1000, user="alice", leader=900, service="gdm-password")
    add_process(proc, FakeProcess(850, "gdm", cgroup="/system.slice/gdm.service"))
    add_process(
        proc,
        FakeProcess(
            900,
            "gdm-session-wor",
            cgroup="/user.slice/user-1000.slice/session-3.scope",
            sessionid="3",
            ppid=850,
        ),
    )
    add_process(
        proc,
        FakeProcess(
            912,
            "gnome-shell",
            uid=1000,
            fds=(str(kernel.dev / "dri/card0"),),
            cgroup="/user.slice/user-1000.slice/session-3.scope",
            sessionid="3",
            ppid=900,
        ),
    )
    use = screen(host, "gpu0")
    assert use.display_manager == "gdm.service"
    assert use.describe().startswith(
        "gpu0 drives seat0: gdm.service, the wayland session of alice, uid 1000 (session 3)"
    )


def test_a_display_server_run_by_the_display_managers_own_unit(tree):
    """lightdm runs Xorg in lightdm.service itself: no session of its own."""
    kernel, proc, _run, host = tree
    add_process(
        proc,
        FakeProcess(
            700,
            "Xorg",
            fds=(str(kernel.dev / "dri/card1"),),
            cgroup="/system.slice/lightdm.service",
        ),
    )
    use = screen(host, "gpu1")
    assert use.display_manager == "lightdm.service"
    assert use.sessions == ()
    assert use.describe() == "gpu1 drives the host's screen: lightdm.service"


def test_a_session_without_audit_is_found_by_its_scope(tree):
    """Without the kernel's audit (sessionid unset), logind names sessions c1, c2, ..."""
    kernel, proc, run, host = tree
    run.session("c1", uid=120, user="gdm", leader=640, type="wayland")
    add_process(
        proc,
        FakeProcess(
            640,
            "gnome-shell",
            uid=120,
            fds=(str(kernel.dev / "dri/card0"),),
            cgroup="/user.slice/user-120.slice/session-c1.scope",
        ),
    )
    use = screen(host, "gpu0")
    assert [s.id for s in use.sessions] == ["c1"]
    assert use.processes[0].session == "c1"


def test_an_ssh_login_rendering_on_it_is_no_screen_but_a_seated_tty_login_is(tree):
    kernel, proc, run, host = tree
    run.session("7", uid=1001, user="bob", leader=1500, seat=None, type="tty", service="sshd")
    add_process(
        proc,
        FakeProcess(
            1510,
            "vkcube",
            uid=1001,
            fds=(str(kernel.dev / "dri/renderD129"),),
            cgroup="/user.slice/user-1001.slice/session-7.scope",
            sessionid="7",
        ),
    )
    assert not screen(host, "gpu1").drives_screen
    run.session("8", uid=1001, user="bob", leader=1600, seat="seat0", type="tty")
    add_process(
        proc,
        FakeProcess(
            1610,
            "kmscube",
            uid=1001,
            fds=(str(kernel.dev / "dri/renderD129"),),
            cgroup="/user.slice/user-1001.slice/session-8.scope",
            sessionid="8",
        ),
    )
    use = screen(host, "gpu1")
    assert [p.pid for p in use.processes] == [1610]
    assert use.describe() == "gpu1 drives seat0: the tty session of bob, uid 1001 (session 8)"


def test_a_gpu_nobody_uses_drives_no_screen(tree):
    _kernel, _proc, _run, host = tree
    assert screen(host, "gpu1").describe() == "gpu1 drives no screen"


@pytest.mark.parametrize(
    ("path", "unit"),
    [
        ("/system.slice/gdm.service", "gdm.service"),
        ("/user.slice/user-1000.slice/session-3.scope", "session-3.scope"),
        (
            "/user.slice/user-1000.slice/user@1000.service/app.slice/x.service",
            "user@1000.service/app.slice/x.service",
        ),
        (
            "/user.slice/user-1000.slice/user@1000.service/init.scope",
            "user@1000.service/init.scope",
        ),
        ("/system.slice/docker-abc.scope", "docker-abc.scope"),
        ("/system.slice/foo.service/payload", "foo.service"),
        ("/user.slice", None),
        ("/", None),
    ],
)
def test_the_unit_of_a_cgroup(path: str, unit: str | None) -> None:
    assert unit_of_cgroup(path) == unit


def test_detect_says_who_uses_each_gpus_screen_in_words_and_in_json(tree):
    from charly_arbiter.host.detect import detect, document, render

    kernel, proc, run, host = tree
    desktop(proc, run, kernel.dev)
    found = detect(host)
    text = render(found)
    assert (
        "    gpu0 drives seat0: charly-weston.service, the wayland session of charly-weston, "
        "uid 998 (session 2)"
    ) in text
    assert "    gpu1 drives no screen" in text
    [boot] = [g for g in document(found)["gpus"] if g["address"] == BOOT]
    assert boot["screen"]["display_manager"] == "charly-weston.service"
    assert boot["screen"]["sessions"][0]["user"] == "charly-weston"
    assert [p["pid"] for p in boot["screen"]["processes"]] == [612, 700]


def test_a_service_holding_the_card_is_a_holder_but_a_kiosk_compositor_is_the_screen(tree):
    """tests/kernel/test_systemd_units.py's card holder (a GPU service with card0 open,
    as an inference server may have) is no one's screen; a kiosk's cage run by a unit
    of its own, in no session, is, and its unit is the display manager."""
    kernel, proc, _run, host = tree
    card = str(kernel.dev / "dri/card1")
    add_process(
        proc, FakeProcess(500, "sleep", fds=(card,), cgroup="/system.slice/charly-card.service")
    )
    assert not screen(host, "gpu1").drives_screen
    add_process(proc, FakeProcess(520, "cage", fds=(card,), cgroup="/system.slice/kiosk.service"))
    use = screen(host, "gpu1")
    assert [p.pid for p in use.processes] == [520]
    assert use.display_manager == "kiosk.service"


def test_logind_and_pid_1_holding_the_card_for_a_session_are_no_holders(tree):
    """They hold the session's card for it and let go when it ends; as holders
    (not preemptible: they cannot be stopped) they refused the real guest's release of
    its desktop.  The system service that renders on the GPU stays a holder."""
    kernel, proc, run, host = tree
    desktop(proc, run, kernel.dev)
    from charly_arbiter.core.tokens import TokenCatalogue

    token = TokenCatalogue(host.config, host).all()["gpu0"]
    pids = {h.ref.name for h in host.processes.holders([token])}
    assert "1" not in pids and "310" not in pids
    assert {"612", "700", "800"} <= pids
