"""The libvirt hook maps a domain's addresses to tokens from the PCI side alone.

Whether a domain claims, and which tokens, is the catalogue's answer: the
configuration and the IOMMU groups of the configured addresses (sysfs, or a
simulated host's files).  The whole host (holder sources that ask libvirt,
Podman or systemd, NVML) is built only when the claim is made, and then uses the
tokens already read.  `reconnect` and `migrate` never build it.
"""

from __future__ import annotations

import pytest

from charly_arbiter import compose
from charly_arbiter.core.model import Claimant, Mode
from charly_arbiter.libvirt import hookrun
from charly_arbiter.libvirt.domainxml import parse_domain
from tests.conftest import SimEnv

XML = (
    b"<domain type='kvm'><name>win11</name><devices><hostdev mode='subsystem' type='pci' "
    b"managed='yes'><source><address domain='0x0000' bus='0x0a' slot='0x00' function='0x1'/>"
    b"</source></hostdev></devices></domain>"
)


@pytest.fixture
def no_host(sim: SimEnv, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The hook's configuration is the simulated host's; building a host is recorded."""
    monkeypatch.setenv("CHARLY_ARBITER_CONFIG", str(sim.config_path))
    built: list[str] = []
    open_host = compose.open_host

    def recorded(*args: object, **kwargs: object) -> object:
        built.append(str(kwargs.get("subject")))
        return open_host(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(compose, "open_host", recorded)
    return built


def test_a_domain_s_claim_is_read_without_building_the_host(no_host: list[str]) -> None:
    facts = parse_domain(XML, "win11")
    run = hookrun.HookRun(Claimant.parse("libvirt:win11"), "win11")
    try:
        claim = run.claim(facts)  # the GPU's audio function: its token is gpu0
        assert claim is not None and claim.tokens == ("gpu0",)
        assert run.reconnect(claim) == 0 and run.migrate(None) == 0
        claimless = hookrun._claim_of(facts)
        assert claimless is not None and claimless.tokens == ("gpu0",)
        assert no_host == []
        # The claim builds it, once, for this domain, with the tokens read above.
        tokens = run.tokens()
        assert run.prepare(claim) == 0
        assert no_host == ["libvirt:win11"] and run.arbiter().tokens is tokens
        assert run.arbiter().ledger.read().lease_of("libvirt:win11").mode is Mode.EXCLUSIVE
    finally:
        run.close()
