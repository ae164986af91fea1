"""NVIDIA's vGPU on SR-IOV virtual functions, as a claim sees it (pure).

From vGPU software 17 on GPUs that have no mdev (Ada, Hopper and newer), a
VM gets a vGPU as a virtual function that stays on `nvidia`: its type is
written to the VF's `nvidia/current_vgpu_type` before the VM starts and 0
after it stopped, and binding the VF to vfio-pci is refused (EINVAL;
kubevirt#17642).  So the exclusive claim on such a VF (a VM passing it
through) switches no driver: its one step is the type, `vgpu:ID` in place of
vfio-pci (`core.host.VGPU`), and its way home clears the type.

A VF is a vGPU VF when it is on `nvidia` and has `nvidia/creatable_vgpu_types`
(`PciFunction.vgpu`); the type comes from the token's `vgpu_type` in
arbiter.toml (an ID or a name as the VF lists it), since the VF a VM is given
is what decides its type, and a type not listed as creatable now is refused
before anything is stopped.
"""

from __future__ import annotations

from charly_arbiter.core.host import TokenSpec, vgpu_target
from charly_arbiter.core.model import Claimant, Mode
from charly_arbiter.errors import ClaimRefused

NVIDIA = "nvidia"


def vgpu_target_of(token: TokenSpec, claimant: Claimant, mode: Mode) -> str | None:
    """The switch target of a claim on `token` when it is a vGPU VF (`vgpu:ID`), None
    when it is none, or the `ClaimRefused` that says why it cannot be had."""
    primary = token.primary
    vgpu = primary.vgpu if primary is not None else None
    if primary is None or (vgpu is None and token.vgpu_type is None):
        return None
    if mode is Mode.SHARED:
        raise ClaimRefused(
            token.label,
            claimant,
            "an NVIDIA vGPU virtual function is only given to a VM, which claims it exclusively",
        )
    if token.vgpu_type is None:
        assert vgpu is not None
        raise ClaimRefused(
            token.label,
            claimant,
            "it is an NVIDIA vGPU virtual function: it stays on nvidia and gets a vGPU type "
            "(vfio-pci refuses it), and no vgpu_type is configured for it",
            hint=f"set `vgpu_type` for {token.name} in arbiter.toml to one it can have now: "
            + vgpu.listed(),
        )
    if vgpu is None or primary.driver != NVIDIA:
        where = f"on {primary.driver}" if primary.driver else "bound to no driver"
        raise ClaimRefused(
            token.label,
            claimant,
            f"vgpu_type is set for it, but {primary.address} is {where}"
            + (", without nvidia/creatable_vgpu_types" if vgpu is None else ""),
            hint="an NVIDIA vGPU VF is one on nvidia with the vGPU manager's sysfs "
            "files; check the driver (`nvidia-smi vgpu`), or remove vgpu_type",
        )
    found = vgpu.find(token.vgpu_type)
    if found is None:
        raise ClaimRefused(
            token.label,
            claimant,
            f"it does not list vGPU type {token.vgpu_type!r} in creatable_vgpu_types (it can "
            f"have now: {vgpu.listed()})",
            hint="configure a type it lists; a GPU runs one vGPU type at a time unless it is "
            "in mixed mode, so the types of its other VFs decide what this one can have",
        )
    return vgpu_target(found[0])
