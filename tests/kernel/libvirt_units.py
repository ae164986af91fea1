"""libvirt's systemd units, as Debian 12 ships them: the systemd guest leaves them
alone at boot when a spec asks for libvirt (sysguest.py, host side), and the desktop
scenarios stop them at their end (desktop_scenarios.py, in the guest).  A module of
its own: the guest side imports nothing of the host side's."""

LIBVIRT_UNITS = frozenset(
    {
        "libvirtd.service",
        "libvirtd.socket",
        "libvirtd-ro.socket",
        "libvirtd-admin.socket",
        "virtlogd.service",
        "virtlogd.socket",
        "virtlogd-admin.socket",
        "virtlockd.service",
        "virtlockd.socket",
        "virtlockd-admin.socket",
    }
)
