"""The shipped example configuration parses, commented and with every example enabled."""

from __future__ import annotations

import re
from pathlib import Path

from charly_arbiter.core.config import load_config

EXAMPLE = Path(__file__).resolve().parent.parent / "etc" / "charly-arbiter" / "arbiter.toml"


def test_example_config_as_shipped_gives_the_defaults():
    config = load_config(EXAMPLE, environ={})
    assert config.tokens == () and config.holders == ()
    assert config.process_policy == "refuse"


def test_example_config_with_every_example_enabled_parses(tmp_path):
    enabled = re.sub(r"(?m)^#(?=[a-z_\[])", "", EXAMPLE.read_text())
    path = tmp_path / "arbiter.toml"
    path.write_text(enabled)
    config = load_config(path, environ={})
    assert [token.name for token in config.tokens] == ["gpu0"]
    assert {holder.ref for holder in config.holders} == {
        "systemd:ollama.service",
        "container:llm",
        "libvirt:render-farm",
    }
