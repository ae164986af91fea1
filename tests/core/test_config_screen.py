"""arbiter.toml's `screen` (top level, per token) and `sleep` (top level) keys."""

from __future__ import annotations

from pathlib import Path

import pytest

from charly_arbiter.core.config import load_config
from charly_arbiter.core.model import ConsolePolicy, ScreenPolicy, SleepPolicy
from charly_arbiter.core.tokens import TokenCatalogue
from charly_arbiter.errors import ConfigError


def load(tmp_path: Path, text: str):
    path = tmp_path / "arbiter.toml"
    path.write_text(text)
    return load_config(path, environ={})


TOKENS = """
[tokens.gpu0]
address = "0000:0a:00.0"
{gpu0}
[tokens.gpu1]
address = "0000:0b:00.0"
"""


def test_defaults_refuse_the_screen_and_block_sleep(tmp_path: Path) -> None:
    config = load(tmp_path, TOKENS.format(gpu0=""))
    assert (config.screen, config.sleep) == (ScreenPolicy.REFUSE, SleepPolicy.BLOCK)
    assert [t.screen for t in config.tokens] == [None, None]


def test_top_level_and_per_token_are_read(tmp_path: Path) -> None:
    config = load(
        tmp_path, 'screen = "release"\nsleep = "allow"\n' + TOKENS.format(gpu0='screen = "refuse"')
    )
    assert (config.screen, config.sleep) == (ScreenPolicy.RELEASE, SleepPolicy.ALLOW)
    assert [t.screen for t in config.tokens] == [ScreenPolicy.REFUSE, None]


@pytest.mark.parametrize(
    ("text", "key"),
    [
        ('screen = "stop"\n' + TOKENS.format(gpu0=""), "screen"),
        ('sleep = "never"\n' + TOKENS.format(gpu0=""), "sleep"),
        (TOKENS.format(gpu0='screen = "yes"'), "tokens.gpu0.screen"),
        (TOKENS.format(gpu0='sleep = "allow"'), "tokens.gpu0.sleep"),  # top level only
    ],
)
def test_wrong_values_are_refused_naming_the_key(tmp_path: Path, text: str, key: str) -> None:
    with pytest.raises(ConfigError) as caught:
        load(tmp_path, text)
    assert key in str(caught.value)


class Functions:
    def token_functions(self, name: str, address: str):
        return ()

    def gpus(self):
        return ()


def test_a_token_inherits_the_top_level_screen_and_release_releases_its_console(
    tmp_path: Path,
) -> None:
    config = load(tmp_path, 'screen = "release"\n' + TOKENS.format(gpu0='screen = "refuse"'))
    specs = TokenCatalogue(config, Functions()).all()  # type: ignore[arg-type]
    assert specs["gpu0"].screen is ScreenPolicy.REFUSE
    assert specs["gpu0"].console is ConsolePolicy.REFUSE
    assert specs["gpu1"].screen is ScreenPolicy.RELEASE
    assert specs["gpu1"].console is ConsolePolicy.RELEASE  # implied by screen = "release"
