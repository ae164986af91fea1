"""The state directory made by processes started at once (core/files.check_directory)."""

from __future__ import annotations

from pathlib import Path

import pytest

from charly_arbiter.core import files
from charly_arbiter.errors import StateDirUnsafe


def test_a_directory_another_process_made_meanwhile_is_used(tmp_path, monkeypatch):
    """Found by the concurrent-process stress run: of the claims started at once on a
    fresh host, one saw no state directory, another made it, and the first failed with
    "cannot use …: File exists".  Here the other process's mkdir comes between the
    look and the mkdir."""
    state = tmp_path / "state"
    looked = Path.exists

    def made_meanwhile(path: Path) -> bool:
        there = looked(path)
        if path == state and not there:
            state.mkdir(mode=0o700)
        return there

    monkeypatch.setattr(Path, "exists", made_meanwhile)
    files.check_directory(state, create=True)
    assert state.is_dir()


def test_a_symlink_planted_meanwhile_is_still_refused(tmp_path, monkeypatch):
    state, elsewhere = tmp_path / "state", tmp_path / "elsewhere"
    elsewhere.mkdir(mode=0o700)
    looked = Path.exists

    def planted_meanwhile(path: Path) -> bool:
        there = looked(path)
        if path == state and not there:
            state.symlink_to(elsewhere)
            return False
        return there

    monkeypatch.setattr(Path, "exists", planted_meanwhile)
    monkeypatch.setattr(Path, "is_symlink", lambda path: False)
    with pytest.raises(StateDirUnsafe, match="symlink"):
        files.check_directory(state, create=True)
