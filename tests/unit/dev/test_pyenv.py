"""The shared Python environments: a pin change must not leave ~6 GB behind for good (issue 19)."""

from __future__ import annotations

import os
from pathlib import Path

from gpuobj_dev import pyenv

DAY = 86400.0


def test_old_environments_go_the_one_in_use_and_the_last_other_stay() -> None:
    now = 100 * DAY
    envs = {Path("in-use"): now - 30 * DAY, Path("last-other"): now - 2 * DAY, Path("older"): now - 3 * DAY}
    assert pyenv.prunable(envs, Path("in-use"), now) == [Path("older")]


def test_an_environment_used_lately_stays_even_beyond_the_count() -> None:
    """Another checkout may be running its tests with it right now."""
    now = 100 * DAY
    envs = {Path("in-use"): now, Path("a"): now - 60.0, Path("b"): now - 120.0, Path("c"): now - 2 * DAY}
    assert pyenv.prunable(envs, Path("in-use"), now) == [Path("c")]


def test_prune_removes_folders_and_reads_when_each_was_used(tmp_path: Path) -> None:
    def env(name: str, used_days_ago: float, marker: str = pyenv.LAST_USED) -> Path:
        venv = tmp_path / name
        (venv / "lib").mkdir(parents=True)
        (venv / "lib" / "big").write_bytes(b"x" * 1000)
        (venv / marker).touch()
        t = (venv / marker).stat().st_mtime - used_days_ago * DAY
        os.utime(venv / marker, (t, t))
        return venv

    current = env("current", 0)
    recent = env("recent", 1)
    old = env("old", 5, marker=".complete")  # made before the last-used marker existed
    half = tmp_path / "interrupted"  # an install that never finished, long ago
    half.mkdir()
    t = half.stat().st_mtime - 9 * DAY
    os.utime(half, (t, t))
    removed = pyenv.prune_environments(current, root=tmp_path)
    assert sorted(removed) == sorted([old, half])
    assert sorted(p.name for p in tmp_path.iterdir()) == ["current", "recent"]
    assert recent.exists()


def test_a_second_set_up_waits_for_the_first(tmp_path: Path, monkeypatch) -> None:
    """Two set-ups at once on a fresh machine: the second took the first's half-made environment for an
    interrupted install and removed it. Now it waits, and gives up with a clear error after the bound."""
    import fcntl

    monkeypatch.setattr(pyenv, "LOCK_WAIT_S", 0.3)
    tmp_path.mkdir(exist_ok=True)
    with open(tmp_path / ".lock", "w") as held:
        fcntl.flock(held, fcntl.LOCK_EX)
        try:
            with pyenv._exclusive(tmp_path):
                raise AssertionError("got the lock another set-up holds")
        except SystemExit as e:
            assert "another gpuobj set-up held" in str(e)
    with pyenv._exclusive(tmp_path):  # free again
        pass
