"""Simulated hosts for the tests, written in one place (docs/simulated-host.md has
every key).  Each builder returns host.toml text; a fault (`fail_switch = true`,
...) is an extra line on a device or a holder."""

from __future__ import annotations

from collections.abc import Iterable, Sequence


def device(
    address: str,
    *,
    vendor: str = "10de",
    model: str,
    pci_class: str,
    driver: str,
    group: int | None,
    extra: str = "",
) -> str:
    lines = [
        "[[devices]]",
        f'address = "{address}"',
        f'vendor = "{vendor}"',
        f'device = "{model}"',
        f'class = "{pci_class}"',
        f'driver = "{driver}"',
    ]
    if group is not None:
        lines.append(f"iommu_group = {group}")
    if extra:
        lines.append(extra.rstrip("\n"))
    return "\n".join(lines) + "\n"


def gpu(
    address: str,
    *,
    group: int,
    driver: str = "nvidia",
    vendor: str = "10de",
    model: str = "2684",
    extra: str = "",
) -> str:
    return device(
        address,
        vendor=vendor,
        model=model,
        pci_class="030000",
        driver=driver,
        group=group,
        extra=extra,
    )


def audio(
    address: str, *, group: int, vendor: str = "10de", model: str = "22ba", extra: str = ""
) -> str:
    return device(
        address,
        vendor=vendor,
        model=model,
        pci_class="040300",
        driver="snd_hda_intel",
        group=group,
        extra=extra,
    )


def holder(
    kind: str,
    name: str,
    tokens: Sequence[str],
    *,
    preemptible: bool,
    running: bool = True,
    extra: str = "",
) -> str:
    lines = [
        "[[holders]]",
        f'kind = "{kind}"',
        f'name = "{name}"',
        "tokens = [" + ", ".join(f'"{token}"' for token in tokens) + "]",
        f"preemptible = {str(preemptible).lower()}",
        f"running = {str(running).lower()}",
    ]
    if extra:
        lines.append(extra.rstrip("\n"))
    return "\n".join(lines) + "\n"


def host(*sections: str, real_holders: Iterable[str] = (), top: str = "") -> str:
    """A whole host.toml: top-level keys first, then devices and holders in order."""
    head = []
    if real_holders:
        head.append("real_holders = [" + ", ".join(f'"{k}"' for k in real_holders) + "]")
    if top:
        head.append(top.rstrip("\n"))
    return "\n".join([*head, *sections])


def default_host(
    *,
    gpu0: str = "",
    gpu1: str = "",
    llm: str = "",
    ollama: str = "",
    dm_preemptible: bool = False,
) -> str:
    """One GPU with its audio function (gpu0, group 12), a second GPU alone (gpu1,
    group 13), two preemptible holders of gpu0 and a display manager on gpu1;
    each keyword adds fault lines to that device or holder."""
    return host(
        gpu("0000:0a:00.0", group=12, extra=gpu0),
        audio("0000:0a:00.1", group=12),
        gpu("0000:0b:00.0", group=13, model="2204", extra=gpu1),
        holder("container", "llm", ["gpu0"], preemptible=True, extra=llm),
        holder("systemd", "ollama.service", ["gpu0"], preemptible=True, extra=ollama),
        holder("systemd", "display-manager.service", ["gpu1"], preemptible=dm_preemptible),
    )


PF = "0000:01:00.0"  # an SR-IOV physical function's address in the tests' hosts
VF0, VF1 = "0000:01:00.1", "0000:01:00.2"  # where its first two VFs go (offset 1, stride 1)


def sriov_pf(address: str = PF, *, total: int = 2, group: int = 4, extra: str = "") -> str:
    """A GPU with SR-IOV (Intel's xe, whose VFs come up on xe too): its VFs exist only
    after `sriov_numvfs` is written (`SimHost.write_sysfs`), each in a group of its own."""
    return device(
        address,
        vendor="8086",
        model="56c0",
        pci_class="030000",
        driver="xe",
        group=group,
        extra=f'sriov_totalvfs = {total}\nsriov_vf_device = "56c1"\nsriov_vf_driver = "xe"\n'
        + extra,
    )


