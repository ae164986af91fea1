"""Proxmox VE: the hookscript, the guest configurations, and guests as holders.

What lives here: `hook` (the hookscript's entry point: argv, the stdout guard,
the byte scan of the VM's configuration and the error boundary; it imports
nothing else until a VM may claim a GPU), `hookrun` (the slow path), `vmconf`
(the configuration files of VMs and containers, as qemu-server and pve-container
read them: `hostpciN`, `devN`, `lxc.*`, the description and the tags), `mapping`
(the cluster's PCI mapping file and qemu-server's PCI reservations), `claims`
(a VM's claim from its configuration) and `holders` (other VMs through `qm`,
containers through `pct`).  docs/proxmox.md says what was read of Proxmox's
own source to get each of them right.
What it may import: `core/`, `host/`, `compose` and `ops/`; never `cli/`.
"""
