"""Where events go for a given configuration."""

from __future__ import annotations

from charly_arbiter.config import Config
from charly_arbiter.events import Events


def events_for(config: Config) -> Events:
    return Events()
