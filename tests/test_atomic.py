"""The one atomic-write module (specdec_runtime/atomic.py): modes a serving process can read, and a folder a crash
left renamed aside comes back."""

from __future__ import annotations

import os
import stat
import threading

import pytest

from specdec_runtime import atomic


@pytest.fixture
def umask_022():
    old = os.umask(0o022)
    yield
    os.umask(old)


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_written_files_get_the_umask_mode_not_mkstemps_0600(tmp_path, umask_022):
    path = atomic.write_text(tmp_path / "serving.yaml", "a: 1\n")
    assert _mode(path) == 0o644 and path.read_text() == "a: 1\n"
    os.chmod(path, 0o640)  # a deployment's own choice survives the next write
    atomic.write_text(path, "a: 2\n")
    assert _mode(path) == 0o640 and path.read_text() == "a: 2\n"


def test_cache_folders_are_readable_by_others(tmp_path, umask_022):
    with atomic.staged_cache_dir(tmp_path / "entry") as tmp:
        (tmp / "config.json").write_text("{}")
    assert _mode(tmp_path / "entry") == 0o755


def test_a_folder_left_aside_by_a_crash_is_recovered(tmp_path):
    final = tmp_path / "best"
    with atomic.staged_dir(final) as tmp:
        (tmp / "w").write_text("old")
    # the crash window of replace_dir: the old folder renamed aside, the new one not yet in place
    final.rename(tmp_path / ".old-best-20260101T000000000000")
    assert atomic.recover_dir(final) == final and (final / "w").read_text() == "old"
    assert atomic.recover_dir(final) is None  # nothing left to recover
    final.rename(tmp_path / ".old-best-20260101T000000000000")
    with atomic.staged_dir(final) as tmp:  # the next write recovers first, then replaces
        (tmp / "w").write_text("new")
    assert (final / "w").read_text() == "new" and not list(tmp_path.glob(".old-*"))


def test_wait_for_files_returns_what_is_still_missing_and_waits_for_a_late_file(tmp_path):
    """The reader's side across nodes: a file another node renames into place shortly after is waited for."""
    present, late = tmp_path / "a", tmp_path / "shards" / "b"
    present.write_text("")
    assert atomic.wait_for_files([present, late], 0.0) == [late]
    timer = threading.Timer(0.3, lambda: (late.parent.mkdir(), late.write_text("")))
    timer.start()
    try:
        assert atomic.wait_for_files([present, late], 30.0) == []
    finally:
        timer.join()
