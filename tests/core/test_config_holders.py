"""arbiter.toml's drain, ready and CDI keys: validated key by key, exit 2 naming both."""

from __future__ import annotations

from pathlib import Path

import pytest

from charly_arbiter.core.config import load_config
from charly_arbiter.errors import ConfigError

BASE = """
[tokens.gpu0]
address = "0000:0a:00.0"
"""


def load(tmp_path: Path, text: str):
    path = tmp_path / "arbiter.toml"
    path.write_text(BASE + text)
    return load_config(path, environ={})


def holder(**keys: str) -> str:
    lines = ["[[holders]]", 'kind = "systemd"', 'name = "ollama.service"', 'tokens = ["gpu0"]']
    return "\n".join([*lines, *(f"{key} = {value}" for key, value in keys.items())]) + "\n"


def test_drain_ready_and_their_timeouts_are_read(tmp_path: Path) -> None:
    config = load(
        tmp_path,
        holder(
            stop='"drain"',
            drain='["/usr/bin/curl", "-fsS", "http://127.0.0.1:11434/"]',
            ready='["/usr/bin/true"]',
        )
        + "[timeouts]\nholder_drain = 5\nholder_ready = 90\n",
    )
    [entry] = config.holders
    assert (
        entry.drains_only
        and entry.drain[0] == "/usr/bin/curl"
        and entry.ready == ("/usr/bin/true",)
    )
    assert (config.timeouts.holder_drain, config.timeouts.holder_ready) == (5.0, 90.0)


@pytest.mark.parametrize(
    ("text", "key", "why"),
    [
        (holder(drain='"curl -X POST x"'), "holders[0].drain", "expected a list"),
        (holder(drain='["curl", "x"]'), "holders[0].drain", "must be an absolute path"),
        (holder(ready='["/bin/true", 3]'), "holders[0].ready", "list of strings"),
        (holder(drain='["/bin/a\\nb"]'), "holders[0].drain", "control characters"),
        (holder(stop='"drain"'), "holders[0].stop", "needs a drain command"),
        (
            holder(stop='"drain"', drain='["/bin/true"]').replace('"systemd"', '"libvirt"'),
            "holders[0].stop",
            "expected one of shutdown, managedsave",
        ),
        (holder(mode='"shared"'), "holders[0].mode", "is not a known setting"),
        (
            BASE.replace("[tokens.gpu0]", "[tokens.gpu1]") + 'cdi_devices = ["gpu0"]\n',
            "tokens.gpu1.cdi_devices",
            "is not a CDI device name",
        ),
        ("[timeouts]\nholder_drain = 0\n", "timeouts.holder_drain", "above 0"),
    ],
)
def test_bad_keys_name_the_file_and_the_key(tmp_path: Path, text: str, key: str, why: str) -> None:
    with pytest.raises(ConfigError) as error:
        load(tmp_path, text)
    assert error.value.key == key, error.value
    assert why in error.value.why
    assert str(error.value).startswith(f"{tmp_path / 'arbiter.toml'}: {key}: ")
    assert error.value.exit_code == 2


def test_cdi_device_names_are_read(tmp_path: Path) -> None:
    config = load(tmp_path, 'cdi_devices = ["nvidia.com/gpu=0", "nvidia.com/gpu=GPU-1a2b:3"]\n')
    assert config.tokens[0].cdi_devices == ("nvidia.com/gpu=0", "nvidia.com/gpu=GPU-1a2b:3")
