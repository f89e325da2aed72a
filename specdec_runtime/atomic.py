"""Atomic writes: a reader (or a resumed run) sees the old file or folder, or the new one, never half of either.

Every writer of the project goes through here. The recipe is the same for files and folders: write under a temp
name in the destination's own folder (same filesystem, so the rename is atomic), fsync what was written, rename it
into place, fsync the parent folder so the rename itself survives a power loss. Standard library only: this module
sits at the bottom floor with the rest of `specdec_runtime/`.

The readers' side across nodes (issue 29): `wait_for_files`, for a file another node has just written to shared
storage.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import time
from collections.abc import Iterable, Iterator
from datetime import datetime, timezone
from pathlib import Path

NETWORK_LAG_S = 120.0
"""How long a reader waits for a file another node has just written (`wait_for_files`): longer than an NFS client's
longest attribute cache by default (acdirmax, 60 s)."""


def fsync_dir(folder: Path) -> None:
    """Flush a folder's entries (renames, new files) to disk."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_tree(folder: Path) -> None:
    for root, _, files in os.walk(folder):
        for name in files:
            with open(os.path.join(root, name), "rb") as f:
                os.fsync(f.fileno())
        fsync_dir(Path(root))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def write_bytes(path: Path, data: bytes) -> Path:
    """Write `data` to `path` atomically (temp file, fsync, os.replace, fsync the folder). The file gets the mode of
    the file it replaces, else what `open` would give it (0o666 minus the umask): mkstemp's 0o600 would make
    serving.yaml or a report unreadable to a serving process running as another user."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    mode = path.stat().st_mode & 0o7777 if path.exists() else 0o666 & ~_umask()
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        os.fchmod(fd, mode)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)
    return path


def write_text(path: Path, text: str) -> Path:
    """Write `text` (UTF-8) to `path` atomically."""
    return write_bytes(path, text.encode("utf-8"))


def fresh_tmp_dir(parent: Path, name: str) -> Path:
    """An empty temp folder `parent/.tmp-<name>` for a folder that will become `parent/<name>`; a leftover of a
    killed run under that name is removed first."""
    parent.mkdir(parents=True, exist_ok=True)
    tmp = parent / f".tmp-{name}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    return tmp


def recover_dir(final: Path) -> Path | None:
    """Put back the folder a crash left renamed aside: `replace_dir` renames the old `final` to
    `.old-<name>-<stamp>` before it renames the new one in, and a crash between the two renames leaves no `final`.
    Returns the recovered folder, or None when `final` exists or nothing was left aside."""
    final = Path(final)
    if final.exists() or not final.parent.is_dir():
        return None
    aside = sorted(final.parent.glob(f".old-{final.name}-*"))
    if not aside:
        return None
    aside[-1].rename(final)  # the newest: stamps sort in time order
    fsync_dir(final.parent)
    return final


def replace_dir(tmp: Path, final: Path) -> Path:
    """Move the finished folder `tmp` to `final` (same parent). Its files are fsynced first; an existing `final`
    is renamed aside and deleted only once `tmp` is in place. Linux has no atomic swap of two folders, so a crash
    between the two renames leaves the old folder aside as `.old-<name>-<stamp>`, never deleted: `recover_dir`
    (called here and by checkpoint pruning) puts it back."""
    recover_dir(final)
    _fsync_tree(tmp)
    if final.exists():
        stamp = datetime.now(timezone.utc).strftime("%Y%m%dT%H%M%S%f")
        old = final.with_name(f".old-{final.name}-{stamp}")
        final.rename(old)
        tmp.rename(final)
        shutil.rmtree(old, ignore_errors=True)
    else:
        tmp.rename(final)
    fsync_dir(final.parent)
    return final


@contextlib.contextmanager
def staged_dir(final: Path) -> Iterator[Path]:
    """Yield a fresh temp folder next to `final`; when the block ends without an error it replaces `final`
    (`replace_dir`), on an error it is removed and `final` is left as it was."""
    final = Path(final)
    tmp = fresh_tmp_dir(final.parent, final.name)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, final)


@contextlib.contextmanager
def staged_cache_dir(final: Path) -> Iterator[Path]:
    """Like `staged_dir`, for a cache entry that several processes may build at once with the same content (every
    rank converting one GGUF): each writes its own temp folder and the first to finish renames it to `final`. A
    later finisher's rename is refused (`final` is not empty), so a folder is never replaced under a reader; its
    copy is dropped, and so is any error it met, since `final` is complete (it only ever appears by a rename)."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=final.parent, prefix=f".tmp-{final.name}-"))
    os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp's 0o700 would hide a shared cache from other users
    try:
        yield tmp
        _fsync_tree(tmp)
        tmp.rename(final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if not final.is_dir():  # not another process winning the race: a real error
            raise
        return
    fsync_dir(final.parent)


def wait_for_files(paths: Iterable[Path], timeout_s: float) -> list[Path]:
    """The `paths` still missing after waiting up to `timeout_s` (0: look once) for them to appear.

    On a network filesystem a file another node has just renamed into place can stay invisible for a while: an NFS
    client caches a folder's attributes and its "no such file" answers (up to acdirmax, 60 s by default). Listing
    the folder and its parent may make the client ask the server again; the wait covers the rest. On a local disk
    a present file is found at once, and only a missing one costs the wait."""
    missing, deadline = [Path(p) for p in paths], time.monotonic() + timeout_s
    while True:
        for folder in {q for p in missing for q in (p.parent.parent, p.parent)}:
            with contextlib.suppress(OSError):
                os.listdir(folder)
        missing = [p for p in missing if not p.exists()]
        if not missing or time.monotonic() >= deadline:
            return missing
        time.sleep(0.5)
