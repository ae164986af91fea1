"""The outside world, behind the Host protocol: the real machine and the simulated one.

What lives here: `local` (the real machine) and `sim` (the file-backed
simulated host, with real holders where it says so); the sysfs and PCI layer
(one `Roots` for /sys, /proc, /dev and /run); bounded calls for everything that
may hang (`blocking`); the one subprocess door (`run`); the /proc scan; NVML;
PCI data and detection; device numbers to PCI functions (`devnodes`); drain
and ready commands around a holder's stop and start (`draining`); systemd
drop-ins (`units`); and the holder sources that touch systemctl, container
CLIs and processes (`holders/`).  What it may import: itself and `core/` (and
`errors`, `logsetup`); never `libvirt/`, `ops/`, `compose` or `cli/`.  A holder
source that lives higher (libvirt's domains) is handed in by `compose`.
"""
