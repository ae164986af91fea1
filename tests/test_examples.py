"""The shipped example configuration parses, commented and with every example enabled."""

from __future__ import annotations

import re
from pathlib import Path

from charly_arbiter.core.config import load_config

ETC = Path(__file__).resolve().parent.parent / "etc" / "charly-arbiter"
EXAMPLE = ETC / "arbiter.toml"


def test_example_config_as_shipped_gives_the_defaults():
    config = load_config(EXAMPLE, environ={})
    assert config.tokens == () and config.holders == ()
    assert config.process_policy == "refuse"


def test_example_config_with_every_example_enabled_parses(tmp_path):
    enabled = re.sub(r"(?m)^#(?=[a-z_\[])", "", EXAMPLE.read_text())
    path = tmp_path / "arbiter.toml"
    path.write_text(enabled)
    config = load_config(path, environ={})
    assert [token.name for token in config.tokens] == ["gpu0", "vgpu0"]
    assert config.tokens[0].vfs == 4
    assert config.tokens[1].vgpu_type == "NVIDIA L40S-2Q"
    assert {holder.ref for holder in config.holders} == {
        "systemd:ollama.service",
        "container:llm",
        "libvirt:render-farm",
    }
    ollama = config.holder("systemd:ollama.service")
    assert ollama is not None and ollama.drains_only and ollama.drain and ollama.ready
    assert config.tokens[0].cdi_devices == ("nvidia.com/gpu=0",)
    assert (config.proxmox.node, config.proxmox.preemption) == ("pve1", "stop")


def test_the_drain_examples_parse_as_arbiter_toml(tmp_path):
    enabled = re.sub(r"(?m)^#(?=[a-z_\[])", "", (ETC / "drains.toml").read_text())
    path = tmp_path / "arbiter.toml"
    path.write_text('[tokens.gpu0]\naddress = "0000:0a:00.0"\n' + enabled)
    config = load_config(path, environ={})
    ollama, generic = config.holders
    assert (ollama.ref, ollama.stop, ollama.drain[0]) == (
        "systemd:ollama.service",
        "drain",
        "/usr/libexec/charly-arbiter/ollama-unload",
    )
    assert (generic.ref, generic.stop) == ("container:inference", "stop")
    assert generic.drain[0] == generic.ready[0] == "/usr/bin/curl"
