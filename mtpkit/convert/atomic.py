"""Atomic output folders: everything is written into a hidden temporary folder beside the destination
and renamed into place only once complete and verified, so a failure or a kill leaves no partial output.
"""

from __future__ import annotations

import os
import secrets
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from mtpkit.errors import OutputError

_TMP_MARK = ".mtpkit-tmp-"


def _tmp_prefix(dest: Path) -> str:
    return f".{dest.name}{_TMP_MARK}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(dest: Path) -> None:
    """Remove temporaries left by earlier runs that were killed (their process is gone)."""
    for path in dest.parent.glob(_tmp_prefix(dest) + "*"):
        pid = path.name[len(_tmp_prefix(dest)):].split("-", 1)[0]
        if pid.isdigit() and not _pid_alive(int(pid)):
            shutil.rmtree(path, ignore_errors=True)


def check_destination(dest: Path, *, force: bool, sources: tuple[Path, ...] = ()) -> None:
    """Refuse before any work: an existing destination without --force, or one that would overwrite an input."""
    resolved = dest.resolve()
    for source in sources:
        src = source.resolve()
        if resolved == src or src in resolved.parents or resolved in src.parents:
            raise OutputError(f"output {dest} overlaps the input {source}", where=dest,
                              fix="choose an output folder outside the input")
    if dest.exists() and not force:
        raise OutputError("already exists", where=dest, fix="choose another output folder, or pass --force to replace it")
    if dest.exists() and not dest.is_dir():
        raise OutputError("exists and is not a folder", where=dest, fix="remove it or choose another output folder")
    if not dest.parent.is_dir():
        raise OutputError(f"parent folder {dest.parent} does not exist", where=dest, fix="create it first")


@contextmanager
def atomic_output_dir(dest: str | Path, *, force: bool = False, sources: tuple[Path, ...] = ()) -> Iterator[Path]:
    """Yield a temporary folder; on success rename it to `dest` (replacing it when `force`), else delete it."""
    dest = Path(dest)
    check_destination(dest, force=force, sources=sources)
    _remove_stale(dest)
    tmp = dest.parent / f"{_tmp_prefix(dest)}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        tmp.mkdir()
    except OSError as e:
        raise OutputError(f"cannot create a folder beside it ({e.strerror})", where=dest) from e
    try:
        yield tmp
        _fsync_dir(tmp)
        if dest.exists():
            # Move the old folder aside first so a failure between the two renames still leaves one of them.
            old = dest.parent / f"{_tmp_prefix(dest)}{os.getpid()}-old-{secrets.token_hex(4)}"
            dest.rename(old)
            tmp.rename(dest)
            shutil.rmtree(old, ignore_errors=True)
        else:
            tmp.rename(dest)
        _fsync_dir(dest.parent)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(e, OSError) and not isinstance(e, FileNotFoundError):
            # A full disk, a file-size limit, a read-only volume: one clear line, no partial output.
            raise OutputError(f"writing failed ({e.strerror or e})", where=dest,
                              fix="free space or choose another output folder, then run again") from e
        raise


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
