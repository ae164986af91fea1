"""ScreenUse in words: what `detect`, `explain`, `plan` and the refusals say."""

from __future__ import annotations

from charly_arbiter.core.host import ScreenProcess, ScreenSession, ScreenUse

SESSION = ScreenSession("3", "seat0", "wayland", 1000, "alice", 900, "gdm.service")
SHELL = ScreenProcess(912, "gnome-shell", 1000, ("card0",), "3", "session-3.scope")


def test_a_desktop_in_words() -> None:
    use = ScreenUse("gpu0", True, True, (SHELL,), (SESSION,), "gdm.service")
    assert use.drives_screen
    assert use.describe() == (
        "gpu0 drives seat0: gdm.service, the wayland session of alice, uid 1000 (session 3); "
        "it is the boot display; the text console runs on it"
    )
    assert use.users == ("alice (uid 1000)",)
    assert use.as_json()["seats"] == ["seat0"]


def test_nothing_on_it_drives_no_screen() -> None:
    use = ScreenUse("gpu1", False, False)
    assert not use.drives_screen
    assert use.describe() == "gpu1 drives no screen"


def test_the_console_alone_and_a_display_server_of_a_system_unit() -> None:
    assert ScreenUse("gpu0", False, True).describe() == (
        "gpu0 drives the host's screen: the text console runs on it"
    )
    xorg = ScreenProcess(700, "Xorg", 0, ("card1",), None, "lightdm.service")
    pipewire = ScreenProcess(
        1200, "pipewire", 1000, ("renderD129",), None, "user@1000.service/app.slice/x.service"
    )
    use = ScreenUse(
        "gpu1", False, False, (xorg, pipewire), user_units=("user@1000.service: x.service",)
    )
    assert use.describe() == (
        "gpu1 drives the host's screen: Xorg (pid 700) of lightdm.service, "
        "the user units user@1000.service: x.service"
    )
