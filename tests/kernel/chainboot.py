"""What the shared real-kernel boot (conftest.py's `chain_boot`) hands its tests."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from guest import Boot


@dataclass(frozen=True)
class ChainBoot:
    directory: Path  # what the guest wrote: chain.json, results.json, the logs
    booted: Boot
