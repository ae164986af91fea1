"""The real-kernel guests that several test files share.

`chain_boot`: what the chain (test_chain.py) and the SR-IOV tests
(test_sriov_kernel.py) share: ONE boot of tests/kernel's guest, with QEMU's SR-IOV
NVMe controller (`guest.SRIOV_NVME`) beside the GPU-shaped pair, the package
installed by `make install`, and chain.py run inside it.  chain.py runs
sriov_scenario.py's kernel facts first (the PF as QEMU made it), then the chain's
setup and scenarios, the SR-IOV one with the real libvirtd last.  A boot costs a
quarter of a minute and the package's setup inside it as much again: one for both
modules keeps the suite short.

`systemd_guest`: the systemd guest's one QEMU run (sysplan.py) that
test_systemd_units.py and test_desktop.py share.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from chainboot import ChainBoot
from guest import (
    SRIOV_NVME,
    Kernel,
    QemuUnavailable,
    boot,
    check_qemu,
    prepare_kernel,
    repo_mount_script,
)
from installed import install_package
from sysguest import Run, kernel_for_tests
from sysguest import run as run_systemd_guest

REPO = Path(__file__).resolve().parents[2]


def guest_script(kernel: Kernel, stage: str) -> str:
    return (
        "export PATH=/usr/sbin:/usr/bin:/sbin:/bin PYTHONDONTWRITEBYTECODE=1 HOME=/tmp\n"
        + repo_mount_script(REPO)
        + f"/usr/bin/python3 {REPO}/tests/kernel/chain.py {kernel.root} {stage}\n"
    )


@pytest.fixture(scope="session")
def chain_boot(tmp_path_factory: pytest.TempPathFactory) -> ChainBoot:
    try:
        check_qemu()
    except QemuUnavailable as why:
        pytest.skip(f"QEMU CANNOT RUN HERE, the real-kernel chain tests are SKIPPED: {why}")
    needed = ("/usr/sbin/libvirtd", "/usr/sbin/virtlogd", "/usr/bin/virsh", "/usr/bin/make")
    missing = [path for path in needed if not os.access(path, os.X_OK)]
    if missing:
        pytest.fail(f"missing {', '.join(missing)}: run scripts/setup (scripts/apt-packages.txt)")
    kernel = prepare_kernel()
    directory = tmp_path_factory.mktemp("chain")
    install_package(directory / "stage", tmp_path_factory.mktemp("build"))
    booted = boot(
        kernel,
        directory,
        guest_script(kernel, "/run/results/stage"),
        timeout=900,
        repo=REPO,
        devices=SRIOV_NVME,
    )
    return ChainBoot(directory, booted)


@pytest.fixture(scope="session")
def systemd_guest(tmp_path_factory: pytest.TempPathFactory) -> Run:
    import sysplan

    kernel = kernel_for_tests(sysplan.NEEDED)
    directory = tmp_path_factory.mktemp("systemd-guest")
    install_package(directory / "stage", tmp_path_factory.mktemp("build"))
    result = run_systemd_guest(kernel, directory, sysplan.spec(directory / "stage"), timeout=1800)
    print(result.timings())
    return result