def sriov_tokens(vfs: int | None = 2, *, vf_tokens: Sequence[str] = ("vf0",)) -> str:
    """arbiter.toml's tokens for `sriov_pf`: the PF (with its configured VF count) and
    VF tokens by address (vf0 at VF0, vf1 at VF1)."""
    places = {"vf0": VF0, "vf1": VF1}
    lines = ["", "[tokens.pf]", f'address = "{PF}"']
    if vfs is not None:
        lines.append(f"vfs = {vfs}")
    for name in vf_tokens:
        lines += ["", f"[tokens.{name}]", f'address = "{places[name]}"']
    return "\n".join(lines) + "\n"


VGPU_TYPES = '{ 557 = "NVIDIA L40S-1Q", 558 = "NVIDIA L40S-2Q", 560 = "NVIDIA L40S-4Q" }'


def vgpu_pf(address: str = PF, *, total: int = 2, group: int = 4) -> str:
    """An NVIDIA GPU whose VFs serve vGPU (vGPU 17 and later, no mdev): they come up
    on nvidia, each with the types of NVIDIA's guide's layout (see core.host.Vgpu)."""
    return device(
        address,
        vendor="10de",
        model="26b9",
        pci_class="030200",
        driver="nvidia",
        group=group,
        extra=f'sriov_totalvfs = {total}\nsriov_vf_device = "26b9"\nsriov_vf_driver = "nvidia"\n'
        f"vgpu_types = {VGPU_TYPES}\n",
    )


MIG_PROFILES = '{ "1g.10gb" = 1, "2g.20gb" = 2, "3g.40gb" = 3, "7g.80gb" = 7 }'


def mig_host(**faults: str) -> str:
    """The default host with gpu0 MIG-capable (an H100's profiles, as NVML lists them)."""
    return default_host(**faults).replace(
        'address = "0000:0a:00.0"\n',
        f'address = "0000:0a:00.0"\nmig_profiles = {MIG_PROFILES}\n',
        1,
    )


def session(
    device: str,
    *,
    session_id: str = "2",
    display_manager: str | None = "display-manager.service",
    user: str = "alice",
    uid: int = 1000,
    compositor: str = "gnome-shell",
    pid: int = 912,
    seat: str = "seat0",
    nodes: Sequence[str] = ("card0",),
    user_units: Sequence[str] = (),
) -> str:
    """A logind session on `device` whose compositor holds its card: present while the
    device is on its own driver and its display manager (a simulated holder) runs."""
    lines = [
        "[[sessions]]",
        f'device = "{device}"',
        f'id = "{session_id}"',
        f'seat = "{seat}"',
        'type = "wayland"',
        f"uid = {uid}",
        f'user = "{user}"',
        f"leader = {pid - 12}",
        f'compositor = "{compositor}"',
        f"pid = {pid}",
        "nodes = [" + ", ".join(f'"{n}"' for n in nodes) + "]",
        "user_units = [" + ", ".join(f'"{u}"' for u in user_units) + "]",
    ]
    if display_manager:
        lines.append(f'display_manager = "{display_manager}"')
    return "\n".join(lines) + "\n"


def desktop(
    address: str = "0000:0a:00.0",
    *,
    display_manager: str = "gdm.service",
    sessions: Sequence[tuple[str, int, str]] = (("3", 1000, "alice"),),
    user_units: Sequence[str] = ("org.gnome.Shell@wayland.service",),
    extra: str = "",
) -> str:
    """A desktop drawn on the GPU at `address` (`[[screens]]`): its display manager,
    the sessions it opened (id, uid, user) and user units of their user that hold the
    card; `extra` adds fault lines (`fail_start = true`: the display manager does not
    come up)."""
    lines = [
        "[[screens]]",
        f'address = "{address}"',
        f'display_manager = "{display_manager}"',
        "sessions = ["
        + ", ".join(f'{{ id = "{i}", uid = {uid}, user = "{user}" }}' for i, uid, user in sessions)
        + "]",
        "user_units = [" + ", ".join(f'"{unit}"' for unit in user_units) + "]",
    ]
    if extra:
        lines.append(extra.rstrip("\n"))
    return "\n".join(lines) + "\n"
